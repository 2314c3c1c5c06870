"""bench/placement_model.py and its library shared/moe_l2_placement: the cost model against the measured GPU
folders (it must pass on both, and fail on a folder with one cell moved by 30%), its physics (more slots never
slower, the CPU/PCIe split at the extremes, the layers/cache split within the budget), and what it prints. No
GPU, no server."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from moe_l2_placement.curve import ESFT_CURVE
from moe_l2_placement.estimate import page_cache_misses
from moe_l2_placement.shape import KNOWN_SHAPES
from moe_l2_placement.split import choose_split, split_time
from tests.benches import load_bench

REPO = Path(__file__).resolve().parent.parent
DEV = REPO / "bench" / "data" / "gpu-2026-12-04-dev"  # in the repository: always here
SHARED = load_bench("data_paths").H200_2026_12_04  # the H200 table of 2026-12-04, in the repository
ESFT = load_bench("data_paths").esft_npz()  # where placement_model.esft_npz() looks


@pytest.fixture(scope="module")
def pm():
    return load_bench("placement_model")


@pytest.fixture(scope="module")
def ds(pm):
    return pm.Shape.named("ds-v2-lite")


@pytest.fixture(scope="module")
def h200(pm):
    return pm.h200_machine()


# -- against the measured folders ---------------------------------------------------------------------


def test_every_cell_of_the_shared_h200_table_within_15_percent(pm, capsys):
    assert pm.main(["--against", str(SHARED)]) == 0
    out = capsys.readouterr().out
    cells = pm.check_folder(SHARED)
    # p12 b,c,e; p25 b,c,d,e; p50 b,c,d,e; r25 and r50 a-e: 21 rows, decode and prompt each
    assert len(cells) == 42
    assert all(c.status in ("checked", "calibration") for c in cells), [c for c in cells if c.note and not c.bound]
    assert max(abs(c.error) for c in cells) <= pm.TOLERANCE
    # the calibration cells are only those the constants come from: a (T_gpu, G) and b's decode (B_cpu)
    assert {(c.row, c.what) for c in cells if c.status == "calibration"} == {
        ("a", "decode"),
        ("a", "prompt"),
        ("b", "decode"),
    }
    assert "h2d.txt of the folder" in out  # the shared folder's JSON has no constants: said, not silent


def test_the_dev_run_passes_and_says_which_cells_it_cannot_model(pm, capsys):
    assert pm.main(["--against", str(DEV)]) == 0
    out = capsys.readouterr().out
    cells = pm.check_folder(DEV)
    skipped = [c for c in cells if c.status not in ("checked", "calibration")]
    assert {c.row for c in skipped} == {"em"}  # the staging ring's rows only; ed (mapped, direct) is modelled
    assert all("staging ring" in c.note and "implies a ring rate" in c.note for c in skipped)
    assert "no row a in the folder: the H200 of 2026-12-04" in out  # T_gpu borrowed, and said so
    ed = next(c for c in cells if (c.file, c.row, c.what) == ("offload_25.json", "ed", "decode"))
    assert ed.status == "checked" and abs(ed.error) <= pm.TOLERANCE


def plant(src: Path, dst: Path, file: str, row: str, metric: str, factor: float) -> None:
    shutil.copytree(src, dst)
    path = dst / file
    path.chmod(0o644)
    doc = json.loads(path.read_text())
    doc["configs"][row][metric] *= factor
    path.write_text(json.dumps(doc))


def test_a_cell_moved_by_30_percent_fails_the_check(pm, tmp_path, capsys):
    plant(DEV, tmp_path / "dev", "offload_50.json", "cp", "decode_tokens_per_s", 1.3)
    assert pm.main(["--against", str(tmp_path / "dev")]) == 1
    assert "**FAIL**" in capsys.readouterr().out
    bad = [c for c in pm.check_folder(tmp_path / "dev") if c.fails]
    assert [(c.file, c.row, c.what) for c in bad] == [("offload_50.json", "cp", "decode")]


def test_a_planted_shared_folder_fails_on_the_moved_cell_only(pm, tmp_path):
    plant(SHARED, tmp_path / "h200", "p25.json", "e", "prompt_tokens_per_s", 0.7)
    assert pm.main(["--against", str(tmp_path / "h200")]) == 1
    bad = [(c.file, c.row, c.what) for c in pm.check_folder(tmp_path / "h200") if c.fails]
    assert bad == [("p25.json", "e", "prompt")]


def test_a_folder_without_runs_is_an_error(pm, tmp_path):
    assert pm.main(["--against", str(tmp_path)]) == 2
    assert pm.main(["--against", str(tmp_path / "nope")]) == 2


# -- physics ------------------------------------------------------------------------------------------------


def test_more_slots_never_predict_slower(pm, ds, h200):
    prev = (0.0, 0.0)
    for slots in range(6, 65):
        st = pm.esft_stats(slots)
        e = pm.decode(ds, h200, pm.Placement("e", n_cache=26, slots=slots), st).tokens_per_s
        ec = pm.decode(ds, h200, pm.Placement("e", n_cache=26, slots=slots, cpu_misses=True), st).tokens_per_s
        assert e >= prev[0] and ec >= prev[1], slots
        assert ec >= e  # c = 0 is always a choice: the CPU path never loses
        prev = (e, ec)
    # with the same hit rates the slot count itself costs nothing
    st = pm.esft_stats(16)
    t16 = pm.decode(ds, h200, pm.Placement("e", n_cache=26, slots=16), st).total_s
    t32 = pm.decode(ds, h200, pm.Placement("e", n_cache=26, slots=32), st).total_s
    assert t16 == t32


def test_a_faster_link_or_cpu_never_predicts_slower(pm, ds, h200):
    from dataclasses import replace

    st = pm.esft_stats(14)
    for pl in (pm.Placement("e", n_cache=26, slots=14), pm.Placement("e", n_cache=26, slots=14, cpu_misses=True)):
        base = pm.decode(ds, h200, pl, st).tokens_per_s
        fast_link = replace(h200, h2d_pinned_big_gbps=110.0, h2d_pinned_expert_gbps=99.0)
        assert pm.decode(ds, fast_link, pl, st).tokens_per_s > base
        fast_cpu = replace(h200, cpu_expert_gbps=2 * h200.cpu_expert_gbps)
        assert pm.decode(ds, fast_cpu, pl, st).tokens_per_s >= base
    c = pm.Placement("c", n_dev=13, n_cpu=13)
    assert pm.decode(ds, replace(h200, cpu_expert_gbps=100), c).tokens_per_s > pm.decode(ds, h200, c).tokens_per_s


def test_the_split_puts_misses_where_the_pipe_is_free(pm):
    S = 4_866_048
    assert choose_split(6, 1, S, h2d_gbps=0.5, cpu_gbps=60) == 6  # a very slow link: all on the CPU
    assert choose_split(6, 1, S, h2d_gbps=50, cpu_gbps=0.5) == 0  # a very slow CPU: all copied
    assert choose_split(0, 1, S, h2d_gbps=50, cpu_gbps=50) == 0
    # equal pipes: half each; 3 misses at equal speed: a tie between 1 and 2 on the CPU keeps the smaller
    assert choose_split(6, 1, S, h2d_gbps=50, cpu_gbps=50) == 3
    assert choose_split(3, 1, S, h2d_gbps=50, cpu_gbps=50) == 1
    # a CPU expert of many tokens costs more: the same misses of a batch go to the link
    assert choose_split(6, 16, S, h2d_gbps=50, cpu_gbps=50) < choose_split(6, 1, S, h2d_gbps=50, cpu_gbps=50)
    # the rule of thumb in the docstring: round(m t_copy / (t_copy + t_cpu)), give or take one
    for m in range(1, 9):
        c = choose_split(m, 1, S, h2d_gbps=25, cpu_gbps=40)
        assert abs(c - m * (S / 25) / (S / 25 + S / 40)) <= 1
        t = split_time(m, c, S / 25e9, S / 40e9)
        assert all(t <= split_time(m, o, S / 25e9, S / 40e9) for o in range(m + 1))


def test_layers_and_cache_within_the_budget(pm, ds, h200):
    layer, S = ds.layer_bytes, ds.expert_bytes
    for share in (0.05, 0.125, 0.25, 0.5, 0.9):
        budget = int(ds.routed_bytes * share)
        got = pm.choose_layers_and_cache(budget, ds, h200)
        assert got.n_dev + got.n_cache + got.n_cpu == ds.n_moe
        assert got.n_dev * layer + got.n_cache * got.slots * S <= budget
        assert got.n_cache == 0 or got.slots >= ds.top_k  # the cache refuses fewer than top-k slots
        # it is the best of the splits it may choose: never slower than stock --n-cpu-moe at that budget
        n = pm.n_cpu_moe_layers(ds, budget)
        stock = pm.decode(ds, h200, pm.Placement("c", n_dev=n, n_cpu=ds.n_moe - n)).tokens_per_s
        assert got.decode_tps >= stock * (1 - 1e-9)
    every = pm.choose_layers_and_cache(ds.routed_bytes, ds, h200)
    assert (every.n_dev, every.n_cache) == (ds.n_moe, 0) and "everything fits" in every.why
    tiny = pm.choose_layers_and_cache(layer - 1, ds, h200)  # no whole layer, 2 slots a layer: under top-6
    assert (tiny.n_dev, tiny.n_cache, tiny.n_cpu) == (0, 0, ds.n_moe) and "on the CPU" in tiny.why
    two = pm.choose_layers_and_cache(ds.top_k * ds.n_moe * S - 1, ds, h200)  # 2.4 layers' bytes, 5.99 slots
    assert (two.n_dev, two.n_cache, two.n_cpu) == (2, 0, ds.n_moe - 2)


def test_a_slow_link_makes_layers_on_the_device_worth_it(pm, ds, h200):
    """With a link 50x slower, whole layers on the device beat spreading the budget as slots."""
    from dataclasses import replace

    slow = replace(h200, h2d_pinned_big_gbps=1.1, h2d_pinned_expert_gbps=1.0)
    got = pm.choose_layers_and_cache(int(ds.routed_bytes * 0.5), ds, slow, cpu_misses=False)
    assert got.n_dev > 0


def engine_choice_tps(pm, shape, machine, budget):
    """What the full model predicts for the split the engine's auto (engine_auto_split) chooses."""
    a = pm.engine_auto_split(
        shape.n_moe, shape.n_expert, shape.top_k, shape.expert_bytes, budget, machine.t_rt_s,
        machine.expert_copy_s(shape.expert_bytes, "pinned"),
    )  # fmt: skip
    rest = shape.n_moe - a.n_dev
    if a.n_slot:
        pl = pm.Placement("lc", n_dev=a.n_dev, n_cache=rest, slots=a.n_slot, cpu_misses=True)
        return a, pm.decode(shape, machine, pl, pm.esft_stats(a.n_slot, shape.top_k, shape.n_expert)).tokens_per_s
    return a, pm.decode(shape, machine, pm.Placement("c", n_dev=a.n_dev, n_cpu=rest)).tokens_per_s


