"""The pure parts of bench/expert_offload.py and its modules (bench/offload_*.py): the choice of --n-cpu-moe
from the cache budget, the host→device bytes derived from routing counts, and its one-line errors. No server,
no timing."""

from __future__ import annotations

import json
import lzma
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from moe_l2_gguf.index import load_index
from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama import build as build_mod
from tests.benches import load_bench

EXPERT = 4_866_048  # one ds-v2-lite expert at Q4 (gate + up Q4_K, down Q4_0): 3 x 2048 x 1408 x 4.5 / 8


# the modules bench/expert_offload.py is made of, each loaded under its own name
configs, h2d, tables, device, servers, runs, constants, results, replay = (
    load_bench(f"offload_{part}")
    for part in ("configs", "bytes", "tables", "device", "servers", "runs", "constants", "results", "replay")
)


@pytest.fixture(scope="module")
def bench():
    return load_bench("expert_offload")


@pytest.fixture(scope="module")
def ds_layout():
    """The full ds-v2-lite shape's layout: 27 layers, layer 0 dense, 64 experts of EXPERT bytes."""
    return configs.ExpertLayout(
        n_layer=27,
        n_expert=64,
        n_expert_used=6,
        expert_bytes=dict.fromkeys(range(1, 27), EXPERT),
        other_bytes=1_000_000_000,
        file_bytes=0,
    )


def test_layout_from_a_generated_gguf(tmp_path):
    path = tmp_path / "ds.gguf"
    write_shape_model(path, get_shape("ds-v2-lite").reduced(3, 8192), progress=False)
    layout = configs.ExpertLayout.from_index(load_index(path))
    assert (layout.n_layer, layout.n_expert, layout.n_expert_used) == (3, 64, 6)
    assert layout.expert_bytes == {1: EXPERT, 2: EXPERT}
    assert layout.routed_bytes == 2 * 64 * EXPERT
    assert layout.layer_bytes(0) == 0  # the dense layer


def test_n_cpu_moe_keeps_the_last_layers_that_fit(ds_layout):
    layer = 64 * EXPERT
    assert configs.choose_n_cpu_moe(ds_layout, 13 * layer) == (14, 13 * layer)  # layers 14..26 on the device
    assert configs.choose_n_cpu_moe(ds_layout, 13 * layer - 1) == (15, 12 * layer)  # never over the budget
    assert configs.choose_n_cpu_moe(ds_layout, layer - 1) == (27, 0)  # nothing fits: --cpu-moe
    # every expert fits: the dense layer 0 costs nothing, so N reaches 0 (all on the device)
    assert configs.choose_n_cpu_moe(ds_layout, 26 * layer) == (0, 26 * layer)
    with pytest.raises(configs.BenchError):
        configs.choose_n_cpu_moe(ds_layout, -1)


def test_cache_bytes_units(ds_layout):
    routed = ds_layout.routed_bytes
    assert configs.parse_bytes("50%", routed) == routed // 2
    assert configs.parse_bytes("4GiB", routed) == 4 << 30
    assert configs.parse_bytes("512M", routed) == 512_000_000
    assert configs.parse_bytes("1000", routed) == 1000
    with pytest.raises(configs.BenchError, match="not a size"):
        configs.parse_bytes("lots", routed)


def test_host_layers_per_config(ds_layout):
    c = configs.CONFIGS
    assert configs.host_expert_layers(c["a"], ds_layout, 14) == []
    assert configs.host_expert_layers(c["b"], ds_layout, 14) == list(range(1, 27))
    assert configs.host_expert_layers(c["c"], ds_layout, 14) == list(range(1, 14))
    assert configs.host_expert_layers(c["d"], ds_layout, 14) == list(range(1, 27))


