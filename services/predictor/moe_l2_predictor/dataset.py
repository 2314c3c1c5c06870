"""Labeled prompts: the taxonomy's examples and optional JSONL files of `{text|messages, domain}`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from moe_l2_contracts.schemas.predict import PredictRequest
from moe_l2_domains.taxonomy import Taxonomy
from moe_l2_predictor.prompt import Prompt, from_request, from_text


class DatasetError(ValueError):
    """A labeled file is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Labeled:
    prompt: Prompt
    domain: str


def read_jsonl(path: Path, taxonomy: Taxonomy) -> list[Labeled]:
    """Each line: {"text": ...} or {"messages": [...]}, plus "domain" (or "label") naming a taxonomy domain."""
    items: list[Labeled] = []
    known = set(taxonomy.names)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            domain = row.pop("domain", None) or row.pop("label", None)
            request = PredictRequest.model_validate({k: v for k, v in row.items() if k in ("text", "messages")})
        except (json.JSONDecodeError, AttributeError, ValidationError) as exc:
            raise DatasetError(f"{path}:{number}: not a labeled prompt: {exc}") from exc
        if domain not in known:
            raise DatasetError(
                f"{path}:{number}: domain {domain!r} is not in the taxonomy ({', '.join(sorted(known))})"
            )
        items.append(Labeled(from_request(request), domain))
    return items


def taxonomy_examples(taxonomy: Taxonomy) -> list[Labeled]:
    """Every example of the taxonomy, and each domain's one-line definition as one more example."""
    items = [Labeled(from_text(text), domain) for text, domain in taxonomy.labeled_examples()]
    items += [Labeled(from_text(d.description), d.name) for d in taxonomy.domains if d.description]
    return items


def calibration_set(taxonomy: Taxonomy) -> list[Labeled]:
    """The taxonomy's calibration prompts (fit only the hybrid's combiners)."""
    return [Labeled(from_text(text), domain) for text, domain in taxonomy.calibration_prompts()]


def training_set(taxonomy: Taxonomy, extra: Path | None = None) -> list[Labeled]:
    return taxonomy_examples(taxonomy) + (read_jsonl(extra, taxonomy) if extra else [])