@pytest.mark.parametrize("name", ["ds-v2-lite", "qwen3-30b-a3b"])
def test_the_engine_s_auto_is_within_2_percent_of_the_full_model_on_the_h200(pm, h200, name):
    """The engine's simpler arithmetic (no CPU share, no prefetch, no prompt) loses at most 2% of the decode
    the full model's best split predicts, from 12.5% to 90% of the experts' bytes, and it is within the
    budget, with top-k slots or no cache at all."""
    shape = pm.Shape.named(name)
    for share in (0.125, 0.25, 0.5, 0.75, 0.9):
        budget = int(shape.routed_bytes * share)
        best = pm.choose_layers_and_cache(budget, shape, h200)
        a, tps = engine_choice_tps(pm, shape, h200, budget)
        rest = shape.n_moe - a.n_dev
        assert a.n_dev * shape.layer_bytes + rest * a.n_slot * shape.expert_bytes <= budget
        assert a.n_slot == 0 or a.n_slot >= shape.top_k
        assert tps >= 0.98 * best.decode_tps, (share, a, best)


def test_the_engine_s_auto_leaves_layers_to_the_cpu_only_below_top_k(pm, ds):
    S, layer = ds.expert_bytes, ds.layer_bytes
    every = pm.engine_auto_split(ds.n_moe, 64, 6, S, ds.routed_bytes, 35e-6, 1e-4)
    assert (every.n_dev, every.n_slot) == (ds.n_moe, 0)
    two = pm.engine_auto_split(ds.n_moe, 64, 6, S, ds.top_k * ds.n_moe * S - 1, 35e-6, 1e-4)
    assert (two.n_dev, two.n_slot) == (2, 0)  # 5.99 slots a layer in every split: two whole layers only
    assert pm.engine_auto_split(ds.n_moe, 64, 6, S, layer - 1, 35e-6, 1e-4).n_dev == 0
    # a slower copy (or a faster round trip) never moves layers onto the device: misses weigh more
    half = int(ds.routed_bytes * 0.5)
    assert (
        pm.engine_auto_split(ds.n_moe, 64, 6, S, half, 35e-6, 1e-3).n_dev
        <= pm.engine_auto_split(ds.n_moe, 64, 6, S, half, 35e-6, 1e-5).n_dev
    )


