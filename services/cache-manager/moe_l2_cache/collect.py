"""`moe-l2 collect --prompts FILE.jsonl`: seed the routing tables by running domain-tagged prompts through llama.

Each line is `{"domain": ..., "text": ...}`. Every prompt goes to llama-server's chat endpoint with
its `X-MoE-Domain` tag, so llama's telemetry counts its routing under that domain; at the end the
cache-manager is asked to pull now (otherwise its flywheel pulls within MOE_L2_CACHE_PULL_INTERVAL_S).
Only counts are kept anywhere, never the prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER, AdminTokenError, configured_token
from moe_l2_contracts.services import CACHE_MANAGER, LLAMA
from moe_l2_domains.known import known_domains


class PromptLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    domain: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    text: str = Field(min_length=1)


class CollectError(Exception):
    """The prompts cannot be collected; the message is one line, fit to show a user."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # 2: the prompts file is wrong; 1: llama is not there


@dataclass
class Outcome:
    domain: str
    tokens: int = 0
    error: str | None = None


def read_prompts(path: Path) -> list[PromptLine]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CollectError(f"cannot read {path}: {e.strerror or e}", exit_code=2) from e
    prompts = []
    try:
        valid = known_domains()
    except ValueError as e:  # a bad MOE_L2_EXTRA_DOMAINS
        raise CollectError(str(e), exit_code=2) from e
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompt = PromptLine.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as e:
            first = str(e).splitlines()[0] if isinstance(e, json.JSONDecodeError) else _first_error(e)
            raise CollectError(f'{path}:{n}: expected {{"domain": ..., "text": ...}}: {first}', exit_code=2) from e
        if prompt.domain not in valid:
            # llama refuses other tags, and the cache-manager keeps no table for them
            raise CollectError(
                f"{path}:{n}: {prompt.domain!r} is not a known domain (valid: {', '.join(sorted(valid))}; more "
                "with MOE_L2_EXTRA_DOMAINS)",
                exit_code=2,
            )
        prompts.append(prompt)
    if not prompts:
        raise CollectError(f"{path} holds no prompts", exit_code=2)
    return prompts


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc']) or 'line'}: {err['msg']}"


def run_prompt(client: httpx.Client, prompt: PromptLine, max_tokens: int) -> Outcome:
    body = {
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "cache_prompt": False,  # every token of the prompt goes through the model, and is counted
    }
    try:
        resp = client.post("/v1/chat/completions", json=body, headers={"X-MoE-Domain": prompt.domain})
        resp.raise_for_status()
        usage = resp.json().get("usage", {})
        return Outcome(prompt.domain, int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0)))
    except (httpx.HTTPError, ValueError) as e:
        return Outcome(prompt.domain, error=f"{type(e).__name__}: {e}")


def collect(prompts: list[PromptLine], llama_url: str, max_tokens: int, parallel: int) -> list[Outcome]:
    from tqdm import tqdm

    with httpx.Client(base_url=llama_url, timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        try:
            client.get("/health").raise_for_status()
        except httpx.HTTPError as e:
            raise CollectError(f"llama-server at {llama_url} is not ready: {e}") from e
        outcomes: list[Outcome] = []
        with ThreadPoolExecutor(parallel) as pool, tqdm(total=len(prompts), unit="prompt", desc="collect") as bar:
            futures = [pool.submit(run_prompt, client, p, max_tokens) for p in prompts]
            for future in as_completed(futures):
                outcomes.append(future.result())
                bar.update()
    return outcomes


def ask_cache_manager_to_pull(cache_url: str, token: str | None) -> str:
    headers = {ADMIN_TOKEN_HEADER: token} if token else {}
    try:
        resp = httpx.post(f"{cache_url}/v1/pull", headers=headers, timeout=60)
    except httpx.HTTPError:
        return f"the cache-manager at {cache_url} is not reachable: its flywheel will pull the counts when it runs"
    if resp.status_code != 200:
        return f"the cache-manager answered {resp.status_code} ({resp.text[:120]}); it will pull on its own schedule"
    body = resp.json()
    if not body.get("ok"):
        return f"the cache-manager could not pull: {body.get('error')}"
    where = "written to Redis" if body.get("flushed") else "buffered until Redis answers"
    return f"the cache-manager pulled {body.get('activations', 0)} activations ({where})"


def _admin_token() -> str | None:
    try:
        return configured_token() or None
    except AdminTokenError as e:
        print(f"warning: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moe-l2 collect",
        description="Run domain-tagged prompts (JSON lines {domain, text}) through llama-server to seed the "
        "cache-manager's routing tables.",
    )
    parser.add_argument("--prompts", type=Path, required=True, help="JSON-lines file of {domain, text}")
    parser.add_argument("--llama-url", default=os.environ.get("MOE_L2_LLAMA_URL", LLAMA.local_url()))
    parser.add_argument("--cache-url", default=os.environ.get("MOE_L2_CACHE_URL", CACHE_MANAGER.local_url()))
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    parser.add_argument("--parallel", type=int, default=4, help="prompts in flight (default 4, llama's slots)")
    parser.add_argument("--no-pull", action="store_true", help="do not ask the cache-manager to pull at the end")
    args = parser.parse_args(argv)
    try:
        prompts = read_prompts(args.prompts)
        outcomes = collect(prompts, args.llama_url.rstrip("/"), args.max_tokens, max(1, args.parallel))
    except CollectError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    ok = Counter(o.domain for o in outcomes if o.error is None)
    tokens = Counter({d: sum(o.tokens for o in outcomes if o.domain == d and o.error is None) for d in ok})
    failed = [o for o in outcomes if o.error is not None]
    for domain in sorted(ok):
        print(f"  {domain:<16} {ok[domain]:>5} prompts {tokens[domain]:>8} tokens")
    if failed:
        print(f"{len(failed)} of {len(outcomes)} prompts failed, e.g. {failed[0].error}", file=sys.stderr)
    if not args.no_pull and ok:
        print(ask_cache_manager_to_pull(args.cache_url.rstrip("/"), _admin_token()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
