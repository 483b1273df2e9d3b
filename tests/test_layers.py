"""The package's layers (docs/architecture.md, "Layers"): no module imports from a higher
layer, and no two modules import each other, directly or round a longer loop.

The check reads every ``.py`` file under ``raycompat/`` with ``ast`` (nothing is imported).
Every import statement counts, at module level or inside a function; only the body of an
``if TYPE_CHECKING:`` block is skipped (annotations only, never run). Imports by string
(``importlib.import_module``) are not seen. An import names the deepest module it reaches:
``from raycompat.data.readers import load_image`` is a dependency on ``data/readers.py``,
``from raycompat.data import catalog_for`` one on ``data/__init__.py``, and
``from raycompat.data import readers`` again one on ``data/readers.py``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "raycompat"

#: The layers, bottom up (docs/architecture.md, "Layers").
LAYER_NAMES = ("foundation", "components", "workflows", "services", "jobs")

#: The layer of each top-level module or package of ``raycompat`` (every module inside a
#: package shares its layer). ``__init__`` is the package face ``raycompat/__init__.py``:
#: layer 0, so anyone may import it for its version string and it may import nothing above.
LAYERS = {
    "__init__": 0,
    "config": 0,
    "console": 0,
    "storage": 0,
    "report": 0,
    "cluster": 0,
    "torch_distributed": 0,
    "outputs": 0,
    "data": 1,
    "models": 1,
    "index": 1,
    "metrics": 1,
    "stores": 1,
    "embeddings": 1,
    "methods": 2,
    "evaluation": 2,
    "pipeline": 2,
    "upgrade": 2,
    "simulator": 2,
    "planning": 2,
    "train": 3,
    "serving": 3,
    "cli": 4,
    "quickstart": 4,
    "quickstart_report": 4,
    "hot_refresh": 4,
    "reproduce": 4,
    "scenario_job": 4,
    "import_model": 4,
    "backfill_store": 4,
}

#: Packages of one layer that must not import each other's modules, with the reason: what an
#: upgrade is (policies, modes, canary) is shared by the live index and the stores, which
#: never run the simulation engine.
NEVER_IMPORTS = {("upgrade", "simulator"): "the upgrade concepts never run the simulation engine"}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package folder)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module):
    """Every Import / ImportFrom in ``tree``, in function and class bodies too, skipping
    ``if TYPE_CHECKING:`` bodies. Only statements are visited: an import is never inside an
    expression."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(
                child
                for child in ast.iter_child_nodes(node)
                if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case))
            )


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, imported module)`` for each import of another module of the package."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = module.split(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [_deepest(alias.name, modules) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}"
                if f"{base}.{alias.name}" in modules
                else _deepest(base, modules)
                for alias in node.names
            ]
        for target in targets:
            if target and target.split(".")[0] == top and target != module:
                found.append((node.lineno, target))
    return sorted(set(found))


@functools.cache
def import_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Module -> its imports of other modules of the package under ``root`` (read once)."""
    modules = module_files(root)
    return {m: imports_of(m, modules) for m in modules}


def _top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unlayered_modules(root: Path, layers: dict[str, int]) -> list[str]:
    """A message for each top-level module or package under ``root`` missing from ``layers``."""
    missing = sorted({_top_level(m) for m in module_files(root)} - set(layers))
    return [
        f"{root.name}/{name}: no layer; add it to LAYERS in tests/test_layers.py "
        "and to docs/architecture.md, 'Layers'"
        for name in missing
    ]


def upward_imports(root: Path, layers: dict[str, int], names=LAYER_NAMES) -> list[str]:
    """A message for each import from a lower layer to a higher one."""
    modules = module_files(root)
    problems = []
    for module, imports in import_graph(root).items():
        own = layers.get(_top_level(module))
        for line, target in imports:
            theirs = layers.get(_top_level(target))
            if own is not None and theirs is not None and theirs > own:
                where = modules[module].relative_to(root.parent)
                problems.append(
                    f"{where}:{line}: {module} (layer {own}, {names[own]}) imports {target} "
                    f"(layer {theirs}, {names[theirs]})"
                )
    return problems


def forbidden_imports(root: Path, rules=NEVER_IMPORTS) -> list[str]:
    """A message for each import that ``rules`` (``(importer, imported) -> reason``) forbid."""
    modules = module_files(root)
    problems = []
    for module, imports in import_graph(root).items():
        for line, target in imports:
            reason = rules.get((_top_level(module), _top_level(target)))
            if reason:
                where = modules[module].relative_to(root.parent)
                problems.append(f"{where}:{line}: {module} imports {target}: {reason}")
    return problems


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _cycle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest loop from ``start`` back to itself inside one component."""
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def import_cycles(root: Path) -> list[str]:
    """A message for each set of modules that import each other, with one loop spelled out."""
    graph = {m: {t for _, t in imports} for m, imports in import_graph(root).items()}
    lines = {}  # the first line importing each edge's target
    for module, imports in import_graph(root).items():
        for line, target in imports:
            lines.setdefault((module, target), line)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        loop = min((_cycle_through(m, set(component), graph) for m in component), key=len)
        steps = " -> ".join(
            f"{a} (line {lines[(a, b)]})" for a, b in zip(loop, loop[1:], strict=False)
        )
        problems.append(f"import cycle among {', '.join(component)}: {steps} -> {loop[-1]}")
    return problems


