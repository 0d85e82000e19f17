# shellcheck shell=bash
# Sourced by the scripts that work in a Debian root made with debootstrap
# (scripts/gpu_build.sh, scripts/interop_root.sh, scripts/interop_check.sh): the root's
# lock, its bind mounts (undone on every exit path), running a command inside it, and
# making it. Set ROOT (the root's path) and ROOT_TAG (the name messages start with) first;
# ROOT_ENV (an array of NAME=value) adds to the clean environment in_root gives.

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"  # one run at a time per root (CI and a developer may share a machine)
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

bind() {  # bind <host path> <path in root> [ro]
  mkdir -p "$ROOT$2"
  mountpoint -q "$ROOT$2" && umount "$ROOT$2"  # left by a run that was killed
  mount --bind "$1" "$ROOT$2"
  mounted+=("$ROOT$2")
  [ "${3:-}" = ro ] && mount -o remount,bind,ro "$ROOT$2"
  return 0
}

unmount_all_under_root() {  # before deleting the root: never delete through a mount
  findmnt -rn -o TARGET | grep -E "^$ROOT(/|$)" | sort -r | while read -r m; do umount -l "$m"; done
  if findmnt -rn -o TARGET | grep -qE "^$ROOT(/|$)"; then
    echo "$ROOT_TAG: mounts remain under $ROOT; not deleting it" >&2
    exit 1
  fi
}

in_root() {  # in_root <command...>: a clean environment inside the root
  chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive "${ROOT_ENV[@]}" "$@"
}

default_mirror() {  # the Debian mirror this machine's apt uses
  local m
  m=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ \
        2>/dev/null | head -1 | tr -d ' ')
  echo "${m:-http://deb.debian.org/debian}"
}

# debootstrap_root <suite> <mirror> [debootstrap options...]: a minimal root, once (a root
# left half made by a killed run is deleted and made again).
debootstrap_root() {
  local suite=$1 mirror=$2
  shift 2
  [ -f "$ROOT/.memtune-debootstrap-done" ] && return 0
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
  if [ -e "$ROOT" ]; then
    unmount_all_under_root
    rm -rf --one-file-system "$ROOT"
  fi
  debootstrap --variant=minbase "$@" "$suite" "$ROOT" "$mirror" \
    >"$ROOT.debootstrap.log" 2>&1 || { tail -20 "$ROOT.debootstrap.log" >&2; exit 1; }
  touch "$ROOT/.memtune-debootstrap-done"
}

# prepare_root: resolv.conf, no services, and /proc, /sys, /dev mounted, for apt inside it.
prepare_root() {
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"  # no services start in the root
  chmod +x "$ROOT/usr/sbin/policy-rc.d"
  bind /proc /proc
  bind /sys /sys
  bind /dev /dev
}
