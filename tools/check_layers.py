#!/usr/bin/env python3
"""Report imports that go up the package's layer order, and import cycles between modules.

Usage: python tools/check_layers.py [PACKAGE_DIR]   (default: this repository's offload_engine)

A module may import from its own layer or a lower one. The base modules may be imported by
any layer and import no layer themselves. Every sub-package and top-level module must be in
ORDER or BASE: one that is in neither is reported, so a new package cannot escape the check
by not being listed. Imports inside functions count like top-level ones: a lazy import still
ties the layers together, it only hides it until the call.

Modules may not import each other in a circle either, inside a layer as across layers: each
cycle of the module graph (a module imports the modules and packages it names; `from X import
a` names X.a where that is a module, else X) is one violation, listed with its modules and
the imports that close it. A lazy import does not break a circle; it only hides it.

Exit 0 when clean; 1 with one line per violation (file:line: what imports what; for a cycle,
its modules and each import in it); 2 when PACKAGE_DIR is not a folder.
"""

import ast
import pathlib
import sys

# The layers, lowest first: the one list; docs cite it rather than copy it.
ORDER = ["io", "layout", "store", "optim", "formats", "checkpoint", "integrations", "offline",
         "consolidate", "migrate", "plan", "demo", "cli"]
# Top-level modules (offload_engine/<name>.py) below every layer. "__init__" is the package
# itself: `import offload_engine` and `from offload_engine import __version__` reach it.
BASE = ["__init__", "errors", "units", "dtypes", "jsonlimits", "envflags", "interrupts"]

DEFAULT_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "offload_engine"


def module_parts(root, path):
    """("io", "align") for root/io/align.py, ("io",) for root/io/__init__.py, () for the root."""
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def unit_of(parts):
    """The layer or base module a dotted path (as parts, package name dropped) belongs to."""
    return parts[0] if parts else "__init__"


def imported(node, parts, is_package, pkg, units):
    """The package-internal modules an import statement reaches, as parts without `pkg`.

    `from X import a` names X, except at the package root, where `a` may be a sub-package or
    top-level module (`from .. import cli`) rather than an attribute of __init__.py.
    """
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == pkg]
    if node.level:
        here = list(parts) if is_package else list(parts[:-1])
        up = node.level - 1
        if up > len(here):
            return []  # beyond the package: Python itself refuses it
        base = here[: len(here) - up] + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == pkg:
        base = node.module.split(".")[1:]
    else:
        return []
    if base:
        return [base]
    return [[a.name] if a.name in units or a.name in ORDER or a.name in BASE else []
            for a in node.names]


def resolve(node, parts, is_package, pkg, modules):
    """The package-internal modules (as parts without `pkg`) an import statement names, for
    the module graph: `from X import a` names X.a where that is a module, else X."""
    if isinstance(node, ast.Import):
        return [tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == pkg]
    if node.level:
        here = list(parts) if is_package else list(parts[:-1])
        up = node.level - 1
        if up > len(here):
            return []
        base = here[: len(here) - up] + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == pkg:
        base = node.module.split(".")[1:]
    else:
        return []
    return [tuple(base) + (a.name,) if tuple(base) + (a.name,) in modules else tuple(base)
            for a in node.names]


def cycles(edges):
    """The strongly connected components of more than one module of the graph ``edges``
    ({module: {imported module: line}}), each as a sorted list, sorted (Tarjan's algorithm,
    iterative: a deep package must not hit Python's recursion limit)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for t in targets:
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(sorted(edges.get(t, ())))))
                    break
                if t in on_stack:
                    low[node] = min(low[node], index[t])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        scc.append(m)
                        if m == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return sorted(found)


def cycle_lines(root, edges, paths):
    """One line per import cycle: its modules, then each import between them (file:line)."""
    pkg = root.name
    name = lambda m: ".".join([pkg, *m])
    out = []
    for scc in cycles(edges):
        members = set(scc)
        links = [f"{paths[m].relative_to(root.parent)}:{line} imports {name(t)}"
                 for m in scc for t, line in sorted(edges[m].items()) if t in members]
        first = paths[scc[0]].relative_to(root.parent)
        out.append(f"{first}: import cycle of {len(scc)} modules: "
                   f"{', '.join(name(m) for m in scc)} ({'; '.join(links)})")
    return out


def check(root):
    """Violation lines for the package at root: layer violations sorted by file, then
    import cycles."""
    root = pathlib.Path(root)
    pkg = root.name
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    units = {unit_of(module_parts(root, p)) for p in files}
    paths = {module_parts(root, p): p for p in files}
    edges = {m: {} for m in paths}  # module -> {imported module: first line}
    bad = []
    for name in sorted(units - set(ORDER) - set(BASE)):
        where = root / name if (root / name).is_dir() else root / f"{name}.py"
        bad.append(f"{where.relative_to(root.parent)}: {name} is not in the layer order "
                   f"(add it to ORDER or BASE in tools/check_layers.py)")
    for path in files:
        parts = module_parts(root, path)
        here = unit_of(parts)
        if here not in ORDER and here not in BASE:
            continue  # reported above
        shown = path.relative_to(root.parent)
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError as exc:
            bad.append(f"{shown}: cannot parse ({exc.msg}, line {exc.lineno})")
            continue
        for node in ast.walk(tree):  # every node: imports inside functions count too
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in resolve(node, parts, path.name == "__init__.py", pkg, paths):
                if target in paths and target != parts:
                    line = edges[parts].get(target, node.lineno)
                    edges[parts][target] = min(line, node.lineno)
            for target in imported(node, parts, path.name == "__init__.py", pkg, units):
                there = unit_of(target)
                what = ".".join([pkg, *target])
                if there == here or there in BASE or there not in ORDER:
                    continue  # same layer, the base, or an unknown unit (reported above)
                if here in BASE:
                    bad.append(f"{shown}:{node.lineno}: base module {here} imports layer "
                               f"{there} ({what})")
                elif ORDER.index(there) > ORDER.index(here):
                    bad.append(f"{shown}:{node.lineno}: {here} imports {there}, a higher "
                               f"layer ({what})")
    return bad + cycle_lines(root, edges, paths)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    root = pathlib.Path(argv[0]) if argv else DEFAULT_PACKAGE
    if not root.is_dir():
        print(f"check_layers: {root} is not a package folder", file=sys.stderr)
        return 2
    bad = check(root.resolve())
    for line in bad:
        print(line)
    if bad:
        circles = sum(": import cycle of " in line for line in bad)
        print(f"{len(bad)} violation(s): {len(bad) - circles} of the layer order "
              f"{' < '.join(ORDER)}, base {', '.join(BASE)}; {circles} import cycle(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
