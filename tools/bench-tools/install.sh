#!/usr/bin/env bash
# Installs the load tools that `make bench` drives:
#   wrk   closed-loop HTTP load (paced with bench/load/pings.lua for the soak), from Debian's
#         package (tools/debian-packages.sh, as root)
#   oha   fixed-rate HTTP load, at the version pinned in versions.env, built with
#         `cargo install oha --locked` into a cache directory outside the repo:
#         ${BENCH_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager}/oha/<version>/bin/
#   nats  the NATS CLI, for `nats bench` (the jobs benchmark's JetStream floor), at the
#         version pinned in versions.env, built with `go install` from the Go module proxy
#         into .../natscli/<version>/bin/ beside oha; Go's own build and module caches are
#         reused, so a rebuild or a new version compiles only what changed
# (pgbench comes with the embedded PostgreSQL's binaries.) A build already in the cache is
# reused. On two cores the first oha takes about four minutes; the first nats about 90 s
# from an empty Go build cache (86 s and 92 s, another build sharing the cores), 4 s with
# --force from a warm one. The last line on stdout is a PATH prefix holding the built
# tools (progress goes to stderr):
#   export PATH="$(tools/bench-tools/install.sh | tail -n1):$PATH"
# Options: --print  print that prefix without installing (exit 1 if a tool is missing)
#          --force  rebuild even if the cache holds the tool
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

force=0 print_only=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --print) print_only=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

log() { echo "[bench-tools] $*" >&2; }
cache_root="${BENCH_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager}"
oha_dir="$cache_root/oha/$OHA_VERSION"
nats_dir="$cache_root/natscli/$NATSCLI_VERSION"

if (( print_only )); then
  ok=1
  [[ -x "$oha_dir/bin/oha" ]] || { log "not installed: $oha_dir/bin/oha"; ok=0; }
  [[ -x "$nats_dir/bin/nats" ]] || { log "not installed: $nats_dir/bin/nats"; ok=0; }
  command -v wrk >/dev/null 2>&1 || { log "not installed: wrk (Debian package wrk)"; ok=0; }
  (( ok )) || exit 1
  echo "$oha_dir/bin:$nats_dir/bin"; exit 0
fi

# build DIR BINARY COMMAND...: run COMMAND (which installs into DIR.tmp) unless DIR holds
# BINARY already; one builder at a time per tool
build() {
  local dir=$1 binary=$2; shift 2
  if (( ! force )) && [[ -x "$dir/bin/$binary" ]]; then return 0; fi
  mkdir -p "$(dirname "$dir")"
  exec 9>"$dir.lock"
  flock 9
  if (( ! force )) && [[ -x "$dir/bin/$binary" ]]; then exec 9>&-; return 0; fi
  local start tmp="$dir.tmp.$$"
  start=$(date +%s)
  rm -rf "$tmp"
  mkdir -p "$tmp/bin"
  log "building $binary into $dir"
  TMP_DIR=$tmp "$@"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  exec 9>&-
  log "$binary built in $(( $(date +%s) - start ))s"
}

cargo=$(command -v cargo || true)
[[ -n "$cargo" || ! -x "$HOME/.cargo/bin/cargo" ]] || cargo="$HOME/.cargo/bin/cargo"

install_oha() {
  [[ -n "$cargo" ]] || { log "no cargo (Rust, https://rustup.rs) to build oha $OHA_VERSION"; exit 1; }
  "$cargo" install oha --version "$OHA_VERSION" --locked --root "$TMP_DIR" --quiet
}

go=$(command -v go || true)
[[ -n "$go" || ! -x /usr/local/go/bin/go ]] || go=/usr/local/go/bin/go

# `go install module@version` builds with the module's own go.mod and go.sum (what
# `cargo install --locked` is for oha); GOBIN puts the binary in the new directory, the
# build cache (go env GOCACHE) and module cache (go env GOMODCACHE) are Go's usual ones
install_nats() {
  [[ -n "$go" ]] || { log "no go (https://go.dev/dl) to build natscli $NATSCLI_VERSION"; exit 1; }
  GOBIN="$TMP_DIR/bin" "$go" install "github.com/nats-io/natscli/nats@$NATSCLI_VERSION"
}

"$here/../debian-packages.sh" wrk
build "$oha_dir" oha install_oha
build "$nats_dir" nats install_nats
echo "$oha_dir/bin:$nats_dir/bin"
