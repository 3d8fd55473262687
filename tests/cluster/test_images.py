"""The three images built without a registry (scripts/image.sh engine|operator|tuner) agree with their Dockerfiles:
the same entrypoint, user, environment, working directory, ports and volumes, and the same layout (the COPY'd
sources in the WORKDIR and nothing of the other parts, the package installed, user 10001 owning the volumes). The
cluster tests run these images under a kubelet: the engine for InferenceDeployments, operator and tuner from the
chart (the tuner image also runs the chart's hook Job and `helm test`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from oci_image import dockerfile_config  # noqa: E402  (a stdlib script, not a package)

DOCKERFILES = {"engine": ROOT / "engine_image" / "Dockerfile", "operator": ROOT / "operator" / "Dockerfile",
               "tuner": ROOT / "tuner" / "Dockerfile"}
# A file of each part's own source that its image must hold, and the other parts' that it must not.
OWN = {"engine": "engine_image/chunkpilot/engine/serving/server.py",
       "operator": "operator/chunkpilot/operator/handlers.py", "tuner": "tuner/chunkpilot/tuner/daemon.py"}


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def image(request):
    from ..local_cluster import build_image

    part = request.param
    built = build_image(part)
    if isinstance(built, str):
        from .conftest import _unavailable

        _unavailable(built)
    name, tarball = built
    with tarfile.open(tarball) as t:
        index = json.load(t.extractfile("index.json"))
        (manifest_desc,) = index["manifests"]

        def blob(digest: str) -> bytes:
            return t.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}").read()
        manifest = json.loads(blob(manifest_desc["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
    return {"part": part, "dockerfile": DOCKERFILES[part], "name": name, "tarball": tarball, "index": index,
            "manifest": manifest, "config": config}


def layer_members(tarball: Path, digest: str, wanted: set[str]) -> dict[str, tarfile.TarInfo]:
    """The named members of one layer inside the image tarball, read without unpacking either (stops early)."""
    found: dict[str, tarfile.TarInfo] = {}
    with tarfile.open(tarball) as outer:
        member = outer.getmember(f"blobs/sha256/{digest.removeprefix('sha256:')}")
        with tarfile.open(fileobj=outer.extractfile(member), mode="r|") as layer:
            for info in layer:
                if info.name in wanted:
                    found[info.name] = info
                    if len(found) == len(wanted):
                        break
    return found


def test_the_image_config_is_the_dockerfiles(image):
    want = dockerfile_config(image["dockerfile"].read_text())
    got = image["config"]["config"]
    for key in ("Entrypoint", "User", "WorkingDir", "ExposedPorts", "Volumes"):
        assert got.get(key) == want.get(key), key
    assert got["Entrypoint"] == ["chunkpilot", image["part"], "serve" if image["part"] == "engine" else "run"]
    assert got["User"] == "10001"
    env = dict(e.split("=", 1) for e in got["Env"])
    for line in want["Env"]:
        key, value = line.split("=", 1)
        assert env[key] == value
    assert image["index"]["manifests"][0]["annotations"]["io.containerd.image.name"] == image["name"]
    assert image["config"]["os"] == "linux" and len(image["manifest"]["layers"]) == 2


def test_the_image_layout_is_the_dockerfiles(image):
    """The app layer holds the Dockerfile's COPY sources (the tracked files) in its WORKDIR, none of the other
    parts', and the installed package; the base layer the user and the volumes (/cache) the Dockerfile's RUN
    makes."""
    workdir = image["config"]["config"]["WorkingDir"].lstrip("/")
    base, app = (d["digest"] for d in image["manifest"]["layers"])
    copied = []
    for line in image["dockerfile"].read_text().splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for src in sources:
                copied += subprocess.run(["git", "ls-files", "--", src], cwd=ROOT, capture_output=True, text=True,
                                         check=True).stdout.split()
    assert OWN[image["part"]] in copied and "cli/chunkpilot/cli/main.py" in copied
    others = {f"{workdir}/{f}" for part, f in OWN.items() if part != image["part"]}
    entry = "usr/local/bin/chunkpilot"
    found = layer_members(image["tarball"], app, {f"{workdir}/{f}" for f in copied} | {entry} | others)
    missing = sorted({f"{workdir}/{f}" for f in copied} - set(found))
    assert not missing, missing[:5]
    assert entry in found and found[entry].mode & 0o111
    assert not others & set(found), f"the {image['part']} image carries another part's source"
    volumes = {v.lstrip("/") for v in image["config"]["config"].get("Volumes", {})}
    assert volumes == ({"cache"} if image["part"] == "engine" else set())
    with tarfile.open(image["tarball"]) as outer:
        layer = tarfile.open(fileobj=outer.extractfile(f"blobs/sha256/{base.removeprefix('sha256:')}"), mode="r|")
        passwd, owned = None, {}
        for info in layer:
            if info.name in volumes:
                owned[info.name] = info
            elif info.name == "etc/passwd":
                passwd = layer.extractfile(info).read().decode()
            if len(owned) == len(volumes) and passwd:
                break
    for v in volumes:
        assert owned[v].isdir() and (owned[v].uid, owned[v].gid) == (10001, 10001), v
    assert "chunkpilot:x:10001:10001::/home/chunkpilot:" in passwd
