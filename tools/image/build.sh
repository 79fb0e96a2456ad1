#!/usr/bin/env bash
# Builds the OCI images without a registry, with buildah (chroot isolation) in a storage
# of its own, and writes each one as an OCI archive (oci-archive, the tag as ref name):
#   base     localhost/python:3.11-slim-bookworm: the python:3.11-slim-bookworm equivalent,
#            made here from Debian's packages (debootstrap --variant=minbase bookworm plus
#            base-packages.txt, security updates, docs and apt lists stripped); cached in
#            the storage and as a rootfs tarball, keyed by a hash of the recipe
#   manager  ghcr.io/node-system/workload-manager:$VERSION from the Dockerfile
#            (buildah bud --build-arg BASE=localhost/python:3.11-slim-bookworm), checked
#            with `workload-manager --version` inside it
#            -> build/image/workload-manager-$VERSION.oci.tar
#   helpers  (--helpers) for a real kubelet test node: localhost/pause:3.10 (pause/main.go,
#            static) -> build/image/pause-3.10.oci.tar, and localhost/pinger:1 (busybox
#            + pinger/pinger.sh, the manager's health ping) -> build/image/pinger-1.oci.tar
# The last line on stdout is the manager's archive (with --helpers alone: the output
# directory); progress and the other archives go to stderr, so callers can do:
#   archive=$(tools/image/build.sh | tail -n1)
#
# Options: --version V      the manager's version (default: $VERSION, else pyproject.toml's);
#                           another one builds the same code from a copy of the build
#                           context whose pyproject.toml says V
#          --never-ready V  also ghcr.io/node-system/workload-manager:V: the manager image
#                           whose entrypoint never serves (sleeps whatever its args, uid
#                           10001) -> build/image/workload-manager-V.oci.tar
#          --helpers        the pause and pinger images only
#          --all            base + manager + helpers
#          --rebuild-base   debootstrap the base again (e.g. for newer security updates)
#          --no-cache       build the manager without buildah's layer cache
# Storage and cache: ${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/image}
# (storage-overlay/ and run-overlay/ are buildah's --root and --runroot, with
# IMAGE_STORAGE_DRIVER=vfs storage-vfs/...; base/ the rootfs tarballs), so look with
#   buildah --root <cache>/storage-overlay --runroot <cache>/run-overlay images
# Archives go to ${IMAGE_OUT:-build/image}. Needs root, buildah, debootstrap, flock,
# busybox-static and Go (for --helpers). One run at a time (a lock in the cache dir).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

IMAGE_REPO=ghcr.io/node-system/workload-manager
BASE_IMAGE=localhost/python:3.11-slim-bookworm
PAUSE_IMAGE=localhost/pause:3.10
PINGER_IMAGE=localhost/pinger:1
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# Bump when the base recipe changes in a way the hash below does not see.
BASE_RECIPE=1

version=${VERSION:-} never_ready="" manager=1 helpers=0 rebuild_base=0 no_cache=0
while (( $# )); do
  case "$1" in
    --version) version=${2:?--version needs a value}; shift ;;
    --version=*) version=${1#*=} ;;
    --never-ready) never_ready=${2:?--never-ready needs a value}; shift ;;
    --never-ready=*) never_ready=${1#*=} ;;
    --helpers) helpers=1 manager=0 ;;
    --all) helpers=1 manager=1 ;;
    --rebuild-base) rebuild_base=1 ;;
    --no-cache) no_cache=1 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

log() { echo "[image] $*" >&2; }
die() { echo "[image] error: $*" >&2; exit 1; }

project_version=$(sed -n '/^version = "\(.*\)"$/{s//\1/p;q;}' "$repo/pyproject.toml")
[[ -n "$project_version" ]] || die "no version = \"...\" line in pyproject.toml"
version=${version:-$project_version}
# A PEP 440 public version, as pip prints it back, that is also a valid image tag.
version_re='^[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?$'
for v in "$version" ${never_ready:+"$never_ready"}; do
  [[ "$v" =~ $version_re ]] || die "version '$v' is not of the form 1.2.3[rc1][.post1][.dev1]"
done
if [[ -n "$never_ready" ]]; then
  (( manager )) || die "--never-ready needs the manager image (not with --helpers alone)"
  [[ "$never_ready" != "$version" ]] || die "--never-ready $never_ready is the manager's own version"
fi

(( EUID == 0 )) || die "needs root (debootstrap, buildah's chroot isolation)"
for tool in buildah flock tar sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found"
done

