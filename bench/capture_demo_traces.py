"""Capture per-token expert-routing traces of the demo MoE model from the real patched llama-server.

The server's telemetry (GET /moe/routing?reset=1) reports counts, not per-token traces. With one
slot and prompt caching, a /completion whose prompt is the tokens so far plus one new token
computes only that token, so the counts since the last reset are exactly that token's experts at
every layer. We feed every request one token at a time (its prompt, then what it generates) and
check each delta: one token, tagged with the request's domain, n_expert_used activations per layer.

Writes bench/results/demo_routing_traces.npz: experts[token, layer, slot], domain (index into
`domains`), seq, pos, phase (0 = prompt, 1 = generated), expert_bytes, n_expert.

    .venv/bin/python bench/capture_demo_traces.py [--requests 16] [--gen 48] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_gguf.demo_model import load_planted, make_demo_model
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.serving_plan import llama_server_binary
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, free_port, http_ok

RESULTS = Path(__file__).resolve().parent / "results"


class CaptureError(Exception):
    """The telemetry did not isolate one token; the message says what it saw."""


@dataclass
class Capture:
    domains: list[str]
    experts: list[np.ndarray] = field(default_factory=list)  # [n_layer, k] per token
    domain: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    phase: list[int] = field(default_factory=list)


def domain_prompt(planted: dict, domain: str, rng: random.Random, n_words: int) -> str:
    """Mostly the domain's planted words, with some neutral words in between, like a real request."""
    words = planted["domains"][domain]["words"]
    neutral = planted.get("neutral_words") or ["the"]
    return " ".join(rng.choice(words) if rng.random() < 0.7 else rng.choice(neutral) for _ in range(n_words))


def token_experts(snapshot: dict, domain: str) -> np.ndarray:
    """The experts of the one token a snapshot holds, [n_layer, k]; raises unless it is exactly one."""
    n_layer, k = snapshot["n_layer"], snapshot["n_expert_used"]
    if snapshot["tokens"] != 1 or snapshot.get("tokens_by_domain", {}).get(domain) != 1:
        raise CaptureError(f"expected one token of {domain!r}, telemetry saw {snapshot['tokens_by_domain']}")
    layers = snapshot["domains"][domain]
    out = np.zeros((n_layer, k), dtype=np.int64)
    for layer in range(n_layer):
        counts = layers.get(str(layer), {})
        ids = sorted(int(e) for e, n in counts.items() for _ in range(n))
        # One token activates k distinct experts per layer, the last layer included (its only row is an output row).
        if len(ids) != k or len(set(ids)) != k:
            raise CaptureError(f"layer {layer}: expected {k} distinct experts for one token, got {counts}")
        out[layer] = ids
    return out


def step(client: httpx.Client, tokens: list[int], domain: str) -> tuple[int, np.ndarray]:
    """Computes the last of `tokens` (the rest is cached); returns the sampled next token and its experts."""
    body = {
        "prompt": tokens,
        "n_predict": 1,
        "cache_prompt": True,
        "id_slot": 0,
        "temperature": 0.8,
        "seed": len(tokens),
        "return_tokens": True,
    }
    resp = client.post("/completion", json=body, headers={"X-MoE-Domain": domain})
    resp.raise_for_status()
    generated = resp.json().get("tokens") or []
    snap = client.get("/moe/routing", params={"reset": "1"})
    snap.raise_for_status()
    if not generated:
        raise CaptureError("the server generated no token")
    return int(generated[0]), token_experts(snap.json(), domain)


def capture(client: httpx.Client, planted: dict, n_requests: int, n_gen: int, seed: int) -> Capture:
    domains = list(planted["domains"])
    rng = random.Random(seed)
    cap = Capture(domains)
    # Requests of every domain in a shuffled order. A new request shares only BOS with what the slot
    # holds, and its first step is BOS alone, so every step still computes exactly one token.
    order = [d for d in domains for _ in range(n_requests)]
    rng.shuffle(order)
    for seq_id, domain in enumerate(order):
        text = domain_prompt(planted, domain, rng, n_words=rng.randint(8, 20))
        tok = client.post("/tokenize", json={"content": text, "add_special": True})
        tok.raise_for_status()
        prompt: list[int] = tok.json()["tokens"]
        client.get("/moe/routing", params={"reset": "1"}).raise_for_status()  # tokenizing computes nothing
        tokens = list(prompt[:1])
        while True:
            next_token, experts = step(client, tokens, domain)
            cap.experts.append(experts)
            cap.domain.append(domains.index(domain))
            cap.seq.append(seq_id)
            cap.pos.append(len(tokens) - 1)
            cap.phase.append(0 if len(tokens) <= len(prompt) else 1)
            if len(tokens) == len(prompt) + n_gen:
                break
            # The prompt's next token, then what the model generated: one new token per step.
            tokens.append(prompt[len(tokens)] if len(tokens) < len(prompt) else next_token)
        print(f"  request {seq_id + 1}/{len(order)} {domain}: {len(tokens)} tokens", file=sys.stderr)
    return cap


def expert_bytes(model: Path) -> int:
    """Bytes of one expert (gate + up + down slices of one layer), from the GGUF's tensor table."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    per_layer: dict[str, int] = {}
    n_expert = 0
    for t in reader.tensors:
        if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight"):
            per_layer[t.name] = int(t.n_bytes)
            n_expert = int(t.shape[-1])
    return sum(per_layer.values()) // max(n_expert, 1)


def start_server(model: Path, log_dir: Path, admin_token: str) -> tuple[Supervisor, str]:
    # the pull with reset=1 is an admin call: this private server gets a token of its own
    settings = LlamaSettings(
        port=free_port(), parallel=1, ctx_size=2048, telemetry=True, threads=2, admin_token=admin_token
    )
    base = f"http://{settings.host}:{settings.port}"
    supervisor = Supervisor(log_dir)
    binary = llama_server_binary(settings)
    spec = ServiceSpec(
        name="llama-capture",
        argv=llama_server_command(binary, model, settings),
        env=llama_server_env(settings),
        health=http_ok(f"{base}/health"),
        url=base,
    )
    try:
        supervisor.start(spec)
    except BaseException:
        supervisor.stop()
        raise
    return supervisor, base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per domain")
    parser.add_argument("--gen", type=int, default=48, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "demo_routing_traces.npz")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moe-l2-capture-") as tmp:
        model = Path(tmp) / "demo.gguf"
        make_demo_model(model, seed=0)
        planted = load_planted(model)
        token = secrets.token_hex(16)
        supervisor, base = start_server(model, Path(tmp) / "logs", token)
        started = time.monotonic()
        try:
            with httpx.Client(base_url=base, timeout=60, headers={ADMIN_TOKEN_HEADER: token}) as client:
                cap = capture(client, planted, args.requests, args.gen, args.seed)
        finally:
            supervisor.stop()
        size = expert_bytes(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        experts=np.stack(cap.experts).astype(np.uint8),
        domain=np.array(cap.domain, dtype=np.uint8),
        domains=np.array(cap.domains),
        seq=np.array(cap.seq, dtype=np.int32),
        pos=np.array(cap.pos, dtype=np.int32),
        phase=np.array(cap.phase, dtype=np.uint8),
        expert_bytes=np.int64(size),
        n_expert=np.int64(planted.get("n_expert", 32)),
        planted=np.array(json.dumps(planted["domains"])),
    )
    print(
        f"captured {len(cap.experts)} tokens of {len(set(cap.seq))} requests in {time.monotonic() - started:.0f}s"
        f" -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
