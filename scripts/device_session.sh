#!/usr/bin/env bash
# What a session lent a GPU machine runs first (issue 24), as one call of the device tool:
# the build against the machine's PyTorch wheel, the GPU tests and runs (scripts/gpu_check.sh),
# the kernels' figures against ATen's (bench_layer_kernels, bench_nf4_bench), then memtune
# against transformers + PEFT (bench/gpu_vs_hf.py), then one traced LoRA step of each model
# vs-hf ran (MEMTUNE_PROFILE), in that order, each step started only while the time left
# allows it.
# Every log and JSON goes under OUT (the device tool's $OUT), with summary.txt saying what
# ran, how long it took and how it ended.
#
#   bash scripts/device_session.sh                 # everything the budget allows
#   STEPS="bench vs-hf" bash scripts/device_session.sh   # a later call on the still-warm machine
#
# The device machine has no network: the Debian 12 libraries memtune links come from .deps
# (bash scripts/device_deps.sh here, then carry .deps). Environment:
#   OUT          where results go (default /tmp/memtune-device)
#   BUDGET_S     seconds this call may take (default 560: the tool's 600 less a margin)
#   STEPS        which of build check bench vs-hf profile to run (default all, in that order)
#   VS_HF_ARGS   gpu_vs_hf.py's arguments (default: --models 1b --ckpt none,all)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/memtune-device}
budget=${BUDGET_S:-560}
steps=${STEPS:-build check bench vs-hf profile}
for s in $steps; do
  case $s in build | check | bench | vs-hf | profile) ;; *) echo "device_session: STEPS names '$s'; the steps are build check bench vs-hf profile" >&2; exit 2 ;; esac
done
mkdir -p "$out"
summary=$out/summary.txt
start=$SECONDS
build=${BUILD_DIR:-$root/build-torch-wheel}

if [ -d "$root/.deps/usr" ]; then
  export DEPS_PREFIX=$root/.deps/usr
  export LD_LIBRARY_PATH=$root/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

note() { echo "$*" | tee -a "$summary"; }
asked() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }  # asked STEP: STEPS names it
# step NAME[:PART] NEEDS_S COMMAND...: runs COMMAND when step NAME is asked for and NEEDS_S
# seconds are left, under a timeout of what is left; logs to OUT/NAME[-PART].log.
step() {
  local name=$1 needs=$2; shift 2
  asked "${name%%:*}" || return 0
  name=${name/:/-}
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$needs" ]; then
    note "$name: not started ($left s left, it needs about $needs s)"
    return 0
  fi
  local t0=$SECONDS rc=0
  timeout "$left" "$@" >"$out/$name.log" 2>&1 || rc=$?
  note "$name: exit $rc in $((SECONDS - t0)) s (log $name.log)"
  return "$rc"
}

note "device_session: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary" ||
  note "no nvidia-smi: this is not a GPU machine"

# A target that does not compile against this wheel (the code is compiled here against Debian's
# LibTorch 2.6 only) must not cost the call's other figures: the build goes on past it, and
# the steps below run with what was built as long as the memtune command was.
if ! step build 200 env KEEP_GOING=1 bash "$root/scripts/torch_wheel_build.sh"; then
  [ -x "$build/memtune" ] || { note "the build failed, the memtune command with it: nothing else runs"; exit 1; }
  note "the build failed in part (build.log: grep -n 'FAILED:'); the steps below run with what was built"
fi
step check 150 env BUILD_DIR="$build" LOG_DIR="$out/gpu-check" bash "$root/scripts/gpu_check.sh"
step bench 60 bash -c "'$build/bench/bench_layer_kernels' --cuda > '$out/layer_kernels.txt' 2>&1;
  '$build/bench/bench_nf4_bench' --cuda > '$out/nf4_bench.txt' 2>&1"
# shellcheck disable=SC2086
step vs-hf 240 python3 "$root/bench/gpu_vs_hf.py" --memtune "$build/memtune" --work /tmp/memtune-gpu-vs-hf \
  --json "$out/gpu_vs_hf.json" ${VS_HF_ARGS:---models 1b --ckpt none,all}
# Where a memtune LoRA step's GPU time goes: one traced step of each model's LoRA run that
# vs-hf configured without checkpointing (the GPU's time by kernel, by memtune's scope and op,
# its busy share; the traces themselves stay on the machine).
for m in 1b 8b; do
  cfg=/tmp/memtune-gpu-vs-hf/run-$m-lora-none.yaml
  if [ ! -f "$cfg" ]; then
    asked profile && note "profile-$m: not started (vs-hf wrote no $cfg)"
    continue
  fi
  needs=40
  [ $m = 8b ] && needs=90  # a 16 GB model to load
  step "profile:$m" $needs bash -c "
    sed 's/run-$m-lora-none\"/run-$m-lora-none-profile\"/; s/\"max_steps\": [0-9]*/\"max_steps\": 5/' '$cfg' > /tmp/profile-$m.yaml
    MEMTUNE_PROFILE=4:/tmp/trace-$m-lora.json '$build/memtune' train /tmp/profile-$m.yaml &&
    python3 '$root/scripts/profile_summary.py' /tmp/trace-$m-lora.json --top 40 > '$out/profile-$m-lora.txt'"
done
note "device_session: $((SECONDS - start)) s in all"
