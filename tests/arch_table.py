"""docs/supported-architectures.md from a run of tests/test_llama_archs.py (issue 43).

    MOE_L2_ARCH_MATRIX=/tmp/matrix.jsonl pytest tests/test_llama_archs.py
    python -m tests.arch_table /tmp/matrix.jsonl "the run: when, where, how long" > docs/supported-architectures.md

Each line of the matrix file is one (architecture, mechanism) run: whether its tokens and log-probabilities
were the cache-off run's, the layers' reasons for computing no miss on the CPU, and the misses the CPU
computed. The table says, per architecture, the mechanisms verified and what was off and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.test_llama_archs import ARCHS, LEFT_OUT, MECHANISMS, N_EXPERT, N_USED, SLOTS

HEADER = f"""# Supported architectures

Written by `python -m tests.arch_table` from a run of `tests/test_llama_archs.py` (issue 43): upstream's
random model of every MoE architecture the pinned llama.cpp knows (`test-llama-archs -o`, patch 0036),
{N_EXPERT} experts and {N_USED} per token, its experts in host memory, on the RPC device. Each mechanism's
greedy tokens and their log-probabilities must be the cache-off run's:

- **cache**: the expert cache at {SLOTS} of {N_EXPERT} slots a layer, the default policy;
- **lru**: the same with `--moe-cache-policy lru`;
- **cpu-misses**: the same with `--moe-cache-cpu-misses on` (every decode miss on the CPU, where the
  layer's graph can compute it; elsewhere the layer says why in the log and copies its misses);
- **auto**: `--moe-cache-bytes auto:B`, B half of every layer's experts: whole layers and a cache, as
  auto chooses, from the expert size this model has;
- **staging**: `--moe-cache-staging on`, the misses through the ring of plain memory and its threads;
- **prompt-ahead**: `--moe-cache-prompt-ahead on`, the budget {SLOTS} slots a layer plus the two buffers
  a prompt's copies ahead go to; "passed, all fit" where those bytes hold every expert (one MoE layer,
  or a large fused tensor, at {N_EXPERT} experts), so a prompt has no miss to copy ahead;
- **np2**: `-np 2`, both prompts sent at once, their sequences in the same micro-batches.

The default policy's cross-layer prefetch needs a domain's transition tables, which these runs do not
have; `tests/test_expert_cache.py` covers it on the reduced DeepSeek-V2-Lite.

"passed" means identical output; "CPU misses" is how many decode misses the CPU computed (0 where every
layer said why not). A wrong token fails the run: none is listed as supported with one.
"""


def cell(run: dict) -> str:
    if not run["ok"]:
        return "**failed**"
    return "passed" if run.get("engaged", True) else "passed, all fit"


def render(rows: list[dict], about: str = "") -> str:
    by_arch: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], {})[row["mechanism"]] = row
    lines = [
        HEADER + (f"\nThis table: {about}\n" if about else ""),
        "| architecture | " + " | ".join(MECHANISMS) + " | CPU misses | the CPU's misses off, why |",
        "|---|" + "---|" * len(MECHANISMS) + "---|---|",
    ]
    for arch in ARCHS:
        runs = by_arch.get(arch, {})
        cells = [cell(runs[m]) if m in runs else "not run" for m in MECHANISMS]
        cpu = runs.get("cpu-misses", {})
        off = ", ".join(cpu.get("off", [])) or "-"
        lines.append(f"| {arch} | " + " | ".join(cells) + f" | {cpu.get('cpu_misses', '-')} | {off} |")
    lines += ["", "Left out, each with its reason (`LEFT_OUT` in `tests/test_llama_archs.py`):", ""]
    lines += [f"- **{arch}**: {why}" for arch, why in LEFT_OUT.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(
            "usage: python -m tests.arch_table MATRIX.jsonl [ABOUT] > docs/supported-architectures.md", file=sys.stderr
        )
        return 2
    rows = [json.loads(line) for line in Path(argv[0]).read_text(encoding="utf-8").splitlines() if line.strip()]
    sys.stdout.write(render(rows, argv[1] if len(argv) == 2 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
