#!/usr/bin/env bash
# Debian packages the tests use: prometheus (the server and promtool), etcd-server (the store of the real
# kube-apiserver the operator and tuner tests run against), postgresql (the tuner's external study storage), and for
# the local cluster's node (tests/local_cluster.py): containerd, runc, the CNI plugins, iptables (kube-proxy, the
# CNI bridge), ipset (the NetworkPolicy enforcer's address sets), catatonit (the pause image) and mmdebstrap (the
# engine image, scripts/image.sh engine). Installed with apt when running as root;
# otherwise says what to run (tests then skip locally, and fail under CI=true, where tools must be present).
set -euo pipefail
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the test API server's service-account key
# Debian keeps PostgreSQL's server binaries off PATH, in /usr/lib/postgresql/<version>/bin
command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
command -v containerd >/dev/null 2>&1 || missing+=(containerd)
command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || missing+=(runc)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
command -v ipset >/dev/null 2>&1 || [ -x /usr/sbin/ipset ] || missing+=(ipset)
command -v catatonit >/dev/null 2>&1 || missing+=(catatonit)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian packages: ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "warning: missing ${missing[*]}; install with: sudo apt-get install ${missing[*]}" >&2
fi
