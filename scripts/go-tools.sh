#!/usr/bin/env bash
# The Go-built tools the chart and local-cluster tests use, built once with `go install` from their modules (the Go module proxy)
# and cached in $CHUNKPILOT_CACHE/bin (default ~/.cache/chunkpilot/bin), never in the repository.
# Needs Go >= 1.24 on PATH; the first build takes a few minutes on 2 cores, later runs are instant.
set -euo pipefail
BIN="${CHUNKPILOT_CACHE:-$HOME/.cache/chunkpilot}/bin"
mkdir -p "$BIN"
declare -A TOOLS=(
    [helm]="helm.sh/helm/v3/cmd/helm@v3.22.0"
    [kubeconform]="github.com/yannh/kubeconform/cmd/kubeconform@v0.8.0"
    # Debian's prometheus is built without Kubernetes service discovery; the local-cluster tests find the engine
    # pods the way a Prometheus in a cluster does, so they use upstream's (module v0.316.0 is Prometheus 3.x).
    [prometheus]="github.com/prometheus/prometheus/cmd/prometheus@v0.316.0"
)
for name in "${!TOOLS[@]}"; do
    [ -x "$BIN/$name" ] && continue
    if ! command -v go >/dev/null 2>&1; then
        echo "warning: go is not installed, so $name cannot be built (chart tests skip locally, fail in CI);" \
             "install Go (https://go.dev/doc/install or apt-get install golang) and rerun" >&2
        continue
    fi
    echo "building $name (go install ${TOOLS[$name]}) into $BIN ..." >&2
    GOBIN="$BIN" GOFLAGS=-mod=mod go install "${TOOLS[$name]}"
done