# -- inputs, outputs -------------------------------------------------------------------------------------------


def test_known_shapes_match_model_shapes(pm):
    from moe_l2_gguf.model_shapes import get_shape, sizes

    for name, known in KNOWN_SHAPES.items():
        assert pm.Shape.named(name) == known
        s = get_shape(name)
        assert (known.n_moe, known.n_expert, known.top_k) == (len(s.moe_layers), s.n_expert, s.n_expert_used)
        assert known.expert_bytes == sizes(s).expert_bytes


def test_the_embedded_curve_is_the_policy_s_replay(pm):
    got = pm.replay_curve([14])
    assert got[14] == ESFT_CURVE[14]
    # and it reproduces the engine's measured decode hit rates of 2026-12-04 (p12, p25, p50: 56.6, 64.5, 81.4%)
    for slots, measured in ((7, 0.5658), (14, 0.6452), (32, 0.8136)):
        assert abs(ESFT_CURVE[slots][0] - measured) < 0.005


def test_host_memory_of_a_row(pm):
    ring = "misses are copied from pageable host memory ..., through a staging ring of 4 x 4.00 MiB"
    direct = "misses are copied from pageable host memory ..., copied directly (no staging ring: ...)"
    assert pm.host_memory("em", {"host_experts_log": ring}) == "ring"
    assert pm.host_memory("ed", {"host_experts_log": direct}) == "mapped"
    assert pm.host_memory("bp", {"server_args": ["--load-mode", "none"]}) == "pinned"
    no_pin = {"server_args": ["--load-mode", "none"], "env": {"GGML_CUDA_NO_PINNED": "1"}}
    assert pm.host_memory("er", no_pin) == "mapped"
    assert pm.host_memory("b", {"server_args": []}) == "mapped"  # llama.cpp maps the model by default


