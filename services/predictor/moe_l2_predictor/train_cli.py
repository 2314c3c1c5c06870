"""`moe-l2 train-predictor [--data labeled.jsonl]`: fit the predictor's tiers now and report how well they do."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from moe_l2_domains.taxonomy import TaxonomyError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 train-predictor",
        description="Fit the TF-IDF and semantic tiers on the taxonomy's examples (plus --data) and the hybrid on "
        "its calibration prompts, store them in the cache folder the predictor loads from, and print "
        "cross-validated accuracies. The predictor uses the same data when MOE_L2_PREDICTOR_DATA_PATH "
        "names the same file.",
    )
    parser.add_argument("--data", type=Path, help='extra labeled prompts, JSONL: {"text": ..., "domain": ...}')
    parser.add_argument(
        "--taxonomy", type=Path, help="taxonomy file (default: MOE_L2_TAXONOMY_PATH or the shipped one)"
    )
    parser.add_argument("--tiers", help="tiers to fit (default: MOE_L2_PREDICTOR_TIERS, all three)")
    parser.add_argument("--cache-dir", type=Path, help="where to store them (default: MOE_L2_PREDICTOR_CACHE_DIR)")
    parser.add_argument("--json", action="store_true", help="print the fit report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from moe_l2_predictor.dataset import DatasetError
    from moe_l2_predictor.predictor import Predictor
    from moe_l2_predictor.settings import PredictorSettings

    overrides = {
        name: value
        for name, value in (
            ("data_path", args.data),
            ("taxonomy_path", args.taxonomy),
            ("tiers", args.tiers),
            ("cache_dir", args.cache_dir),
        )
        if value is not None
    }
    try:
        settings = PredictorSettings(**overrides)
        predictor = Predictor.from_settings(settings, refit=True, cross_validate=True)
    except (DatasetError, TaxonomyError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = predictor.artefacts.report
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"fitted tiers {','.join(predictor.tiers)} in {report.get('fit_seconds', 0):.1f}s")
    print(f"  examples {report.get('examples')}, calibration prompts {report.get('calibration_prompts')}")
    for name, value in report.get("cv_accuracy_on_examples", {}).items():
        note = "  (in-sample: keywords are not fitted)" if name == "keyword" else ""
        print(f"  5-fold accuracy on the examples   {name:<24} {value:6.1%}{note}")
    print(f"  the hybrid is fitted on {report.get('combiners_fitted_on')}; accuracy there:")
    for name, value in report.get("accuracy_where_combiners_were_fitted", {}).items():
        print(f"    {name:<24} {value:6.1%}")
    print(f"  stored in {settings.cache_dir / (predictor.artefacts.key + '.pkl')}")
    if args.data:
        print(f"  serve with: MOE_L2_PREDICTOR_DATA_PATH={args.data.resolve()}")
    return 0
