#!/usr/bin/env bash
# What the local cluster needs beyond Kubernetes itself (scripts/kube-tools.sh) to be a cluster a Helm chart can be
# installed into as on a real one, built once from Go modules (the Go module proxy) into $CHUNKPILOT_CACHE/bin and
# never in the repository:
#   coredns                   cluster DNS (the kubernetes plugin): pods resolve <service>.<namespace>.svc. Built
#                             with the plugins a cluster's Corefile uses only, by CoreDNS's documented way of
#                             choosing plugins at compile time (a main that sets dnsserver.Directives), which
#                             leaves out the cloud DNS providers (half the build);
#   prometheus-operator       the Prometheus Operator, and the config reloader its Prometheus pods run; their
#   prometheus-config-reloader  module's go.mod replaces two of its own submodules by relative paths, so `go install
#                             module@version` refuses it: the module is copied and those two point at their
#                             published versions instead. Its CRDs and example RBAC are copied next to them
#                             ($CHUNKPILOT_CACHE/prometheus-operator/$PO_VERSION/{crds,rbac}).
#   kube-router               the test node's NetworkPolicy enforcer, its firewall controller alone (iptables and
#                             ipset; kube-network-policies needs nftables' queue statement, which this kernel lacks).
#                             Version 2.1.0 is the one the module proxy serves, and security flaws are reported for
#                             it: it runs only as the test cluster's enforcer, on loopback-bound test nodes, and is
#                             never shipped or recommended (docs/testing.md).
# A cold build takes ~10 min on 2 cores; later runs are instant.
set -euo pipefail
CACHE="${CHUNKPILOT_CACHE:-$HOME/.cache/chunkpilot}"
BIN="$CACHE/bin"
COREDNS_VERSION=v1.14.7
PO_VERSION=v0.85.0
PO_DIR="$CACHE/prometheus-operator/$PO_VERSION"
KUBE_ROUTER_VERSION=v2.1.0
mkdir -p "$BIN"
if ! command -v go >/dev/null 2>&1; then
    echo "warning: go is not installed, so coredns and prometheus-operator cannot be built (the Helm install tests" \
         "skip locally, fail in CI); install Go >= 1.24 and rerun scripts/cluster-tools.sh" >&2
    exit 0
fi
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

if [ ! -x "$BIN/coredns" ]; then
    echo "building coredns $COREDNS_VERSION into $BIN (one-time, a few minutes) ..." >&2
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/chunkpilot-coredns.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    cd "$WORK"
    go mod init chunkpilot.local/coredns >/dev/null 2>&1
    cat > main.go <<'GO'
// CoreDNS with the plugins of a cluster's usual Corefile only (CoreDNS's compile-time plugin selection).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order of plugin.cfg: a query passes them in this order.
func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "loop", "forward"}
}

func main() { coremain.Run() }
GO
    go get "github.com/coredns/coredns@$COREDNS_VERSION" >/dev/null 2>&1
    go mod tidy >/dev/null
    go build -p 2 -trimpath -ldflags "-s -w" -o "$BIN/coredns.tmp" . && mv "$BIN/coredns.tmp" "$BIN/coredns"
    cd / && rm -rf "$WORK" && trap - EXIT
fi

if [ ! -x "$BIN/prometheus-operator" ] || [ ! -x "$BIN/prometheus-config-reloader" ] || [ ! -d "$PO_DIR/crds" ] || [ ! -d "$PO_DIR/rbac" ]; then
    echo "building prometheus-operator $PO_VERSION into $BIN (one-time, a few minutes) ..." >&2
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/chunkpilot-po.XXXXXX")
    trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
    mod=github.com/prometheus-operator/prometheus-operator
    dir=$(go mod download -json "$mod@$PO_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    [ -d "$dir" ] || { echo "error: could not download $mod@$PO_VERSION" >&2; exit 1; }
    cp -r "$dir" "$WORK/src" && chmod -R u+w "$WORK/src"
    cd "$WORK/src"
    for sub in pkg/apis/monitoring pkg/client; do
        go mod edit -replace="$mod/$sub=$mod/$sub@$PO_VERSION"
    done
    go mod tidy >/dev/null 2>&1 || true
    ldflags="-s -w -X github.com/prometheus/common/version.Version=${PO_VERSION#v}"
    go build -p 2 -trimpath -ldflags "$ldflags" -o "$WORK/out/" ./cmd/operator ./cmd/prometheus-config-reloader
    mkdir -p "$PO_DIR"
    rm -rf "$PO_DIR/crds" "$PO_DIR/rbac" && cp -r example/rbac "$PO_DIR/rbac"  # upstream's ClusterRoles
    cp -r example/prometheus-operator-crd "$PO_DIR/crds"
    mv "$WORK/out/operator" "$BIN/prometheus-operator"
    mv "$WORK/out/prometheus-config-reloader" "$BIN/prometheus-config-reloader"
    cd / && chmod -R u+w "$WORK"; rm -rf "$WORK"; trap - EXIT
fi

if [ ! -x "$BIN/kube-router" ]; then
    echo "building kube-router $KUBE_ROUTER_VERSION into $BIN (one-time, ~5 min) ..." >&2
    GOBIN="$BIN" go install -trimpath \
        -ldflags "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
        "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
fi
