"""The pipeline's modules import one way: the plain conversion core (convert.py, job.py,
ledger.py, ...) below, the Dask runner above the jobs, the Prefect flow and the head start
above the core. Every import counts, also one inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINE = Path(__file__).resolve().parent.parent / "pipeline"


def pipeline_imports() -> dict[str, set[str]]:
    """module name -> the pipeline modules it imports (relative or absolute, anywhere)."""
    mods = {p.stem for p in PIPELINE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PIPELINE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1:
                    names = [base.split(".")[0]] if base else [a.name for a in node.names]
                elif base.startswith("turboquant.pipeline."):
                    names = [base.split(".")[2]]
                elif base == "turboquant.pipeline":
                    names = [a.name for a in node.names]
                else:
                    names = []
                deps |= {n for n in names if n in mods}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("turboquant.pipeline."):
                        deps.add(a.name.split(".")[2])
        graph[path.stem] = deps - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [node, dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_pipeline_has_no_import_cycle():
    cycle = find_cycle(pipeline_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_is_below_the_flow_and_the_runners():
    g = pipeline_imports()
    assert not g["convert"] & {"flow", "head_start", "flow_api", "flow_env"}
    assert not g["distributed"] & {"convert", "flow", "head_start"}
    assert not g["head_start"] & {"flow", "distributed"}


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
