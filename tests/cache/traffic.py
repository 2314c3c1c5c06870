"""Domain-tagged traffic for the real llama-server, and readings of its /metrics counters."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from tests.metrics import sample_sum


def domain_prompt(planted: dict, domain: str, n_words: int = 24, seed: int = 0) -> str:
    words = planted["domains"][domain]["words"]
    rng = random.Random(f"{domain}-{seed}")
    return " ".join(rng.choice(words) for _ in range(n_words))


def chat(llama_url: str, text: str, domain: str | None, max_tokens: int = 8) -> dict:
    headers = {"X-MoE-Domain": domain} if domain else {}
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "cache_prompt": False,
    }
    resp = httpx.post(f"{llama_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    resp.raise_for_status()
    return resp.json()


def serve_mix(
    llama_url: str, planted: dict, per_domain: int = 3, seed: int = 0, domains: tuple[str, ...] = DEFAULT_DOMAINS
) -> None:
    """Every domain's prompts interleaved, four at a time (llama's four slots mix them in its batches)."""
    jobs = [(d, domain_prompt(planted, d, seed=seed * 100 + i)) for i in range(per_domain) for d in domains]
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(chat, llama_url, text, d) for d, text in jobs]:
            future.result()


def metric(text: str, name: str, domain: str | None = None) -> float:
    return sample_sum(text, f"llamacpp:{name}", **({"domain": domain} if domain is not None else {}))


def llama_metrics(llama_url: str) -> str:
    resp = httpx.get(f"{llama_url}/metrics", timeout=30)
    resp.raise_for_status()
    return resp.text
