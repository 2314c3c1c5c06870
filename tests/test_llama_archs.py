"""Every MoE architecture llama.cpp knows, through the expert cache (issue 43), on the RPC device.

The pinned tree's `tests/test-llama-archs.cpp` builds a random-weight model of every architecture it
supports; patch 0036 gives it the expert count and top-k (upstream hard-codes 2 of 2, which leave a cache
no room), and `-o` writes the models as GGUF files. Each MoE model here has 16 experts, 4 per token, and
runs on llama-server's RPC device (tests/conftest.py) with its experts in host memory (`--cpu-moe`):
first without a cache (the reference), then through the expert cache at 5 of 16 slots per layer, once
per mechanism (MECHANISMS). Each run's greedy tokens must be the reference's, and the log-probability of
each token within LOGPROB_TOL of it: the cache changes where an expert's weights come from, never what
the model computes. A mechanism a layer cannot use says so once in the log and runs without it.

Measured 2026-12-07 (issue 43, D1): before the cache split only the layers whose graph built the CPU's
nodes, `--moe-cache-cpu-misses on` gave gpt-oss (expert biases) and llama4 (routing weights before the
experts) other tokens than the cache off; see docs/supported-architectures.md for the table.

nemotron_h_moe runs with a top-k per layer (TOP_K_PER_LAYER): the model saver that writes the random models
keeps one top-k, so the fixture writes the array that heterogeneous nemotron-h models have (D4: the cache's
ids were laid out for the largest top-k, and the device read past them and crashed).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest

from moe_l2_contracts.schemas.llama import LayerPairCounts
from moe_l2_llama.build import LLAMA_ARCHS
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import free_port
from tests.conftest import ADMIN_HEADERS, RpcDevice
from tests.test_vulkan import serve as serve_binary

pytestmark = [pytest.mark.llama, pytest.mark.slow]

N_EXPERT = 16
N_USED = 4
SLOTS = 5  # of 16 per layer: every step misses, and 5 slots hold a token's 4 experts
SEED = 1
N_PREDICT = 6
LOGPROB_TOL = 1e-3
# token ids (the models' "test" tokenizer has 128 tokens and no text): a prompt of 9 and one of 12, both
# micro-batches the CPU-miss path takes (at most 16 tokens), then one-token decode steps
PROMPTS = ([1, 17, 33, 49, 65, 81, 97, 113, 5], [2, 9, 27, 44, 58, 71, 88, 103, 120, 6, 14, 30])

# mechanism -> the llama-server flags beside the cache's budget of SLOTS slots; "auto" takes the budget of
# half of every layer's experts instead (`--moe-cache-bytes auto:B`: whole layers and a cache, its choice)
MECHANISMS = {
    "cache": "--moe-cache-policy default",
    "lru": "--moe-cache-policy lru",
    "cpu-misses": "--moe-cache-cpu-misses on",
    "auto": "--fit off",
    "staging": "--moe-cache-staging on",
    "prompt-ahead": "--moe-cache-prompt-ahead on",
    "np2": "--moe-cache-policy default",  # two slots, the prompts sent at once (settings: parallel 2)
}
AUTO_INPUTS = re.compile(
    r"expert cache auto: budget (\d+) bytes \(.*\) for (\d+) MoE layers of (\d+) experts of (\d+) bytes"
)

# The MoE architectures whose random model the pinned tree writes (test_every_moe_architecture_is_run keeps
# this list equal to what the binary writes), and those left out of the runs, each with its reason.
ARCHS = (
    "afmoe", "arctic", "bailingmoe", "bailingmoe2", "bailingmoe3", "cohere2moe", "dbrx", "deepseek", "deepseek2",
    "deepseek32", "deepseek4", "dots1", "dots3note", "ernie4_5-moe", "exaone-moe", "glm-dsa", "glm4moe", "glm5-next",
    "gpt-oss", "granite", "granitemoe", "grok", "grovemoe", "hunyuan-moe", "hy_v3", "hy_v4", "kimi-k3",
    "kimi-linear", "laguna", "lfm2moe", "llama", "llama4", "maple", "mellum", "mimo2", "minicpm", "minimax-01",
    "minimax-m2", "minimax-m3", "mistral3", "mistral4", "nemotron_h_moe", "olmoe", "phimoe", "qwen2moe",
    "qwen35moe", "qwen3moe", "qwen3next", "qwen3vlmoe", "qwen4exp", "smallthinker",
)  # fmt: skip
LEFT_OUT = {
    "ernie4_5": "llama.cpp builds no routed experts for it (its MoE form is ernie4_5-moe): the file has none",
    "paddleocr": "llama.cpp builds no routed experts for its text model: the file has none",
    "llada-moe": "a diffusion model: llama-server's /completion computes no logits for it (HTTP 500)",
    "rnd1": "a diffusion model: llama-server's /completion computes no logits for it (HTTP 500)",
    "refact": "llama.cpp loads its experts but its graph computes a dense FFN (src/models/refact.cpp): none is asked",
}


# architecture -> its MoE layers' top-k as a fraction of the model's largest: a top-k per layer (nemotron-h)
TOP_K_PER_LAYER = {"nemotron_h_moe": 2}
# `sched_reserve: graph: nodes = 125, splits = 8`: the pieces the scheduler cuts a graph into
GRAPH_SPLITS = re.compile(r"graph.*: nodes = .*, splits = (\d+)")


@dataclass(frozen=True)
class ArchModel:
    arch: str
    path: Path
    expert_bytes: int  # one expert of the largest MoE layer: gate, up (or gate_up) and down, one slot
    n_layer: int  # layers with routed experts

    def budget(self, slots: int) -> int:
        """The bytes of `slots` slots in every MoE layer, as llama_moe_cache_make_plan divides them."""
        return slots * self.expert_bytes * self.n_layer


def rewrite_gguf(
    path: Path,
    out: Path,
    value: Callable[[str, Any], Any] = lambda name, v: v,
    tensor: Callable[[Any], tuple[np.ndarray, gguf.GGMLQuantizationType]] = lambda t: (t.data, t.tensor_type),
) -> None:
    """A copy of the GGUF at `path` with each metadata value through `value` and each tensor through `tensor`
    (its data and type): the random models, in forms the model saver that writes them does not give."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = value(name, field.contents())
        if isinstance(v, list) and field.types[0] != gguf.GGUFValueType.ARRAY:
            writer.add_array(name, v)
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            if v:  # the writer refuses an empty array; the loader reads a missing one as empty
                writer.add_key_value(name, v, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(name, v, field.types[0])
    for t in reader.tensors:
        data, ggml_type = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def with_top_k_per_layer(path: Path, divisor: int) -> None:
    """`{arch}.expert_used_count` an array, the last layer's top-k the others' / divisor: the form a model with
    a top-k per layer has (llama_model_loader reads a scalar or an array)."""
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    n_layer = int(gguf.GGUFReader(path).fields[f"{arch}.block_count"].contents())

    def top_k(name: str, v: Any) -> Any:
        return [int(v)] * (n_layer - 1) + [max(1, int(v) // divisor)] if name == f"{arch}.expert_used_count" else v

    out = path.with_suffix(".topk.gguf")
    rewrite_gguf(path, out, value=top_k)
    out.replace(path)


def with_q4_0_gate_up(path: Path, out: Path) -> None:
    """The fused gate_up experts in Q4_0, a type the CPU backend repacks for its own kernels."""

    def q4_0(t: Any) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        if t.name.endswith("ffn_gate_up_exps.weight"):
            q = gguf.GGMLQuantizationType.Q4_0
            return gguf.quants.quantize(np.asarray(t.data), q), q
        return t.data, t.tensor_type

    rewrite_gguf(path, out, tensor=q4_0)


def expert_products(path: Path) -> int:
    """The graph's products of routed experts kept in host memory by --cpu-moe: one per expert weight tensor,
    the chunk experts (`*_chexps`, grovemoe) too."""
    pattern = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_(ch|)exps\.weight")
    return sum(1 for t in gguf.GGUFReader(path).tensors if pattern.fullmatch(t.name))


def expert_shape(path: Path) -> tuple[int, int]:
    """(the bytes of one expert of the largest MoE layer, the MoE layers), read from the GGUF's tensors."""
    reader = gguf.GGUFReader(path)
    per_layer: dict[int, int] = {}
    for t in reader.tensors:
        found = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight", t.name)
        if found:
            n_expert = int(t.shape[-1])
            per_layer[int(found[1])] = per_layer.get(int(found[1]), 0) + int(t.n_bytes) // n_expert
    return max(per_layer.values(), default=0), len(per_layer)


@pytest.fixture(scope="session")
def arch_models(rpc_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ArchModel]:
    """Every MoE architecture's random model, written once by the RPC build's test-llama-archs."""
    binary = rpc_binary.parent / LLAMA_ARCHS
    if not binary.is_file():
        pytest.fail(f"no {LLAMA_ARCHS} next to {rpc_binary}: an RPC test build has it (`moe-l2 build-llama --rpc`)")
    out = tmp_path_factory.mktemp("arch-models")
    cmd = [str(binary), "-o", str(out), "-s", str(SEED), "--n-expert", str(N_EXPERT), "--n-expert-used", str(N_USED)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = {}
    for path in sorted(out.glob("*-moe.gguf")):
        arch = path.name.removesuffix("-moe.gguf")
        if arch in TOP_K_PER_LAYER:
            with_top_k_per_layer(path, TOP_K_PER_LAYER[arch])
        models[arch] = ArchModel(arch, path, *expert_shape(path))
    return models


def settings(extra: str = "", budget: str | None = None, host_experts: bool = True) -> LlamaSettings:
    """The experts in host memory (--cpu-moe; host_experts False: on the device too), everything else on the
    device; no warm-up decode (a second a server, of the matrix's hundreds)."""
    s = LlamaSettings(
        port=free_port(),
        parallel=1,
        ctx_size=256,
        threads=2,
        gpu_layers=99,
        extra_args=f"{'--cpu-moe ' if host_experts else ''}--no-warmup -lv 4 {extra}".strip(),
    )
    return s if budget is None else s.model_copy(update={"expert_cache_bytes": budget})


def largest_expert_tensor(path: Path) -> int:
    pattern = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight")
    return max(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if pattern.fullmatch(t.name))


def ahead_bytes(model: ArchModel) -> int:
    """The two buffers a prompt's copies ahead go to: each holds the largest expert tensor whole."""
    return 2 * largest_expert_tensor(model.path)


def ahead_engages(model: ArchModel) -> bool:
    """Whether SLOTS slots and the two buffers are fewer bytes than every expert: else the cache holds them all,
    and a prompt has no miss to copy ahead (a model of one MoE layer, or a large fused tensor, at 16 experts)."""
    return model.budget(SLOTS) + ahead_bytes(model) < model.budget(N_EXPERT)


def mechanism_settings(mechanism: str, model: ArchModel) -> LlamaSettings:
    if mechanism == "auto":
        return settings(MECHANISMS[mechanism], budget=f"auto:{model.budget(N_EXPERT // 2)}")
    if mechanism == "prompt-ahead":
        return settings(MECHANISMS[mechanism], budget=str(model.budget(SLOTS) + ahead_bytes(model)))
    s = settings(MECHANISMS[mechanism], budget=str(model.budget(SLOTS)))
    return s.model_copy(update={"parallel": 2}) if mechanism == "np2" else s


def serve(
    device: RpcDevice, model: Path, s: LlamaSettings, logs: Path, name: str
) -> AbstractContextManager[tuple[httpx.Client, Path]]:
    """The device's build on the model, placed on the device; a log per run (the reference's is its own)."""
    return serve_binary(device.binary, model, device.on_device(s), {}, logs, name)


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]


def greedy(client: httpx.Client, at_once: bool = False) -> Run:
    """Each prompt's greedy tokens and their log-probabilities; at_once: the prompts sent together (-np 2
    batches their sequences)."""
    if at_once:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            runs = list(pool.map(lambda p: complete(client, p), PROMPTS))
    else:
        runs = [complete(client, p) for p in PROMPTS]
    return Run([t for t, _ in runs], [lp for _, lp in runs])


def complete(client: httpx.Client, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "prompt": prompt,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "n_probs": 1,
        "post_sampling_probs": False,
    }
    resp = client.post("/completion", json=body)
    resp.raise_for_status()
    data = resp.json()
    return data["tokens"], [p["logprob"] for p in data["completion_probabilities"]]


_reference: dict[str, Run] = {}


def reference(device: RpcDevice, model: ArchModel, logs: Path) -> Run:
    """The cache-off run of the same device, once per architecture."""
    if model.arch not in _reference:
        with serve(device, model.path, settings(), logs, f"{model.arch}-cache-off") as (client, _):
            _reference[model.arch] = greedy(client)
    return _reference[model.arch]


def same_run(got: Run, expected: Run) -> str | None:
    """None when the tokens are the same and every log-probability within LOGPROB_TOL, else what differs."""
    for n, (t_got, t_exp) in enumerate(zip(got.tokens, expected.tokens, strict=True)):
        if t_got != t_exp:
            return f"prompt {n}: tokens {t_got}, cache off {t_exp}"
    for n, (p_got, p_exp) in enumerate(zip(got.logprobs, expected.logprobs, strict=True)):
        worst = max((abs(a - b) for a, b in zip(p_got, p_exp, strict=True)), default=0.0)
        if not worst <= LOGPROB_TOL or any(math.isnan(a) for a in p_got):
            return f"prompt {n}: log-probabilities {p_got}, cache off {p_exp} (|diff| {worst:.2g})"
    return None


def test_every_moe_architecture_is_run(arch_models: dict[str, ArchModel]) -> None:
    """The list the matrix runs is what the pinned tree writes: a bump that adds an architecture fails here
    until it is in ARCHS or LEFT_OUT with its reason; every architecture run has routed experts."""
    assert sorted(arch_models) == sorted([*ARCHS, *LEFT_OUT]), sorted(arch_models)
    assert not set(ARCHS) & set(LEFT_OUT)
    assert all(arch_models[a].n_layer > 0 and arch_models[a].expert_bytes > 0 for a in ARCHS)


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_expert_cache_gives_the_cache_off_run(
    rpc_device: RpcDevice, arch_models: dict[str, ArchModel], arch: str, mechanism: str, tmp_path: Path
) -> None:
    """The greedy tokens and their log-probabilities through the cache are the cache-off run's. The cache
    holds SLOTS of every layer's experts (auto: the split it chose, of the expert size this model has);
    a layer that cannot use a mechanism said so in the log and ran without it."""
    model = arch_models[arch]
    expected = reference(rpc_device, model, tmp_path)
    with serve(rpc_device, model.path, mechanism_settings(mechanism, model), tmp_path, f"{arch}-{mechanism}") as (
        client,
        log_path,
    ):
        got = greedy(client, at_once=mechanism == "np2")
        info = client.get("/moe/cache")
        metrics = client.get("/metrics").text
    log = log_path.read_text(errors="replace")
    accesses = re.search(r"^llamacpp:moe_cache_accesses_total (\d+)$", metrics, re.M)
    if mechanism == "auto":
        # the split is auto's to choose; the shape it chose it from must be this model's (D3: a fused
        # gate_up was not counted, and an expert came out a third of its size)
        found = AUTO_INPUTS.search(log)
        assert found, log[-3000:]
        assert (int(found[2]), int(found[3]), int(found[4])) == (model.n_layer, N_EXPERT, model.expert_bytes)
    elif mechanism == "prompt-ahead" and not ahead_engages(model):
        assert info.status_code == 200 and info.json()["ahead_bytes"] == 0, info.text  # every expert fits
    else:
        assert f"{SLOTS} of {N_EXPERT} experts per layer" in log, log[-3000:]
        assert info.status_code == 200 and info.json()["n_slot"] == SLOTS, info.text
        # the graph asked the cache for its experts: a model whose graph never does proves nothing here
        assert accesses is not None and int(accesses[1]) > 0, "the cache was never asked"
    if mechanism == "prompt-ahead" and ahead_engages(model):
        assert info.json()["ahead_bytes"] > 0, info.text  # its two buffers exist: the prompts copied ahead
    if mechanism == "staging":
        assert "through a staging ring" in log, log[-3000:]
    on_cpu = re.search(r"^llamacpp:moe_cache_cpu_misses_total (\d+)$", metrics, re.M)
    off = sorted(set(re.findall(r"expert cache: layer \d+: CPU misses off \(([^)]*)\)", log)))
    problem = same_run(got, expected)
    engaged = mechanism != "prompt-ahead" or ahead_engages(model)
    record(arch, mechanism, problem, off, int(on_cpu[1]) if on_cpu else 0, engaged)
    if mechanism == "cpu-misses":
        # forced on: the CPU computed misses, or a layer said why it could not (D1: it split them anyway)
        assert (on_cpu is not None and int(on_cpu[1]) > 0) or off, f"no miss on the CPU and no layer said why: {on_cpu}"
    assert problem is None, problem


def graph_splits(log: str) -> int:
    found = GRAPH_SPLITS.search(log)
    assert found, log[-3000:]
    return int(found[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cache_cuts_the_graph_only_where_it_maps_experts(
    rpc_device: RpcDevice, arch_models: dict[str, ArchModel], arch: str, tmp_path: Path
) -> None:
    """Through the cache, the graph is the all-on-device graph plus one split per product of host experts,
    where the scheduler reads the ids the cache maps: the experts' biases and scales stay on the device with
    the rest (D5: --cpu-moe's pattern put gpt-oss's biases in host memory beside the weights, and 10 more
    splits sent the graph back to the CPU for them every micro-batch)."""
    model = arch_models[arch]
    with serve(rpc_device, model.path, settings(host_experts=False), tmp_path, f"{arch}-on-device") as (_, log_path):
        base = graph_splits(log_path.read_text(errors="replace"))
    with serve(rpc_device, model.path, settings(budget=str(model.budget(N_EXPERT))), tmp_path, f"{arch}-all-slots") as (
        _,
        log_path,
    ):
        cached = graph_splits(log_path.read_text(errors="replace"))
    assert cached == base + expert_products(model.path), (base, cached, expert_products(model.path))


def moe_layers(path: Path) -> list[int]:
    pattern = re.compile(r"blk\.(\d+)\.ffn_(up|gate_up)_exps\.weight")
    return sorted({int(found[1]) for t in gguf.GGUFReader(path).tensors if (found := pattern.fullmatch(t.name))})


@pytest.mark.parametrize("arch", ["llama4", "qwen3moe"])
def test_transitions_pair_each_moe_layer_with_the_next(
    rpc_device: RpcDevice, arch_models: dict[str, ArchModel], arch: str, tmp_path: Path
) -> None:
    """The transitions telemetry (LLAMA_ARG_MOE_TRANSITIONS) counts a pair from each MoE layer to the next MoE
    layer: llama4 routes at layers 1 and 3 (dense layers between), qwen3moe at 0 and 1 (D6: only l, l+1 was
    counted, and llama4 had no pair at all). Every token that reaches the second layer pairs its k experts
    there with its k at the first."""
    model = arch_models[arch]
    first, second = moe_layers(model.path)[:2]
    s = settings().model_copy(update={"telemetry": True, "transitions": True})
    with serve(rpc_device, model.path, s, tmp_path, f"{arch}-transitions") as (client, _):
        greedy(client)
        resp = client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS)
    resp.raise_for_status()
    routing = resp.json()
    pairs = LayerPairCounts.model_validate(routing["transitions"]["untagged"]).tables(N_EXPERT)
    assert sorted(pairs) == [first], (sorted(pairs), first, second)
    at_second = sum(routing["domains"]["untagged"][str(second)].values())  # k per token there
    assert int(pairs[first].sum()) == N_USED * at_second > 0


def with_mixed_expert_types(path: Path, out: Path) -> None:
    """The experts' gate in Q8_0, up in Q4_0 and down in F16: a layer whose three tensors differ in type."""
    types = {"gate": gguf.GGMLQuantizationType.Q8_0, "up": gguf.GGMLQuantizationType.Q4_0}

    def mixed(t: Any) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        found = re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", t.name)
        if found is None:
            return t.data, t.tensor_type
        if found[1] == "down":
            return np.asarray(t.data).astype(np.float16), gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(np.asarray(t.data), types[found[1]]), types[found[1]]

    rewrite_gguf(path, out, tensor=mixed)


@pytest.mark.parametrize("mechanism", ["cache", "cpu-misses"])
def test_a_layer_of_three_expert_types_gives_the_cache_off_run(
    rpc_device: RpcDevice, arch_models: dict[str, ArchModel], mechanism: str, tmp_path: Path
) -> None:
    """olmoe's experts with gate Q8_0, up Q4_0 and down F16: a slot holds the three types side by side and the
    CPU's misses read each in its own; the tokens and log-probabilities are the cache-off run's."""
    path = tmp_path / "olmoe-mixed.gguf"
    with_mixed_expert_types(arch_models["olmoe"].path, path)
    model = ArchModel("olmoe-mixed", path, *expert_shape(path))
    with serve(rpc_device, path, settings(), tmp_path, "mixed-cache-off") as (client, _):
        expected = greedy(client)
    s = mechanism_settings(mechanism, model)
    with serve(rpc_device, path, s, tmp_path, f"mixed-{mechanism}") as (client, _):
        got = greedy(client)
        assert client.get("/moe/cache").json()["n_slot"] == SLOTS
        on_cpu = re.search(r"^llamacpp:moe_cache_cpu_misses_total (\d+)$", client.get("/metrics").text, re.M)
    assert same_run(got, expected) is None, same_run(got, expected)
    if mechanism == "cpu-misses":
        assert on_cpu is not None and int(on_cpu[1]) > 0, "the CPU computed no miss"


def test_repacked_fused_experts_are_named_as_the_reason_for_no_cache(
    rpc_device: RpcDevice, arch_models: dict[str, ArchModel], tmp_path: Path
) -> None:
    """deepseek2's fused gate_up in Q4_0 in host memory, its down on the device: with repacking on, the CPU
    backend repacks gate_up into its own layout, which no device reads, so no layer has experts for the cache,
    and the log says why (D8: the check left out gate_up and said no expert was in host memory at all)."""
    model = tmp_path / "deepseek2-q4_0-gate-up.gguf"
    with_q4_0_gate_up(arch_models["deepseek2"].path, model)
    s = settings("-ot gate_up_exps=CPU", budget=str(arch_models["deepseek2"].budget(SLOTS)), host_experts=False)
    repacking = rpc_device.on_device(s).model_copy(update={"cpu_repack": True})
    with serve_binary(rpc_device.binary, model, repacking, {}, tmp_path, "repacked") as (client, log_path):
        assert client.get("/moe/cache").status_code == 501  # no cache: the server runs without it
    log = log_path.read_text(errors="replace")
    assert "repacked for the CPU's own kernels" in log and "start with --no-repack" in log, log[-3000:]


@pytest.mark.parametrize("budget", ["64M", "auto"])
def test_a_dense_model_with_the_cache_flags_is_one_line_and_serves(
    rpc_device: RpcDevice, tmp_path: Path, budget: str
) -> None:
    """A dense model (Mixtral's attention with a plain FFN, no experts) given the cache's flags: one line says
    the model has no routed experts, and the server answers as without them."""
    from dataclasses import replace

    from moe_l2_gguf.model_shapes import SHAPES, write_shape_model

    dense = replace(SHAPES["mixtral-8x7b"], n_layer=1, n_dense_lead=1, n_expert=0, n_expert_used=0, n_ff=2048)
    model = write_shape_model(tmp_path / "dense.gguf", dense.reduced(n_vocab=8192), progress=False).path
    with serve(rpc_device, model, settings(budget=budget), tmp_path, f"dense-{budget}") as (client, log_path):
        assert client.get("/moe/cache").status_code == 501  # no cache
        assert len(greedy(client).tokens[0]) > 0
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if "no routed experts" in line]
    assert len(lines) == 1, lines
    assert ("expert cache off: the model has no routed experts" if budget != "auto" else "to place: no cache") in lines[
        0
    ]


@pytest.fixture(scope="session")
def mtp_model(rpc_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> ArchModel:
    """deepseek2's random model with one MTP (nextn) layer after its own, with experts of its own (patch 0036's
    --nextn). glm4moe's random MTP model stops the RPC device in its rope with the cache off too (an mrope
    section of 0), so deepseek2 stands for the MTP architectures."""
    out = tmp_path_factory.mktemp("mtp-model")
    cmd = [str(rpc_binary.parent / LLAMA_ARCHS), "-a", "deepseek2", "-o", str(out), "-s", str(SEED)]
    cmd += ["--n-expert", str(N_EXPERT), "--n-expert-used", str(N_USED), "--nextn", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = out / "deepseek2-moe.gguf"
    return ArchModel("deepseek2-mtp", path, *expert_shape(path))


def test_an_mtp_layer_gets_no_cache_and_the_draft_keeps_the_tokens(
    rpc_device: RpcDevice, mtp_model: ArchModel, tmp_path: Path
) -> None:
    """With --spec-type draft-mtp the MTP layer's experts are in host memory beside the model's, and the cache
    plans the model's layers only (D2: it planned the MTP layer too and wrote past the end of its tables of
    n_layer rows, a heap-buffer-overflow under AddressSanitizer). The tokens are the cache-off run's."""
    moe = moe_layers(mtp_model.path)
    assert len(moe) == 2, moe  # the model's MoE layer, then the MTP layer's experts
    draft = "--spec-type draft-mtp"
    with serve(rpc_device, mtp_model.path, settings(draft), tmp_path, "mtp-cache-off") as (client, _):
        expected = greedy(client).tokens
    s = settings(draft, budget=str(mtp_model.budget(SLOTS)))
    with serve(rpc_device, mtp_model.path, s, tmp_path, "mtp-cache") as (client, log_path):
        got = greedy(client).tokens
        info = client.get("/moe/cache")
    assert info.status_code == 200 and info.json()["layers"] == moe[:1], info.text
    assert "MTP draft context" in log_path.read_text(errors="replace")
    assert got == expected


def record(
    arch: str, mechanism: str, problem: str | None, off: list[str], cpu_misses: int, engaged: bool = True
) -> None:
    """One line of the matrix to MOE_L2_ARCH_MATRIX (JSON lines), if set: `python -m tests.arch_table` makes
    docs/supported-architectures.md of it."""
    if path := os.environ.get("MOE_L2_ARCH_MATRIX"):
        line = {"arch": arch, "mechanism": mechanism, "ok": problem is None, "off": off, "cpu_misses": cpu_misses}
        line["engaged"] = engaged
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def test_the_table_says_what_ran_and_what_was_off() -> None:
    """tests/arch_table.py renders the matrix: a failure shows as failed, a layer's reason beside it."""
    from tests.arch_table import render

    rows = [
        {"arch": "gpt-oss", "mechanism": "cache", "ok": True, "off": [], "cpu_misses": 0},
        {"arch": "gpt-oss", "mechanism": "cpu-misses", "ok": True, "off": ["expert biases"], "cpu_misses": 0},
        {"arch": "olmoe", "mechanism": "cpu-misses", "ok": False, "off": [], "cpu_misses": 37},
    ]
    table = render(rows)
    rows.append(
        {"arch": "olmoe", "mechanism": "prompt-ahead", "ok": True, "off": [], "cpu_misses": 0, "engaged": False}
    )
    table = render(rows)
    runs = " | ".join("passed" if m in ("cache", "cpu-misses") else "not run" for m in MECHANISMS)
    assert f"| gpt-oss | {runs} | 0 | expert biases |" in table
    cells = {m: "not run" for m in MECHANISMS} | {"cpu-misses": "**failed**", "prompt-ahead": "passed, all fit"}
    assert f"| olmoe | {' | '.join(cells.values())} | 37 | - |" in table
    assert all(f"- **{arch}**: " in table for arch in LEFT_OUT)
