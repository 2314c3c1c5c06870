"""A cost model of decode and prompt tokens/s for every place a MoE model's experts can live (issue 32),
calibrated on measured constants, checked against the runs of bench/expert_offload.py.

    python bench/placement_model.py                       # the new design's predictions (H200, consumer)
    python bench/placement_model.py --against DIR [DIR]   # predicted vs measured, every cell; exit 1 if > 15%
    python bench/placement_model.py --json OUT            # the predictions (and any --against cells) as JSON
    python bench/placement_model.py --replay-curve        # regenerate ESFT_CURVE from the policy's replay: the
                                                          # hit curve file it writes, the rest it prints
    python bench/placement_model.py --two-gpus            # 2 x 24 GB (PCIe 4.0 x16, x8/x8): stock --n-cpu-moe
                                                          # with --tensor-split against a cache per device

The formula (seconds; one decode step, then one prompt micro-batch of n tokens)
-------------------------------------------------------------------------------
A shape has L MoE layers of E experts, k used a token, S bytes an expert. A placement puts each MoE
layer's experts in one of four places: on the device (n_dev layers), computed on the CPU (n_cpu: b, c's
host layers), copied every step (n_copy: d), or behind the expert cache with s slots (n_cache: e).

    decode = T_gpu                                   all on the device: a's step (launches, weights)
           + (n_cpu + n_copy + n_cache) * t_rt       one host round trip a host-crossing layer a token
           + n_cpu * k * S / B_cpu                   CPU experts
           + n_copy * k * t_x                        d: every used expert copied
           + n_cache * (p * t_x + crit)              e: the prefetch's copies and the misses
    crit   = m * t_x                                 e: the layer's m misses copied, then computed
           = min over c of max((m - c) * t_x,        e+cpu (new): m - c copied while the CPU computes c
                               c * t_cpu + [c > 0] * t_lat)      (choose_split)
    decode = max(decode, n_cache * (m + p) * t_x)    e+cpu: every miss is still admitted by a copy, off
                                                     the critical path, but the link carries it

    prompt = G(n) = g0 + g1 * n                      a's prompt: GPU compute of one micro-batch
           + copied bytes / h2d_big                  stock (n >= the offload minimum, 32): the scheduler
                                                     copies each host layer's used experts, in long runs
           + copied bytes / h2d_expert               e after patch 0017: the cache copies its misses, one
                                                     expert each (the others come from slots on the device)

where m and p are a cached layer's misses and prefetches a token (the policy's replay: m = k (1 - hit
rate), the distribution of m from the replay when ESFT_CURVE holds the shape, else binomial), and

    t_x   = S / h2d_expert  pinned: one expert's copy (the one-expert rate: t_lat + S / h2d_big)
          = S / h2d_mapped  mapped (pageable): the driver stages every copy (see MAPPED_FACTOR)
    t_cpu = S / B_cpu * (1 + CPU_TOKEN_COST * (tokens - 1))    one missing expert on the CPU threads
    t_lat = S / h2d_expert - S / h2d_big             the fixed cost of one copy (DMA setup): 9.7 us on the H200

The bounding term of a cell is the largest of its terms (printed with its share of the time).

The constants and where each is measured
----------------------------------------
- h2d_big, h2d_expert (pinned), h2d_pageable: host->device GB/s for 512 MiB and for one expert, by torch at
  the bench's start (bench/gpu_facts.py constants, the JSON's `constants.h2d`); a folder without them
  (bench/data/gpu-2026-12-04) has them in h2d.txt, which is read instead.
- h2d_mapped: host->device GB/s from the mapped model file itself (bench/expert_offload.py measures it at
  its start since this model: `constants.h2d_mapped`); where absent, h2d_pageable * MAPPED_FACTOR.
- T_gpu, g0, g1: row a (all on the device) of the run, else of a sibling file of the folder (same machine),
  else the H200 of 2026-12-04 (H200_GPU: r50/r25's a rows) when the run's GPU is an H200; each cell says so.
- B_cpu: CPU expert GB/s at the run's thread count, from row b's decode (every run has b):
  B_cpu = L k S / (1 / b_decode - T_gpu - L t_rt). Row b's decode is therefore the calibration cell of B_cpu
  (its error is 0 by construction), and every other CPU cell (c, new design) is a prediction from it.
- hit rate, misses and prefetches: the e row's `replay_check.replay` (the Python replay of the engine's own
  access log, which equals the engine's counters); for slot counts no run measured, ESFT_CURVE (the
  policy's replay of the bench's own requests on the ESFT trace, `--replay-curve`), which reproduces the
  measured 56.6 / 64.5 / 81.4% at 7 / 14 / 32 slots within 0.5 points.
- copied prompt bytes: the run's own (routing-derived for stock rows, the cache's counters for e); for a
  prediction, used share * E * S per host layer (ESFT prompts of the bench: PROMPT_USED_SHARE), times the
  share the cache does not hold (ESFT_CURVE's prompt share).

Free parameters: two fitted, two assumed, each a physical quantity
--------------------------------------------------------------------
- T_RT_S = 35 us: one host round trip per host-crossing layer and token (the router's ids read back to the
  host, the stream synchronised, the next kernels launched). Fitted on the pinned d rows of 2026-12-04,
  whose every other term is measured (36 and 40 us), and e at 50% (28 us).
- MAPPED_FACTOR = 0.85: a copy from the mapped model (4 KiB page-cache pages, staged by the driver) runs
  at 0.85 x torch's pageable rate (an anonymous buffer). Fitted on 2026-12-04's mapped rows (d, e, b/c
  prompts: 0.83-0.88); the dev run's ed cells (0.80-0.95) check it.
- CPU_TOKEN_COST = 0.5 (assumed; no run measures it): each extra token of a CPU expert costs half its
  read (17 MFLOP a token-expert at ~0.5 TFLOP/s against 4.87 MB at ~60 GB/s). Only batched CPU misses use it.
- HBM_EFFICIENCY = 0.8 (assumed): the GPU reads weights at 80% of its data-sheet bandwidth; it only splits
  T_gpu into weights read and per-token overhead, and scales T_gpu to a GPU without a measurement.

Known bias: the cache's decode with pinned copies is predicted 4-11% slow at 7-16 slots (p12, p25, the
dev run's e25), where the prefetch copies a token's 30-67 experts: the model puts every prefetch copy on the
critical path (at 7 slots on the H200 the measurement is 9% above that, while hiding them behind compute
would predict 21% above it), and the prefetch's second stream hides some of them. Not fitted away: a
parameter for it would fit the table.

Out of scope, printed with the reason: rows with -np N (batched decode of several requests), rows through
the staging ring (its rate is the engine's own pipeline of copy threads and pinned chunks; no constant
measured before the servers start isolates it; the cell prints the rate it implies).

The model itself (shapes, machines, the replay curve, decode and prompt, choose_split, choose_layers_and_cache,
engine_auto_split) is the library shared/moe_l2_placement, which `moe-l2 doctor --model` uses too; this file
reads the bench's runs, checks the model against them (--against), prints the tables and the replay curve.

Standard library at import time (the model's library is too); numpy, moe_l2_gguf and moe_l2_cache only inside
the functions that need them (a shape by name, --replay-curve), so a bare interpreter runs --against: shared/
goes on sys.path here when the library is not installed (gpu_check.sh sets PYTHONPATH from pyproject's roots).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
try:
    import moe_l2_placement  # noqa: F401
except ImportError:  # a bare interpreter (the GPU machine's, a rehearsal's): the library from the checkout
    sys.path.insert(0, str(REPO / "shared"))
from data_paths import esft_npz  # noqa: E402

# tests/test_expert_cache_auto.py reads the engine's arithmetic from here (pm.engine_auto_split, ...)
from moe_l2_placement.choose import (  # noqa: E402, F401
    ENGINE_HIT_CURVE,
    EngineSplit,
    choose_layers_and_cache,
    engine_auto_split,
)
from moe_l2_placement.curve import CacheStats, esft_stats  # noqa: E402
from moe_l2_placement.estimate import (  # noqa: E402
    EXPERT_TENSORS,
    Placement,
    decode,
    page_cache_share,
    prompt,
)
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, write_hit_curve  # noqa: E402
from moe_l2_placement.machine import (  # noqa: E402
    CONSUMER_HOST_RAM_BYTES,
    CPU_TOKEN_COST,
    DEVICE_RESERVE_BYTES,
    H200_DEVICE_BYTES,
    H200_GPU,
    HBM_EFFICIENCY,
    MAPPED_FACTOR,
    NVME_GBPS,
    T_RT_S,
    Machine,
    consumer_machine,
    h200_for,
    h200_machine,
    hbm_of,
)
from moe_l2_placement.multi_gpu import (  # noqa: E402
    LINKS,
    TwoGpuRow,
    describe,
    desktop_gpus,
    device_words,
    one_cache_plan,
    per_device_plan,
    stock_best,
    stock_even,
)
from moe_l2_placement.shape import NotModelled, Shape  # noqa: E402

TOLERANCE = 0.15  # the bound on a cell's error
PROMPT_TOKENS = (117, 81, 118)  # the bench's three prompts of 40 words (every run of 2026-12-04)


# -- hit rates of a run ------------------------------------------------------------------------------------


def stats_from_row(row: Mapping, shape: Shape) -> CacheStats:
    """An e row's hit rate, misses and prefetches a cached layer a token: the Python replay of the engine's
    access log (replay_check.replay), else the engine's decode counters; the spread from ESFT_CURVE."""
    cache = row.get("expert_cache") or {}
    replay = (cache.get("replay_check") or {}).get("replay")
    slots = (cache.get("replay_check") or {}).get("slots") or slots_of(row, shape)
    if replay and replay.get("accesses"):
        acc = replay["accesses"]
        hit, loads, prefetch, src = (
            replay["hits"] / acc,
            replay["loads"] / acc,
            replay.get("prefetch", 0) / acc,
            "replay",
        )
    elif cache.get("decode_totals", {}).get("accesses"):
        t = cache["decode_totals"]
        hit, loads, src = t["hits"] / t["accesses"], t["loads"] / t["accesses"], "engine counters (no replay)"
        prefetch = max(0.0, t["h2d_bytes"] / shape.expert_bytes - t["loads"]) / t["accesses"]
    else:
        raise NotModelled("the e row has neither a replay nor decode counters: no hit rate")
    k = shape.top_k
    try:
        spread = esft_stats(slots, k, shape.n_expert).miss_hist
    except NotModelled:
        spread = CacheStats.binomial(k, hit, 0).miss_hist
    return CacheStats(hit, k * loads, k * prefetch, spread, source=f"{src}, {slots} slots")


