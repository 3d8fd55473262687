"""Shared fixtures: the converted SmolLM2 model is made once per machine (cached outside the repo) and loaded
once per test session."""

from __future__ import annotations

import os

import pytest


def require_tool(name: str, how: str) -> str:
    """The tool's path (PATH, then the cache's bin/ where scripts/go-tools.sh builds helm and kubeconform). In CI a
    missing tool fails the test; locally it skips with how to get it."""
    import shutil
    from pathlib import Path

    cache_bin = Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot")) / "bin"
    found = shutil.which(name) or shutil.which(name, path=str(cache_bin))
    if found:
        return found
    message = f"{name} is not installed: {how}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_dir():
    from chunkpilot.engine.model_fetch import ModelFetchError, fetch

    try:
        return str(fetch("smollm2"))
    except ModelFetchError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))
