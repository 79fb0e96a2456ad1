#!/usr/bin/env bash
# Installs the Debian packages named as arguments that are not installed yet (as root, with
# apt-get; `apt-get update` once if the first try cannot find them). Without root or apt it
# names what is missing and fails, so the step that needs them says why.
#   tools/debian-packages.sh containerd runc socat
set -euo pipefail
missing=()
for pkg in "$@"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) || status=""
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
(( ${#missing[@]} )) || exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing Debian packages (install them as root): ${missing[*]}" >&2
  exit 1
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# another install running (a second test run, the bench tools) holds dpkg's lock: wait for it
lock=(-o DPkg::Lock::Timeout=600)
apt-get "${lock[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null \
  || { apt-get "${lock[@]}" update >/dev/null \
       && apt-get "${lock[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null; }