cache=${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/workload-manager/image}
out=${IMAGE_OUT:-$repo/build/image}
mkdir -p "$cache/base" "$out"
out=$(cd "$out" && pwd)

export BUILDAH_ISOLATION=chroot
# overlay (kernel overlayfs) on the cache's filesystem; IMAGE_STORAGE_DRIVER=vfs otherwise.
# A storage keeps the driver it was created with: a change starts a storage of its own.
driver=${IMAGE_STORAGE_DRIVER:-overlay}
storage="$cache/storage-$driver"
bh() {
  buildah --root "$storage" --runroot "$cache/run-$driver" --storage-driver "$driver" "$@"
}

exec 9>"$cache/lock"
if ! flock -n 9; then
  log "another build holds $cache/lock: waiting"
  flock 9
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/wm-image.XXXXXX")
containers=()
cleanup() {
  local c
  for c in "${containers[@]}"; do bh rm "$c" >/dev/null 2>&1 || true; done
  # debootstrap mounts proc and sys inside the rootfs; never follow them when removing
  if [[ -d "$work/rootfs" ]]; then
    umount -R "$work/rootfs/proc" "$work/rootfs/sys" 2>/dev/null || true
    [[ $'\n'"$(findmnt -rno TARGET)" != *$'\n'"$work/"* ]] || { log "still mounted under $work: left in place"; return; }
  fi
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# A working container of its own (removed at exit even if the build fails).
new_container() {
  local c
  c=$(bh from --pull=never --name "wm-image-$$-${#containers[@]}" "$1")
  containers+=("$c")
  echo "$c"
}
done_container() {
  local c=$1 i
  for i in "${!containers[@]}"; do [[ "${containers[$i]}" != "$c" ]] || unset 'containers[i]'; done
}

# image -> oci-archive (the image name as ref name), written atomically
push_archive() {
  local image=$1 archive=$2
  rm -f "$archive.tmp"
  bh push --quiet "$image" "oci-archive:$archive.tmp:$image" >&2
  mv -f "$archive.tmp" "$archive"
  log "$image -> $archive ($(du -h "$archive" | cut -f1))"
}

seconds() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(seconds)" 'BEGIN { printf "%.1fs", b - a }'; }

# --- base ---------------------------------------------------------------------------

arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)

# The packages, one line, comma-separated.
base_packages() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$here/base-packages.txt" | xargs | tr ' ' ,; }

