"""The engine's layers, read from its source with `ast` (nothing is imported, torch included): no import cycle among
its modules, the bottom layer imports nothing above it, and every settings type lives with the settings.

Every import counts wherever it stands: at module level, inside a function (an import deferred to call time is
still a dependency, one the interpreter only meets later), under `if TYPE_CHECKING:`, and a module named by its
dotted path in a string (the package's lazy exports). A cycle through the settings is how a setting's type ends up
at the top of the engine: a settings type kept beside the code that uses it (a proposer, the scheduler) drags that
code, and what it imports, under every module that reads the settings.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "chunkpilot.engine"
ENGINE = Path(__file__).resolve().parents[2] / "engine_image" / "chunkpilot" / "engine"

# The bottom layer: the settings and the plain values every part of the engine passes around. They may import each
# other and nothing else of the engine, so any module can read them without pulling in what sits above.
BOTTOM = {"config", "knobs", "sampling_params", "sequence", "outputs", "stats"}
# Where the settings live; *Config classes elsewhere are a layering mistake, but for the checkpoint's own
# description (model_config.py reads a model folder's config.json: the model's, not the engine's, settings).
SETTINGS = "config"
NOT_SETTINGS = {("model_config", "ModelConfig"), ("model_config", "RopeConfig")}


def modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(ENGINE.glob("*.py"))}


def engine_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The engine modules `name` imports, anywhere in its source."""
    deps: set[str] = set()

    def add(dotted: str, names: list[str] = ()) -> None:
        if dotted == PACKAGE:  # `from chunkpilot.engine import x`: a module, or a name of the package's own
            deps.update(n if n in known else "__init__" for n in names)
        elif dotted.startswith(PACKAGE + "."):
            deps.add(dotted.split(".")[2])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from .x import y`, `from . import x`
                base = PACKAGE if node.level == 1 else ""
                add(f"{base}.{node.module}" if node.module else base, [a.name for a in node.names])
            elif node.module:
                add(node.module, [a.name for a in node.names])
            if node.module == "chunkpilot" and any(a.name == "engine" for a in node.names):
                deps.add("__init__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if all(part.isidentifier() for part in node.value.split(".")):  # a dotted path, not prose
                add(node.value)
    deps.discard(name)  # a module that names itself (`python -m chunkpilot.engine.tp_worker`) imports nothing
    return deps & (known | {"__init__"})


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: engine_imports(name, tree, known) for name, tree in trees.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None (a depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_every_kind_of_import():
    """The parser itself: each form an engine module could import another by."""
    source = '''
import chunkpilot.engine.a
from chunkpilot.engine.b import B
from chunkpilot.engine import c, Name
from . import d
from .e import E
TYPE_CHECKING = False
if TYPE_CHECKING:
    from chunkpilot.engine.f import F
def later():
    from chunkpilot.engine.g import G
EXPORTS = {"H": "chunkpilot.engine.h"}
from chunkpilot.contract import knobs
'''
    known = set("abcdefgh")
    assert engine_imports("x", ast.parse(source), known) == set("abcdefgh") | {"__init__"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_engine_modules():
    graph = import_graph()
    assert {"config", "scheduler", "llm_engine", "speculative", "draft_model"} <= set(graph)  # the source was found
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in the engine: " + " -> ".join(cycle)


def test_the_bottom_layer_imports_nothing_above_it():
    graph = import_graph()
    above = {name: sorted(graph[name] - BOTTOM) for name in BOTTOM if graph[name] - BOTTOM}
    assert not above, f"bottom-layer modules import engine modules above them: {above}"
    assert not graph[SETTINGS], f"{SETTINGS}.py reads no other engine module, got {sorted(graph[SETTINGS])}"


def test_every_settings_type_lives_with_the_settings():
    elsewhere = sorted(
        (name, node.name) for name, tree in modules().items() if name != SETTINGS
        for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Config")
        and (name, node.name) not in NOT_SETTINGS
    )
    assert not elsewhere, f"settings types outside {SETTINGS}.py: {elsewhere}"
