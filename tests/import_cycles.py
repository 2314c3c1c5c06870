"""No import cycle among the project's modules: an import-linter contract (`make lint`, `lint-imports`).

pyproject.toml registers it (`contract_types`) beside the layers contract. The layers keep the
packages apart (no import may go up a layer, nor across the services); this contract keeps the
modules of every package apart, in whichever package they are: a module may not import, directly
or through others, a module that imports it. import-linter's graph is grimp's, with every import
in it, function-level and `if TYPE_CHECKING:` ones included, so neither hides a cycle.

A broken contract lists every elementary cycle (Johnson's algorithm: each closed path that visits
no module twice), each with the line of every import along it, up to MAX_LISTED cycles. The module
is importable without import-linter's command line, so its tests run `find_cycles` on a graph built
by hand.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Set

import grimp
from importlinter import Contract, ContractCheck, output
from rich.markup import escape

MAX_LISTED = 200  # a longer list is cut there, saying how many more were found


def import_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Every module of the graph and the modules it imports directly."""
    return {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}


def strongly_connected(edges: Mapping[str, Set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit), in no set order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in edges:
                    continue
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def _cyclic_components(edges: Mapping[str, Set[str]]) -> list[set[str]]:
    return [c for c in strongly_connected(edges) if len(c) > 1 or next(iter(c)) in edges[next(iter(c))]]


def simple_cycles(edges: Mapping[str, Set[str]]) -> Iterator[list[str]]:
    """Every elementary cycle of the graph, each once, starting at its smallest module (Johnson, 1975)."""
    pending = _cyclic_components(edges)
    while pending:
        component = pending.pop()
        sub = {node: edges[node] & component for node in component}
        start = min(component)
        if start in sub[start]:
            yield [start]
        path = [start]
        blocked = {start}
        closed: set[str] = set()
        blockers: dict[str, set[str]] = defaultdict(set)
        work = [(start, sorted(sub[start] - {start}, reverse=True))]
        while work:
            node, successors = work[-1]
            if successors:
                successor = successors.pop()
                if successor == start:
                    yield list(path)
                    closed.update(path)
                elif successor not in blocked:
                    path.append(successor)
                    work.append((successor, sorted(sub[successor] - {successor}, reverse=True)))
                    closed.discard(successor)
                    blocked.add(successor)
                    continue
            if not successors:
                if node in closed:
                    _unblock(node, blocked, blockers)
                else:
                    for successor in sub[node]:
                        blockers[successor].add(node)
                work.pop()
                path.pop()
        rest = {node: sub[node] - {start} for node in component - {start}}
        pending.extend(_cyclic_components(rest))


def _unblock(node: str, blocked: set[str], blockers: dict[str, set[str]]) -> None:
    todo = {node}
    while todo:
        n = todo.pop()
        if n in blocked:
            blocked.discard(n)
            todo.update(blockers.pop(n, set()))


def find_cycles(graph: grimp.ImportGraph, limit: int | None = None) -> list[list[str]]:
    """The import cycles among the graph's modules, sorted; at most `limit` of them when given."""
    cycles: list[list[str]] = []
    for cycle in simple_cycles(import_edges(graph)):
        cycles.append(cycle)
        if limit is not None and len(cycles) >= limit:
            break
    return sorted(cycles, key=lambda c: (len(c), c))


def _import_line(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = sorted(graph.get_import_details(importer=importer, imported=imported), key=lambda d: d["line_number"])
    if not details:
        return f"{importer} imports {imported}"
    first = details[0]
    more = f" (and {len(details) - 1} more imports)" if len(details) > 1 else ""
    return f"{importer}:{first['line_number']}  {first['line_contents']}{more}"


class AcyclicModulesContract(Contract):
    """Kept when no module of the root packages imports itself through others; takes no options."""

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        cycles = find_cycles(graph, limit=MAX_LISTED + 1)
        listed = [
            {
                "modules": cycle,
                "imports": [_import_line(graph, a, b) for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)],
            }
            for cycle in cycles[:MAX_LISTED]
        ]
        output.verbose_print(verbose, f"{len(graph.modules)} modules, {len(cycles)} import cycles")
        return ContractCheck(kept=not cycles, metadata={"cycles": listed, "cut": len(cycles) > MAX_LISTED})

    def render_broken_contract(self, check: ContractCheck) -> None:
        cycles = check.metadata["cycles"]
        count = f"more than {MAX_LISTED}" if check.metadata["cut"] else str(len(cycles))
        output.print_error(f"{count} import cycles among the modules, each with its imports:")
        output.new_line()
        for cycle in cycles:
            modules = cycle["modules"]
            output.print_error(escape(" -> ".join([*modules, modules[0]])))
            for line in cycle["imports"]:
                output.indent_cursor()
                output.print_error(escape(line), bold=False)
            output.new_line()
        if check.metadata["cut"]:
            output.print_error(f"(the first {MAX_LISTED} listed)")