# debootstrap + updates + slimming into $1 (as root, on the host).
make_base_rootfs() {
  local rootfs=$1
  debootstrap --variant=minbase --components=main --include="$(base_packages)" \
    "$SUITE" "$rootfs" "$MIRROR" >&2
  # the sources of the official Debian image, then the security and point updates
  rm -f "$rootfs/etc/apt/sources.list"
  cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # what debian:bookworm-slim keeps out of later apt-get installs as well
  cat > "$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
EOF
  cat > "$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  printf 'APT::Install-Recommends "false";\n' > "$rootfs/etc/apt/apt.conf.d/docker-no-recommends"
  printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  cp -f /etc/resolv.conf "$rootfs/etc/resolv.conf"
  mount -t proc proc "$rootfs/proc"
  local rc=0
  (
    export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
    if [[ "$MIRROR" != http://deb.debian.org/debian || "$SECURITY_MIRROR" != http://deb.debian.org/debian-security ]]; then
      sed -i -e "s|http://deb.debian.org/debian-security|$SECURITY_MIRROR|" \
        -e "s|http://deb.debian.org/debian\$|$MIRROR|" "$rootfs/etc/apt/sources.list.d/debian.sources"
    fi
    chroot "$rootfs" apt-get -q update >&2
    chroot "$rootfs" apt-get -q -y -o Dpkg::Options::=--force-confold dist-upgrade >&2
    chroot "$rootfs" apt-get -q -y autoremove --purge >&2
    chroot "$rootfs" apt-get clean
    if [[ "$MIRROR" != http://deb.debian.org/debian || "$SECURITY_MIRROR" != http://deb.debian.org/debian-security ]]; then
      sed -i -e "s|$SECURITY_MIRROR|http://deb.debian.org/debian-security|" \
        -e "s|$MIRROR\$|http://deb.debian.org/debian|" "$rootfs/etc/apt/sources.list.d/debian.sources"
    fi
  ) || rc=$?
  umount "$rootfs/proc"
  (( rc == 0 )) || return "$rc"
  rm -f "$rootfs/usr/sbin/policy-rc.d"
  # slim: what the dpkg excludes above would have kept out, apt lists, caches, logs
  find "$rootfs/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,linda}/* \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/var/lib/dpkg/*-old "$rootfs"/var/cache/ldconfig/aux-cache "$rootfs"/tmp/* \
    "$rootfs"/var/tmp/* "$rootfs"/root/.bash_history
  find "$rootfs/var/log" -type f -delete
  # host-specific files: a container runtime provides them
  rm -f "$rootfs"/etc/{resolv.conf,hostname,hosts}
  : > "$rootfs/etc/machine-id"
  # device nodes debootstrap made: /dev is the runtime's
  find "$rootfs/dev" -mindepth 1 -delete
}

base_key() {
  { echo "recipe=$BASE_RECIPE suite=$SUITE arch=$arch"; base_packages; declare -f make_base_rootfs; } \
    | sha256sum | cut -c1-16
}

build_base() {
  local key tarball have t0 rootfs pyver c
  key=$(base_key)
  tarball="$cache/base/python-3.11-slim-$SUITE-$arch-$key.tar"
  if (( rebuild_base )); then
    rm -f "$tarball"
  else
    have=$(bh inspect --type image --format '{{index .OCIv1.Config.Labels "io.workload-manager.base-key"}}' \
      "$BASE_IMAGE" 2>/dev/null || true)
    if [[ "$have" == "$key" ]]; then
      log "base $BASE_IMAGE: cached (key $key)"
      return
    fi
  fi
  t0=$(seconds)
  if [[ ! -s "$tarball" ]]; then
    command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found (apt-get install debootstrap)"
    log "base: debootstrap $SUITE ($arch) from $MIRROR with $(base_packages)"
    rootfs="$work/rootfs"
    make_base_rootfs "$rootfs"
    tar --numeric-owner --xattrs --xattrs-include='*' --acls -C "$rootfs" -cf "$tarball.tmp" .
    rm -rf --one-file-system "$rootfs"
    mv -f "$tarball.tmp" "$tarball"
    # older tarballs are of other recipes
    find "$cache/base" -name 'python-3.11-slim-*.tar' -not -name "${tarball##*/}" -delete
    log "base: rootfs tarball $tarball ($(du -h "$tarball" | cut -f1)) in $(took "$t0")"
  else
    log "base: rootfs tarball cached: $tarball"
  fi
  # awk reads to the end: a reader that stops early kills tar with SIGPIPE (pipefail)
  pyver=$(tar -xOf "$tarball" ./var/lib/dpkg/status \
    | awk '/^Package: python3.11-minimal$/ { p = 1 } p && /^Version:/ && v == "" { v = $2 } END { print v }')
  c=$(new_container scratch)
  bh add "$c" "$tarball" / >&2
  bh config --os linux --arch "$arch" \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --env PYTHON_VERSION="${pyver%%-*}" \
    --cmd '["python3"]' \
    --label io.workload-manager.base-key="$key" \
    --label org.opencontainers.image.title="python:3.11-slim-$SUITE (local, Debian python3 $pyver)" \
    --created-by "tools/image/build.sh: debootstrap --variant=minbase $SUITE + $(base_packages)" \
    "$c" >&2
  bh commit --quiet --rm "$c" "$BASE_IMAGE" >/dev/null
  done_container "$c"
  log "base $BASE_IMAGE: imported (key $key, python3.11 $pyver) in $(took "$t0")"
}

# --- manager ------------------------------------------------------------------------

# The build context: the repository, or for another version a copy of its files
# (tracked and untracked, not ignored) whose pyproject.toml says that version.
build_context() {
  if [[ "$version" == "$project_version" ]]; then
    echo "$repo"
    return
  fi
  local ctx="$work/context" f
  mkdir -p "$ctx"
  if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$repo" ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do [[ -e "$repo/$f" || -L "$repo/$f" ]] && printf '%s\0' "$f"; done \
      | tar -C "$repo" --null -T - -cf - | tar -C "$ctx" -xf -
  else
    tar -C "$repo" --exclude-vcs --exclude=./.venv --exclude=./build -cf - . | tar -C "$ctx" -xf -
  fi
  sed -i "0,/^version = \".*\"\$/s//version = \"$version\"/" "$ctx/pyproject.toml"
  grep -qx "version = \"$version\"" "$ctx/pyproject.toml" || die "could not set the version in the copy of pyproject.toml"
  log "manager: context $ctx (a copy, pyproject.toml version $project_version -> $version)"
  echo "$ctx"
}

build_manager() {
  local ctx image="$IMAGE_REPO:$version" t0 args=() ca
  ctx=$(build_context)
  # pip inside the build trusts the host's CA bundle (a TLS-inspecting proxy's CA, say):
  # it is mounted over the base's bundle for the RUN steps only, not committed.
  ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
  if [[ -s "$ca" ]]; then
    args+=(--volume "$(readlink -f "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")
  fi
  (( no_cache )) && args+=(--no-cache) || args+=(--layers)
  t0=$(seconds)
  log "manager: buildah bud $image (BASE=$BASE_IMAGE)"
  bh bud --isolation chroot --pull=never --format oci \
    --build-arg BASE="$BASE_IMAGE" "${args[@]}" \
    -f "$ctx/Dockerfile" -t "$image" "$ctx" 2>&1 | tee "$work/bud.log" >&2
  log "manager: built $image in $(took "$t0")"
  prune_layer_cache "$work/bud.log"
  verify_manager "$image" "$version"
  push_archive "$image" "$out/workload-manager-$version.oci.tar"
}

# The layer cache keeps every untagged image; drop those of earlier builds: the untagged
# images without children except the last layer of each stage (the build stage's pip
# install, say) of the latest build of each version still tagged, which a next build of
# that version reuses. Those are listed in $cache/layer-cache-$driver.keep.
prune_layer_cache() {
  local log=$1 keepfile="$cache/layer-cache-$driver.keep" ids keep="" v rest id k stale=()
  # the "--> <id>" just before each "[N/M] STEP 1/..." line ends the previous stage
  ids=$(awk '/^\[[0-9]+\/[0-9]+\] STEP 1\// { if (last != "") printf "%s ", last }
             /^--> / { last = $NF }' "$log")
  [[ -n "$ids" ]] || return 0
  touch "$keepfile"
  { grep -v "^$version " "$keepfile" || true; echo "$version $ids"; } > "$keepfile.tmp"
  while read -r v rest; do
    bh inspect --type image --format '{{.FromImageID}}' "$IMAGE_REPO:$v" >/dev/null 2>&1 || continue
    echo "$v $rest"
    keep="$keep $rest"
  done < "$keepfile.tmp" > "$keepfile"
  rm -f "$keepfile.tmp"
  for id in $(bh images --filter dangling=true --format '{{.ID}}' 2>/dev/null); do
    for k in $keep; do [[ "$k" != "$id"* && "$id" != "$k"* ]] || continue 2; done
    stale+=("$id")
  done
  if (( ${#stale[@]} )); then
    bh rmi "${stale[@]}" >/dev/null 2>&1 || true
    log "layer cache: dropped ${#stale[@]} untagged image(s) of earlier builds"
  fi
}

# `workload-manager --version` in the image, as the image's user; and its config.
verify_manager() {
  local image=$1 want=$2 c got cfg
  cfg=$(bh inspect --type image --format '{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}}' "$image")
  [[ "$cfg" == "10001 [workload-manager]" ]] \
    || die "$image: user/entrypoint are '$cfg', want '10001 [\"workload-manager\"]'"
  c=$(new_container "$image")
  got=$(bh run --isolation chroot "$c" -- workload-manager --version 2>&1) \
    || die "$image: 'workload-manager --version' failed: $got"
  [[ "$got" == "workload-manager $want" ]] \
    || die "$image: 'workload-manager --version' printed '$got', want 'workload-manager $want'"
  # shellcheck disable=SC2016  # expanded inside the image
  bh run --isolation chroot "$c" -- sh -c 'test "$(id -u)" = 10001 && test -r /app/migrations && test -n "$(ls -A /app/migrations)"' \
    || die "$image: not running as 10001, or no migrations in /app/migrations"
  # what `serve` imports comes from bytecode compiled in the image, none from source
  # shellcheck disable=SC2016  # Python, run inside the image
  got=$(bh run --isolation chroot "$c" -- python -c 'import os, sys, app.cli, app.main
print(" ".join(sorted(n for n, m in list(sys.modules.items()) if (getattr(m, "__file__", None) or "").endswith(".py") and getattr(m, "__cached__", None) and not os.path.exists(m.__cached__))))' 2>&1) \
    || die "$image: importing the manager failed: $got"
  [[ -z "$got" ]] || die "$image: modules without compiled bytecode: $got"
  bh rm "$c" >/dev/null
  done_container "$c"
  log "manager: verified: 'workload-manager $want' as uid 10001, migrations in /app/migrations, bytecode compiled"
}

# The manager image with an entrypoint that never serves: sleeps whatever its args
# (serve, migrate), exits on SIGTERM. For the self-update rollback test.
build_never_ready() {
  local from="$IMAGE_REPO:$version" image="$IMAGE_REPO:$never_ready" c cfg
  c=$(new_container "$from")
  bh config \
    --entrypoint '["python", "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(1e9)"]' \
    --user 10001 \
    --label io.workload-manager.never-ready=true \
    --label org.opencontainers.image.description="workload-manager $version that never serves, tagged $never_ready (rollback tests)" \
    "$c" >&2
  bh commit --quiet --rm "$c" "$image" >/dev/null
  done_container "$c"
  cfg=$(bh inspect --type image --format '{{.OCIv1.Config.User}} {{index .OCIv1.Config.Entrypoint 0}}' "$image")
  [[ "$cfg" == "10001 python" ]] || die "$image: user/entrypoint are '$cfg'"
  log "never-ready: $image from $from (entrypoint sleeps)"
  push_archive "$image" "$out/workload-manager-$never_ready.oci.tar"
}

# --- helpers for the test node ------------------------------------------------------

build_pause() {
  local stage="$work/pause" c go=go
  command -v go >/dev/null 2>&1 || go=/usr/local/go/bin/go
  command -v "$go" >/dev/null 2>&1 || die "no Go toolchain (for the pause image)"
  mkdir -p "$stage"
  (cd "$here/pause" && CGO_ENABLED=0 GOFLAGS=-mod=mod "$go" build -trimpath -ldflags='-s -w' -o "$stage/pause" .) >&2
  c=$(new_container scratch)
  bh copy --chown 0:0 "$c" "$stage/pause" /pause >&2
  bh config --os linux --arch "$arch" --entrypoint '["/pause"]' --cmd '' --user 65535:65535 \
    --label org.opencontainers.image.title="pause (workload-manager test node)" "$c" >&2
  bh commit --quiet --rm "$c" "$PAUSE_IMAGE" >/dev/null
  done_container "$c"
  push_archive "$PAUSE_IMAGE" "$out/pause-3.10.oci.tar"
}

build_pinger() {
  local stage="$work/pinger" c applet busybox=/bin/busybox
  [[ -x "$busybox" ]] || die "no $busybox (apt-get install busybox-static)"
  ! command -v file >/dev/null || [[ "$(file -L "$busybox")" == *"statically linked"* ]] \
    || die "$busybox is not static (apt-get install busybox-static)"
  mkdir -p "$stage"/{bin,etc,tmp,home/nonroot,usr/local/bin}
  cp "$busybox" "$stage/bin/busybox"
  for applet in $("$busybox" --list); do
    [[ "$applet" == busybox || "$applet" == */* ]] || ln -sf busybox "$stage/bin/$applet"
  done
  install -m 755 "$here/pinger/pinger.sh" "$stage/usr/local/bin/pinger"
  printf 'root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532:nonroot:/home/nonroot:/bin/false\n' > "$stage/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$stage/etc/group"
  chmod 1777 "$stage/tmp"
  chown 65532:65532 "$stage/home/nonroot"
  chmod 755 "$stage"
  # a tarball keeps the owners (buildah copy would make everything 0:0)
  tar --numeric-owner -C "$stage" -cf "$work/pinger.tar" .
  c=$(new_container scratch)
  bh add "$c" "$work/pinger.tar" / >&2
  bh config --os linux --arch "$arch" --env PATH=/usr/local/bin:/bin --env PING_INTERVAL=5 \
    --entrypoint '["/usr/local/bin/pinger"]' --cmd '' --user 65532:65532 --workingdir /home/nonroot \
    --label org.opencontainers.image.title="pinger (workload-manager test workload)" "$c" >&2
  bh commit --quiet --rm "$c" "$PINGER_IMAGE" >/dev/null
  done_container "$c"
  push_archive "$PINGER_IMAGE" "$out/pinger-1.oci.tar"
}

# --- main ---------------------------------------------------------------------------

t_start=$(seconds)
if (( manager )); then
  build_base
  build_manager
  [[ -z "$never_ready" ]] || build_never_ready
fi
if (( helpers )); then
  build_pause
  build_pinger
fi
log "done in $(took "$t_start")"
if (( manager )); then
  echo "$out/workload-manager-$version.oci.tar"
else
  echo "$out"
fi
