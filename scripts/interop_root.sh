#!/usr/bin/env bash
# Makes (or reuses) the Debian unstable root in which scripts/interop_check.sh runs the real
# Hugging Face transformers as a judge: python3-transformers (5.x), python3-torch,
# python3-tokenizers, python3-safetensors, python3-accelerate, python3-numpy.
# The root lives outside the checkout (about 2 GB) and is reused while its stamp matches
# the package list below. Needs root (debootstrap, chroot, mount).
#
# Environment:
#   MEMTUNE_INTEROP_ROOT  the root (default /var/cache/memtune/sid-transformers)
#   MEMTUNE_DEBIAN_MIRROR Debian mirror (default: the one this machine's apt uses)
set -euo pipefail

ROOT=${MEMTUNE_INTEROP_ROOT:-/var/cache/memtune/sid-transformers}
if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env=MEMTUNE_INTEROP_ROOT,MEMTUNE_DEBIAN_MIRROR bash "$0" "$@"
fi

# Bump ROOT_VERSION whenever the way the root is made changes; the package list is part of
# the stamp, so editing it also tops the root up.
ROOT_VERSION=1
packages=(
  python3-transformers python3-torch python3-tokenizers python3-safetensors
  python3-accelerate python3-numpy
)
stamp="$ROOT_VERSION ${packages[*]}"
stamp_file=$ROOT/.memtune-root-stamp

ROOT_TAG=interop_root
ROOT_ENV=()
# shellcheck source=scripts/debian_root.sh
source "$(dirname "$0")/debian_root.sh"

make_root() {
  local mirror; mirror=${MEMTUNE_DEBIAN_MIRROR:-$(default_mirror)}
  if [ ! -f "$ROOT/.memtune-debootstrap-done" ]; then
    echo "interop_root: debootstrap sid from $mirror (a few minutes)"
    debootstrap_root sid "$mirror"
  fi
  echo "interop_root: apt-get install ${packages[*]}"
  echo "deb $mirror sid main" >"$ROOT/etc/apt/sources.list"
  # An unstable Release file can be past its Valid-Until on a mirror snapshot.
  echo 'Acquire::Check-Valid-Until "false";' >"$ROOT/etc/apt/apt.conf.d/99memtune-no-valid-until"
  prepare_root
  in_root apt-get update -qq >"$ROOT.apt.log" 2>&1 || { tail -30 "$ROOT.apt.log" >&2; exit 1; }
  in_root apt-get install -y -qq --no-install-recommends "${packages[@]}" >>"$ROOT.apt.log" 2>&1 ||
    { tail -30 "$ROOT.apt.log" >&2; exit 1; }
  in_root apt-get clean
  echo "$stamp" >"$stamp_file"
  cleanup
}

main() {
  if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
    echo "interop_root: reusing $ROOT"
  else
    make_root
  fi
}
main "$@"
exit
