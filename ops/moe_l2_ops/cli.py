"""The `moe-l2` command: one entry point, each subcommand implemented by its own module.

Subcommands import their module lazily so an image that lacks a service's dependencies still has
a working CLI for the others.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with a `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "moe_l2_ops.stack",
        "start the whole stack as local processes, restarting any that dies (--llama-replicas N)",
    ),
    "build-llama": ("moe_l2_llama.build", "build the patched llama-server (cached)"),
    "bump-llama": (
        "moe_l2_llama.bump",
        "replay the llama.cpp patch series on another llama-cpp-python sdist and report what conflicts",
    ),
    "make-demo-model": ("moe_l2_gguf.demo_model", "write a small MoE GGUF with a planted router"),
    "predict": ("moe_l2_predictor.predict_cli", "predict the domain of a prompt (in-process, or --url a predictor)"),
    "train-predictor": (
        "moe_l2_predictor.train_cli",
        "fit the predictor's tiers (+ --data labeled.jsonl), report accuracy",
    ),
    "make-route-trace": ("moe_l2_llama.route_trace", "convert recorded routing (ESFT npz) into a trace llama replays"),
    "index": ("moe_l2_gguf.index", "index a GGUF's routed experts: layers, experts, bytes (--json)"),
    "stats": (
        "moe_l2_ops.stats",
        "figures of the running services: requests, domains, hit rate, pool, restarts (--watch)",
    ),
    "doctor": (
        "moe_l2_ops.doctor",
        "pass/warn/fail checks: binary, model, GPU, memlock, Redis, services, restarts, admin token",
    ),
    "collect": ("moe_l2_cache.collect", "run domain-tagged prompts (JSONL) through llama to seed the routing tables"),
    "bench": (
        "moe_l2_ops.bench",
        "stock placements against the default on your machine and model: markdown, JSON, PNG (--model)",
    ),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: moe-l2 COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`moe-l2 COMMAND --help` describes a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from moe_l2_ops.version import version_text

        print(version_text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