def routing(layers: dict[int, dict[int, int]]) -> dict:
    """A GET /moe/routing answer (string keys, as JSON has them), split over two tags."""
    half = {str(layer): {str(e): c // 2 for e, c in experts.items()} for layer, experts in layers.items()}
    rest = {str(layer): {str(e): c - c // 2 for e, c in experts.items()} for layer, experts in layers.items()}
    return {"n_expert_used": 6, "domains": {"law": half, "untagged": rest}}


def test_prompt_step_copies_distinct_experts_of_layers_at_the_offload_batch():
    # a 40-token prompt: layers 1 and 2 see 40 rows (240 selections over 10 and 8 experts), the last
    # layer (3) only the output row (6 experts once each)
    layer1 = {e: 24 for e in range(10)}
    layer2 = {e: 30 for e in range(8)}
    layer3 = {e: 1 for e in range(20, 26)}
    counts = h2d.merge_domains(routing({1: layer1, 2: layer2, 3: layer3}))
    assert counts[1] == layer1 and counts[3] == layer3
    sizes = {1: 100, 2: 1000, 3: 10_000}
    # default minimum 32: layers 1 and 2 are copied once per distinct expert; the last layer's single
    # row stays on the CPU
    assert h2d.prompt_step_bytes(counts, [1, 2, 3], sizes, 6, 32) == 10 * 100 + 8 * 1000
    # minimum 1: the last layer's 6 experts too
    assert h2d.prompt_step_bytes(counts, [1, 2, 3], sizes, 6, 1) == 10 * 100 + 8 * 1000 + 6 * 10_000
    # a minimum above the prompt's 40 rows: nothing is copied
    assert h2d.prompt_step_bytes(counts, [1, 2, 3], sizes, 6, 64) == 0
    # only the layers whose experts are in host memory count (c with layers 2.. on the device)
    assert h2d.prompt_step_bytes(counts, [1], sizes, 6, 32) == 10 * 100
    assert h2d.prompt_step_bytes(counts, [], sizes, 6, 1) == 0


def test_decode_copies_every_activation_only_with_a_minimum_of_one():
    # 16 single-token steps: 96 selections per layer
    counts = h2d.merge_domains(routing({1: {0: 50, 3: 46}, 2: {e: 12 for e in range(8)}}))
    sizes = {1: 100, 2: 1000}
    assert h2d.decode_bytes(counts, [1, 2], sizes, 32) == 0  # stock --cpu-moe: computed on the CPU
    assert h2d.decode_bytes(counts, [1, 2], sizes, 1) == 96 * 100 + 96 * 1000
    assert h2d.decode_bytes(counts, [2], sizes, 1) == 96 * 1000


def test_device_buffers_from_the_server_log():
    log = "\n".join(
        [
            "load_tensors:      Vulkan0 model buffer size =   512.50 MiB",
            "load_tensors:   CPU_Mapped model buffer size =  1024.00 MiB",
            "llama_kv_cache:      Vulkan0 KV buffer size =    10.00 MiB",
            "sched_reserve:      Vulkan0 compute buffer size =    99.00 MiB",
            "sched_reserve:      Vulkan0 compute buffer size =   100.00 MiB",
            "sched_reserve:  Vulkan_Host compute buffer size =     4.00 MiB",
        ]
    )
    sizes = device.buffer_sizes(log)
    assert sizes["Vulkan0"] == {"model": 537395200, "KV": 10 << 20, "compute": 100 << 20}
    assert sizes["CPU_Mapped"] == {"model": 1 << 30}
    assert [n for n in sizes if device.is_device_buffer(n)] == ["Vulkan0"]
    assert not device.is_device_buffer("CUDA_Host") and device.is_device_buffer("CUDA0")


def test_a_binary_without_the_cache_says_so():
    rows = {"e": {"config": "expert-cache", "what": "x", "status": configs.NOT_BUILT, "device_expert_bytes": 2e9}}
    text = tables.table(rows)
    assert "no expert cache (the series' NNNN-expert-cache.patch)" in text and "2000.00" in text


def test_the_cache_and_the_trace_are_found_by_patch_name_and_build_flags(bench, tmp_path):
    """The series is renumbered when it is reordered: the cache patch is found by its name, whatever its
    number, and a build without the test-only hooks (--portable) has no route-trace replay."""
    binary = tmp_path / "key" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    names = [p.name for p in build_mod.patch_files(build_mod.default_patches_dir())]
    info = tmp_path / "key" / "build-info.json"
    info.write_text(json.dumps({"patches": names, "cmake_flags": ["-DLLAMA_MOE_TEST_HOOKS=ON"]}))
    assert configs.cache_patch_present(binary) and bench.trace_patch_present(binary)
    info.write_text(json.dumps({"patches": names, "cmake_flags": ["-DLLAMA_MOE_TEST_HOOKS=OFF"]}))
    assert configs.cache_patch_present(binary) and not bench.trace_patch_present(binary)
    info.write_text(json.dumps({"patches": [n for n in names if not n.endswith("-expert-cache.patch")]}))
    assert not configs.cache_patch_present(binary)


def test_the_expert_cache_runs_with_c_s_expert_bytes_and_is_measured(ds_layout):
    c = configs.CONFIGS
    assert configs.host_expert_layers(c["e"], ds_layout, 14) == list(range(1, 27))
    # e holds c's expert bytes plus the scheduler's one-layer copy, as d does
    e_need = device.device_need(c["e"], ds_layout, 123)
    assert e_need == device.device_need(c["d"], ds_layout, 0) + 123
    args = SimpleNamespace(ubatch=512, backend="cpu", trace_file=None)
    extra, _, n, _ = servers.server_plan(c["e"], 14, args)
    assert "--cpu-moe" in extra and n is None


def test_the_cache_counters_come_from_metrics():
    lines = ["# TYPE llamacpp:moe_cache_hits_total counter", "llamacpp:moe_cache_slots 16"]
    lines += [f"llamacpp:moe_cache_{name}_total {10 * i}" for i, name in enumerate(h2d.CACHE_COUNTERS)]
    served = httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(200, text="\n".join(lines))))
    got = h2d.cache_counters(served, "http://llama")
    assert got == {name: 10 * i for i, name in enumerate(h2d.CACHE_COUNTERS)}
    assert h2d.counters_delta(got, dict.fromkeys(h2d.CACHE_COUNTERS, 5))["hits"] == 10 - 5
    bare = httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(200, text="llamacpp:other 1")))
    with pytest.raises(configs.BenchError, match="is the cache on"):
        h2d.cache_counters(bare, "http://llama")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "a,z"], "unknown config z"),
        (["--configs", "a,c"], "must include b"),
        (["--backend", "cpu", "--binary", "/nonexistent/llama-server"], "--binary /nonexistent/llama-server does not"),
    ],
)
def test_bad_input_is_one_error_line(bench, capsys, argv, message):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_unknown_backend_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--backend", "rocm"])
    assert "invalid choice: 'rocm'" in capsys.readouterr().err


