"""schemathesis against each service's own published OpenAPI document, valid and invalid requests
alike (its positive and negative generation modes): whatever is sent, no answer may be a 5xx.

The cases come from schemathesis' strategies for each operation, driven by hypothesis here (its
pytest plugin does not run on this pytest). The operations are listed from the same document built
in process, so each is its own test; the requests go to the running services and the document
fuzzed is the one they publish.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from moe_l2_domains.known import known_domains
from moe_l2_predictor.app import create_app
from moe_l2_proxy.openapi import build_document
from tests.fuzz.conftest import FuzzCounts, examples

pytestmark = [pytest.mark.llama, pytest.mark.slow]

# A fuzzed request must not be able to make llama generate for long: every generation is clamped to
# a couple of tokens (the requests are otherwise left exactly as generated, wrong types included).
MAX_TOKENS = 2


def operations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, methods in doc["paths"].items() for method in methods]


def clamp_generation(path: str, body: Any) -> None:
    if not isinstance(body, dict):
        return
    if path.startswith("/v1/"):
        body["max_tokens"] = MAX_TOKENS
        body["n_predict"] = MAX_TOKENS  # llama's own name wins over max_tokens
    elif path in ("/api/chat", "/api/generate"):
        options = body.get("options")
        if isinstance(options, dict):
            options["num_predict"] = MAX_TOKENS
        elif options is None:
            body["options"] = {"num_predict": MAX_TOKENS}


def fuzz(
    schema: schemathesis.BaseSchema,
    method: str,
    path: str,
    base_url: str,
    service: str,
    counts: FuzzCounts,
    max_examples: int,
) -> None:
    operation = schema[path][method]
    # half valid requests (they reach the prediction, the translation and llama), half invalid ones
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(
            max_examples=max(1, max_examples // 2),
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            if service == "gateway":
                clamp_generation(case.path, case.body)
            response = case.call(base_url=base_url, timeout=120)
            counts.record(service, response.status_code)
            assert response.status_code < 500, (
                f"{service} answered {response.status_code}: {response.text[:500]}\n{case.as_curl_command()}"
            )

        try:
            run()
        except Unsatisfiable:
            # an operation without any input has no invalid request to send
            if mode is not schemathesis.GenerationMode.NEGATIVE:
                raise


@pytest.mark.parametrize(("method", "path"), operations(create_app().openapi()))
def test_predictor_never_answers_5xx(
    method: str, path: str, predictor_schema: schemathesis.BaseSchema, fuzz_predictor: str, fuzz_counts: FuzzCounts
) -> None:
    fuzz(predictor_schema, method, path, fuzz_predictor, "predictor", fuzz_counts, examples(600))


@pytest.mark.parametrize(("method", "path"), operations(build_document(known_domains(), "")))
def test_gateway_never_answers_5xx(
    method: str, path: str, gateway_schema: schemathesis.BaseSchema, fuzz_gateway: str, fuzz_counts: FuzzCounts
) -> None:
    fuzz(gateway_schema, method, path, fuzz_gateway, "gateway", fuzz_counts, examples(300))