def slots_of(row: Mapping, shape: Shape) -> int:
    return min(shape.n_expert, int(row.get("device_expert_bytes", 0)) // (shape.n_moe * shape.expert_bytes))


# -- reading runs ---------------------------------------------------------------------------------------------


def parse_h2d_txt(text: str) -> dict[str, float]:
    """h2d.txt of bench/data/gpu-2026-12-04 as gpu_facts' keys."""
    out: dict[str, float] = {}
    pats = {
        "pageable_512MiB_gbps": r"pageable:\s*([\d.]+) GB/s",
        "pinned_512MiB_gbps": r"pinned:\s*([\d.]+) GB/s",
        "pageable_expert_gbps": r"pageable one expert[^:]*:\s*([\d.]+) GB/s",
        "pinned_expert_gbps": r"pinned one expert[^:]*:\s*([\d.]+) GB/s",
    }
    for key, pat in pats.items():
        m = re.search(pat, text, re.IGNORECASE)
        if m:
            out[key] = float(m[1])
    return out


def base_of(key: str, row: Mapping) -> str:
    return str(row.get("base") or key[0])


def host_memory(key: str, row: Mapping) -> str:
    """pinned, mapped or ring: where a row's host experts are copied from."""
    args = [str(a) for a in row.get("server_args") or []]
    env = row.get("env") or {}
    mode = args[args.index("--load-mode") + 1] if "--load-mode" in args else row.get("load_mode")
    log = str(row.get("host_experts_log") or "")
    if "through a staging ring" in log:  # not "copied directly (no staging ring: ...)"
        return "ring"
    if "pageable host memory" in log or "refused pinned" in log:
        return "mapped"
    if "from pinned host memory" in log or "pinned memory (load mode none)" in log:
        return "pinned"
    if mode == "none" and env.get("GGML_CUDA_NO_PINNED") != "1":
        return "pinned"
    return "mapped"  # llama.cpp's default maps the model; the engine before 0018 made no choice


def placement_of(key: str, row: Mapping, shape: Shape) -> Placement:
    base, host = base_of(key, row), host_memory(key, row)
    host_layers = len(row.get("host_expert_layers") or [])
    L = shape.n_moe
    if base == "a":
        return Placement(key, n_dev=L, host=host)
    if base == "b":
        return Placement(key, n_cpu=L, host=host)
    if base == "c":
        return Placement(key, n_dev=L - host_layers, n_cpu=host_layers, host=host)
    if base == "d":
        return Placement(key, n_copy=L, host=host)
    if base == "e":
        through = bool(row.get("host_experts_log"))  # the line came with 0018, after 0017 (prompts through the cache)
        ahead = "copied one expert tensor ahead" in str(row.get("prompt_ahead_log") or "")  # 0021 on
        return Placement(
            key, n_cache=L, slots=slots_of(row, shape), host=host, prompt_through_cache=through, prompt_ahead=ahead
        )
    raise NotModelled(f"unknown placement {base!r}")


@dataclass
class Cell:
    file: str
    row: str
    what: str  # decode | prompt
    measured: float | None
    predicted: float | None = None
    bound: str = ""
    status: str = "checked"  # checked | calibration | not modelled | out of scope
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return self.predicted / self.measured - 1

    @property
    def fails(self) -> bool:
        return self.status in ("checked", "calibration") and (self.error is None or abs(self.error) > TOLERANCE)


def load_runs(folder: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("benchmark") == "expert_offload":
            runs[path.name] = doc
    return runs


def _measured(row: Mapping, what: str) -> float | None:
    v = row.get(f"{what}_tokens_per_s")
    return float(v) if v else None


def a_rows(runs: Mapping[str, dict]) -> list[tuple[str, dict]]:
    return [
        (name, r)
        for name, run in runs.items()
        for key, r in run.get("configs", {}).items()
        if base_of(key, r) == "a" and r.get("status") == "measured" and r.get("decode_tokens_per_s")
    ]


def fit_prompt(rows: Iterable[Mapping]) -> tuple[float, float]:
    """g0, g1 of G(n) = g0 + g1 n by least squares over a's prompt runs."""
    xs, ys = [], []
    for r in rows:
        runs = r.get("runs") or {}
        for n, tps in zip(runs.get("prompt_tokens", []), runs.get("prompt_tokens_per_s", []), strict=False):
            if n and tps:
                xs.append(float(n))
                ys.append(n / tps)
    if len(set(xs)) < 2:
        raise NotModelled("a's prompt runs have one length: g0 and g1 cannot be told apart")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    g1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - g1 * mx, g1


def gpu_name(run: Mapping) -> str:
    gpu = (run.get("constants") or {}).get("gpu")
    return str(gpu.get("name", "")) if isinstance(gpu, dict) else ""


def readme_gpu(folder: Path) -> str:
    """The GPU a folder's README names (bench/data/gpu-2026-12-04's JSON files carry no constants)."""
    readme = folder / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    m = re.search(r"NVIDIA (H200|H100|A100|RTX \w+)", text)
    return f"NVIDIA {m[1]} (the folder's README)" if m else ""


def machine_for(name: str, run: Mapping, runs: Mapping[str, dict], folder: Path) -> Machine:
    """The constants of one run: its own, else its folder's (same machine), else the H200 defaults."""
    src: dict[str, str] = {}
    h2d = dict((run.get("constants") or {}).get("h2d") or {})
    if "pinned_512MiB_gbps" in h2d:
        src["h2d"] = f"{name}: constants.h2d (gpu_facts, at the run's start)"
    elif (folder / "h2d.txt").is_file():
        h2d = parse_h2d_txt((folder / "h2d.txt").read_text())
        src["h2d"] = "h2d.txt of the folder (torch, same machine and day; the JSON has no constants)"
    needed = ("pinned_512MiB_gbps", "pinned_expert_gbps", "pageable_512MiB_gbps")
    if not all(k in h2d for k in needed):
        raise NotModelled("no host->device rates: neither constants.h2d in the JSON nor h2d.txt in the folder")
    mapped = (run.get("constants") or {}).get("h2d_mapped") or {}
    mapped_gbps = mapped.get("mapped_512MiB_gbps") if isinstance(mapped, dict) else None
    src["h2d_mapped"] = (
        f"{name}: constants.h2d_mapped (the model file, at the run's start)"
        if mapped_gbps
        else f"not measured: pageable x MAPPED_FACTOR {MAPPED_FACTOR}"
    )
    own = [(name, r) for n, r in a_rows(runs) if n == name]
    a_list = own or a_rows(runs)
    gname = gpu_name(run) or next((gpu_name(r) for r in runs.values() if gpu_name(r)), "") or readme_gpu(folder)
    if a_list:
        t_gpu = 1 / statistics.median(float(r["decode_tokens_per_s"]) for _, r in a_list)
        g0, g1 = fit_prompt(r for _, r in a_list)
        files = sorted({n for n, _ in a_list})
        src["gpu"] = f"row a of {', '.join(files)}" + ("" if own else " (same folder: same machine, other run)")
    elif "H200" in gname:
        t_gpu, g0, g1 = H200_GPU["gpu_token_s"], H200_GPU["gpu_prompt_fixed_s"], H200_GPU["gpu_prompt_token_s"]
        src["gpu"] = (
            "no row a in the folder: the H200 of 2026-12-04 (bench/data/gpu-2026-12-04 r50/r25 a rows; same GPU model)"
        )
    else:
        raise NotModelled("no row a (all on the device) in the folder and no measured GPU of this kind")
    hbm = hbm_of(gname) or (hbm_of("H200") if "H200" in src["gpu"] else None)
    base = Machine(
        name=gname or "GPU",
        h2d_pinned_big_gbps=float(h2d["pinned_512MiB_gbps"]),
        h2d_pinned_expert_gbps=float(h2d["pinned_expert_gbps"]),
        h2d_pageable_big_gbps=float(h2d["pageable_512MiB_gbps"]),
        cpu_expert_gbps=1.0,
        gpu_token_s=t_gpu,
        gpu_prompt_fixed_s=g0,
        gpu_prompt_token_s=g1,
        h2d_mapped_gbps=float(mapped_gbps) if mapped_gbps else None,
        ref_bytes=int((h2d.get("bytes") or {}).get("expert", 4_866_048)),
        hbm_gbps=hbm,
        sources=src,
    )
    shape = Shape.from_run(run)
    b = next((run["configs"][k] for k in ("b", "bp") if k in run.get("configs", {})), None)
    if not b or not b.get("decode_tokens_per_s"):
        raise NotModelled("no row b: CPU expert GB/s is derived from it")
    cpu_s = 1 / float(b["decode_tokens_per_s"]) - t_gpu - shape.n_moe * base.t_rt_s
    if cpu_s <= 0:
        raise NotModelled("row b decodes faster than a plus its round trips: CPU GB/s undefined")
    cpu = shape.n_moe * shape.top_k * shape.expert_bytes / cpu_s / 1e9
    src["cpu"] = f"{name}: row b's decode at {run.get('threads')} threads, net of T_gpu and L t_rt"
    return replace(base, cpu_expert_gbps=cpu)


def check_run(name: str, run: dict, runs: Mapping[str, dict], folder: Path) -> list[Cell]:
    """Every cell of one run: predicted against measured, or why not."""
    cells: list[Cell] = []
    try:
        machine: Machine | None = machine_for(name, run, runs, folder)
        shape: Shape | None = Shape.from_run(run)
        why = ""
    except NotModelled as exc:
        machine, shape, why = None, None, str(exc)
    for key, row in run.get("configs", {}).items():
        for what in ("decode", "prompt"):
            cell = Cell(name, key, what, _measured(row, what))
            cells.append(cell)
            if row.get("status") != "measured":
                cell.status, cell.note = "out of scope", f"not measured: {row.get('status')}"
            elif row.get("concurrent") is not None or re.search(r"-np\d+$", key):
                cell.status, cell.note = "out of scope", "-np N: a batched decode of several requests"
            elif machine is None or shape is None:
                cell.status, cell.note = "not modelled", why
            else:
                predict_cell(cell, key, row, shape, machine)
    return cells


def predict_cell(cell: Cell, key: str, row: Mapping, shape: Shape, machine: Machine) -> None:
    pl: Placement | None = None
    try:
        pl = placement_of(key, row, shape)
        stats = stats_from_row(row, shape) if pl.n_cache else None
        base = base_of(key, row)
        if cell.what == "decode":
            est = decode(shape, machine, pl, stats)
            cell.predicted, cell.bound = est.tokens_per_s, est.bound
            if base == "b":
                cell.status, cell.note = "calibration", "B_cpu is derived from this cell"
            elif base == "a" and "row a of " + cell.file in machine.sources.get("gpu", ""):
                cell.status, cell.note = "calibration", "T_gpu is this cell"
            if stats:
                cell.note = f"hit rate {100 * stats.hit_rate:.1f}% ({stats.source})"
        else:
            runs = row.get("runs") or {}
            ns = runs.get("prompt_tokens") or []
            copied = runs.get("prompt_h2d_expert_bytes_derived") or [None] * len(ns)
            ests = [prompt(shape, machine, pl, int(n), b, stats) for n, b in zip(ns, copied, strict=False)]
            if not ests:
                raise NotModelled("no prompt runs")
            cell.predicted = statistics.median(e.tokens_per_s for e in ests)
            cell.bound = ests[0].bound
            if base == "a" and "row a of " + cell.file in machine.sources.get("gpu", ""):
                cell.status, cell.note = "calibration", "g0, g1 are fitted on this row's runs"
    except NotModelled as exc:
        cell.status, cell.note = "not modelled", str(exc)
        if pl is not None and pl.host == "ring" and cell.measured:
            cell.note += "; " + implied_ring_rate(cell, row, shape, machine, pl)


def implied_ring_rate(cell: Cell, row: Mapping, shape: Shape, machine: Machine, pl: Placement) -> str:
    """What a ring row's measured time implies for the ring's copy rate (GB/s), for the record."""
    try:
        if cell.what == "decode":
            stats = stats_from_row(row, shape)
            rest = decode(shape, machine, replace(pl, host="pinned", n_cache=pl.n_cache), stats)
            rest_s = rest.total_s - rest.terms.get("PCIe copies", 0.0)
            nbytes = pl.n_cache * (stats.misses + stats.prefetch) * shape.expert_bytes
            rate = nbytes / (1 / cell.measured - rest_s) / 1e9
        else:
            runs = row.get("runs") or {}
            n, b = runs["prompt_tokens"][0], runs["prompt_h2d_expert_bytes_derived"][0]
            rate = b / (n / runs["prompt_tokens_per_s"][0] - machine.gpu_prompt_s(n)) / 1e9
        return f"the measured cell implies a ring rate of {rate:.1f} GB/s (mapped direct: {machine.mapped_gbps:.1f})"
    except (KeyError, IndexError, ZeroDivisionError, NotModelled):
        return "no implied rate"


def check_folder(folder: Path) -> list[Cell]:
    runs = load_runs(folder)
    cells: list[Cell] = []
    for name, run in runs.items():
        cells += check_run(name, run, runs, folder)
    return cells


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def cells_table(cells: Sequence[Cell]) -> str:
    lines = [
        "| cell | predicted tok/s | measured tok/s | error | bounding term | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        err = "-" if c.error is None else f"{100 * c.error:+.1f}%"
        flag = " **FAIL**" if c.fails else ""
        status = "" if c.status == "checked" else f"[{c.status}] "
        lines.append(
            f"| {c.file.removesuffix('.json')} {c.row} {c.what} | {_fmt(c.predicted)} | {_fmt(c.measured)} "
            f"| {err}{flag} | {c.bound} | {status}{c.note} |"
        )
    return "\n".join(lines)


def constants_table(folder: Path) -> str:
    runs = load_runs(folder)
    lines = []
    for name, run in runs.items():
        try:
            m = machine_for(name, run, runs, folder)
        except NotModelled as exc:
            lines.append(f"- {name}: constants not available: {exc}")
            continue
        lines.append(
            f"- {name}: h2d pinned {m.h2d_pinned_big_gbps:.1f} GB/s (512 MiB), {m.h2d_pinned_expert_gbps:.1f} "
            f"(one expert; t_lat {1e6 * m.copy_latency_s:.1f} us); pageable {m.h2d_pageable_big_gbps:.1f}, "
            f"mapped {m.mapped_gbps:.2f}; B_cpu {m.cpu_expert_gbps:.1f} GB/s; T_gpu {1e3 * m.gpu_token_s:.2f} ms; "
            f"G(n) = {1e3 * m.gpu_prompt_fixed_s:.1f} ms + {1e3 * m.gpu_prompt_token_s:.4f} ms x n; "
            f"t_rt {1e6 * m.t_rt_s:.0f} us. Sources: " + "; ".join(f"{k}: {v}" for k, v in m.sources.items())
        )
    return "\n".join(lines)


# -- predictions: the new design on the H200 and on a consumer machine ------------------------------------------


@dataclass
class Prediction:
    machine: str
    shape: str
    budget: str
    budget_bytes: int
    row: str
    what: str
    decode_tps: float
    prompt_tps: float
    decode_bound: str
    prompt_bound: str
    note: str = ""


def n_cpu_moe_layers(shape: Shape, budget: int) -> int:
    """Stock --n-cpu-moe at `budget`: the last whole layers that fit on the device."""
    return min(shape.n_moe, budget // shape.layer_bytes)


def design_rows(shape: Shape, machine: Machine, budget: int, label: str) -> list[Prediction]:
    """At one device budget: the best stock row (c pinned), e as built, e+cpu, layers+cache (+cpu). Where the
    host-held experts pass the host's memory, nothing can be pinned: every row copies from the mapping."""
    L, S = shape.n_moe, shape.expert_bytes
    out: list[Prediction] = []
    n = PROMPT_TOKENS[0]

    def add(row: str, what: str, pl: Placement, stats: CacheStats | None, note: str = "") -> None:
        if page_cache_share(shape, machine, pl) < 1.0:
            pl = replace(pl, host="mapped")
            what = what.replace(" pinned", "") + "; from the mapping (more than the host's memory: none pinned)"
        d, p = decode(shape, machine, pl, stats), prompt(shape, machine, pl, n, None, stats)
        out.append(
            Prediction(
                machine.name,
                shape.name,
                label,
                budget,
                row,
                what,
                d.tokens_per_s,
                p.tokens_per_s,
                d.bound,
                p.bound,
                note,
            )
        )

    if budget >= shape.routed_bytes:
        add("a", "everything fits: every expert on the device", Placement("a", n_dev=L), None)
        return out
    n_dev = n_cpu_moe_layers(shape, budget)
    add(
        "cp",
        f"stock --n-cpu-moe pinned: {n_dev} layers on the device",
        Placement("cp", n_dev=n_dev, n_cpu=L - n_dev),
        None,
    )
    slots = min(shape.n_expert, budget // (L * S))
    if slots >= shape.top_k:
        st = esft_stats(slots, shape.top_k, shape.n_expert)
        add(
            "e",
            f"expert cache, {slots} slots, pinned (as built)",
            Placement("e", n_cache=L, slots=slots),
            st,
            st.source,
        )
        pl = Placement("e+cpu", n_cache=L, slots=slots, cpu_misses=True)
        add("e+cpu", f"{slots} slots, misses split PCIe/CPU (choose_split)", pl, st, st.source)
        # patch 0021's two buffers (a full-size expert tensor each) come out of the budget when they take at
        # most an eighth of it
        ahead = 2 * shape.n_expert * S // EXPERT_TENSORS
        slots_a = min(shape.n_expert, (budget - ahead) // (L * S))
        if 8 * ahead <= budget and slots_a >= shape.top_k:
            st_a = esft_stats(slots_a, shape.top_k, shape.n_expert)
            pl = Placement("e+cpu+ahead", n_cache=L, slots=slots_a, cpu_misses=True, prompt_ahead=True)
            add("e+cpu+ahead", f"{slots_a} slots and the prompt's copies one tensor ahead", pl, st_a, st_a.source)
    else:
        out.append(
            Prediction(
                machine.name,
                shape.name,
                label,
                budget,
                "e",
                f"{slots} slots < top-{shape.top_k}: the cache refuses to start",
                0.0,
                0.0,
                "",
                "",
            )
        )
    for cpu in (False, True):
        lc = choose_layers_and_cache(budget, shape, machine, cpu_misses=cpu)
        if lc.n_cache:
            st = esft_stats(lc.slots, shape.top_k, shape.n_expert)
            pl = Placement("lc", n_dev=lc.n_dev, n_cache=lc.n_cache, slots=lc.slots, cpu_misses=cpu)
        else:
            st, pl = None, Placement("lc", n_dev=lc.n_dev, n_cpu=lc.n_cpu)
        add("layers+cache" + ("+cpu" if cpu else ""), lc.why, pl, st, st.source if st else "")
    auto = engine_auto_split(
        shape.n_moe,
        shape.n_expert,
        shape.top_k,
        shape.expert_bytes,
        budget,
        machine.t_rt_s,
        machine.expert_copy_s(shape.expert_bytes, "pinned"),
    )
    rest = shape.n_moe - auto.n_dev
    if auto.n_slot:
        st = esft_stats(auto.n_slot, shape.top_k, shape.n_expert)
        pl = Placement("lc", n_dev=auto.n_dev, n_cache=rest, slots=auto.n_slot, cpu_misses=True)
    elif rest:
        st, pl = None, Placement("c", n_dev=auto.n_dev, n_cpu=rest)
    else:
        st, pl = None, Placement("a", n_dev=shape.n_moe)
    add("auto (engine)", auto.why(shape.n_moe, shape.n_expert), pl, st, st.source if st else "")
    return out


def predictions() -> list[Prediction]:
    h200 = h200_machine()
    out: list[Prediction] = []
    ds = Shape.named("ds-v2-lite")
    for share, label in ((0.5, "50%"), (0.25, "25%"), (0.125, "12.5%")):
        out += design_rows(ds, h200, int(ds.routed_bytes * share), label)
    for name in ("ds-v2-lite", "qwen3-30b-a3b"):
        shape = Shape.named(name)
        consumer = consumer_machine(shape, h200)
        free = 24 * 10**9 - shape.other_bytes - 2 * 10**9  # the card less the dense weights, KV and compute (2 GB)
        out += design_rows(shape, consumer, free, "24 GB card")
        for share, label in ((0.5, "50%"), (0.25, "25%"), (0.125, "12.5%")):
            out += design_rows(shape, consumer, int(shape.routed_bytes * share), label)
    return out


def predictions_table(preds: Sequence[Prediction]) -> str:
    lines = [
        "| machine | shape | budget | row | placement | decode tok/s | bound | prompt tok/s (117 tokens) | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        lines.append(
            f"| {p.machine} | {p.shape} | {p.budget} ({p.budget_bytes / 1e9:.2f} GB) | {p.row} | {p.what} "
            f"| {p.decode_tps:.1f} | {p.decode_bound} | {p.prompt_tps:.0f} | {p.prompt_bound} |"
        )
    return "\n".join(lines)


# -- the real shapes (issue 43): each on the H200 and on the 24 GB desktop ------------------------------------

REAL_SHAPES = (
    "gpt-oss-20b",
    "gpt-oss-120b",
    "mixtral-8x7b",
    "llama-4-scout",
    "glm-4.5-air",
    "qwen3-235b-a22b",
    "deepseek-v3",
)


def real_shape_predictions() -> list[Prediction]:
    """Each real shape with the whole card as its budget (the card less the dense weights and 2 GB), on the
    H200 and on the 24 GB desktop: stock --n-cpu-moe against the project's default and the cache's rows."""
    h200 = h200_machine()
    out: list[Prediction] = []
    for name in REAL_SHAPES:
        shape = Shape.named(name)
        for machine, card in (
            (h200_for(shape, h200), H200_DEVICE_BYTES),
            (
                replace(consumer_machine(shape, h200), host_ram_bytes=CONSUMER_HOST_RAM_BYTES, nvme_gbps=NVME_GBPS),
                24 * 10**9,
            ),
        ):
            free = max(0, card - shape.other_bytes - DEVICE_RESERVE_BYTES)
            out += design_rows(shape, machine, free, f"{card / 1e9:.0f} GB card")
    return out


def real_shapes_table(preds: Sequence[Prediction]) -> str:
    """One line a shape and machine: the routed experts against the card's room, stock --n-cpu-moe (pinned,
    or the mapping) against the project's default (auto) and the best of the cache's rows."""
    lines = [
        "| shape | machine | experts / room on the card | stock --n-cpu-moe tok/s | default (auto) tok/s | "
        "auto / stock | best cache row | its tok/s | decode bound (auto) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Prediction]] = {}
    for p in preds:
        groups.setdefault((p.shape, p.machine), []).append(p)
    for (name, machine), rows in groups.items():
        routed = Shape.named(name).routed_bytes
        by = {r.row: r for r in rows}
        auto = by.get("auto (engine)") or by["a"]
        stock = by.get("cp") or by["a"]
        cache = [r for r in rows if r.row.startswith(("e", "layers")) and r.decode_tps > 0]
        best = max(cache, key=lambda r: r.decode_tps, default=auto)
        short = "H200" if "H200" in machine else "24 GB desktop"
        lines.append(
            f"| {name} | {short} | {routed / 1e9:.1f} / {auto.budget_bytes / 1e9:.1f} GB | {stock.decode_tps:.1f} "
            f"| {auto.decode_tps:.1f} | {auto.decode_tps / stock.decode_tps:.2f}x | {best.row} | "
            f"{best.decode_tps:.1f} | {auto.decode_bound} |"
        )
    return "\n".join(lines)


# -- two GPUs (issue 45): stock --n-cpu-moe with --tensor-split against one cache and a cache per device ------

TWO_GPU_SHAPES = ("qwen3-235b-a22b", "gpt-oss-120b", "glm-4.5-air")


def two_gpu_predictions() -> list[TwoGpuRow]:
    """Each shape on 2 x 24 GB of the 24 GB desktop, both cards on PCIe 4.0 x16 and on x8/x8: stock --n-cpu-moe
    on llama.cpp's default split and on the best split, one cache on device 0 (today), a cache per device."""
    h200 = h200_machine()
    out: list[TwoGpuRow] = []
    for name in TWO_GPU_SHAPES:
        shape = Shape.named(name)
        for link in LINKS:
            gpus = desktop_gpus(shape, h200, link)
            for plan in (
                stock_even(shape, gpus),
                stock_best(shape, gpus),
                one_cache_plan(shape, gpus),
                per_device_plan(shape, gpus),
            ):
                if plan is not None:
                    out.append(describe(shape, gpus, plan))
    return out


def two_gpus_table(rows: Sequence[TwoGpuRow]) -> str:
    lines = [
        "| shape | link | placement | --tensor-split | --n-cpu-moe | decode tok/s | prompt tok/s (117 tokens) | "
        "decode bound | per device: whole layers, cached x slots, CPU; used / memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        link = r.machine.rsplit(" ", 1)[-1]
        n = "" if r.n_cpu_moe is None else str(r.n_cpu_moe)
        lines.append(
            f"| {r.shape} | {link} | {r.placement} | {r.tensor_split} | {n} | {r.decode_tps:.1f} | "
            f"{r.prompt_tps:.0f} | {r.decode_bound} | {device_words(r)} |"
        )
    return "\n".join(lines)


# -- the replay curve ----------------------------------------------------------------------------------------

# The shipped hit curve's header (moe_l2_placement/data/hit-curve-default.txt), which --replay-curve writes.
REPLAY_CURVE_COMMENT = """\
The hit rate of a layer's expert cache against the share of the layer's experts it holds (slots / experts):
the project's default policy (hybrid_threshold_prefetch, per-domain priors and transitions fitted on ESFT
sequences 7..212) replaying bench/expert_offload.py's requests (a warm-up, then per run a prompt and a
65-token decode, sequences 0..6) on DeepSeek-V2-Lite's ESFT routing (26 MoE layers of 64 experts, top-6),
at s = 6..64 of 64 slots; its decode hit rates are the engine's measured ones (56.6 / 64.5 / 81.4% at 7 /
14 / 32 slots, the H200 run of 2026-12-04).
llama-server's --moe-cache-bytes auto reads it with --moe-cache-hit-curve FILE when no curve of the model's
own routing exists yet (moe-l2 up passes the cache-manager's, MOE_L2_CACHE_HIT_CURVE_PATH, once written).
Regenerate (about a minute): python bench/placement_model.py --replay-curve
Format: moe_l2_placement.hit_curve (a point a line, linear between points, (0, 0) before the first)."""


def replay_curve(
    slot_counts: Iterable[int], runs: int = 3, prompt_tokens: Sequence[int] = PROMPT_TOKENS, decode_tokens: int = 65
) -> dict[int, tuple[float, float, float, tuple[float, ...], float]]:
    """ESFT_CURVE's rows: the project's default policy replaying the bench's requests on the ESFT trace.

    As bench/expert_offload.py sends them (request r replays sequence r from its first evaluated token): a
    warm-up (sequence 0, 10 tokens one at a time), then per run a prompt (sequence 1 + 2i, its first n tokens
    in one micro-batch: a bypass when they use more experts than a layer has slots, counting the used experts
    already resident) and a decode (sequence 2 + 2i, 65 tokens one at a time). Profile: priors and
    transitions fitted on the sequences no run replays, requests tagged with their task.
    """
    import numpy as np

    from moe_l2_cache.policy.prefetch import CrossLayerPrefetch
    from moe_l2_cache.policy.profile import fit_profile
    from moe_l2_cache.policy.registry import DEFAULT_POLICY, make_policy
    from moe_l2_llama.route_trace import esft_sequence_tasks, from_esft_npz

    npz = esft_npz()
    trace, tags = from_esft_npz(npz), esft_sequence_tasks(npz)
    replayed = 1 + 2 * runs
    fit = list(range(replayed, trace.n_seq))
    ids = np.concatenate([trace.sequence(q) for q in fit])
    labels = np.repeat([tags[q] for q in fit], np.diff(trace.offsets)[fit])
    prof = fit_profile(ids, list(labels), trace.n_expert)
    L, k = trace.n_layer, trace.n_used
    out = {}
    for slots in slot_counts:
        cache = make_policy(
            DEFAULT_POLICY,
            L,
            trace.n_expert,
            slots,
            top_k=k,
            domain_freq=dict(prof.domain_freq),
            transitions=prof.transitions,
            domain_transitions=dict(prof.domain_transitions),
        )
        hist = [0] * (k + 1)
        used = copied = 0
        n_tok = 0

        cache.on_domain(tags[0])
        for tok in trace.sequence(0)[:10]:
            for layer in range(L):
                hist[k - cache.access(layer, tuple(sorted(int(x) for x in tok[layer])))] += 1
        for i in range(runs):
            q = 1 + 2 * i
            cache.on_domain(tags[q])
            batch = trace.sequence(q)[: prompt_tokens[i % len(prompt_tokens)]]
            warm = i > 0 or runs == 1  # the share counts prompts after a decode: a warm cache
            for layer in range(L):
                experts = tuple(sorted({int(x) for x in batch[:, layer, :].ravel()}))
                if len(experts) > slots:  # a bypass: residency unchanged, resident experts from slots
                    miss = len(experts) - len(cache.resident(layer).intersection(experts))
                else:
                    miss = len(experts) - cache.access(layer, experts)
                used += len(experts) if warm else 0
                copied += miss if warm else 0
            q += 1
            cache.on_domain(tags[q])
            before = sum(hist)
            for tok in trace.sequence(q)[:decode_tokens]:
                for layer in range(L):
                    hist[k - cache.access(layer, tuple(sorted(int(x) for x in tok[layer])))] += 1
            n_tok += (sum(hist) - before) // L
        decode_hist = hist  # warm-up included: a few tokens of 205
        acc = sum(decode_hist) * k
        misses = sum(m * c for m, c in enumerate(decode_hist))
        prefetch = cache.stats.loads if isinstance(cache, CrossLayerPrefetch) else 0
        tokens = sum(decode_hist) / L
        out[slots] = (
            round(1 - misses / acc, 4),
            round(misses / tokens, 2),
            round(prefetch / tokens, 2),
            tuple(round(c / sum(decode_hist), 4) for c in decode_hist),
            round(copied / used, 4),
        )
    return out


# -- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[], help="folders of expert_offload JSON files")
    parser.add_argument("--json", type=Path, help="write the predictions (and the --against cells) here")
    parser.add_argument(
        "--replay-curve",
        action="store_true",
        help="replay the policy: write its hit rates to the shipped hit curve (or --hit-curve-out) and print the "
        "rest of ESFT_CURVE (curve.py's _ESFT_REPLAY)",
    )
    parser.add_argument(
        "--hit-curve-out",
        type=Path,
        default=DEFAULT_HIT_CURVE,
        help="where --replay-curve writes the hit curve (default: the shipped %(default)s)",
    )
    parser.add_argument(
        "--two-gpus",
        action="store_true",
        help="2 x 24 GB cards (PCIe 4.0 x16 and x8/x8): stock --n-cpu-moe with --tensor-split against one cache "
        "on device 0 and a cache per device (issue 45); with --json, written as two_gpus",
    )
    args = parser.parse_args(argv)
    if args.two_gpus:
        rows = two_gpu_predictions()
        print(two_gpus_table(rows))
        if args.json:
            doc2 = {"free_parameters": free_parameters(), "two_gpus": [asdict(r) for r in rows]}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc2, indent=2) + "\n")
        return 0
    if args.replay_curve:
        curve = replay_curve(range(6, 65))
        write_hit_curve(args.hit_curve_out, [(s / 64, v[0]) for s, v in curve.items()], REPLAY_CURVE_COMMENT)
        print(f"# the hit rates: written to {args.hit_curve_out}", file=sys.stderr)
        print("_ESFT_REPLAY: dict[int, tuple[float, float, tuple[float, ...], float]] = {")
        for s, v in curve.items():
            print(f"    {s}: {v[1:]!r},")
        print("}")
        return 0
    failed = False
    doc: dict = {"tolerance": TOLERANCE, "free_parameters": free_parameters(), "against": {}}
    for folder in args.against:
        if not folder.is_dir():
            print(f"error: --against {folder}: not a folder", file=sys.stderr)
            return 2
        cells = check_folder(folder)
        if not cells:
            print(f"error: --against {folder}: no expert_offload JSON there", file=sys.stderr)
            return 2
        print(f"## {folder}\n")
        print(constants_table(folder) + "\n")
        print(cells_table(cells))
        bad = [c for c in cells if c.fails]
        checked = [c for c in cells if c.status in ("checked", "calibration")]
        worst = max((abs(c.error) for c in checked if c.error is not None), default=0.0)
        print(
            f"\n{len(checked)} cells checked ({sum(c.status == 'calibration' for c in cells)} calibration), "
            f"{len(cells) - len(checked)} not modelled or out of scope (reasons above); worst error "
            f"{100 * worst:.1f}%; {len(bad)} over {100 * TOLERANCE:.0f}%\n"
        )
        failed |= bool(bad)
        doc["against"][str(folder)] = [asdict(c) | {"error": c.error} for c in cells]
    if not args.against or args.json:
        preds = predictions()
        doc["predictions"] = [asdict(p) for p in preds]
        real = real_shape_predictions()
        doc["real_shapes"] = [asdict(p) for p in real]
        if not args.against:
            print(predictions_table(preds))
            print("\n## The real shapes (issue 43): the whole card as the budget\n")
            print(real_shapes_table(real))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if failed else 0


def free_parameters() -> dict[str, float]:
    return {
        "t_rt_s": T_RT_S,
        "mapped_factor": MAPPED_FACTOR,
        "cpu_token_cost": CPU_TOKEN_COST,
        "hbm_efficiency": HBM_EFFICIENCY,
    }


if __name__ == "__main__":
    sys.exit(main())
