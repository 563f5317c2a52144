"""The package's layering (docs/architecture.md, "Layers"), read from the import statements of every source file:
``ring/`` imports nothing else of blink; ``device/``, ``nic/`` and ``models/`` import neither each other nor the
top level, except the leaf modules ``blink.errors``, ``blink.paths`` and ``blink.version``; ``nic/remote/`` (the
transports) imports only the ring, and the rest of ``nic/`` (the agent) does not import it; ``host/`` imports the
ring, the engine's core and config and the transports, never the agent, the device or the models; nothing imports
``blink.bench`` but ``blink.cli``; no import cycle between modules; every source file holds at most 350
lines."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
PACKAGE = SRC / "blink"
LEAVES = {"blink.errors", "blink.paths", "blink.version"}
# package -> the blink packages its modules may import (besides itself and the leaves)
# (a package nested in another one listed here is a layer of its own: blink.nic.remote is not blink.nic)
ALLOWED = {"blink.ring": set(), "blink.device": {"blink.ring"}, "blink.nic": {"blink.ring"}, "blink.models": set(),
           "blink.nic.remote": {"blink.ring"},
           # the engine's process builds an EngineCore from an EngineConfig and offers its ring to remote agents
           "blink.host": {"blink.ring", "blink.nic.remote", "blink.config", "blink.core", "blink.extras"},
           "blink.bench": {"blink.models", "blink.nic", "blink.host"}}
MAX_LINES = 350


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every blink module that ``path`` imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("blink")} & MODULES


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES} | {"blink"}
GRAPH = {module_name(p): imports(p) for p in SOURCES}


def layer(module: str) -> str:
    """The package a module belongs to for the layering rules: the innermost package of ``ALLOWED`` that holds it
    (blink.nic.remote.wire -> blink.nic.remote, blink.nic.openai.server -> blink.nic), else the top-level module
    itself (blink.config)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in ALLOWED:
            return ".".join(parts[:n])
    return ".".join(parts[:2])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_its_layer_allows(package):
    wrong = []
    for module, targets in GRAPH.items():
        if layer(module) != package:
            continue
        for target in targets:
            if target in LEAVES or layer(target) == package or layer(target) in ALLOWED[package]:
                continue
            wrong.append(f"{module} -> {target}")
    assert not wrong, f"imports across the layering of {package}: {wrong}"


def test_the_leaf_modules_import_only_the_rings_errors():
    for leaf in LEAVES:
        assert GRAPH[leaf] <= {"blink.ring", "blink.ring.errors"}, (leaf, GRAPH[leaf])


def test_only_the_command_line_imports_the_bench_package():
    users = {m for m, targets in GRAPH.items() if any(layer(t) == "blink.bench" for t in targets)}
    assert {layer(m) for m in users} <= {"blink.cli", "blink.bench"}, users


def test_no_module_imports_itself_back():
    """No cycle: a depth-first walk over module imports (a package's __init__ counts as the package)."""
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for target in GRAPH.get(module, ()):
            if target == module or target in ("blink",):
                continue
            if state.get(target) == "open":
                raise AssertionError(f"import cycle: {' -> '.join([*path, module, target])}")
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in GRAPH:
        if module not in state:
            visit(module, [])


def test_every_source_file_is_at_most_350_lines():
    long = {str(p.relative_to(SRC)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
