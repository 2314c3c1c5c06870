"""Checks of a published OpenAPI document: every `$ref` resolves inside it, and its schemas validate."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

BASE = "urn:moe-l2:openapi"


def refs(node: Any) -> Iterator[str]:
    """Every `$ref` value anywhere in the document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def registry(doc: dict[str, Any]) -> Registry:
    return Registry().with_resource(BASE, DRAFT202012.create_resource(doc))


def unresolved(doc: dict[str, Any]) -> list[str]:
    """The `$ref`s that do not resolve against the document itself (a reference is relative to the
    document's root, so a schema's own `#/$defs/...` copied into it no longer resolves)."""
    resolver = registry(doc).resolver(base_uri=BASE)
    bad = []
    for ref in refs(doc):
        try:
            resolver.lookup(ref)
        except Unresolvable:
            bad.append(ref)
    return bad


def request_validator(doc: dict[str, Any], path: str, method: str = "post") -> Draft202012Validator:
    """A validator of the JSON request body of one operation, its references resolved in the document."""
    schema = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = {"$ref": BASE + schema["$ref"]}
    return Draft202012Validator(schema, registry=registry(doc))
