#!/usr/bin/env bash
# One of the project's images (engine | operator | tuner), built without a registry or a container daemon, for the
# local cluster (scripts/local-cluster.sh) and its tests: `bash scripts/image.sh engine`. Where a registry is
# reachable, `docker build -f <part's Dockerfile> .` is the way; this builds the same image from Debian instead of
# the Dockerfile's base image (the pytorch image for the engine, python:3.12-slim for operator and tuner):
#   layer 1: Debian bookworm (mmdebstrap) + python3 + the packages of the extra the Dockerfile installs
#            (`pip install ".[engine]"`; torch from PyPI runs on the CPU) + the Dockerfile's USER and its VOLUMEs
#            owned by it; cached by the hash of what decides it;
#   layer 2: the Dockerfile's COPY sources in its WORKDIR, installed with pip (`pip install .`), as the Dockerfile does;
#   config:  read from the Dockerfile's ENV, WORKDIR, USER, ENTRYPOINT, EXPOSE and VOLUME (scripts/oci_image.py).
# Output: $CHUNKPILOT_CACHE/images/<part>-<hash>.tar (an OCI image tarball named
# docker.io/chunkpilot/<part>:local-<hash>) and its name in $CHUNKPILOT_CACHE/images/<part>.name; `ctr -n k8s.io
# images import` loads it. The tuner image also runs the chart's hook Job and `helm test`.
# Needs root (mmdebstrap, chroot, overlayfs) and the network to Debian's mirror and PyPI; the engine's layer 1
# downloads PyTorch (~4 GB with its CUDA libraries; kept in a pip cache under $CHUNKPILOT_CACHE/pip where the index
# lets pip cache: this workplace's proxy does not, so each layer-1 build downloads again) and took 2-4 min here,
# operator and tuner about a minute each; a change to the project's code rebuilds layer 2 only (a minute).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CACHE="${CHUNKPILOT_CACHE:-$HOME/.cache/chunkpilot}"
OUT="$CACHE/images"
PART=${1:-}
case "$PART" in
    engine) DOCKERFILE=engine_image/Dockerfile ;;
    operator|tuner) DOCKERFILE=$PART/Dockerfile ;;
    *) echo "usage: bash scripts/image.sh engine|operator|tuner" >&2; exit 2 ;;
esac
SUITE=bookworm
if [ "$(id -u)" != 0 ] || ! command -v mmdebstrap >/dev/null 2>&1; then
    echo "warning: the $PART image is built as root with mmdebstrap (apt-get install mmdebstrap); the local-cluster" \
         "tests skip locally and fail in CI without it" >&2
    exit 0
