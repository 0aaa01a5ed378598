"""Print sluice's internal import graph: package edges, layering breaches, cycles,
module sizes, the longest functions.

    python scripts/import_graph.py            # packages, breaches, cycles, sizes
    python scripts/import_graph.py --edges    # also every module edge

Every import counts, including those under `if TYPE_CHECKING:` and those inside
functions (lazy imports); each edge is tagged so a cycle hidden that way is
still a cycle here. The layering rules (docs/architecture.md):

- proxy.wire imports nothing else of sluice;
- proxy never imports controlplane;
- controlplane imports from proxy only proxy.wire, proxy.redisurl and proxy.cli;
- each package imports from the rest of sluice only what `MAY_IMPORT` lists for it
  (the package docstrings point here; a package missing from it is a breach).

A function over the limit whose docstring says "Long because" is listed apart.
Exits 1 on a cycle or a breach. Standard library only, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxy", "controlplane")


def _modules(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    type_checking.add(id(inner))
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                lazy.add(id(inner))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        kind = "type" if id(node) in type_checking else "lazy" if id(node) in lazy else "top"
        for name in names:
            target = _resolve(name, modules)
            if target and target != mod:
                yield target, kind


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _long_functions(path: Path, limit: int) -> Iterator[tuple[str, int, bool]]:
    """(name, lines, justified) of every function longer than `limit` lines."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                doc = ast.get_docstring(node) or ""
                yield node.name, length, "long because" in doc.lower()


#: What controlplane may import from proxy (module names or package prefixes).
CONTROLPLANE_MAY_IMPORT = ("proxy.wire", "proxy.redisurl", "proxy.cli", "proxy.stopping")


_CP = "controlplane."
#: What each package's modules may import from sluice outside their own package:
#: module names or package prefixes ("controlplane" alone: all of it). The standard
#: library and third-party packages are not checked. `controlplane` and `proxy` are
#: their top-level modules (the leaves, the decisions, the proxy's request path).
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "proxy.wire": (),
    # the proxy process wires the ready-set sources in (app.py)
    "proxy": ("proxy.wire", "proxy.sources"),
    # never the app, the runner or the CLI
    "proxy.sources": ("proxy.wire", "proxy.config", "proxy.errors", "proxy.readyset",
                      "proxy.stats", "proxy.stopping", "proxy.compat", "proxy.redisurl",
                      "proxy.tally", "proxy.placement"),
    # display shows ops' views and escapes what Redis holds; the decisions read the spec
    "controlplane": (_CP + "servicespec", _CP + "ops", _CP + "store.untrusted",
                     *CONTROLPLANE_MAY_IMPORT),
    # the wire contract only (policy names, PrefixOptions); nothing else of controlplane
    "controlplane.servicespec": ("proxy.wire",),
    # nothing in the control plane above it (reconcile, ops, cli)
    "controlplane.store": (_CP + "errors", _CP + "records", _CP + "states", _CP + "lease",
                           "proxy.wire", "proxy.redisurl"),
    # never the store (backends do not touch Redis) nor the controller
    # (proxy.stopping: a loop that a library's swallowed cancel must still stop)
    "controlplane.backends": (_CP + "records", _CP + "servicespec", _CP + "statedir",
                              _CP + "processes", "proxy.wire", "proxy.stopping"),
    "controlplane.ops": (_CP + "records", _CP + "states", _CP + "store", _CP + "servicespec",
                         _CP + "rollout", _CP + "autoscaler", _CP + "lifecycle",
                         _CP + "backends", "proxy.wire"),
    "controlplane.reconcile": (_CP + "records", _CP + "states", _CP + "store", _CP + "servicespec",
                               _CP + "rollout", _CP + "autoscaler", _CP + "lifecycle",
                               _CP + "prober", _CP + "lease", _CP + "processes",
                               _CP + "backends", _CP + "engines", "proxy.wire",
                               "proxy.stopping"),
    # scraping the engines' metrics and publishing the view (the store's engines key)
    "controlplane.engines": (_CP + "store", _CP + "records", _CP + "states", "proxy.wire",
                             "proxy.stopping"),
    "controlplane.dashboard": (_CP + "ops", _CP + "store", _CP + "records", _CP + "states",
                               "proxy.wire", "proxy.stopping"),
    # `sluice run`: everything but the CLI
    "controlplane.run": (_CP + "ops", _CP + "store", _CP + "backends", _CP + "reconcile",
                         _CP + "display", _CP + "redisserver", _CP + "statedir",
                         _CP + "processes", _CP + "records", _CP + "states", _CP + "servicespec",
                         "proxy.wire"),
    # all of controlplane; nothing in controlplane imports it
    "controlplane.cli": ("controlplane", "proxy.cli", "proxy.wire"),
}


