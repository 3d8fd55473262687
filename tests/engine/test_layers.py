"""The engine's layers, read from its source with `ast` (nothing is imported, torch included): no import cycle among
its modules, each sub-package imports only from the layers below it, the settings import nothing of the engine, and
every settings type lives with the settings.

Every import counts wherever it stands: at module level, inside a function (an import deferred to call time is
still a dependency, one the interpreter only meets later), under `if TYPE_CHECKING:`, and a module named by its
dotted path in a string (the package's lazy exports, a process started with `python -m`). A cycle through the
settings is how a setting's type ends up at the top of the engine: a settings type kept beside the code that uses
it (a proposer, the scheduler) drags that code, and what it imports, under every module that reads the settings.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "chunkpilot.engine"
ENGINE = Path(__file__).resolve().parents[2] / "engine_image" / "chunkpilot" / "engine"

# The layers, bottom first; a module may import its own layer and the layers below it, never one above it nor a
# sibling on its own level. "engine" is the package's top-level modules (llm_engine, async_engine, llm, metrics and
# the package's lazy exports): the engine and its facades. Why this order, read from the code:
# * core (scheduler, block manager, sequences, knobs) is torch-free and reads only the settings, so the tuner's
#   simulator runs the exact scheduling code;
# * parallel (the step plan and the group that carries it between ranks) builds a plan from the scheduler's output;
# * model (the network and its loading) sits above parallel because its layers all-reduce through the group;
# * execution (worker, runner, sampler, rank processes) runs the model; speculation (the proposers, the draft model)
#   reads the tokenizer and the core; the two are siblings, neither imports the other, and the engine joins them;
# * kv_transfer (prefill/decode disaggregation: the wire, leases, peers, transports, the decode side's pull) moves
#   whole blocks of the execution layer's pool and hands the engine's own methods the sequences; the engine wires it
#   into the async layer;
# * serving (HTTP) sees the engine only through its facades, and nothing below it knows there is a server.
LAYERS: list[set[str]] = [{"config"}, {"core"}, {"parallel"}, {"model"}, {"execution", "speculation"}, {"kv_transfer"},
                          {"engine"}, {"serving"}]
SUBPACKAGES = set().union(*LAYERS) - {"config", "engine"}
# Where the settings live; *Config classes elsewhere are a layering mistake, but for the checkpoint's own
# description (model_config.py reads a model folder's config.json: the model's, not the engine's, settings).
SETTINGS = "config"
NOT_SETTINGS = {("model.model_config", "ModelConfig"), ("model.model_config", "RopeConfig")}


def modules() -> dict[str, ast.Module]:
    """Every module of the engine by its dotted name under the package ("core.scheduler", "config"); a package's own
    `__init__.py` by the package's name ("core"), the engine package's as "__init__"."""
    found = {}
    for p in sorted(ENGINE.rglob("*.py")):
        parts = p.relative_to(ENGINE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = ast.parse(p.read_text(), str(p))
    return found


def layer_of(name: str) -> str:
    """A module's layer: its sub-package, the settings, or the engine (the package's top-level modules)."""
    first = name.split(".")[0]
    return first if first in SUBPACKAGES or first == SETTINGS else "engine"


def engine_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The engine modules `name` imports, anywhere in its source."""
    deps: set[str] = set()

    def resolve(dotted: str) -> str | None:
        """The longest known module a dotted path (relative to the package) names: `core.scheduler.Scheduler` is
        core.scheduler; the package itself is "__init__"."""
        parts = dotted.split(".") if dotted else []
        while parts:
            if ".".join(parts) in known:
                return ".".join(parts)
            parts.pop()
        return "__init__"

    def add(dotted: str, names: list[str] = ()) -> None:
        if dotted != PACKAGE and not dotted.startswith(PACKAGE + "."):
            return
        rest = dotted[len(PACKAGE) + 1:]
        # `from chunkpilot.engine.core import scheduler`: a module; `from chunkpilot.engine import LLM`: a name of
        # the package's own
        for n in names or [None]:
            sub = f"{rest}.{n}" if rest and n else (n or rest)
            deps.add(sub if n and sub in known else resolve(rest))

    # what a relative import starts from: a module's own sub-package ("" for the package's top-level modules)
    package = name if name in SUBPACKAGES else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from .x import y`, `from . import x`, `from ..core import y`
                parts = package.split(".") if package else []
                base = ".".join([PACKAGE] + parts[:len(parts) - (node.level - 1)])
                add(f"{base}.{node.module}" if node.module else base, [a.name for a in node.names])
            elif node.module:
                add(node.module, [a.name for a in node.names])
            if node.module == "chunkpilot" and any(a.name == "engine" for a in node.names):
                deps.add("__init__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if all(part.isidentifier() for part in node.value.split(".")):  # a dotted path, not prose
                add(node.value)
    deps.discard(name)  # a module that names itself (`python -m chunkpilot.engine.execution.tp_worker`) imports nothing
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


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module's imports of a layer above its own or of a sibling on its level, by module."""
    level = {layer: i for i, layers in enumerate(LAYERS) for layer in layers}
    found = {}
    for name, deps in graph.items():
        mine = layer_of(name)
        wrong = sorted(d for d in deps if layer_of(d) != mine and level[layer_of(d)] >= level[mine])
        if wrong:
            found[name] = wrong
    return found


def test_the_reader_sees_every_kind_of_import():
    """The parser itself: each form an engine module could import another by."""
    source = '''
import chunkpilot.engine.a
from chunkpilot.engine import c, Name
from chunkpilot.engine.b import B
from chunkpilot.engine.core import d
from .e import E
from . import f
from ..model.g import G
TYPE_CHECKING = False
if TYPE_CHECKING:
    from chunkpilot.engine.core.h import H
def later():
    from chunkpilot.engine.core.i import I
EXPORTS = {"J": "chunkpilot.engine.core.j"}
from chunkpilot.contract import knobs
'''
    known = {"a", "b", "c", "core", "core.d", "core.e", "core.f", "model.g", "core.h", "core.i", "core.j",
             "core.x"}
    assert engine_imports("core.x", ast.parse(source), known) == known - {"core", "core.x"} | {"__init__"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_layer_rule_sees_an_import_upward_or_sideways():
    """The rule itself: the core importing the server, or execution importing speculation, is caught; importing
    down is not."""
    assert upward_imports({"core.scheduler": {"serving.server", "config"}}) == {"core.scheduler": ["serving.server"]}
    assert upward_imports({"execution.worker": {"speculation.proposers"}}) == {
        "execution.worker": ["speculation.proposers"]}
    assert upward_imports({"model.llama": {"core.scheduler"}, "config": set(), "llm": {"__init__", "core"}}) == {}
    assert upward_imports({"core.scheduler": {"llm_engine"}}) == {"core.scheduler": ["llm_engine"]}


def test_no_import_cycle_among_engine_modules():
    graph = import_graph()
    # the source was found, in its sub-packages
    assert {"config", "core.scheduler", "llm_engine", "speculation.speculative", "speculation.draft_model",
            "serving.server", "model.llama", "execution.worker", "parallel.tp_group"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in the engine: " + " -> ".join(cycle)


def test_every_module_imports_only_the_layers_below_it():
    graph = import_graph()
    assert {layer_of(name) for name in graph} == set().union(*LAYERS)  # every layer has its modules, and no other
    wrong = upward_imports(graph)
    assert not wrong, f"engine modules import a layer above their own or beside it (bottom first: {LAYERS}): {wrong}"


def test_the_settings_import_nothing_of_the_engine():
    graph = import_graph()
    assert not graph[SETTINGS], f"{SETTINGS}.py reads no other engine module, got {sorted(graph[SETTINGS])}"


def test_the_core_is_torch_free():
    """What the scheduler owns runs without torch: the tuner's simulator imports it."""
    with_torch = sorted(
        name for name, tree in modules().items() if layer_of(name) == "core"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names)
        or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch"
    )
    assert not with_torch, f"core modules import torch: {with_torch}"


def test_every_settings_type_lives_with_the_settings():
    elsewhere = sorted(
        (name, node.name) for name, tree in modules().items() if name != SETTINGS
        for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Config")
        and (name, node.name) not in NOT_SETTINGS
    )
    assert not elsewhere, f"settings types outside {SETTINGS}.py: {elsewhere}"
