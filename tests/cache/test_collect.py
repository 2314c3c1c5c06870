"""`moe-l2 collect`: domain-tagged prompts through the real llama-server into the cache-manager's tables."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_l2_cache.collect import main
from moe_l2_gguf.index import load_index
from moe_l2_ops.cli import main as cli_main

from ..conftest import LlamaServer
from .conftest import CacheManager, RedisServer
from .traffic import domain_prompt


@pytest.mark.llama
def test_collect_seeds_the_tables(
    cache_llama: LlamaServer,
    demo_model: Path,
    planted: dict,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache_llama.routing(reset=True)
    manager = start_cache_manager(
        MOE_L2_MODEL_PATH=str(demo_model),
        MOE_L2_LLAMA_URL=cache_llama.url,
        MOE_L2_REDIS_URL=redis_server.url,
        MOE_L2_CACHE_PULL_INTERVAL_S="0",
    )
    domains = ("math", "translate", "chinese_tech")
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"domain": d, "text": domain_prompt(planted, d, seed=i)} for i in range(2) for d in domains]
    prompts.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n\n")

    argv = ["--prompts", str(prompts), "--llama-url", cache_llama.url, "--cache-url", str(manager.client.base_url)]
    assert main([*argv, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "the cache-manager pulled" in out and "written to Redis" in out

    printed = {line.split()[0]: int(line.split()[3]) for line in out.splitlines() if "prompts" in line}
    assert set(printed) == set(domains)
    with redis_server.client() as r:
        tokens = r.hgetall(f"moe:{load_index(demo_model).model_id}:tokens")
    for d in domains:
        # llama routes every prompt token and every generated token but the last of each request
        assert int(tokens[d]) == printed[d] - 2, (d, tokens, printed)


def test_collect_rejects_a_bad_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"domain": "math", "text": "x"}\n{"domain": "bad domain", "text": "y"}\n')
    assert cli_main(["collect", "--prompts", str(bad)]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["--prompts", str(empty)]) == 2
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"domain": "math", "text": "x"}\n')
    assert main(["--prompts", str(ok), "--llama-url", "http://127.0.0.1:9"]) == 1
    assert "not ready" in capsys.readouterr().err
