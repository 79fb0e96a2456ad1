#!/usr/bin/env bash
# The cold path of `make test`'s set-up, measured: what a fresh machine goes through before
# the first test runs. Run it before resolving any change to tools/, the Makefile, the
# Dockerfile or the dependencies (this machine's own caches hide that path).
#
# A copy of this work tree (tracked and untracked files, not ignored ones) in a temporary
# folder, with a temporary HOME: empty build caches (control plane, kubelet, Go build cache,
# buildah's image store, base rootfs, virtualenvs). Downloads are reused: Go's module cache
# and pip's cache stay this machine's. Then:
#   1. cold:   make install test-deps control-plane image   (everything built)
#   2. warm:   the same again; must reuse every built artefact (nothing under the control
#              plane's cache or the base tarball rewritten, the base image taken from the store)
#   3. tarball only: the base image dropped from the image store, its rootfs tarball kept
#              (a machine that has the one but not the other), then `make image`
# and prints the three times. Exit 0 only if all three succeeded and the warm run reused.
# The make logs go to build/cold-path/. Needs root (the image build).
#
#   tools/cold-path.sh [--keep]    --keep: leave the temporary folder (logs, caches) in place
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
keep=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "cold-path.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

log() { echo "[cold-path] $*" >&2; }
die() { echo "[cold-path] error: $*" >&2; exit 1; }

(( EUID == 0 )) || die "needs root (tools/image/build.sh)"
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null 2>&1 || die "no Go toolchain"
# the downloads this machine already has, reused
gomodcache=$(go env GOMODCACHE)
pipcache=$(python3 -m pip cache dir 2>/dev/null) || pipcache="${XDG_CACHE_HOME:-$HOME/.cache}/pip"

logs="$repo/build/cold-path"
mkdir -p "$logs"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/wm-cold-path.XXXXXX")
home="$scratch/home"
tree="$scratch/repo"
cleanup() {
  if (( keep )); then
    log "kept $scratch"
    return
  fi
  # buildah's overlay storage may leave mounts below the temporary home: never follow them
  local mounts
  mounts=$(findmnt -rno TARGET)
  while IFS= read -r m; do
    if [[ "$m" == "$scratch"/* ]]; then umount -l "$m" 2>/dev/null || true; fi
  done <<<"$mounts"
  rm -rf --one-file-system "$scratch" 2>/dev/null || log "could not remove all of $scratch"
}
trap cleanup EXIT
mkdir -p "$home" "$tree"

# the work tree as it is, without .venv, build/ or anything else git ignores
git -C "$repo" ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [[ -e "$repo/$f" || -L "$repo/$f" ]] && printf '%s\0' "$f"; done \
  | tar -C "$repo" --null -T - -cf - | tar -C "$tree" -xf -

cache="$home/.cache"
steps=(install test-deps control-plane image)
in_tree() {
  (cd "$tree" && env -u IMAGE_CACHE -u IMAGE_OUT -u CONTROL_PLANE_CACHE -u VIRTUAL_ENV \
    HOME="$home" XDG_CACHE_HOME="$cache" GOCACHE="$cache/go-build" \
    GOMODCACHE="$gomodcache" GOPATH="$home/go" PIP_CACHE_DIR="$pipcache" "$@")
}
timed() {
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  log "$name: $* (log: $logs/$name.log)"
  in_tree "$@" >"$logs/$name.log" 2>&1 || rc=$?
  if (( rc != 0 )); then
    tail -n 40 "$logs/$name.log" >&2
    die "$name failed (exit $rc); its log is $logs/$name.log"
  fi
  echo $(( $(date +%s) - t0 ))
}

cold=$(timed cold make "${steps[@]}")
marker="$scratch/after-cold"
touch "$marker"
warm=$(timed warm make "${steps[@]}")

# the warm run reused what the cold one built
rebuilt=$(find "$cache/workload-manager/control-plane" "$cache/workload-manager/image/base" \
  -type f -newer "$marker" -not -name '*.lock' -not -name lock)
[[ -z "$rebuilt" ]] || die "the warm run rebuilt: $rebuilt"
warm_log=$(<"$logs/warm.log")
[[ "$warm_log" == *"[image] base localhost/python:3.11-slim-bookworm: cached"* ]] \
  || die "the warm run did not take the base image from the store (see $logs/warm.log)"

# a machine with the base rootfs tarball cached but not the base image in its store
in_tree buildah --root "$cache/workload-manager/image/storage-overlay" \
  --runroot "$cache/workload-manager/image/run-overlay" --storage-driver overlay rmi --force \
  localhost/python:3.11-slim-bookworm >/dev/null
tarball_only=$(timed tarball-only make image)
tarball_log=$(<"$logs/tarball-only.log")
[[ "$tarball_log" == *"[image] base: rootfs tarball cached"* ]] \
  || die "the tarball-only run did not import the cached tarball (see $logs/tarball-only.log)"

printf '%s\n' \
  "cold path of make test's set-up (make ${steps[*]}), $(nproc) cores:" \
  "  cold (empty build caches; Go modules and pip downloads reused): ${cold} s" \
  "  warm (everything reused):                                       ${warm} s" \
  "  base tarball cached, base image not in the store (make image):  ${tarball_only} s"