fi
mkdir -p "$OUT" "$CACHE/pip"
# pip inside the image's root: a clean environment (none of this host's PIP_* settings), this host's CA bundle (a
# proxy's CA may sit in it; Debian's pip reads SSL_CERT_FILE), and a download cache that outlives the build (one hook:
# a bind mount does not outlive the hook that made it).
PIP_ENV="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt \
SSL_CERT_FILE=/tmp/host-ca.crt REQUESTS_CA_BUNDLE=/tmp/host-ca.crt PIP_CACHE_DIR=/tmp/pipcache \
PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_WARN_SCRIPT_LOCATION=1 PIP_DISABLE_PIP_VERSION_CHECK=1"
hash_of() { sha256sum "$@" | sha256sum | cut -c1-12; }
# The Dockerfile's COPY sources and its WORKDIR (the image's layout comes from the Dockerfile, not from here).
mapfile -t COPIES < <(sed -n 's/^COPY \([^-].*\)$/\1/p' "$DOCKERFILE")
WORKDIR=$(sed -n 's/^WORKDIR //p' "$DOCKERFILE" | tail -1)
IMAGE_USER=$(sed -n 's/^USER //p' "$DOCKERFILE" | tail -1)
# The extra the Dockerfile installs (`pip install ".[engine]"`), and the directories it declares as volumes.
EXTRA=$(sed -n 's/.*pip install [^"]*"\.\[\([a-z]*\)\]".*/\1/p' "$DOCKERFILE" | head -1)
VOLUMES=$(python3 scripts/oci_image.py config "$DOCKERFILE" | python3 -c 'import json, sys; print(" ".join(json.load(sys.stdin).get("Volumes", {})))')
[ -n "$EXTRA" ] && [ -n "$IMAGE_USER" ] || { echo "error: $DOCKERFILE has no USER or no pip install \".[extra]\"" >&2; exit 1; }
# Layer 1 depends on the Dockerfile, this script and the packages pyproject.toml names for the extra, not on the
# rest of pyproject.toml (test settings, other extras).
deps=$(python3 -c 'import json, sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(json.dumps([p["requires-python"], p["dependencies"], p["optional-dependencies"][sys.argv[1]]]))' "$EXTRA")
base_key=$( (cat "$DOCKERFILE" "${BASH_SOURCE[0]}"; echo "$deps") | sha256sum | cut -c1-12)
app_files=()
for c in "${COPIES[@]}"; do
    read -ra parts <<<"$c"
    for src in "${parts[@]:0:${#parts[@]}-1}"; do
        while IFS= read -r f; do app_files+=("$f"); done < <(git ls-files --cached --others --exclude-standard -- "$src")
    done
done
app_key=$(hash_of "${app_files[@]}" scripts/oci_image.py)
NAME="docker.io/chunkpilot/$PART:local-$base_key-$app_key"
TARBALL="$OUT/$PART-$base_key-$app_key.tar"
if [ -f "$TARBALL" ]; then
    echo "$NAME" > "$OUT/$PART.name"; echo "$TARBALL"; exit 0
fi

BASE="$OUT/$PART-base-$base_key"
if [ ! -f "$BASE/layer.tar" ]; then
    echo "building the $PART image's base layer in $BASE (Debian $SUITE + the [$EXTRA] packages from PyPI: minutes) ..." >&2
    rm -rf "$BASE" && mkdir -p "$BASE"
    # pip needs the project's metadata to resolve the extra: install it, then remove the project itself
    # (layer 2 holds it, so a code change does not rebuild this layer).
    mkdir -p "$BASE/src" && cp pyproject.toml README.md "$BASE/src/"
    for c in "${COPIES[@]}"; do read -ra parts <<<"$c"; cp -r "${parts[@]:0:${#parts[@]}-1}" "$BASE/src/" 2>/dev/null || true; done
    cp /etc/ssl/certs/ca-certificates.crt "$BASE/host-ca.crt"  # this host's trust (a proxy's CA), for pip only
    mmdebstrap --mode=root --variant=minbase --include=python3,python3-pip,ca-certificates,passwd \
        --customize-hook='mkdir -p "$1/tmp/src" "$1/tmp/pipcache" && cp -r '"$BASE/src"'/. "$1/tmp/src/" && cp '"$BASE/host-ca.crt"' "$1/tmp/host-ca.crt" && mount --bind '"$CACHE/pip"' "$1/tmp/pipcache" && { chroot "$1" env -i '"$PIP_ENV"' sh -ec "pip install -q --upgrade pip; /usr/local/bin/pip install -q \"/tmp/src['"$EXTRA"']\"; /usr/local/bin/pip uninstall -q -y chunkpilot"; rc=$?; umount "$1/tmp/pipcache"; rm -rf "$1/tmp/src" "$1/tmp/pipcache" "$1/tmp/host-ca.crt"; exit $rc; }' \
        --customize-hook='chroot "$1" sh -ec "useradd --uid '"$IMAGE_USER"' --create-home --home-dir /home/chunkpilot chunkpilot; mkdir -p '"$WORKDIR $VOLUMES"'; for v in '"$VOLUMES"'; do chown '"$IMAGE_USER:$IMAGE_USER"' \$v; done"' \
        --customize-hook='rm -rf "$1/var/cache/apt/archives"/*.deb "$1/var/lib/apt/lists"/* "$1/root/.cache"' \
        "$SUITE" "$BASE/rootfs" >&2
    python3 scripts/oci_image.py layer "$BASE/rootfs" "$BASE/layer.tar.partial" >&2
    mv "$BASE/layer.tar.partial" "$BASE/layer.tar" && mv "$BASE/layer.tar.partial.sha256" "$BASE/layer.tar.sha256"
    rm -rf "$BASE/src" "$BASE/host-ca.crt"
    find "$OUT" -maxdepth 1 -name "$PART-base-*" ! -name "$PART-base-$base_key" -exec rm -rf {} +  # older bases
