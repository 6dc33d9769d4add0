"""The package's floors (docs/architecture.md "Layout"), checked over every module of megaopd.

A package imports its own modules and packages of lower floors only; two packages on one floor never
import each other; the libraries (floors 0 and 1) never import an application; no module is part of an
import cycle. Imports inside functions count (a lazy import is still a dependency); imports under
`if TYPE_CHECKING:` do not (annotations only). Entry points (megaopd/cli.py, */cli.py, */__main__.py)
compose: they may import any floor, and no other module imports them.

The floor table has one place, docs/architecture.md (this test reads it). No caps on lines: a file or function
cap pushed state into long parameter lists to fit, which reads worse than a long function. KNOWN_* list what
breaks the floors today; each test fails on a new violation and on a listed one that is gone.
"""

import ast
import os
import re

import megaopd

ROOT = os.path.dirname(megaopd.__file__)
ARCHITECTURE = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")


def _read_floors(path: str) -> dict[str, int]:
    """The floor table, from its one place: the code block under docs/architecture.md's "The packages, floor by
    floor" (rows `  name/   N  what`), so the document a newcomer reads is the rule the test applies."""
    text = open(path).read()
    section = text[text.index("## The packages, floor by floor") :]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    floors = {m[1]: int(m[2]) for m in re.finditer(r"^  (\w+)/\s+(\d+)\s", block, re.M)}
    assert floors, f"no floor rows found in {path}"
    return floors


FLOOR = _read_floors(ARCHITECTURE)
LIBRARIES = {p for p, floor in FLOOR.items() if floor <= 1}  # floors 0 and 1 (docs/architecture.md)
APPLICATIONS = set(FLOOR) - LIBRARIES


# Imports that break the floors today: (file, imported module). Strict: each fix deletes its line.
KNOWN_BACK_UP: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, str]:
    """megaopd.a.b -> path, packages by their __init__.py's name."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def _resolve(name: str) -> str | None:
    """The longest megaopd module a dotted name starts with (`from m import f` names m.f)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def _imports(module: str, path: str) -> set[str]:
    """The megaopd modules `module` imports, anywhere but under `if TYPE_CHECKING:`."""
    tree = _parse(path)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for b in node.body
        for n in ast.walk(b)
    }
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) or _resolve(name.rsplit(".", 1)[0])
            if target and target != module:
                out.add(target)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[module].endswith("__init__.py")) else None


def _is_entry(module: str) -> bool:
    return module == "megaopd.cli" or module.rsplit(".", 1)[-1] in ("cli", "__main__")


def _floor_violations() -> set[tuple[str, str]]:
    bad = set()
    for m, targets in GRAPH.items():
        for t in targets:
            a, b = _package(m), _package(t)
            if _is_entry(t) and not _is_entry(m):
                bad.add((_rel(MODULES[m]), t))  # an entry point is for megaopd/cli.py only
            elif not _is_entry(m) and a is not None and b is not None and a != b and FLOOR[b] >= FLOOR[a]:
                bad.add((_rel(MODULES[m]), t))
    return bad


def test_every_package_is_on_a_floor():
    packages = {_package(m) for m in MODULES} - {None}
    assert packages <= set(FLOOR), (
        f"put {sorted(packages - set(FLOOR))} on a floor (the floor table in docs/architecture.md)"
    )
    assert LIBRARIES | APPLICATIONS == set(FLOOR) and not LIBRARIES & APPLICATIONS


def test_libraries_never_import_applications():
    bad = sorted(
        f"{_rel(MODULES[m])} imports {t}"
        for m, targets in GRAPH.items()
        if _package(m) in LIBRARIES
        for t in targets
        if _package(t) in APPLICATIONS
    )
    known = {f"{f} imports {t}" for f, t in KNOWN_BACK_UP}
    assert not [b for b in bad if b not in known], bad


def test_no_import_runs_back_up_a_floor():
    """Each package imports only lower floors (config, the top, composes every package's section; so no
    package imports config). KNOWN_BACK_UP is strict: a fixed import must leave the list too."""
    bad = _floor_violations()
    assert not bad - KNOWN_BACK_UP, [
        f"{f} imports {t}: a higher floor or an entry point" for f, t in sorted(bad - KNOWN_BACK_UP)
    ]
    assert not KNOWN_BACK_UP - bad, f"fixed, so delete from KNOWN_BACK_UP: {sorted(KNOWN_BACK_UP - bad)}"


def _cycles() -> set[tuple[str, ...]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm), sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(tuple(sorted(component)))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_modules_import_each_other():
    cycles = _cycles()
    assert not cycles - KNOWN_CYCLES, f"import cycles: {sorted(cycles - KNOWN_CYCLES)}"
    assert not KNOWN_CYCLES - cycles, f"fixed, so delete from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"
