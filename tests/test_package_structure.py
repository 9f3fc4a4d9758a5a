"""The package's layering, read from its source (imports inside functions included):
no import cycle; the objectives import neither the loop, the step layer, assembly nor the host
collectors; the loop imports no command-line module; nothing probes an objective with
getattr/hasattr (its hooks are declared in algorithms/base.py)."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ctopd_jax"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules) -> set[str]:
    """Package modules `name` imports anywhere in its file (a `from X import y` of a submodule y
    counts as y)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rsplit(".", 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph) -> list[str] | None:
    """One import cycle of `graph`, or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    assert _cycle(_graph()) is None


def test_objectives_import_neither_the_loop_the_step_assembly_nor_the_collectors():
    forbidden = ("ctopd_jax.build", "ctopd_jax.trainer", "ctopd_jax.step", "ctopd_jax.host",
                 "ctopd_jax.host_episodes", "ctopd_jax.preflight", "ctopd_jax.train",
                 "ctopd_jax.evaluate", "ctopd_jax.cli")
    bad = {name: sorted(m for m in deps if m.startswith(forbidden))
           for name, deps in _graph().items() if name.startswith("ctopd_jax.algorithms")}
    assert not {k: v for k, v in bad.items() if v}


def test_the_loop_imports_no_command_line_module():
    deps = _graph()["ctopd_jax.trainer"]
    assert not deps & {"ctopd_jax.evaluate", "ctopd_jax.train", "ctopd_jax.cli", "ctopd_jax.demo"}


def test_nothing_probes_an_objective_with_getattr_or_hasattr():
    probe = re.compile(r"(getattr|hasattr)\([^)]*(objective|\bobj\b)")
    assert probe.search('after = getattr(kwargs.get("objective"), "after_micro_batch", None)')
    hits = [f"{path.relative_to(PACKAGE)}:{i}" for path in PACKAGE.rglob("*.py")
            if path.name != "base.py"
            for i, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert hits == []
