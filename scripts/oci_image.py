"""Assemble an OCI image tarball from root-filesystem layers, without a container daemon or registry.

Where no registry is reachable (these CI machines), `scripts/image.sh engine` builds the engine's root filesystem
from Debian packages and pip, and this writes it as an OCI image layout in one tar that `ctr -n k8s.io images
import` (containerd) and `podman load` read. The image's config (entrypoint, user, environment, working directory,
ports, volumes) is read from the Dockerfile itself, so the two ways to build the image cannot drift apart
(tests/cluster/test_engine_image.py checks the result against the Dockerfile).

Stdlib only: it runs under any python3, before the project's virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import tarfile
from pathlib import Path

# The Debian rootfs's PATH; the pytorch base image of the Dockerfile puts its own python first, ours is /usr/local.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def dockerfile_config(text: str) -> dict:
    """The OCI image config fields that the Dockerfile's final stage sets: Env, WorkingDir, User, Entrypoint,
    Cmd, ExposedPorts, Volumes. ARG/FROM/COPY/RUN/HEALTHCHECK describe how to build, not what runs."""
    lines, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    env: dict[str, str] = {"PATH": DEFAULT_PATH}
    conf: dict = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            env, conf = {"PATH": DEFAULT_PATH}, {}  # only the last stage is the image
        elif word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        elif word == "WORKDIR":
            conf["WorkingDir"] = rest
        elif word == "USER":
            conf["User"] = rest
        elif word in ("ENTRYPOINT", "CMD"):
            conf["Entrypoint" if word == "ENTRYPOINT" else "Cmd"] = json.loads(rest)
        elif word == "EXPOSE":
            ports = conf.setdefault("ExposedPorts", {})
            for p in rest.split():
                ports[p if "/" in p else f"{p}/tcp"] = {}
        elif word == "VOLUME":
            vols = conf.setdefault("Volumes", {})
            for v in (json.loads(rest) if rest.startswith("[") else rest.split()):
                vols[v] = {}
    conf["Env"] = [f"{k}={v}" for k, v in env.items()]
    return conf


def _layer(rootfs: Path, out: Path) -> tuple[str, str, int]:
    """Write rootfs as an uncompressed layer tar (numeric owners, no user names, fixed times: the same tree gives
    the same digest). Returns (digest of the tar, its diff id, size); uncompressed, the two are equal."""
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(rootfs.iterdir()):
            tar.add(entry, arcname=entry.name, filter=clean)
    return _sha_of(out)


def write_image(layers: list[Path], config: dict, name: str, out: Path) -> str:
    """An OCI image layout tar at `out` named `name` (the layers' tars are taken as they are, in order: a later
    one overlays an earlier). Returns the manifest digest."""
    layer_descs, diff_ids = [], []
    for layer in layers:
        digest, diff_id, size = _sha_of(layer)
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size})
        diff_ids.append(diff_id)
    image_config = {"architecture": "amd64", "os": "linux", "config": config,
                    "rootfs": {"type": "layers", "diff_ids": diff_ids},
                    "history": [{"created_by": "chunkpilot scripts/image.sh"}]}
    blobs: dict[str, bytes] = {}

    def blob(data: dict, media: str) -> dict:
        raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        digest = f"sha256:{hashlib.sha256(raw).hexdigest()}"
        blobs[digest] = raw
        return {"mediaType": media, "digest": digest, "size": len(raw)}

    manifest = blob({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                     "config": blob(image_config, "application/vnd.oci.image.config.v1+json"),
                     "layers": layer_descs}, "application/vnd.oci.image.manifest.v1+json")
    manifest["annotations"] = {"io.containerd.image.name": name,
                               "org.opencontainers.image.ref.name": name.rpartition(":")[2]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest]}
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:
        def add_bytes(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add_bytes(f"blobs/sha256/{digest.removeprefix('sha256:')}", data)
        for layer, desc in zip(layers, layer_descs):
            tar.add(layer, arcname=f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}")
    os.replace(tmp, out)
    return manifest["digest"]


def _sha_of(layer: Path) -> tuple[str, str, int]:
    sidecar = layer.with_name(layer.name + ".sha256")  # written by `layer`, so a cached layer is hashed once
    if sidecar.exists() and sidecar.stat().st_mtime >= layer.stat().st_mtime:
        digest = sidecar.read_text().strip()
    else:
        h = hashlib.sha256()
        with open(layer, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = f"sha256:{h.hexdigest()}"
        sidecar.write_text(digest)
    return digest, digest, layer.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    lay = sub.add_parser("layer", help="write a directory as a layer tar")
    lay.add_argument("rootfs", type=Path)
    lay.add_argument("out", type=Path)
    img = sub.add_parser("image", help="write layer tars as an OCI image tarball")
    img.add_argument("--dockerfile", type=Path, required=True, help="the image config comes from its last stage")
    img.add_argument("--name", required=True, help="e.g. docker.io/chunkpilot/engine:local")
    img.add_argument("--out", type=Path, required=True)
    img.add_argument("layers", type=Path, nargs="+")
    conf = sub.add_parser("config", help="print the image config the Dockerfile sets")
    conf.add_argument("dockerfile", type=Path)
    args = parser.parse_args()
    if args.cmd == "layer":
        digest, _, size = _layer(args.rootfs, args.out)
        print(f"{digest} {size}")
    elif args.cmd == "image":
        config = dockerfile_config(args.dockerfile.read_text())
        print(write_image(args.layers, config, args.name, args.out))
    else:
        print(json.dumps(dockerfile_config(args.dockerfile.read_text()), indent=2))


if __name__ == "__main__":
    main()
