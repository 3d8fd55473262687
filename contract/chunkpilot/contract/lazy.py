"""Public names that load on first use (PEP 562), for the packages that declare them (chunkpilot.engine,
chunkpilot.tuner, chunkpilot.sim): importing one part of a package does not import every part, which keeps
torch out of torch-free callers and import cycles out of packages whose modules import each other."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` that serves each of `names` (name -> defining module)."""
    def __getattr__(name: str) -> object:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