# -- the GPU check's rows: load modes, the best stock row, -np N, the cost model's constants ---------


def test_pinned_and_mmap_variants_add_the_load_mode():
    c = configs.CONFIGS
    args = SimpleNamespace(ubatch=512, backend="cpu", trace_file=None)
    for key, mode in (("bp", "none"), ("cp", "none"), ("dp", "none"), ("ep", "none"), ("em", "mmap")):
        extra, _, n, min_batch = servers.server_plan(c[key], 14, args)
        assert extra[extra.index("--load-mode") + 1] == mode
        base_extra, _, base_n, base_min = servers.server_plan(c[c[key].base], 14, args)
        assert extra == [*base_extra, "--load-mode", mode] and (n, min_batch) == (base_n, base_min)
    # e itself names no load mode: the engine chooses (pinned when the experts fit in RAM)
    assert "--load-mode" not in servers.server_plan(c["e"], 14, args)[0]
    assert c["el"].policy == "lru" and c["el"].base == "e" and c["el"].load_mode is None
    assert [k for k, x in c.items() if x.stock] == ["b", "bp", "c", "cp", "d", "dp"]


def test_concurrent_configs_get_their_own_servers():
    got = configs.parse_concurrent("cp,e", 4)
    assert [x.key for x in got] == ["cp-np4", "e-np4"]
    assert [configs.concurrency(x) for x in got] == [4, 4] and configs.concurrency(configs.CONFIGS["e"]) == 1
    assert got[0].base == "c" and got[0].load_mode == "none"
    assert configs.parse_concurrent("cp,e", 1) == [] and configs.parse_concurrent("", 4) == []
    with pytest.raises(configs.BenchError, match="unknown config zz"):
        configs.parse_concurrent("zz", 4)


