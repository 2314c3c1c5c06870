"""Model shapes of real MoE models: byte sizes of the full shapes, and reduced-depth files that the real
llama-server loads, generates with and routes through.

The reduced files keep the real expert shapes and types (only the depth, the vocabulary and, where one
layer's experts pass half a gigabyte, the experts a layer shrink), 0.3 to 2.6 GB each: written once per
session, by the CLI in a subprocess whose peak RSS is the memory check.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf  # a base dependency (pyproject.toml): its absence is a broken install, not a skip
import httpx
import numpy as np
import pytest

from moe_l2_gguf.demo_model import main
from moe_l2_gguf.index import load_index
from moe_l2_gguf.model_shapes import (
    BLOCK,
    MXFP4,
    Q4_0,
    Q4_K,
    Q8_0,
    SHAPES,
    TYPE_NAMES,
    ModelShape,
    block_pool,
    build_vocab,
    get_shape,
    sizes,
    tensor_plan,
)
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

from .conftest import ADMIN_HEADERS

REDUCED_VOCAB = 8192
# name: (layers, experts a layer or None for all): the dense leading layers and one MoE layer
REDUCED = {
    "ds-v2-lite": (2, None),
    "qwen3-30b-a3b": (2, None),
    "qwen3-235b-a22b": (1, 16),
    "gpt-oss-20b": (1, None),
    "gpt-oss-120b": (1, 16),
    "glm-4.5-air": (2, 16),
    "deepseek-v3": (4, 16),  # its three dense layers are 1.3 GB of the 2.6
    # llama4 with fewer than 4 layers has no NoPE layer, and the pinned llama.cpp then aborts setting the
    # NoPE layers' attention-temperature input ("tensor buffer not set"): the 4th layer is the first NoPE one
    "llama-4-scout": (4, 2),
    "mixtral-8x7b": (1, 4),
}


def reduced_shape(name: str) -> ModelShape:
    layers, experts = REDUCED[name]
    return SHAPES[name].reduced(layers, REDUCED_VOCAB, experts)


# ---- the full shapes: bytes and parameters of the real models --------------------------------------


def q4_expert_bytes(n_embd: int, n_ff_exp: int) -> int:
    # gate, up and down of one expert at 4.5 bits per weight (Q4_K: 144 bytes per 256, Q4_0: 18 per 32)
    return n_embd * n_ff_exp * 3 * 9 // 16


@pytest.mark.parametrize("expert_type", ["q4_k", "q4_0"])
def test_ds_v2_lite_full_shape_bytes(expert_type: str) -> None:
    shape = SHAPES["ds-v2-lite"]
    report = sizes(shape, expert_type)
    assert report.expert_bytes == q4_expert_bytes(2048, 1408) == 4_866_048
    assert report.routed_bytes == 26 * 64 * 4_866_048  # 26 MoE layers after the dense one
    # DeepSeek-V2-Lite has 15.7B parameters (its model card); the sum of the shapes gives 15,706,484,224
    assert abs(report.n_params - 15.7e9) < 0.01e9
    assert 9.0e9 < report.tensor_bytes < 10.0e9  # "about 9 GB at Q4"
    plan = {t.name: t for t in tensor_plan(shape, expert_type)}
    assert "blk.0.ffn_gate.weight" in plan and "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.1.ffn_gate_exps.weight"].ne == (2048, 1408, 64)
    assert plan["blk.1.ffn_down_exps.weight"].ne == (1408, 2048, 64)
    assert plan["blk.1.ffn_up_shexp.weight"].ne == (2048, 2 * 1408)
    assert plan["blk.1.attn_q.weight"].ne == (2048, 16 * 192)
    assert plan["blk.1.attn_kv_a_mqa.weight"].ne == (2048, 512 + 64)
    assert plan["blk.1.attn_k_b.weight"].ne == (128, 512, 16)
    assert plan["blk.1.attn_v_b.weight"].ne == (512, 128, 16)
    assert plan["token_embd.weight"].ne == (2048, 102400)


@pytest.mark.parametrize("expert_type", ["q4_k", "q4_0"])
def test_qwen3_30b_a3b_full_shape_bytes(expert_type: str) -> None:
    shape = SHAPES["qwen3-30b-a3b"]
    report = sizes(shape, expert_type)
    assert report.expert_bytes == q4_expert_bytes(2048, 768) == 2_654_208
    assert report.routed_bytes == 48 * 128 * 2_654_208
    assert abs(report.n_params - 30.5e9) < 0.05e9  # Qwen3-30B-A3B: 30.5B parameters
    assert 17.0e9 < report.tensor_bytes < 19.0e9  # "about 17 GB at Q4"
    plan = {t.name: t for t in tensor_plan(shape, expert_type)}
    assert plan["blk.47.ffn_up_exps.weight"].ne == (2048, 768, 128)
    assert plan["blk.0.attn_q.weight"].ne == (2048, 32 * 128)
    assert plan["blk.0.attn_k.weight"].ne == (2048, 4 * 128)
    assert plan["output.weight"].ne == (2048, 151936)


def test_types_follow_a_q4_recipe() -> None:
    for name, shape in SHAPES.items():
        types = {t.name: t.type_name for t in tensor_plan(shape)}
        experts = {v for k, v in types.items() if "_exps.weight" in k}
        if shape.arch == "gpt-oss":
            assert experts == {"MXFP4"}, name  # as released
        else:
            # K-quant rows are 256 wide: ds-v2-lite's down rows (1408) take Q4_0, as many bits per weight
            assert experts <= {"Q4_K", "Q4_0"} and "Q4_K" in experts, name
        assert all(v == "F32" for k, v in types.items() if k.endswith("norm.weight") or "ffn_gate_inp" in k)
        assert all(v == "F32" for k, v in types.items() if k.endswith(".bias") or "attn_sinks" in k), name
        others = {v for k, v in types.items() if "_exps.weight" not in k and not k.endswith("norm.weight")}
        assert others == {"Q8_0", "F32"}, name
        assert {t.type_name for t in tensor_plan(shape, "q4_0") if t.role == "expert"} == {"Q4_0"}


# the released models' parameter counts (their model cards), and the file the real GGUF is
@pytest.mark.parametrize(
    ("name", "params", "gb"),
    [
        ("gpt-oss-20b", 20.9e9, 12.1),  # ggml-org/gpt-oss-20b-GGUF: 12.1 GB (MXFP4 experts)
        ("gpt-oss-120b", 116.8e9, 63.4),  # ggml-org/gpt-oss-120b-GGUF: 63.4 GB
        ("qwen3-235b-a22b", 235.1e9, None),
        ("glm-4.5-air", 106.9e9, None),  # 106B without the MTP layer
        ("deepseek-v3", 671.0e9, None),  # 671B without the MTP module (685B with it)
        ("llama-4-scout", 107.8e9, None),  # 109B with the vision encoder, not written
        ("mixtral-8x7b", 46.7e9, None),
    ],
)
def test_real_shapes_have_the_released_size(name: str, params: float, gb: float | None) -> None:
    report = sizes(SHAPES[name])
    assert abs(report.n_params - params) < 0.005 * params, report.n_params
    if gb is not None:
        assert abs(report.tensor_bytes / 1e9 - gb) < 0.02 * gb, report.tensor_bytes


def test_gpt_oss_layout_has_its_biases_sinks_and_mxfp4_experts() -> None:
    shape = SHAPES["gpt-oss-20b"]
    plan = {t.name: t for t in tensor_plan(shape)}
    assert plan["blk.0.ffn_gate_exps.weight"].ne == (2880, 2880, 32)
    assert plan["blk.0.ffn_gate_exps.weight"].ggml_type == MXFP4
    assert plan["blk.0.ffn_gate_exps.weight"].nbytes == 2880 * 2880 * 32 * 17 // 32
    assert plan["blk.0.ffn_down_exps.bias"].ne == (2880, 32)
    assert plan["blk.0.ffn_gate_inp.bias"].ne == (32,)
    assert plan["blk.0.attn_q.weight"].ne == (2880, 64 * 64) and plan["blk.0.attn_k.bias"].ne == (8 * 64,)
    assert plan["blk.0.attn_sinks.weight"].ne == (64,)
    assert "blk.0.post_attention_norm.weight" in plan and "blk.0.ffn_norm.weight" not in plan
    # the expert's bytes the cache moves are its weights; the biases stay with the rest on the device
    assert sizes(shape).expert_bytes == 3 * 2880 * 2880 * 17 // 32


def test_deepseek_v3_and_glm_have_a_score_bias_and_their_dense_lead() -> None:
    ds = {t.name: t for t in tensor_plan(SHAPES["deepseek-v3"])}
    assert "blk.2.ffn_gate.weight" in ds and "blk.3.ffn_gate_exps.weight" in ds
    assert ds["blk.3.exp_probs_b.bias"].ne == (256,)
    assert ds["blk.3.attn_q_a.weight"].ne == (7168, 1536) and ds["blk.3.attn_q_b.weight"].ne == (1536, 128 * 192)
    glm = {t.name: t for t in tensor_plan(SHAPES["glm-4.5-air"])}
    assert glm["blk.1.exp_probs_b.bias"].ne == (128,) and glm["blk.1.ffn_up_shexp.weight"].ne == (4096, 1408)
    assert glm["blk.1.attn_q.bias"].ne == (96 * 128,)


@pytest.mark.parametrize("ggml_type", [Q4_K, Q4_0, Q8_0, MXFP4])
def test_random_blocks_dequantize_to_sane_weights(ggml_type: int) -> None:
    pool = block_pool(np.random.default_rng(0), ggml_type, 1 << 20)
    weights = gguf.quants.dequantize(pool.reshape(-1, BLOCK[ggml_type][1]), gguf.GGMLQuantizationType(ggml_type))
    assert np.isfinite(weights).all(), TYPE_NAMES[ggml_type]
    assert 0.015 < float(weights.std()) < 0.025
    assert abs(float(weights.mean())) < 0.15 * float(weights.std())


def test_vocab_has_the_requested_size_and_unique_tokens() -> None:
    tokens, scores, types = build_vocab(102400)
    assert len(tokens) == len(scores) == len(types) == 102400
    assert len(set(tokens)) == len(tokens)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]


# ---- bad input ---------------------------------------------------------------------------------------


def test_unknown_shape_is_one_error_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.gguf"
    assert main(["--shape", "mixtral-9000", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "mixtral-9000" in err[0] and "ds-v2-lite" in err[0] and "qwen3-30b-a3b" in err[0]
    assert not path.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shape", "ds-v2-lite", "--layers", "1"], "--layers"),  # only the dense layer: no experts
        (["--shape", "qwen3-30b-a3b", "--layers", "49"], "--layers"),
        (["--shape", "qwen3-30b-a3b", "--vocab", "100"], "--vocab"),
        (["--layers", "2"], "--shape"),
        (["--shape", "gpt-oss-20b", "--experts", "4"], "--experts"),  # no more than the 4 a token uses
        (["--shape", "mixtral-8x7b", "--experts", "9"], "--experts"),
        (["--experts", "4"], "--shape"),
    ],
)
def test_bad_shape_options_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    path = tmp_path / "x.gguf"
    assert main([*args, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not path.exists()


def test_get_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="ds-v2-lite, qwen3-30b-a3b"):
        get_shape("nope")


# ---- reduced-depth files: written by the CLI, read back, loaded by llama-server ----------------------

# The writer's own peak RSS: VmHWM, the high-water mark of this process image. getrusage's ru_maxrss
# would do on a fresh process, but Linux carries it across fork+exec, so under pytest it starts at
# the test process's size.
_WRITER = (
    "import re, sys\n"
    "from moe_l2_gguf.demo_model import main\n"
    "rc = main(sys.argv[1:])\n"
    "status = open('/proc/self/status').read()\n"
    "print('peak_rss_kib', re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
    "sys.exit(rc)\n"
)


@dataclass(frozen=True)
class Written:
    name: str
    path: Path
    peak_rss_bytes: int


# module: the files (~7.6 GB together) are deleted once this file's tests are done, not at the session's end,
# where they would sit on the disk through the rest of the suite (a CI run filled a disk with them beside others)
@pytest.fixture(scope="module")
def reduced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Written]]:
    folder = tmp_path_factory.mktemp("shapes")
    written: dict[str, Written] = {}
    for name in SHAPES:
        path = folder / f"{name}.gguf"
        layers, experts = REDUCED[name]
        args = ["--shape", name, "--layers", str(layers), "--vocab", str(REDUCED_VOCAB), str(path)]
        args += ["--experts", str(experts)] if experts else []
        proc = subprocess.run(
            [sys.executable, "-c", _WRITER, *args], capture_output=True, text=True, timeout=900, check=False
        )
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {path}" in proc.stdout
        match = re.search(r"peak_rss_kib (\d+)", proc.stdout)
        assert match is not None, proc.stdout
        written[name] = Written(name, path, int(match.group(1)) * 1024)
    yield written
    for w in written.values():
        w.path.unlink(missing_ok=True)


def test_writer_memory_stays_bounded(reduced: dict[str, Written]) -> None:
    w = reduced["qwen3-30b-a3b"]
    size = w.path.stat().st_size
    assert size > 600e6  # a real test of streaming: far larger than the writer may hold
    assert w.peak_rss_bytes < size / 5, (w.peak_rss_bytes, size)


@pytest.mark.parametrize("name", list(SHAPES))
def test_reduced_file_is_the_plan(reduced: dict[str, Written], name: str) -> None:
    shape = reduced_shape(name)
    plan = tensor_plan(shape)
    reader = gguf.GGUFReader(reduced[name].path)
    on_disk = {t.name: (tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors}
    assert on_disk == {t.name: (t.ne, t.ggml_type, t.nbytes) for t in plan}
    assert str(reader.get_field("general.architecture").contents()) == shape.arch
    assert reader.get_field(f"{shape.arch}.block_count").contents() == shape.n_layer
    assert reader.get_field(f"{shape.arch}.expert_count").contents() == shape.n_expert
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == REDUCED_VOCAB

    # the project's own expert index finds the routed experts at the sizes the module computed
    index = load_index(reduced[name].path)
    report = sizes(shape)
    assert index.n_expert == shape.n_expert and index.n_expert_used == shape.n_expert_used
    assert index.moe_layers == list(shape.moe_layers)
    # the index counts an expert's bias rows with it (gpt-oss); the module's expert_bytes is the weights
    bias = sum(t.nbytes for t in plan if t.role == "expert_bias") // (len(shape.moe_layers) * shape.n_expert)
    assert all(index.expert_bytes(layer) == report.expert_bytes + bias for layer in index.moe_layers)
    assert index.routed_bytes == report.routed_bytes + bias * len(shape.moe_layers) * shape.n_expert
    assert index.tensor_bytes == report.tensor_bytes


@pytest.mark.llama
@pytest.mark.parametrize("name", list(SHAPES))
def test_llama_server_generates_and_routes(
    llama_binary: Path, reduced: dict[str, Written], tmp_path: Path, name: str
) -> None:
    shape = reduced_shape(name)
    # --no-repack: the native CPU build segfaults in ggml's AMX matmul on quantized weights on AMX hosts
    # (llama.cpp #20824, reproduced here); the demo model is F16/F32 and never meets it.
    settings = LlamaSettings(
        port=free_port(), parallel=1, ctx_size=1024, threads=2, telemetry=True, extra_args="--no-repack"
    )
    supervisor = Supervisor(tmp_path / "logs")
    try:
        supervisor.start(llama_service_spec(f"llama-{name}", llama_binary, reduced[name].path, settings))
        base = f"http://{settings.host}:{settings.port}"
        with httpx.Client(base_url=base, timeout=300) as client:
            client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS).raise_for_status()
            resp = client.post(
                "/completion",
                json={"prompt": "the capital of france is", "n_predict": 4, "temperature": 0, "ignore_eos": True},
            )
            resp.raise_for_status()
            body = resp.json()
            assert body["tokens_predicted"] == 4
            routing = client.get("/moe/routing", headers=ADMIN_HEADERS).json()
    finally:
        supervisor.stop()

    assert routing["n_layer"] == shape.n_layer
    assert routing["n_expert"] == shape.n_expert
    assert routing["n_expert_used"] == shape.n_expert_used
    layers = routing["domains"]["untagged"]
    # routed tokens reach exactly the MoE layers: never a dense one
    assert sorted(int(layer) for layer in layers) == list(shape.moe_layers)
    for experts in layers.values():
        assert all(0 <= int(e) < shape.n_expert for e in experts)
        # each token picks n_expert_used distinct experts
        assert sum(experts.values()) % shape.n_expert_used == 0 and sum(experts.values()) > 0