fi

echo "building the $PART image's app layer ($app_key) ..." >&2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/chunkpilot-image.XXXXXX")
cleanup() {
    for m in "$WORK/merged/proc" "$WORK/merged/tmp/pipcache" "$WORK/merged"; do mountpoint -q "$m" && umount "$m"; done
    rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$WORK/upper" "$WORK/work" "$WORK/merged"
# overlayfs: what `pip install .` adds on top of layer 1 lands in upper/, which is exactly layer 2.
mount -t overlay overlay -o "lowerdir=$BASE/rootfs,upperdir=$WORK/upper,workdir=$WORK/work" "$WORK/merged"
mkdir -p "$WORK/merged$WORKDIR" "$WORK/merged/tmp/pipcache"
cp pyproject.toml README.md "$WORK/merged$WORKDIR/"
for c in "${COPIES[@]}"; do
    read -ra parts <<<"$c"
    for src in "${parts[@]:0:${#parts[@]}-1}"; do
        [ "$src" = pyproject.toml ] || [ "$src" = README.md ] && continue
        while IFS= read -r f; do
            mkdir -p "$(dirname "$WORK/merged$WORKDIR/$f")" && cp -p "$f" "$WORK/merged$WORKDIR/$f"
        done < <(git ls-files --cached --others --exclude-standard -- "$src")
    done
done
cp /etc/ssl/certs/ca-certificates.crt "$WORK/host-ca.crt"
mount -t proc proc "$WORK/merged/proc"
mount --bind "$CACHE/pip" "$WORK/merged/tmp/pipcache"
cp "$WORK/host-ca.crt" "$WORK/merged/tmp/host-ca.crt"
cp /etc/resolv.conf "$WORK/merged/etc/resolv.conf"  # removed from the layer below
# shellcheck disable=SC2086  # PIP_ENV is a list of assignments
chroot "$WORK/merged" env -i $PIP_ENV sh -ec "cd $WORKDIR && /usr/local/bin/pip install -q --no-deps ." >&2
umount "$WORK/merged/tmp/pipcache" "$WORK/merged/proc"
rm -rf "$WORK/merged/tmp/"* "$WORK/merged/tmp/".[!.]* "$WORK/merged/root/.cache" 2>/dev/null || true
umount "$WORK/merged"
rm -rf "$WORK/upper/tmp" "$WORK/upper/root" "$WORK/upper/etc/resolv.conf"
rmdir "$WORK/upper/etc" 2>/dev/null || true
python3 scripts/oci_image.py layer "$WORK/upper" "$WORK/app.tar" >&2
python3 scripts/oci_image.py image --dockerfile "$DOCKERFILE" --name "$NAME" --out "$TARBALL.partial" \
    "$BASE/layer.tar" "$WORK/app.tar" >&2
mv "$TARBALL.partial" "$TARBALL"
find "$OUT" -maxdepth 1 -name "$PART-*.tar" ! -name "$(basename "$TARBALL")" -delete  # older app layers
echo "$NAME" > "$OUT/$PART.name"
echo "$TARBALL"
