"""The package's imports, read from the source with `ast`: no import circle, and the arrows
between the folders point one way (stages/ at the bottom, pipeline/ imported only by the CLI,
the runtime free of Prefect; nothing imports benchmarks/ or tools/).

Every module of every package that pyproject.toml installs (stages/ -> turboquant.stages,
...) is parsed; an import counts wherever it sits (a function-level import runs too, so it
must not hide a circle), except under `if TYPE_CHECKING:`. Relative imports are resolved,
and `from package import name` points at the submodule `name` where there is one, else at
the package. Nothing is imported, so the test reads any checkout.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> its folder, as pyproject.toml's setuptools tables declare them."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = tool.get("package-dir", {})
    return {pkg: root / where.get(pkg, pkg.replace(".", "/")) for pkg in tool["packages"]}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the installed packages (a package is its
    __init__.py)."""
    found = {}
    for pkg, folder in package_dirs(root).items():
        for path in sorted(folder.glob("*.py")):
            found[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _type_checking(node.test):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """What module `name` (in file `path`) imports, as absolute (module, None) for `import
    module` and (module, name) for `from module import name`."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = []
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise AssertionError(f"{path}: a relative import above the top package")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            out += [(source, alias.name) for alias in node.names]
    return out


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, every dotted name each module imports).
    `from X import a` is an edge to X.a where X.a is a module, else to X."""
    mods = modules(root)
    edges, names = {}, {}
    for name, path in mods.items():
        found = imports(name, path)
        names[name] = {f"{m}.{a}" if a else m for m, a in found} | {m for m, _ in found}
        targets = {f"{m}.{a}" if a and f"{m}.{a}" in mods else m for m, a in found}
        edges[name] = {t for t in targets if t in mods} - {name}
    return edges, names


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach one another through their imports (Tarjan's strongly
    connected components of more than one module), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def circle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One closed path through a component: its first module back to itself."""
    inside, start = set(component), component[0]
    paths, seen = [[start]], {start}
    while paths:  # breadth first: the shortest way back
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & inside):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no circle through {component}")


def describe(found: list[list[str]], edges: dict[str, set[str]]) -> str:
    return "\n".join(f"  {' -> '.join(circle(c, edges))}  (all of: {', '.join(c)})"
                     for c in found)


def test_no_import_circle():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, (
        "import circles in the package (break each by moving what both sides need into a "
        f"module below them, not by importing inside a function):\n{describe(found, edges)}")


def _top(name: str) -> str:
    return name.split(".")[0]


def _folder(module: str) -> str:
    """stages, runtime, ... for turboquant.stages.x; "" for the turboquant/ folder (the CLI)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in _FOLDERS else ""


_FOLDERS = ("stages", "manifests", "pipeline", "kernels", "runtime")


def _reached(module: str, edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module `module` imports, directly or through others -> one import path to it."""
    paths, todo = {module: [module]}, [module]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v]):
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return paths


def arrows_broken(root: Path = ROOT) -> list[str]:
    """The imports against the design's arrows: stages imports no other folder; kernels
    nothing of runtime or pipeline and the runtime neither pipeline nor Prefect (through
    any module); only the CLI (turboquant/) imports pipeline; nothing in the package
    imports benchmarks/ or tools/."""
    edges, names = graph(root)
    wrong = []
    for module in sorted(edges):
        folder = _folder(module)
        for target in sorted(edges[module]):
            other = _folder(target)
            if folder == "stages" and other != "stages":
                wrong.append(f"{module} imports {target}: stages/ imports no other folder")
            if other == "pipeline" and folder not in ("pipeline", ""):
                wrong.append(f"{module} imports {target}: only the CLI imports pipeline/")
        for target in sorted(names[module]):
            if _top(target) in ("benchmarks", "tools"):
                wrong.append(f"{module} imports {target}: nothing in the package imports "
                             f"{_top(target)}/")
        if folder not in ("runtime", "kernels"):
            continue
        for reached, path in _reached(module, edges).items():
            via = " -> ".join(path)
            if folder == "kernels" and _folder(reached) in ("runtime", "pipeline"):
                wrong.append(f"{via}: kernels/ sits below runtime/ and pipeline/")
            if folder == "runtime" and _folder(reached) == "pipeline":
                wrong.append(f"{via}: the runtime never imports pipeline/")
            prefect = sorted(n for n in names[reached] if _top(n) in ("prefect", "prefect_dask"))
            if folder == "runtime" and prefect:
                wrong.append(f"{via} imports {prefect[0]}: the runtime never imports Prefect")
    return wrong


def test_design_arrows():
    wrong = arrows_broken()
    assert not wrong, "imports against the design's arrows:\n  " + "\n  ".join(wrong)


# ---------------------------------------------------------------------------- the checker


def test_the_conversion_core_sits_below_the_flow_and_the_runners():
    """pipeline/: the plain core (convert, job, ledger, ...) below; the Dask runner above the
    jobs only; the head start and the Prefect flow above the core."""
    edges, _ = graph()

    def reaches(module: str) -> set[str]:
        return {m.rsplit(".", 1)[-1] for m in _reached(f"turboquant.pipeline.{module}", edges)
                if m.startswith("turboquant.pipeline.")}

    assert not reaches("convert") & {"flow", "head_start", "flow_api", "flow_env"}
    assert not reaches("distributed") & {"convert", "flow", "head_start"}
    assert not reaches("head_start") & {"flow", "flow_api"}


def _package(tmp_path: Path, files: dict[str, str], packages=("tq", "tq.a")) -> Path:
    """A package laid out as this repository's: folder `x` holds package tq.x."""
    where = "".join(f'"{p}" = "{p.rpartition(".")[2]}"\n' for p in packages)
    (tmp_path / "pyproject.toml").write_text(
        f"[tool.setuptools]\npackages = {list(packages)!r}\n"
        f"[tool.setuptools.package-dir]\n{where}".replace("'", '"'))
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_function_level_import_does_not_hide_a_circle(tmp_path):
    root = _package(tmp_path, {
        "tq/__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from . import two\n",
        "a/two.py": "def f():\n    from .one import g\n",  # today's runtime circle's shape
        "a/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from tq.a import one\n",
    })
    edges, _ = graph(root)
    assert edges["tq.a.one"] == {"tq.a.two"} and edges["tq.a.two"] == {"tq.a.one"}
    assert edges["tq.a.three"] == set()  # type checking only
    assert cycles(edges) == [["tq.a.one", "tq.a.two"]]
    assert circle(["tq.a.one", "tq.a.two"], edges) == ["tq.a.one", "tq.a.two", "tq.a.one"]


def test_relative_and_absolute_imports_resolve_to_modules(tmp_path):
    root = _package(tmp_path, {
        "tq/__init__.py": "from .a import helper\n",  # a name of tq.a's __init__
        "tq/cli.py": "import tq.a.one\n",
        "a/__init__.py": "from .one import helper\n",
        "a/one.py": "from .. import cli as c\n",
        "a/two.py": "from tq import a\nimport numpy\n",
    })
    edges, names = graph(root)
    assert edges == {"tq": {"tq.a"}, "tq.cli": {"tq.a.one"}, "tq.a": {"tq.a.one"},
                     "tq.a.one": {"tq.cli"}, "tq.a.two": {"tq.a"}}
    assert "numpy" in names["tq.a.two"]
    assert cycles(edges) == [["tq.a.one", "tq.cli"]]


def test_the_arrows_are_checked_through_other_modules(tmp_path):
    files = {f"{d}/__init__.py": "" for d in _FOLDERS + ("tq",)}
    root = _package(tmp_path, {
        **files,
        "stages/pure.py": "import numpy\nfrom ..kernels import fast\n",
        "kernels/fast.py": "def f():\n    from tq.manifests import schema\n",
        "manifests/schema.py": "import prefect\nfrom tq.pipeline import flow\n",
        "pipeline/flow.py": "import tools.lab\n",
        "runtime/load.py": "from tq.manifests.schema import Row\n",
        "tq/cli.py": "from tq.pipeline import flow\n",  # the CLI may
    }, packages=["tq", *(f"tq.{d}" for d in _FOLDERS)])
    assert arrows_broken(root) == [
        "tq.kernels.fast -> tq.manifests.schema -> tq.pipeline.flow: kernels/ sits below "
        "runtime/ and pipeline/",
        "tq.manifests.schema imports tq.pipeline.flow: only the CLI imports pipeline/",
        "tq.pipeline.flow imports tools.lab: nothing in the package imports tools/",
        "tq.runtime.load -> tq.manifests.schema imports prefect: the runtime never imports "
        "Prefect",
        "tq.runtime.load -> tq.manifests.schema -> tq.pipeline.flow: the runtime never "
        "imports pipeline/",
        "tq.stages.pure imports tq.kernels.fast: stages/ imports no other folder",
    ]
