"""Every MoE architecture llama.cpp knows, through the expert cache (issue 43), on the RPC device.

The pinned tree's `tests/test-llama-archs.cpp` builds a random-weight model of every architecture it
supports; patch 0026 gives it the expert count and top-k (upstream hard-codes 2 of 2, which leave a cache
no room), and `-o` writes the models as GGUF files. Each MoE model here has 16 experts, 4 per token, and
runs on llama-server's RPC device (tests/conftest.py) with its experts in host memory (`--cpu-moe`):
first without a cache (the reference), then through the expert cache at 5 of 16 slots per layer, once
per mechanism (MECHANISMS). Each run's greedy tokens must be the reference's, and the log-probability of
each token within LOGPROB_TOL of it: the cache changes where an expert's weights come from, never what
the model computes. A mechanism a layer cannot use says so once in the log and runs without it.

Measured 2026-12-07 (issue 43, D1): before the cache split only the layers whose graph built the CPU's
nodes, `--moe-cache-cpu-misses on` gave gpt-oss (expert biases) and llama4 (routing weights before the
experts) other tokens than the cache off; see docs/supported-architectures.md for the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import pytest

from moe_l2_llama.build import LLAMA_ARCHS
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import free_port
from tests.conftest import RpcDevice
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
    "cpu-misses": "--moe-cache-cpu-misses on",
    "auto": "--fit off",
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
    "minimax-m2", "minimax-m3", "mistral3", "mistral4", "olmoe", "phimoe", "qwen2moe", "qwen35moe", "qwen3moe",
    "qwen3next", "qwen3vlmoe", "qwen4exp", "smallthinker",
)  # fmt: skip
LEFT_OUT = {
    "ernie4_5": "llama.cpp builds no routed experts for it (its MoE form is ernie4_5-moe): the file has none",
    "paddleocr": "llama.cpp builds no routed experts for its text model: the file has none",
    "llada-moe": "a diffusion model: llama-server's /completion computes no logits for it (HTTP 500)",
    "rnd1": "a diffusion model: llama-server's /completion computes no logits for it (HTTP 500)",
    "refact": "llama.cpp loads its experts but its graph computes a dense FFN (src/models/refact.cpp): none is asked",
}


@dataclass(frozen=True)
class ArchModel:
    arch: str
    path: Path
    expert_bytes: int  # one expert of the largest MoE layer: gate, up (or gate_up) and down, one slot
    n_layer: int  # layers with routed experts

    def budget(self, slots: int) -> int:
        """The bytes of `slots` slots in every MoE layer, as llama_moe_cache_make_plan divides them."""
        return slots * self.expert_bytes * self.n_layer


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
        models[arch] = ArchModel(arch, path, *expert_shape(path))
    return models


def settings(extra: str = "", budget: str | None = None) -> LlamaSettings:
    """The experts in host memory (--cpu-moe), everything else on the device; no warm-up decode (a second
    a server, of the matrix's hundreds)."""
    s = LlamaSettings(
        port=free_port(),
        parallel=1,
        ctx_size=256,
        threads=2,
        gpu_layers=99,
        extra_args=f"--cpu-moe --no-warmup -lv 4 {extra}".strip(),
    )
    return s if budget is None else s.model_copy(update={"expert_cache_bytes": budget})


def mechanism_settings(mechanism: str, model: ArchModel) -> LlamaSettings:
    if mechanism == "auto":
        return settings(MECHANISMS[mechanism], budget=f"auto:{model.budget(N_EXPERT // 2)}")
    return settings(MECHANISMS[mechanism], budget=str(model.budget(SLOTS)))


def serve(
    device: RpcDevice, model: Path, s: LlamaSettings, logs: Path, name: str
) -> AbstractContextManager[tuple[httpx.Client, Path]]:
    """The device's build on the model, placed on the device; a log per run (the reference's is its own)."""
    return serve_binary(device.binary, model, device.on_device(s), {}, logs, name)


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]


def greedy(client: httpx.Client) -> Run:
    tokens, logprobs = [], []
    for prompt in PROMPTS:
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
        tokens.append(data["tokens"])
        logprobs.append([p["logprob"] for p in data["completion_probabilities"]])
    return Run(tokens, logprobs)


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
        got = greedy(client)
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
    else:
        assert f"{SLOTS} of {N_EXPERT} experts per layer" in log, log[-3000:]
        assert info.status_code == 200 and info.json()["n_slot"] == SLOTS, info.text
        # the graph asked the cache for its experts: a model whose graph never does proves nothing here
        assert accesses is not None and int(accesses[1]) > 0, "the cache was never asked"
    on_cpu = re.search(r"^llamacpp:moe_cache_cpu_misses_total (\d+)$", metrics, re.M)
    off = sorted(set(re.findall(r"expert cache: layer \d+: CPU misses off \(([^)]*)\)", log)))
    problem = same_run(got, expected)
    record(arch, mechanism, problem, off, int(on_cpu[1]) if on_cpu else 0)
    if mechanism == "cpu-misses":
        # forced on: the CPU computed misses, or a layer said why it could not (D1: it split them anyway)
        assert (on_cpu is not None and int(on_cpu[1]) > 0) or off, f"no miss on the CPU and no layer said why: {on_cpu}"
    assert problem is None, problem


def record(arch: str, mechanism: str, problem: str | None, off: list[str], cpu_misses: int) -> None:
    """One line of the matrix to MOE_L2_ARCH_MATRIX (JSON lines), if set: `python -m tests.arch_table` makes
    docs/supported-architectures.md of it."""
    if path := os.environ.get("MOE_L2_ARCH_MATRIX"):
        line = {"arch": arch, "mechanism": mechanism, "ok": problem is None, "off": off, "cpu_misses": cpu_misses}
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
    assert "| gpt-oss | passed | passed | not run | 0 | expert biases |" in table
    assert "| olmoe | not run | **failed** | not run | 37 | - |" in table
    assert all(f"- **{arch}**: " in table for arch in LEFT_OUT)
