#!/usr/bin/env bash
# The manifest scan of `make lint`: renders each kustomization with `kubectl kustomize` (what
# `kubectl apply -k` sends) and runs checkov, configured by .checkov.yaml, on the result.
# Fails on any failed check that .checkov.yaml does not skip with its reason.
#   tools/checkov/scan.sh [KUSTOMIZATION_FOLDER...]   (default: every one under k8s/)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
checkov="${CHECKOV:-$root/.venv/tools/checkov/bin/checkov}"
kubectl="${KUBECTL:-kubectl}"

if [ ! -x "$checkov" ]; then
  echo "scan: $checkov not found (make checkov builds it)" >&2
  exit 2
fi
if ! command -v "$kubectl" >/dev/null 2>&1; then
  echo "scan: kubectl not found (Debian: kubernetes-client); it renders the kustomizations" >&2
  exit 2
fi

folders=("$@")
if [ ${#folders[@]} -eq 0 ]; then
  while IFS= read -r found; do
    folders+=("$(dirname "$found")")
  done < <(cd "$root" && find k8s -name kustomization.yaml | sort)
fi

rendered="$(mktemp -d)"
trap 'rm -rf "$rendered"' EXIT
for folder in "${folders[@]}"; do
  relative="${folder#"$root"/}"
  name="$(printf '%s' "${relative%/}" | tr '/' '_')"
  (cd "$root" && "$kubectl" kustomize "$folder") >"$rendered/$name.yaml"
done
echo "scan: checkov $("$checkov" --version) on ${folders[*]}"
exec "$checkov" --config-file "$root/.checkov.yaml" --directory "$rendered"
