"""Route trace override (patch 0034): llama-server replays recorded expert selections.

A reduced ds-v2-lite model (4 layers: layer 0 dense, layers 1-3 MoE, the real expert shapes) runs the
real patched llama-server with LLAMA_MOE_ROUTE_TRACE set to a trace of DeepSeek-V2-Lite's own routing on
the ESFT `law` prompts, cut to 3 MoE layers. /moe/routing must then count exactly the trace's experts
for the tokens the server evaluated, and the replayed experts must drive the computation. With
LLAMA_ARG_MOE_TRANSITIONS (patch 0032) it must also count the trace's cross-layer pairs, exactly as
`transition_counts` counts them on the same tokens.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_l2_cache.policy.profile import transition_counts
from moe_l2_contracts.schemas.llama import LayerPairCounts
from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.route_trace import (
    ESFT_TASKS,
    RouteTrace,
    esft_sequence_tasks,
    from_esft_npz,
    main,
    parse_seqs,
    read_route_trace,
    write_route_trace,
)
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port
from tests.benches import load_bench

from .conftest import ADMIN_HEADERS

# the ESFT routing ids, in the repository (bench/data_paths.py, as bench/ finds them)
ESFT_NPZ = load_bench("data_paths").esft_npz()
LAYERS = 4  # layer 0 dense, MoE layers 1..3
MOE_LAYERS = [1, 2, 3]
PROMPT = "the court finds that the defendant breached the contract and owes the plaintiff damages"
TRACE_ENV = "LLAMA_MOE_ROUTE_TRACE"
# quantized weights crash ggml's AMX path on AMX hosts (docs/model-shapes.md); harmless elsewhere
NO_REPACK = "--no-repack"

needs_npz = pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"{ESFT_NPZ} is not present")


# ---- the converter -----------------------------------------------------------------------------------


@needs_npz
def test_converter_round_trips_the_npz(tmp_path: Path) -> None:
    out = tmp_path / "all.bin"
    assert main(["--from", str(ESFT_NPZ), "--out", str(out)]) == 0
    trace = read_route_trace(out)
    with np.load(ESFT_NPZ) as npz:
        experts, seq = npz["experts"], npz["seq"]
    assert trace.shape_text() == "26 MoE layers x 64 experts, top-6"
    assert trace.n_seq == 213 and trace.n_token == 33279
    np.testing.assert_array_equal(trace.ids, experts)  # the npz is already sequence by sequence, in order
    np.testing.assert_array_equal(np.diff(trace.offsets), np.bincount(seq))


@needs_npz
def test_converter_selects_task_sequences_and_layers(tmp_path: Path) -> None:
    trace = from_esft_npz(ESFT_NPZ, tasks=["translation"], seqs=parse_seqs("1:3"), layers=2)
    with np.load(ESFT_NPZ) as npz:
        experts, task, seq = npz["experts"], npz["task"], npz["seq"]
    seq_ids = np.unique(seq[task == ESFT_TASKS.index("translation")])[1:3]
    expected = np.concatenate([experts[seq == s][:, :2] for s in seq_ids])
    np.testing.assert_array_equal(trace.ids, expected)
    assert trace.n_seq == 2 and trace.n_layer == 2
    write_route_trace(trace, tmp_path / "t.bin")
    again = read_route_trace(tmp_path / "t.bin")
    np.testing.assert_array_equal(again.ids, trace.ids)
    np.testing.assert_array_equal(again.offsets, trace.offsets)


@needs_npz
def test_every_sequence_of_the_trace_has_its_task() -> None:
    tasks = esft_sequence_tasks(ESFT_NPZ)
    whole = from_esft_npz(ESFT_NPZ)
    assert len(tasks) == whole.n_seq == 213
    offsets = whole.offsets
    for name in ESFT_TASKS:  # the task's own trace is the whole trace's sequences of that task, in order
        own = from_esft_npz(ESFT_NPZ, tasks=[name])
        mine = [i for i, t in enumerate(tasks) if t == name]
        assert own.n_seq == len(mine)
        np.testing.assert_array_equal(own.ids, np.concatenate([whole.ids[offsets[i] : offsets[i + 1]] for i in mine]))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--from", "/nonexistent.npz"], "does not exist"),
        (["--from", "{bad}"], "not an npz file"),
        (["--from", "{npz}", "--task", "poetry"], "unknown task 'poetry'"),
        (["--from", "{npz}", "--layers", "27"], "--layers 27"),
        (["--from", "{npz}", "--seqs", "x:y"], "--seqs 'x:y'"),
        (["--from", "{npz}", "--seqs", "500:"], "no sequence selected"),
        (["--from", "{npz}", "--experts", "32"], "out of range for --experts 32"),
    ],
)
def test_converter_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    if "{npz}" in args and not ESFT_NPZ.is_file():
        pytest.skip(f"{ESFT_NPZ} is not present")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    argv = [a.replace("{npz}", str(ESFT_NPZ)).replace("{bad}", str(bad)) for a in args]
    assert main([*argv, "--out", str(tmp_path / "t.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "t.bin").exists()


# ---- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("route-trace") / "ds-v2-lite-4.gguf"
    write_shape_model(path, get_shape("ds-v2-lite").reduced(LAYERS, 8192), progress=False)
    yield path
    path.unlink(missing_ok=True)  # ~1 GB


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ESFT_NPZ.is_file():
        pytest.skip(f"{ESFT_NPZ} is not present")
    path = tmp_path_factory.mktemp("route-trace") / "law-3.bin"
    # two sequences: the third request loops back to the first
    write_route_trace(from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 2), layers=len(MOE_LAYERS)), path)
    return path


@pytest.fixture(scope="module")
def start_server(llama_binary: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable]:
    supervisor = Supervisor(tmp_path_factory.mktemp("route-trace-logs"))
    clients: list[httpx.Client] = []

    def start(name: str, trace: Path | None, transitions: bool = True) -> httpx.Client:
        settings = LlamaSettings(
            port=free_port(),
            parallel=1,
            ctx_size=1024,
            threads=2,
            telemetry=True,
            transitions=transitions,
            extra_args=NO_REPACK,
        )
        spec = llama_service_spec(name, llama_binary, model, settings)
        if trace is not None:
            spec = dataclasses.replace(spec, env={**spec.env, TRACE_ENV: str(trace)})
        supervisor.start(spec)
        client = httpx.Client(base_url=f"http://{settings.host}:{settings.port}", timeout=300)
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


def generate(client: httpx.Client, n_predict: int = 6) -> dict:
    # cache_prompt off: every request evaluates its whole prompt, from position 0
    body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    body["n_probs"] = 4  # the log-probabilities show any change of the experts computed with, to the last bit
    resp = client.post("/completion", json=body)
    resp.raise_for_status()
    return resp.json()


def routing(client: httpx.Client) -> dict:
    resp = client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS)
    resp.raise_for_status()
    return resp.json()


@dataclasses.dataclass(frozen=True)
class Served:
    body: dict  # the /completion answer
    routing: dict  # /moe/routing for this request alone


@pytest.fixture(scope="module")
def traced(start_server: Callable, trace_path: Path) -> list[Served]:
    """Three requests, one after the other, on a server replaying a two-sequence trace."""
    client = start_server("llama-trace", trace_path)
    routing(client)  # nothing counted before the first request
    served = []
    for _ in range(3):
        body = generate(client)
        served.append(Served(body, routing(client)))
    return served


def trace_counts(trace: RouteTrace, seq: int, first: int, last: int) -> dict[str, dict[str, int]]:
    """Per-layer counts of the trace's sequence `seq`, tokens first..last-1 (looping), as /moe/routing has them."""
    ids = trace.sequence(seq)
    rows = ids[np.arange(first, last) % len(ids)]
    out: dict[str, dict[str, int]] = {}
    for i, layer in enumerate(MOE_LAYERS):
        experts, counts = np.unique(rows[:, i, :], return_counts=True)
        out[str(layer)] = {str(int(e)): int(c) for e, c in zip(experts, counts, strict=True)}
    return out


