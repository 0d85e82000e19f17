#!/usr/bin/env bash
# memtune judged by the real Hugging Face transformers (issue 22): tiny random models of each
# family memtune supports, written by memtune (init-model) and by transformers (save_pretrained:
# one file and sharded, fp32/fp16/bf16); losses and greedy text of memtune eval / generate
# against transformers; adapters trained by memtune (LoRA, QLoRA), merged by memtune merge,
# the merge's loss by transformers against memtune eval --adapter; and each feature memtune
# does not implement refused by name (exit 2), never dropped. Prints a table of checks with
# their figures and PASS/FAIL; exits 1 when a check fails.
#
# transformers runs inside a Debian unstable root (scripts/interop_root.sh: debootstrap +
# python3-transformers 5.x, about 2 GB, made once and reused); memtune runs on this machine;
# both see one work directory. Not part of CI. Needs root (chroot, mount): re-runs itself
# under sudo after building memtune as the calling user.
#
# Environment:
#   MEMTUNE_INTEROP_ROOT  the root (default /var/cache/memtune/sid-transformers)
#   BUILD_DIR             memtune's build tree (default build)
#   INTEROP_ONLY          check groups to run (space separated: defaults mt->hf hf->mt bf16 skip adapter peft full refusal tokenizer)
#   INTEROP_FAMILIES      families whose models groups mt->hf, hf->mt, bf16 and adapter check
#                         (space separated, e.g. "gemma2 llama"; default all)
#   INTEROP_KEEP          1: keep the work directory (kept anyway when a check fails)
#   MEMTUNE_PEFT_SRC      PEFT's source for group peft: a directory holding peft/ (a checkout's src)
#   MEMTUNE_PEFT_GIT      or a git directory of huggingface/peft (default: the tool library's
#                         mirror, /work/.mirror/huggingface+peft/repo): its HEAD's src/peft is
#                         unpacked once beside the root. Debian packages no PEFT, and PyPI may be
#                         out of reach; without either, group peft's checks are SKIPs.
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
export BUILD_DIR=${BUILD_DIR:-$src/build}
ROOT=${MEMTUNE_INTEROP_ROOT:-/var/cache/memtune/sid-transformers}
export MEMTUNE_INTEROP_ROOT=$ROOT

if [ "${INTEROP_BUILT:-}" != 1 ]; then
  bash "$src/scripts/build.sh" --target memtune >/dev/null
  export INTEROP_BUILT=1
fi
if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env=MEMTUNE_INTEROP_ROOT,MEMTUNE_DEBIAN_MIRROR,BUILD_DIR,INTEROP_BUILT,INTEROP_ONLY,INTEROP_FAMILIES,INTEROP_KEEP,MEMTUNE_PEFT_SRC,MEMTUNE_PEFT_GIT \
    bash "$0" "$@"
fi

bash "$src/scripts/interop_root.sh"

ROOT_TAG=interop_check
ROOT_ENV=()
# The root's lock (it is not remade under a running check) and its bind mounts.
# shellcheck source=scripts/debian_root.sh
source "$src/scripts/debian_root.sh"

work=$(mktemp -d /tmp/memtune-interop.XXXXXX)

# PEFT's source for the judge (group peft), or nothing.
peft_source() {
  if [ -n "${MEMTUNE_PEFT_SRC:-}" ]; then
    [ -d "$MEMTUNE_PEFT_SRC/peft" ] || { echo "interop_check: MEMTUNE_PEFT_SRC=$MEMTUNE_PEFT_SRC holds no peft/" >&2; exit 1; }
    echo "$MEMTUNE_PEFT_SRC"
    return
  fi
  local git=${MEMTUNE_PEFT_GIT:-/work/.mirror/huggingface+peft/repo} dest=$ROOT.peft rev
  rev=$(git --git-dir="$git" rev-parse HEAD 2>/dev/null) || return 0
  if [ "$(cat "$dest/REVISION" 2>/dev/null)" != "$rev" ]; then
    rm -rf "$dest" && mkdir -p "$dest"
    git --git-dir="$git" archive HEAD src/peft | tar -x -C "$dest" --strip-components=1
    echo "$rev" >"$dest/REVISION"
  fi
  echo "$dest"
}

main() {
  bind /proc /proc
  bind /dev /dev
  bind /sys /sys
  bind "$src/scripts/interop" /interop/judge ro
  bind "$work" /interop/work
  local peft
  peft=$(peft_source)
  [ -n "$peft" ] && bind "$peft" /interop/peft ro
  local python=python3
  [ -x /usr/bin/python3 ] && python=/usr/bin/python3
  echo "interop_check: $(date -u '+%Y-%m-%d %H:%M UTC'), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
  echo "interop_check: memtune $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?') ($BUILD_DIR/memtune), work $work"
  local status=0
  # shellcheck disable=SC2086
  "$python" "$src/scripts/interop/check.py" --memtune "$BUILD_DIR/memtune" --src "$src" --root "$ROOT" \
    --work "$work" --work-in-root /interop/work --judge-in-root /interop/judge/judge.py \
    ${INTEROP_ONLY:+--only $INTEROP_ONLY} ${INTEROP_FAMILIES:+--families $INTEROP_FAMILIES} || status=$?
  cleanup
  if [ "$status" = 0 ] && [ "${INTEROP_KEEP:-}" != 1 ]; then
    rm -rf "$work"
  else
    echo "interop_check: files kept in $work"
  fi
  return "$status"
}
main "$@"
exit