def test_every_top_level_module_has_a_layer():
    assert not unlayered_modules(PACKAGE_ROOT, LAYERS), "\n".join(
        unlayered_modules(PACKAGE_ROOT, LAYERS)
    )


def test_no_import_from_a_lower_layer_to_a_higher_one():
    problems = upward_imports(PACKAGE_ROOT, LAYERS)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_the_upgrade_concepts_never_import_the_simulator():
    assert forbidden_imports(PACKAGE_ROOT) == []


def test_a_forbidden_import_is_named(tmp_path):
    pkg = tmp_path / "pkg"
    for name, body in {"__init__": "", "upgrade/__init__": "", "simulator/__init__": "",
                       "upgrade/modes": "from pkg.simulator import engine\n",
                       "simulator/engine": "from pkg.upgrade import modes\n"}.items():  # fmt: skip
        path = pkg / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    assert forbidden_imports(pkg) == [
        "pkg/upgrade/modes.py:1: pkg.upgrade.modes imports pkg.simulator.engine: "
        "the upgrade concepts never run the simulation engine"
    ]


def test_no_import_cycles():
    problems = import_cycles(PACKAGE_ROOT)
    assert not problems, "\n".join(problems)


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_the_checks_report_a_cycle_an_upward_import_and_a_module_without_layer(tmp_path):
    root = _write_tree(
        tmp_path,
        {
            "pkg/__init__.py": '"""face"""\n',
            "pkg/base.py": "def f():\n    from pkg.high import job\n",  # inside a function
            "pkg/low/__init__.py": "from .a import x\n",
            "pkg/low/a.py": "from . import b\nx = 1\n",
            "pkg/low/b.py": "import os\nfrom ..low.a import x\n",  # a <-> b
            "pkg/low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.high import job\n",  # annotations only: allowed
            "pkg/high.py": "from pkg import low\nfrom pkg.low import a\njob = 1\n",
            "pkg/extra.py": "import pkg\n",
        },
    )
    layers = {"__init__": 0, "base": 0, "low": 1, "high": 2}
    assert upward_imports(root, layers) == [
        "pkg/base.py:2: pkg.base (layer 0, foundation) imports pkg.high (layer 2, workflows)"
    ]
    assert import_cycles(root) == [
        "import cycle among pkg.low.a, pkg.low.b: pkg.low.a (line 1) -> pkg.low.b (line 2) "
        "-> pkg.low.a"
    ]
    assert unlayered_modules(root, layers) == [
        "pkg/extra: no layer; add it to LAYERS in tests/test_layers.py "
        "and to docs/architecture.md, 'Layers'"
    ]
    assert import_graph(root)["pkg.high"] == [(1, "pkg.low"), (2, "pkg.low.a")]
    assert import_graph(root)["pkg.low.c"] == []


def test_a_longer_cycle_is_spelled_out_in_order(tmp_path):
    root = _write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/one.py": "from pkg import two\n",
            "pkg/two.py": "\n\nfrom pkg.three import y\n",
            "pkg/three.py": "def g():\n    import pkg.one\n",
        },
    )
    assert import_cycles(root) == [
        "import cycle among pkg.one, pkg.three, pkg.two: pkg.one (line 1) -> pkg.two (line 3) "
        "-> pkg.three (line 2) -> pkg.one"
    ]