def test_h2d_txt_is_read(pm):
    text = (
        "H2D pageable: 9.8 GB/s (512 MiB copies)\nH2D pinned: 55.3 GB/s (512 MiB copies)\n"
        "H2D pageable one expert (4.87 MB): 16.6 GB/s, 0.293 ms\nH2D pinned one expert (4.87 MB): 49.8 GB/s, 0.098 ms\n"
    )
    assert pm.parse_h2d_txt(text) == {
        "pageable_512MiB_gbps": 9.8,
        "pinned_512MiB_gbps": 55.3,
        "pageable_expert_gbps": 16.6,
        "pinned_expert_gbps": 49.8,
    }


def test_a_measured_mapped_rate_replaces_the_fitted_factor(pm, h200):
    from dataclasses import replace

    assert h200.mapped_gbps == pytest.approx(9.8 * pm.MAPPED_FACTOR)
    assert replace(h200, h2d_mapped_gbps=7.0).mapped_gbps == 7.0


def test_predictions_cover_the_h200_budgets_and_the_consumer_card(pm, tmp_path, capsys):
    assert pm.main(["--json", str(tmp_path / "p.json")]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    preds = doc["predictions"]
    h200 = {(p["budget"], p["row"]) for p in preds if "H200" in p["machine"]}
    for budget in ("50%", "25%", "12.5%"):
        assert {(budget, r) for r in ("cp", "e", "e+cpu", "layers+cache", "layers+cache+cpu")} <= h200
    consumer = [p for p in preds if "24 GB" in p["machine"]]
    assert {p["shape"] for p in consumer} == {"ds-v2-lite", "qwen3-30b-a3b"}
    whole = [p for p in consumer if p["budget"] == "24 GB card"]
    assert {p["row"] for p in whole} == {"a"} and all("everything fits" in p["what"] for p in whole)
    assert all(p["decode_tps"] > 0 for p in preds if p["row"] != "e" or "refuses" not in p["what"])
    assert "| NVIDIA H200 (2026-12-04) | ds-v2-lite | 50%" in capsys.readouterr().out


def test_the_prompt_copies_ahead_overlap_the_compute(pm, ds, h200):
    """Patch 0021's prompt: only the first tensor's copies stay in line, the rest overlap the compute, so the
    prompt is faster than the same cache copying in line, and the wasted copies of a layer ahead count; a
    prompt that is all compute (no copies) gains nothing."""
    st = pm.esft_stats(30, ds.top_k, ds.n_expert)
    line = pm.Placement("e", n_cache=ds.n_moe, slots=30)
    ahead = pm.Placement("e", n_cache=ds.n_moe, slots=30, prompt_ahead=True)
    p_line = pm.prompt(ds, h200, line, 117, stats=st)
    p_ahead = pm.prompt(ds, h200, ahead, 117, stats=st)
    assert p_ahead.total_s < p_line.total_s
    # never faster than the longer of the two pipes: the compute, or all the copies (with the unused ones)
    compute = p_line.terms["GPU prompt compute"] + p_line.terms["host round trips"]
    assert p_ahead.total_s >= max(compute, p_line.terms["PCIe copies"])
    none = pm.prompt(ds, h200, ahead, 117, copied_bytes=0.0, stats=st)
    assert none.total_s == pytest.approx(compute)


def test_the_copies_ahead_are_predicted_to_beat_stock_prompts_on_the_h200(pm):
    preds = [p for p in pm.predictions() if "H200" in p.machine and p.shape == "ds-v2-lite"]
    by = {(p.budget.split(" ")[0], p.row): p for p in preds}
    for budget in ("50%", "25%"):
        assert by[(budget, "e+cpu+ahead")].prompt_tps > by[(budget, "cp")].prompt_tps
        assert by[(budget, "e+cpu+ahead")].prompt_tps > by[(budget, "e+cpu")].prompt_tps
        assert by[(budget, "e+cpu+ahead")].decode_tps > 1.1 * by[(budget, "cp")].decode_tps


# -- the host's memory and the real shapes (issue 43) ------------------------------------------------------------


def test_the_drive_is_read_only_where_the_host_cannot_hold_the_experts(pm, h200):
    shape = pm.Shape.named("qwen3-235b-a22b")  # 127.7 GB of experts
    big = replace(h200, host_ram_bytes=512e9, nvme_gbps=5.0)
    small = replace(h200, host_ram_bytes=64e9, nvme_gbps=5.0)
    stock = pm.Placement("cp", n_dev=10, n_cpu=shape.n_moe - 10)
    assert page_cache_misses(shape, big, stock) == 0.0
    assert "NVMe reads" not in pm.decode(shape, big, stock).terms
    misses = page_cache_misses(shape, small, stock)
    assert 0 < misses < stock.n_cpu * shape.top_k
    slow = pm.decode(shape, small, stock)
    assert slow.terms["NVMe reads"] == pytest.approx(misses * shape.expert_bytes / 5e9)
    assert slow.tokens_per_s < pm.decode(shape, big, stock).tokens_per_s
    # a cached layer's device slots and the page cache add up: fewer reads from the drive than without slots
    few = pm.Placement("lc", n_cache=shape.n_moe, slots=8, cpu_misses=True)
    many = pm.Placement("lc", n_cache=shape.n_moe, slots=32, cpu_misses=True)
    assert page_cache_misses(shape, small, many) < page_cache_misses(shape, small, few)
    # the runs of the bench have no host bound: the checked cells stay as they were
    assert h200.host_ram_bytes == 0 and page_cache_misses(shape, h200, stock) == 0.0


def test_the_real_shapes_are_predicted_on_both_machines(pm):
    preds = pm.real_shape_predictions()
    pairs = {(p.shape, "H200" in p.machine) for p in preds}
    assert pairs == {(name, h) for name in pm.REAL_SHAPES for h in (True, False)}
    for p in preds:
        assert p.row == "e" or (p.decode_tps > 0 and p.prompt_tps > 0), p
    by = {(p.shape, "H200" in p.machine, p.row): p for p in preds}
    # on the H200 everything but deepseek-v3 fits the card; deepseek-v3 does not fit its host either
    assert by[("gpt-oss-120b", True, "a")].what.startswith("everything fits")
    assert ("deepseek-v3", True, "a") not in by
    assert "the mapping" in by[("deepseek-v3", True, "cp")].what
    # the 24 GB card holds a third of gpt-oss-120b's experts: stock and the default both run
    assert by[("gpt-oss-120b", False, "cp")].decode_tps > 0 and ("gpt-oss-120b", False, "auto (engine)") in by
    table = pm.real_shapes_table(preds)
    assert all(f"| {name} | H200 |" in table and f"| {name} | 24 GB desktop |" in table for name in pm.REAL_SHAPES)
