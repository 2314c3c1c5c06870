"""`moe-l2 predict "text"`: the domain of a prompt, in-process or from a running predictor (--url)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from moe_l2_contracts.schemas.predict import PredictResponse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 predict",
        description="Predict the domain of a prompt. Runs the predictor in this process (loading its models, "
        "fitting them on first use) unless --url names a running one.",
    )
    parser.add_argument("text", nargs="+", help="the prompt (several words are joined; `-` reads standard input)")
    parser.add_argument("--url", help="ask a running predictor, e.g. http://127.0.0.1:11437")
    parser.add_argument("--tiers", help="tiers to run in-process, e.g. keyword or keyword,tfidf (default: all)")
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    return parser.parse_args(argv)


def remote(url: str, text: str) -> PredictResponse:
    import httpx

    resp = httpx.post(f"{url.rstrip('/')}/v1/predict", json={"text": text}, timeout=30.0)
    resp.raise_for_status()
    return PredictResponse.model_validate(resp.json())


def local(text: str, tiers: str | None) -> PredictResponse:
    from moe_l2_predictor.predictor import Predictor
    from moe_l2_predictor.prompt import from_text
    from moe_l2_predictor.settings import PredictorSettings

    settings = PredictorSettings(tiers=tiers) if tiers else PredictorSettings()
    return Predictor.from_settings(settings).predict(from_text(text)).response


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = sys.stdin.read() if args.text == ["-"] else " ".join(args.text)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = remote(args.url, text) if args.url else local(text, args.tiers)
    except Exception as exc:  # the CLI reports any failure in one line
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.model_dump(), ensure_ascii=False))
        return 0
    print(f"{result.domain}  confidence {result.confidence:.2f}  ({result.tier}, lang {result.lang})")
    ranked = sorted(result.scores.items(), key=lambda kv: -kv[1])[:4]
    print("  " + "  ".join(f"{name} {score:.2f}" for name, score in ranked))
    return 0
