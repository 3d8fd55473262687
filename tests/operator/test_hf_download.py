"""The init container of an hf:// InferenceDeployment, run as rendered (its command and env, from the engine
image's own `chunkpilot model download`) against a local stand-in for the Hub's HTTP API; then the engine loads
what it downloaded. Before, the init container pip-installed an unpinned huggingface_hub at run time and ran a
module that current releases no longer have, so every hf:// deployment looped in Init."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from chunkpilot.api import InferenceDeployment
from chunkpilot.operator import builders as b

from ..engine.tiny_models import make_checkpoint
from .fake_hub import FakeHub
from .operator_proc import sample

REPO = "chunkpilot-test/tiny-llama"


def rendered_init(settings: b.OperatorSettings, **model) -> tuple[dict, dict]:
    raw = sample("hf-model", "ns")
    raw["spec"]["model"] = {"source": f"hf://{REPO}@main", **model}
    raw["metadata"]["uid"] = "u-1"
    dep = b.deployment(InferenceDeployment.model_validate(raw), settings)
    pod = dep["spec"]["template"]["spec"]
    return pod["initContainers"][0], pod


def run_as_rendered(init: dict, root: Path, extra_env: dict) -> subprocess.CompletedProcess:
    """The container's argv and env on this machine: its volume mounts under `root`, its image's entrypoint
    (`chunkpilot`) from this environment."""
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    env.update(extra_env)
    argv = [a.replace(b.MODELS_DIR, str(root / "models")) for a in init["command"]]
    assert argv[0] == "chunkpilot"
    env["HOME"] = env["HF_HOME"] = str(root / "tmp")
    return subprocess.run([sys.executable, "-m", "chunkpilot.cli.main", *argv[1:]], capture_output=True, text=True,
                          timeout=120, env={"PATH": os.environ["PATH"], **env})


def test_the_init_container_downloads_from_the_hub_and_the_engine_loads_it(tmp_path):
    model = make_checkpoint(tmp_path / "source", "llama")
    (model / "README.md").write_text("not needed by the engine")
    with FakeHub(REPO, model) as hub:
        init, pod = rendered_init(b.OperatorSettings(hf_endpoint=hub.url), cacheClaim="model-cache")
        assert init["image"] == b.OperatorSettings().engine_image  # pinned with the engine, no pip at run time
        assert "sh" not in init["command"] and "pip" not in " ".join(init["command"])
        assert pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}}
        root = tmp_path / "pod"
        first = run_as_rendered(init, root, {})
        assert first.returncode == 0, first.stderr[-3000:]
        dest = Path(first.stdout.strip().splitlines()[-1])
        assert dest == root / "models" / "hf" / REPO / "main"
        assert sorted(hub.downloads) == sorted(f for f in hub.files if f != "README.md")
        # the engine container's CHUNKPILOT_MODEL is that folder, and the engine loads it
        engine_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert engine_env["CHUNKPILOT_MODEL"] == f"{b.MODELS_DIR}/hf/{REPO}/main"
        from chunkpilot.engine import LLM, SamplingParams
        out = LLM(str(dest), max_model_len=64).generate(["hello"], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].token_ids) == 3
        # a restart on the same PVC downloads nothing again
        hub.downloads.clear()
        again = run_as_rendered(init, root, {})
        assert again.returncode == 0, again.stderr[-3000:]
        assert hub.downloads == []


def test_an_unknown_repository_fails_the_init_container_with_a_clear_message(tmp_path):
    model = make_checkpoint(tmp_path / "source", "llama")
    with FakeHub("someone/else", model) as hub:
        init, pod = rendered_init(b.OperatorSettings(hf_endpoint=hub.url))
        assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "200Gi"}  # bounded, not the node's whole disk
        res = run_as_rendered(init, tmp_path / "pod", {})
        assert res.returncode == 1 and re.search(rf"error: downloading {REPO}@main failed", res.stderr), res.stderr


def test_a_token_secret_reaches_the_init_container_only():
    init, pod = rendered_init(b.OperatorSettings(), hfTokenSecret="hub-token")
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub-token", "key": "token"}}} in init["env"]
    assert "HF_TOKEN" not in json.dumps(pod["containers"][0])
