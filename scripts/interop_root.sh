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

default_mirror() {
  local m
  m=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ \
        2>/dev/null | head -1 | tr -d ' ')
  echo "${m:-http://deb.debian.org/debian}"
}

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"   # one run at a time per root
flock 9

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount "${mounted[i]}" 2>/dev/null || umount -l "${mounted[i]}" || true
  done
  mounted=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
bind() {  # bind <host path> <path in root>
  mkdir -p "$ROOT$2"
  mountpoint -q "$ROOT$2" && umount "$ROOT$2"  # left by a run that was killed
  mount --bind "$1" "$ROOT$2"
  mounted+=("$ROOT$2")
}
unmount_all_under_root() {  # before deleting the root: never delete through a mount
  findmnt -rn -o TARGET | grep -E "^$ROOT(/|$)" | sort -r | while read -r m; do umount -l "$m"; done
  if findmnt -rn -o TARGET | grep -qE "^$ROOT(/|$)"; then
    echo "interop_root: mounts remain under $ROOT; not deleting it" >&2
    exit 1
  fi
}
in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive "$@"
}

make_root() {
  local mirror; mirror=${MEMTUNE_DEBIAN_MIRROR:-$(default_mirror)}
  if [ ! -f "$ROOT/.memtune-debootstrap-done" ]; then
    echo "interop_root: debootstrap sid from $mirror (a few minutes)"
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    if [ -e "$ROOT" ]; then
      unmount_all_under_root
      rm -rf --one-file-system "$ROOT"
    fi
    debootstrap --variant=minbase sid "$ROOT" "$mirror" \
      >"$ROOT.debootstrap.log" 2>&1 || { tail -20 "$ROOT.debootstrap.log" >&2; exit 1; }
    touch "$ROOT/.memtune-debootstrap-done"
  fi
  echo "interop_root: apt-get install ${packages[*]}"
  echo "deb $mirror sid main" >"$ROOT/etc/apt/sources.list"
  # An unstable Release file can be past its Valid-Until on a mirror snapshot.
  echo 'Acquire::Check-Valid-Until "false";' >"$ROOT/etc/apt/apt.conf.d/99memtune-no-valid-until"
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"  # no services start in the root
  chmod +x "$ROOT/usr/sbin/policy-rc.d"
  bind /proc /proc
  bind /sys /sys
  bind /dev /dev
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
