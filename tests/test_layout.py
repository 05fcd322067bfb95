"""The house: no import cycle among aamperf's modules, and the README's Layout section names every
module and package of aamperf/ (and nothing that is gone)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aamperf"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    """Each module's imports of other aamperf modules at module level (those inside functions run
    late, on purpose, and cannot make a cycle at import time)."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aamperf"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names} & modules
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("aamperf")}
        graph[module_name(path)] = deps & modules
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # visiting | done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "visiting"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "visiting":
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    graph = imports()
    assert "aamperf.trainer.loop" in graph and "aamperf.guards" in graph["aamperf.trainer.loop"]
    assert find_cycle(graph) is None


def test_the_readme_layout_names_every_module_and_package():
    readme = (ROOT / "README.md").read_text()
    layout = re.search(r"## Layout\n+```\n(.*?)```", readme, re.S).group(1)
    block = layout.split("aamperf/\n", 1)[1].split("\ntests/", 1)[0]
    named = set(re.findall(r"^  (\S+)", block, re.M))
    present = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    present |= {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert named == present, f"missing from the README: {present - named}; gone: {named - present}"