def expected_counts(trace: RouteTrace, seq: int, body: dict) -> dict[str, dict[str, int]]:
    n_prompt, n_eval = body["tokens_evaluated"], body["tokens_evaluated"] + body["tokens_predicted"] - 1
    expected = trace_counts(trace, seq, 0, n_eval)
    # the last layer computes only the rows of the tokens whose logits are needed: the prompt's last token
    # and every generated one
    last = str(MOE_LAYERS[-1])
    expected[last] = trace_counts(trace, seq, n_prompt - 1, n_eval)[last]
    return expected


def expected_pairs(trace: RouteTrace, seq: int, body: dict) -> dict[int, np.ndarray]:
    """The trace's (a at l, b at l+1) counts over the tokens the server evaluated, by model layer l."""
    n_prompt, n_eval = body["tokens_evaluated"], body["tokens_evaluated"] + body["tokens_predicted"] - 1
    ids = trace.sequence(seq)
    rows = ids[np.arange(n_eval) % len(ids)]
    counts = transition_counts(rows, trace.n_expert)
    # the last MoE layer sees only the output rows, so its pairs are those tokens' only
    counts[-1] = transition_counts(rows[n_prompt - 1 :], trace.n_expert)[-1]
    return {layer: counts[i] for i, layer in enumerate(MOE_LAYERS[:-1])}