def row(base: str, device: int, decode: float, prompt: float) -> dict:
    return {
        "status": "measured",
        "base": base,
        "device_expert_bytes": device,
        "decode_tokens_per_s": decode,
        "prompt_tokens_per_s": prompt,
    }


def test_the_project_default_against_the_best_stock_row_at_equal_device_memory():
    rows = {
        "a": row("a", 8_000, 206.0, 2000.0),  # more device memory: never the competitor
        "b": row("b", 0, 52.0, 128.0),
        "bp": row("b", 0, 60.8, 687.0),
        "c": row("c", 4_000, 85.8, 242.0),
        "cp": row("c", 4_000, 95.5, 1104.0),
        "dp": row("d", 0, 47.6, 697.0),
        "e": row("e", 4_000, 111.7, 691.0),
        "e-small": row("e", 1_000, 58.8, 672.0),  # below c's bytes: only b and d count
    }
    v = tables.versus_best_stock(rows)
    assert v["e"]["decode"]["best_stock"] == "cp" and v["e"]["decode"]["ratio"] == pytest.approx(111.7 / 95.5)
    assert v["e"]["prompt"]["best_stock"] == "cp" and v["e"]["prompt"]["ratio"] == pytest.approx(691 / 1104)
    assert v["e-small"]["decode"]["best_stock"] == "bp" and v["e-small"]["stock_rows"] == ["b", "bp", "dp"]
    assert v["e-small"]["prompt"]["best_stock"] == "dp"
    assert set(v) == {"e", "e-small"}
    text = tables.versus_table(v)
    assert "| e | 0.00 | 111.7 | cp 95.5 | **1.17** | 691.0 | cp 1104.0 | **0.63** |" in text


def test_constants_derived_from_the_runs(ds_layout):
    rows = {"a": row("a", 0, 200.0, 1.0), "b": row("b", 0, 50.0, 1.0)}
    got = constants.derived_constants(rows, ds_layout)
    per_token = 26 * 6 * EXPERT  # every MoE layer's top-6 experts, read once a token
    assert got["expert_bytes_read_per_token"] == per_token and got["activations_per_token"] == 156
    assert got["gpu_ms_per_token"] == pytest.approx(5.0)
    assert got["cpu_expert_b"]["raw_gbps"] == pytest.approx(per_token * 50 / 1e9)
    assert got["cpu_expert_b"]["net_of_a_gbps"] == pytest.approx(per_token / (0.02 - 0.005) / 1e9)
    assert "cpu_expert_bp" not in got


def test_the_engine_s_host_memory_line_is_kept():
    log = "load: something\nsrv  init: expert cache: host experts in pinned memory (8.10 GB)\nmore"
    assert results.host_experts_line(log) == "srv  init: expert cache: host experts in pinned memory (8.10 GB)"
    assert results.host_experts_line("nothing here") is None


def test_concurrent_requests_in_figures():
    one = {"predicted_n": 64, "prompt_n": 30, "predicted_per_second": 60.0}
    timings = [dict(one, predicted_ms=1000.0 + 100 * i) for i in range(4)]  # decoded in one batch
    got = runs.concurrent_summary({"timings": timings, "wall_s": 2.0, "domains": ["law", "intent"] * 2}, 4)
    assert got["decode_tokens"] == 256 and got["aggregate_decode_tokens_per_s"] == pytest.approx(256 / 1.3)
    assert got["wall_tokens_per_s"] == pytest.approx(128.0) and got["prompt_tokens"] == 120


