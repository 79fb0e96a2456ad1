#!/usr/bin/env bash
# Fetches the upstream CustomResourceDefinitions that k8s/monitoring/ needs
# (monitoring.coreos.com ServiceMonitor and PrometheusRule) from the pinned
# github.com/prometheus-operator/prometheus-operator module (versions.env), through the
# Go module proxy with its checksum database, into a cache directory keyed by the version:
#   ${CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/control-plane}/crds-prometheus-operator-<version>/
# A no-op when present. The last line on stdout is that directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null 2>&1 || { echo "crds.sh: no Go toolchain in PATH" >&2; exit 1; }

cache_root="${CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/control-plane}"
entry="$cache_root/crds-prometheus-operator-${PROMETHEUS_OPERATOR_VERSION}"
wanted=(monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml)

complete() {
  local f
  for f in "${wanted[@]}"; do [[ -s "$entry/$f" ]] || return 1; done
}
if complete; then echo "$entry"; exit 0; fi

module=github.com/prometheus-operator/prometheus-operator
# outside any module, so that no go.mod of ours is consulted or changed
dir=$(cd "$(mktemp -d)" && GOFLAGS=-mod=mod go mod download -json "$module@${PROMETHEUS_OPERATOR_VERSION}" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -n "$dir" && -d "$dir/example/prometheus-operator-crd" ]] || {
  echo "crds.sh: $module@${PROMETHEUS_OPERATOR_VERSION} has no example/prometheus-operator-crd" >&2; exit 1; }
mkdir -p "$entry.tmp.$$"
for f in "${wanted[@]}"; do cp "$dir/example/prometheus-operator-crd/$f" "$entry.tmp.$$/"; done
rm -rf "$entry"
mv "$entry.tmp.$$" "$entry"
echo "[control-plane] CRDs from $module@${PROMETHEUS_OPERATOR_VERSION} in $entry" >&2
echo "$entry"