@pytest.mark.llama
def test_routing_equals_the_trace(traced: list[Served], trace_path: Path) -> None:
    trace = read_route_trace(trace_path)
    for request, served in enumerate(traced):
        body, got = served.body, served.routing
        assert body["timings"]["prompt_n"] == body["tokens_evaluated"]  # the whole prompt, nothing reused
        # the prompt, then every generated token but the last is evaluated
        assert got["tokens"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1
        # request r replays sequence r mod n_seq: the third loops back to the first
        seq = request % trace.n_seq
        assert got["domains"]["untagged"] == expected_counts(trace, seq, body), f"request {request}"


@pytest.mark.llama
def test_transitions_equal_the_traces_pairs(traced: list[Served], trace_path: Path) -> None:
    trace = read_route_trace(trace_path)
    for request, served in enumerate(traced):
        got = LayerPairCounts.model_validate(served.routing["transitions"]["untagged"]).tables(trace.n_expert)
        want = expected_pairs(trace, request % trace.n_seq, served.body)
        assert sorted(got) == sorted(want) == [1, 2], f"request {request}"
        for layer in want:
            assert np.array_equal(got[layer], want[layer]), f"request {request}, layers {layer}->{layer + 1}"
        # every token has k experts at the next layer: a's row sums to k times a's activations at l
        first = served.routing["domains"]["untagged"]["1"]
        k = trace.n_used
        assert {str(a): int(n) // k for a, n in enumerate(got[1].sum(axis=1)) if n} == first


@pytest.mark.llama
def test_the_replayed_experts_are_the_ones_computed(traced: list[Served]) -> None:
    # the same trace sequence gives the same log-probabilities, another sequence other ones: the replayed
    # experts are the ones the model computes with, not only the ones counted (random weights: the text
    # itself may not change, the embeddings dominate the logits)
    probs = [served.body["completion_probabilities"] for served in traced]
    assert probs[0] == probs[2]
    assert probs[0] != probs[1]


@pytest.mark.llama
def test_without_the_trace_the_model_routes_itself(
    start_server: Callable, traced: list[Served], trace_path: Path
) -> None:
    client = start_server("llama-no-trace", None, transitions=False)
    routing(client)
    body = generate(client)
    snapshot = routing(client)
    assert "transitions" not in snapshot  # not asked for: nothing counted
    got = snapshot["domains"]["untagged"]
    assert got != expected_counts(read_route_trace(trace_path), 0, body)
    # same model, prompt and greedy sampling: only the routing differs
    assert body["completion_probabilities"] != traced[0].body["completion_probabilities"]


def run_until_exit(llama_binary: Path, model: Path, trace: Path) -> subprocess.CompletedProcess[str]:
    settings = LlamaSettings(
        port=free_port(), parallel=1, ctx_size=512, threads=2, telemetry=True, extra_args=NO_REPACK
    )
    env = {**os.environ, **llama_server_env(settings), TRACE_ENV: str(trace)}
    cmd = llama_server_command(llama_binary, model, settings)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.llama
def test_trace_of_another_shape_stops_the_server(llama_binary: Path, model: Path, tmp_path: Path) -> None:
    if not ESFT_NPZ.is_file():
        pytest.skip(f"{ESFT_NPZ} is not present")
    wrong = tmp_path / "two-layers.bin"
    write_route_trace(from_esft_npz(ESFT_NPZ, seqs=slice(0, 1), layers=2), wrong)
    proc = run_until_exit(llama_binary, model, wrong)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "route trace" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "2 MoE layers x 64 experts, top-6" in lines[0] and "3 MoE layers x 64 experts, top-6" in lines[0]


@pytest.mark.llama
def test_unreadable_trace_stops_the_server(llama_binary: Path, model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"PK\x03\x04 an npz is not a trace")
    proc = run_until_exit(llama_binary, model, bad)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "route trace" in line]
    assert len(lines) == 1 and "not a route trace" in lines[0], proc.stderr[-3000:]