def test_identity_rows_and_comparison():
    identity = load_bench("gpu_identity")
    rows = identity.plan_rows([7, 32], ["none", "mmap"])
    assert [c.key for c, _ in rows] == ["a", "d-pinned", "d-mmap", "e7-pinned", "e7-mmap", "e32-pinned", "e32-mmap"]
    assert [n for _, n in rows] == [0, 0, 0, 7, 7, 32, 32]
    assert all(c.load_mode in ("none", "mmap") for c, _ in rows[1:])
    got = identity.compare({"a": ["x", "y"], "d-pinned": ["x", "z"], "e7-mmap": ["x"]})
    assert got == {"d-pinned": [True, False], "e7-mmap": [True]}


def test_concurrent_requests_mix_the_domains_of_sequences_no_run_replays(bench, tmp_path):
    tags = ["intent"] * 6 + ["law"] * 3 + ["translation"] * 2 + ["summary"]
    got = bench.interleave_domains(tags, 2, 8)
    assert got == [2, 6, 9, 11, 3, 7, 10, 4]  # round-robin; summary's only sequence used once
    assert [tags[q] for q in got[:4]] == ["intent", "law", "translation", "summary"]
    assert bench.interleave_domains(tags, 11, 8) == [11]
    from moe_l2_llama.route_trace import RouteTrace, read_route_trace, write_route_trace

    ids = np.arange(12 * 2 * 6, dtype=np.uint16).reshape(12, 2, 6)  # 6 sequences of 2 tokens
    write_route_trace(RouteTrace(ids=ids, offsets=np.arange(0, 13, 2, dtype=np.int32), n_expert=64), tmp_path / "t")
    six = ["a", "a", "b", "b", "c", "c"]
    assert bench.subset_trace(tmp_path / "t", [4, 1], tmp_path / "s", six) == ["c", "a"]
    sub = read_route_trace(tmp_path / "s")
    assert sub.n_seq == 2 and (sub.sequence(0) == ids[8:10]).all() and (sub.sequence(1) == ids[2:4]).all()


def test_the_rpc_device_s_buffers_are_device_memory():
    log = "load_tensors: RPC0[127.0.0.1:41234] model buffer size =   311.00 MiB\n"
    log += "load_tensors:   CPU_Mapped model buffer size =  1.00 MiB"
    sizes = device.buffer_sizes(log)
    assert sizes["RPC0[127.0.0.1:41234]"] == {"model": 311 << 20}
    assert [n for n in sizes if device.is_device_buffer(n)] == ["RPC0[127.0.0.1:41234]"]


def test_the_table_leaves_the_concurrent_rows_to_their_own_lines():
    rows = {
        "e-np4": {"config": "expert-cache -np 4", "what": "x", "status": "measured", "base": "e", "concurrent": None},
        "cp-np4": {"config": "n-cpu-moe pinned -np 4", "what": "x", "status": "measured", "concurrent": {"x": 1}},
    }
    assert "np4" not in tables.table(rows)


def test_the_mapped_model_s_copy_rate_is_measured_in_a_child_or_says_why_not(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    got = constants.mapped_h2d(model, size=1 << 20)
    # without torch or a CUDA device (CI) a reason; on a GPU the rate, from at most `size` bytes of the file
    assert got.get("skipped") or (got["mapped_512MiB_gbps"] > 0 and got["bytes"] == 1 << 20)
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'not json'\necho 'Traceback: boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(constants.sys, "executable", str(broken))
    assert constants.mapped_h2d(model) == {"skipped": "exit 3: Traceback: boom"}


def test_an_access_log_that_differs_from_the_counters_comes_back_compressed(tmp_path):
    log = tmp_path / "logs" / "e-access.log"
    log.parent.mkdir()
    log.write_text("1 0 0 - 3 7 9\n1 1 1 - 0 1 2 3 4 5 6 7\n" * 100)
    kept = replay.keep_access_log(log, tmp_path / "out" / "offload_50.json", "e")
    assert kept == tmp_path / "out" / "offload_50-e-access.log.xz"
    assert lzma.decompress(kept.read_bytes()) == log.read_bytes()
    assert kept.stat().st_size < log.stat().st_size
