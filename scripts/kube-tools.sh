#!/usr/bin/env bash
# A real Kubernetes cluster for the tests: kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and
# kubelet built from k8s.io/kubernetes (Go module proxy) and cached in $CHUNKPILOT_CACHE/kube/$VERSION (default
# ~/.cache/chunkpilot/kube/v1.34.4), never in the repository; etcd, containerd, runc and the CNI plugins from Debian
# (scripts/system-deps.sh). Only the binaries missing from the cache are built.
#
# k8s.io/kubernetes is not meant to be imported: its go.mod points every staging module (k8s.io/api, client-go, ...)
# at ./staging. A throwaway module requires it and replaces each of those with the published v0.$MINOR.$PATCH
# release; main.go is upstream's cmd/<binary> main. A cold build takes 6-10 min on 2 cores, ~2 GB of memory and
# ~4 GB of temporary disk (module and build caches of its own, deleted afterwards); later runs are instant.
set -euo pipefail
VERSION=${CHUNKPILOT_KUBE_VERSION:-v1.34.4}
OUT="${CHUNKPILOT_CACHE:-$HOME/.cache/chunkpilot}/kube/$VERSION"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet)
missing=()
for bin in "${BINARIES[@]}"; do [ -x "$OUT/$bin" ] || missing+=("$bin"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v go >/dev/null 2>&1; then
    echo "warning: go is not installed, so kube-apiserver cannot be built (API-server tests skip locally, fail in" \
         "CI); install Go >= 1.24 (https://go.dev/doc/install) and rerun scripts/kube-tools.sh" >&2
    exit 0
fi
STAGING_VERSION="v0.${VERSION#v1.}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/chunkpilot-kube-build.XXXXXX")
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
export GOMODCACHE="$WORK/mod" GOCACHE="$WORK/cache" GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
echo "building ${missing[*]} $VERSION into $OUT (one-time, 6-10 min each) ..." >&2
cd "$WORK"
for bin in "${missing[@]}"; do mkdir -p "src/cmd/$bin"; done
cd src
go mod init chunkpilot.local/kube-build >/dev/null 2>&1
# The staging modules are exactly the replace directives of k8s.io/kubernetes's own go.mod that point into ./staging.
gomod=$(go mod download -json "k8s.io/kubernetes@$VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$gomod" ] || { echo "error: could not download k8s.io/kubernetes@$VERSION's go.mod" >&2; exit 1; }
go mod edit -require="k8s.io/kubernetes@$VERSION"
for mod in $(sed -n 's#^[[:space:]]*\(k8s.io/[^[:space:]]*\) => ./staging/.*#\1#p' "$gomod"); do
    case "$mod" in k8s.io/sample-cli-plugin|k8s.io/sample-controller) continue ;; esac  # not published, not needed
    go mod edit -replace="$mod=$mod@$STAGING_VERSION"
done
for bin in "${missing[@]}"; do
    case "$bin" in
        kube-apiserver) ctor="app.NewAPIServerCommand()" ;;
        kube-controller-manager) ctor="app.NewControllerManagerCommand()" ;;
        kube-scheduler) ctor="app.NewSchedulerCommand()" ;;
        kube-proxy) ctor="app.NewProxyCommand()" ;;
        kubelet) ctor="app.NewKubeletCommand(context.Background())" ;;
    esac
    imports='"os"'
    [ "$bin" = kubelet ] && imports='"context"
	"os"'
    cat > "cmd/$bin/main.go" <<GO
// Upstream's cmd/$bin main, built against the published staging modules.
package main

import (
	$imports
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/$bin/app"
)

func main() {
	os.Exit(cli.Run($ctor))
}
GO
done
go mod tidy >/dev/null
minor=${VERSION#v1.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
mkdir -p "$OUT.tmp"
pkgs=(); for bin in "${missing[@]}"; do pkgs+=("./cmd/$bin"); done
go build -p 2 -trimpath -ldflags "$ldflags" -o "$OUT.tmp/" "${pkgs[@]}"
for bin in "${missing[@]}"; do "$OUT.tmp/$bin" --version; done
mkdir -p "$OUT" && mv "$OUT.tmp"/* "$OUT/" && rmdir "$OUT.tmp"
echo "built ${missing[*]} in $OUT" >&2
