"""No import cycle between any two modules of selfspec: an import-linter contract type, and a script.

import-linter's own contracts (``layers``, ``acyclic_siblings``) compare packages as wholes, so a
cycle through a package's ``__init__`` (``selfspec.kernels`` <-> ``selfspec.kernels.auto``) passes
them. This contract takes the import graph module by module, function-level and
``TYPE_CHECKING`` imports included, and fails on every strongly connected component of more
than one module. ``pyproject.toml`` registers it (``contract_types``), so ``lint-imports`` checks
it with the others; ``python scripts/import_contracts.py`` prints the cycles on its own.
"""

from __future__ import annotations

import sys

import grimp
from importlinter import Contract, ContractCheck, fields, output


def module_cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module among ``package`` and its
    descendants (Tarjan's algorithm, iterative), each sorted, sorted by first module."""
    nodes = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    inside = set(nodes)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def cycle_imports(graph: grimp.ImportGraph, cycle: list[str]) -> list[str]:
    """``importer -> imported (l.N, ...)`` for each import between two modules of ``cycle``."""
    lines = []
    for a in cycle:
        for b in sorted(graph.find_modules_directly_imported_by(a) & set(cycle)):
            nums = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
            lines.append(f"{a} -> {b} (l.{', l.'.join(map(str, nums))})")
    return lines


class AcyclicModulesContract(Contract):
    """``type = "acyclic_modules"``: no import cycle between modules of ``packages``."""

    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        cycles = [c for p in self.packages for c in module_cycles(graph, p)]  # type: ignore[attr-defined]
        return ContractCheck(kept=not cycles, metadata={"cycles": [cycle_imports(graph, c) for c in cycles]})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for lines in check.metadata["cycles"]:
            output.print_error("Import cycle:")
            output.new_line()
            for line in lines:
                output.indent_cursor()
                output.print_error(f"- {line}", bold=False)
            output.new_line()


def main() -> int:
    graph = grimp.build_graph("selfspec")
    cycles = module_cycles(graph, "selfspec")
    for c in cycles:
        print("cycle:", ", ".join(c))
        for line in cycle_imports(graph, c):
            print("  ", line)
    print(f"{len(cycles)} import cycle(s) among {len(graph.modules)} modules")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
