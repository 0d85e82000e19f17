#!/usr/bin/env bash
# tests/reference/hf_reference.py judged by the real transformers (and PEFT) for the
# soft-capping families, Gemma 2 and Gemma 3's logit cap: logits, loss and every gradient in
# fp64, fp32 and bf16 (scripts/interop/reference_judge.py says what is compared). The
# reference prepares its outputs on this machine (Debian's python3-torch); transformers runs
# in the interop root (scripts/interop_root.sh). Not part of CI. Needs root (chroot, mount):
# re-runs itself under sudo.
#
# Environment: MEMTUNE_INTEROP_ROOT (default /var/cache/memtune/sid-transformers),
# MEMTUNE_PEFT_SRC / MEMTUNE_PEFT_GIT as for scripts/interop_check.sh (without PEFT the LoRA
# part fails; the rest is printed first).
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${MEMTUNE_INTEROP_ROOT:-/var/cache/memtune/sid-transformers}
export MEMTUNE_INTEROP_ROOT=$ROOT
if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env=MEMTUNE_INTEROP_ROOT,MEMTUNE_DEBIAN_MIRROR,MEMTUNE_PEFT_SRC,MEMTUNE_PEFT_GIT bash "$0" "$@"
fi

bash "$src/scripts/interop_root.sh"
ROOT_TAG=reference_judge
ROOT_ENV=(OMP_NUM_THREADS=2)
# shellcheck source=scripts/debian_root.sh
source "$src/scripts/debian_root.sh"

work=$(mktemp -d /tmp/memtune-reference-judge.XXXXXX)
echo "reference_judge: $(date -u '+%Y-%m-%d %H:%M UTC'), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), work $work"
/usr/bin/python3 "$src/scripts/interop/reference_judge.py" prepare "$work" "$src/tests/reference/hf_reference.py"

peft=${MEMTUNE_PEFT_SRC:-}
if [ -z "$peft" ] && [ -d "$ROOT.peft/peft" ]; then peft=$ROOT.peft; fi  # scripts/interop_check.sh unpacks it there
bind /proc /proc
bind /dev /dev
bind /sys /sys
bind "$src/scripts/interop" /interop/judge ro
bind "$work" /interop/work
[ -n "$peft" ] && bind "$peft" /interop/peft ro
status=0
in_root python3 /interop/judge/reference_judge.py judge /interop/work || status=$?
cleanup
echo "reference_judge: files in $work"
exit "$status"