def _within(name: str, allowed: str) -> bool:
    return name == allowed or name.startswith(allowed + ".")


def _breach(a: str, b: str, pa: str = "", pb: str = "") -> str | None:
    """Why the edge a -> b (modules of packages pa, pb) breaks the layering, or None."""
    if a.startswith("proxy.wire") and not b.startswith("proxy.wire"):
        return "proxy.wire imports only itself"
    if a.startswith("proxy") and b.startswith("controlplane"):
        return "proxy never imports controlplane"
    if a.startswith("controlplane") and b.startswith("proxy") and not any(
        b == allowed or b.startswith(allowed + ".") for allowed in CONTROLPLANE_MAY_IMPORT
    ):
        return f"controlplane imports from proxy only {', '.join(CONTROLPLANE_MAY_IMPORT)}"
    if pa and pa != pb:
        if pa not in MAY_IMPORT:
            return f"package {pa} has no MAY_IMPORT rule"
        if not any(_within(b, allowed) for allowed in MAY_IMPORT[pa]):
            return f"{pa} may import only {', '.join(MAY_IMPORT[pa]) or 'itself'}"
    return None


def _package(mod: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to (a module that is a package is its own)."""
    if modules[mod].name == "__init__.py":
        return mod
    return mod.rpartition(".")[0] or mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge")
    parser.add_argument("--max-lines", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=60)
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout to read (default: this script's)")
    args = parser.parse_args()
    modules = _modules(args.root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    kinds: dict[tuple[str, str], set[str]] = {}
    for mod, path in modules.items():
        for target, kind in _imports(mod, path, modules):
            graph[mod].add(target)
            kinds.setdefault((mod, target), set()).add(kind)
    if args.edges:
        for (a, b), k in sorted(kinds.items()):
            print(f"{a} -> {b} [{','.join(sorted(k))}]")
    print(f"modules: {len(modules)}  edges: {len(kinds)}")
    packages: dict[tuple[str, str], int] = {}
    for a, b in kinds:
        pa, pb = _package(a, modules), _package(b, modules)
        if pa != pb:
            packages[(pa, pb)] = packages.get((pa, pb), 0) + 1
    print("package edges (importer -> imported: module edges):")
    for (pa, pb), n in sorted(packages.items()):
        print(f"  {pa} -> {pb}: {n}")
    breaches = [(a, b, why) for (a, b) in sorted(kinds)
                if (why := _breach(a, b, _package(a, modules), _package(b, modules)))]
    print(f"layering breaches: {len(breaches)}")
    for a, b, why in breaches:
        print(f"  {a} -> {b}: {why}")
    cycles = _cycles(graph)
    print(f"cycles: {len(cycles)}")
    for comp in cycles:
        members = set(comp)
        edges = [f"{a}->{b}[{','.join(sorted(k))}]" for (a, b), k in sorted(kinds.items())
                 if a in members and b in members]
        print("  " + " | ".join(edges))
    print(f"modules over {args.max_lines} lines:")
    for mod, path in sorted(modules.items(), key=lambda kv: -len(kv[1].read_text().splitlines())):
        n = len(path.read_text().splitlines())
        if n > args.max_lines:
            print(f"  {n:5d}  {mod}")
    long = [(mod, *f) for mod, path in modules.items()
            for f in _long_functions(path, args.max_function)]
    print(f"functions over {args.max_function} lines:")
    for mod, name, length, justified in long:
        if not justified:
            print(f"  {length:5d}  {mod}.{name}")
    print(f"functions over {args.max_function} lines whose docstring says why:")
    for mod, name, length, justified in long:
        if justified:
            print(f"  {length:5d}  {mod}.{name}")
    return 1 if cycles or breaches else 0


if __name__ == "__main__":
    sys.exit(main())
