"""Only http1_transport.py knows the fast transport: the rest of the gateway talks to httpx.AsyncClient.

So going back to httpx's own transport stays one line (MOE_L2_PROXY_LLAMA_TRANSPORT, or the constructor in
app.py). The check reads the gateway's sources: what they import from the transport module, and
which attributes they use. The transport's own private names (underscored) are collected from its
source, and its class must not grow public methods beyond httpx's transport interface, so whatever
it adds is private and caught here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

import moe_l2_proxy
from moe_l2_proxy.http1_transport import Http1Transport

PACKAGE = Path(moe_l2_proxy.__file__).parent
MODULE = "http1_transport"
QUALIFIED = f"moe_l2_proxy.{MODULE}"
PUBLIC = {"Http1Transport"}  # what may be imported: the class, to be constructed
CONSTRUCTED_IN = {"app.py"}  # the lifespan's llama client, where the transport is chosen


def private_names(source: str) -> set[str]:
    """The transport module's underscored names: module level, its classes' members and attributes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def transport_uses(source: str, private: set[str]) -> list[str]:
    """What `source` uses of the transport module beyond constructing its public class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == QUALIFIED or (node.level and module == MODULE):
                found += [f"imports {alias.name}" for alias in node.names if alias.name not in PUBLIC]
            elif module == "moe_l2_proxy" or (node.level and not module):
                found += ["imports the module" for alias in node.names if alias.name == MODULE]
        elif isinstance(node, ast.Import):
            found += ["imports the module" for alias in node.names if alias.name == QUALIFIED]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"uses .{node.attr}")
    return found


def importers(source: str) -> bool:
    return any(
        isinstance(node, ast.ImportFrom) and (node.module == QUALIFIED or (node.level and node.module == MODULE))
        for node in ast.walk(ast.parse(source))
    )


def gateway_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(PACKAGE.glob("*.py")) if path.stem != MODULE}


def test_no_gateway_module_reaches_into_the_transport():
    private = private_names((PACKAGE / f"{MODULE}.py").read_text())
    assert {"_Connection", "_Body", "_exchange", "_idle", "_request_head"} <= private  # the scan sees them
    uses = {name: found for name, source in gateway_sources().items() if (found := transport_uses(source, private))}
    assert uses == {}


def test_only_the_lifespan_constructs_the_transport():
    assert {name for name, source in gateway_sources().items() if importers(source)} == CONSTRUCTED_IN


def test_the_transport_class_has_only_httpx_interface_in_public():
    interface = {name for name in dir(httpx.AsyncBaseTransport) if not name.startswith("_")}
    public = {name for name in vars(Http1Transport) if not name.startswith("_")}
    assert public <= interface, public - interface


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from moe_l2_proxy.http1_transport import _request_head", ["imports _request_head"]),
        ("from .http1_transport import Http1Transport, _Body", ["imports _Body"]),
        ("import moe_l2_proxy.http1_transport as t", ["imports the module"]),
        ("from moe_l2_proxy import http1_transport", ["imports the module"]),
        ("async def f(client):\n    await client._transport._exchange(1, 2, 3, 4)", ["uses ._exchange"]),
        ("def f(t):\n    return t._idle", ["uses ._idle"]),
        ("from moe_l2_proxy.http1_transport import Http1Transport\nHttp1Transport()", []),
    ],
)
def test_the_scan_finds_what_it_looks_for(source, expected):
    private = private_names((PACKAGE / f"{MODULE}.py").read_text())
    assert transport_uses(source, private) == expected
