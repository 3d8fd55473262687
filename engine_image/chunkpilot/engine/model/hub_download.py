"""Download a model from the Hugging Face Hub (or a mirror: HF_ENDPOINT) into a folder the engine loads:
what the init container of an `hf://` InferenceDeployment runs, from the engine image itself (so the version is
pinned with the engine and nothing is installed at run time).

Only the files the engine reads are fetched. Files already in the folder with the Hub's size and hash are kept,
so a restart on a persistent cache (a PVC) downloads nothing again.
"""

from __future__ import annotations

from pathlib import Path

# What ModelConfig, load_weights and Tokenizer read; other repository files (GGUF, ONNX, other frameworks'
# weights) can be many times the model's size.
ENGINE_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


class HubDownloadError(RuntimeError):
    pass


def download(repo: str, revision: str, dest: Path, *, token: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - the engine extra installs it
        raise HubDownloadError(f"huggingface_hub is missing: pip install 'chunkpilot[engine]' ({e})") from None
    dest.mkdir(parents=True, exist_ok=True)
    try:
        path = Path(snapshot_download(repo, revision=revision, local_dir=dest, allow_patterns=ENGINE_FILES,
                                      token=token or None))
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError, OSError) as e:
        raise HubDownloadError(f"downloading {repo}@{revision} failed: {type(e).__name__}: {e}") from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise HubDownloadError(f"{repo}@{revision} has no config.json or *.safetensors weights: the engine loads "
                               "Hugging Face safetensors checkpoints")
    return path
