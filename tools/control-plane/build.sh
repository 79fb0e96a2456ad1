#!/usr/bin/env bash
# Builds the local control plane used by the integration tests:
#   kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes), etcd, kwok
# from the pinned Go modules in this directory (go.mod, etcd/go.mod, kwok/go.mod;
# versions in versions.env) with the ordinary Go toolchain.
#
# The binaries go to a cache directory outside the repo, keyed by the versions,
# the Go toolchain, the platform and a hash of the module files:
#   ${CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/control-plane}/<key>/bin/
# If they are already there this is a no-op. The last line on stdout is always the
# bin directory (progress goes to stderr), so callers can do:
#   bin=$(tools/control-plane/build.sh | tail -n1)
#
# Options: --force  rebuild even if the cache entry exists
#          --print  print the bin directory without building (exit 1 if not built)
#          --node   the real node's kubelet and kube-proxy instead (node/go.mod: the same
#                   k8s.io/kubernetes version), in a cache entry of their own
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

force=0 print_only=0 node=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --print) print_only=1 ;;
    --node) node=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null 2>&1 || { echo "build.sh: no Go toolchain in PATH" >&2; exit 1; }

log() { echo "[control-plane] $*" >&2; }

# Bump when the build recipe below changes (flags, ldflags, extra files) so that
# cached binaries built with the old recipe are not reused.
RECIPE=1

# Run in $here so that a GOTOOLCHAIN switch (go.mod's go line) is reflected.
read -r goversion goos goarch < <(cd "$here" && go env GOVERSION GOOS GOARCH | tr '\n' ' '; echo)
cache_root="${CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/control-plane}"
if (( node )); then
  mod_hash=$( (cd "$here" && echo "recipe=$RECIPE" && cat node/go.mod node/go.sum) | sha256sum | cut -c1-12)
  key="node-k8s-${KUBE_VERSION}_${goversion}_${goos}-${goarch}_${mod_hash}"
  binaries=(kubelet kube-proxy)
else
  mod_hash=$( (cd "$here" && echo "recipe=$RECIPE" && cat go.mod go.sum etcd/go.mod etcd/go.sum kwok/go.mod kwok/go.sum) \
    | sha256sum | cut -c1-12)
  key="k8s-${KUBE_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_${goversion}_${goos}-${goarch}_${mod_hash}"
  binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
fi
entry="$cache_root/$key"
bin="$entry/bin"

complete() {
  local b
  [[ -f "$bin/VERSIONS" ]] || return 1
  (( node )) || [[ -f "$bin/kwok-stages.yaml" ]] || return 1
  for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
}

if (( print_only )); then
  complete || { log "not built yet: $bin"; exit 1; }
  echo "$bin"; exit 0
fi
if (( ! force )) && complete; then
  echo "$bin"; exit 0
fi

mkdir -p "$cache_root"
# One builder at a time per cache entry (parallel test workers may call this).
exec 9>"$entry.lock"
flock 9
if (( ! force )) && complete; then
  echo "$bin"; exit 0
fi

tmp="$entry/bin.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

export CGO_ENABLED=0
# -mod=readonly: build exactly what go.mod/go.sum pin (fail instead of re-resolving).
# -buildvcs=false: the main modules live inside this repo's (dirty) git work tree.
export GOFLAGS="-mod=readonly -buildvcs=false"
common=(-trimpath)

kube_minor=${KUBE_VERSION#v1.}; kube_minor=${kube_minor%%.*}
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=${KUBE_VERSION} -X $pkg.gitMajor=1 -X $pkg.gitMinor=${kube_minor}"
  kube_ldflags+=" -X $pkg.gitTreeState=clean"
done

# finish LINES: the VERSIONS file (LINES are the extra versions of this build), the build
# moved into place, its bin directory printed
finish() {
  {
    echo "KUBE_VERSION=${KUBE_VERSION}"
    printf '%b' "$1"
    cat <<EOF
GO_VERSION=${goversion}
PLATFORM=${goos}/${goarch}
RECIPE=${RECIPE}
MODULES_SHA256_12=${mod_hash}
BUILT_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
BUILD_SECONDS=$(( $(date +%s) - start ))
EOF
  } > "$tmp/VERSIONS"
  rm -rf "$bin"
  mv "$tmp" "$bin"
  trap - EXIT
  log "built in $(( $(date +%s) - start ))s, $(du -sh "$bin" | cut -f1)"
  echo "$bin"
}

start=$(date +%s)
log "building into $entry ($(nproc) cores)"

if (( node )); then
  log "kubelet, kube-proxy (k8s.io/kubernetes ${KUBE_VERSION})"
  (cd "$here/node" && go build "${common[@]}" -ldflags "$kube_ldflags" -o "$tmp/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
  finish ""
  exit 0
fi

log "kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes ${KUBE_VERSION})"
(cd "$here" && go build "${common[@]}" -ldflags "$kube_ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler)

log "etcd (go.etcd.io/etcd/server/v3 ${ETCD_VERSION})"
(cd "$here/etcd" && go build "${common[@]}" -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)

log "kwok (sigs.k8s.io/kwok ${KWOK_VERSION})"
(cd "$here/kwok" && go build "${common[@]}" \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" \
  -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)

# The kwok binary has no built-in Stages (kwokctl normally writes them into the
# config it passes with --config). Export the same defaults kwokctl uses
# (pkg/kwokctl/runtime/cluster.go: node fast + heartbeat-with-lease, pod fast)
# from the pinned kwok module, for `kwok --config "$bin/kwok-stages.yaml"`.
kwok_dir=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
{
  echo "# Default kwok Stages from sigs.k8s.io/kwok@${KWOK_VERSION} (as kwokctl uses them)."
  first=1
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    (( first )) || echo "---"
    first=0
    cat "$kwok_dir/kustomize/stage/$f"
  done
} > "$tmp/kwok-stages.yaml"

finish "ETCD_VERSION=${ETCD_VERSION}
KWOK_VERSION=${KWOK_VERSION}
"
