#!/usr/bin/env bash
# On a machine with a GPU, after a build (scripts/torch_wheel_build.sh or scripts/build.sh
# against a CUDA LibTorch): the GPU tests, then the real command on the GPU: QLoRA with
# evaluation, generation-based accuracy and checkpoints, a resume, LLM.int8 in bf16, and the
# launcher with NCCL. Each run's log goes to LOG_DIR; a summary line per check is printed.
#
# Environment: BUILD_DIR (default build-torch-wheel), LOG_DIR (default /tmp/memtune-gpu-check),
# JOBS (ctest jobs, default: all cores).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-torch-wheel}
logs=${LOG_DIR:-/tmp/memtune-gpu-check}
mkdir -p "$logs"
bin=$build/memtune
failed=0
check() {  # check NAME COMMAND...: runs it, logs it, prints one line
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "gpu_check: $name: ok ($((SECONDS - start)) s)"
  else
    echo "gpu_check: $name: FAILED ($((SECONDS - start)) s), last lines of $logs/$name.log:"
    tail -15 "$logs/$name.log"
    failed=1
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$bin" --version

# Integration tests are CTest tests of their own; unit tests run inside their binaries.
check gpu-tests bash -c "cd '$build' && ctest --output-on-failure -R '_CUDA|Sdpa' &&
  for b in tests/test_*; do \$b --gtest_filter='*_CUDA*:*Sdpa*' || exit 1; done"

out=$logs/runs
rm -rf "$out"
train=("$bin" train "$root/configs/quickstart.yaml" model.name_or_path=tiny-llama runtime.device=cuda
       data.max_seq_length=128 memory.device_limit=null training.logging_steps=5 training.eval_steps=20
       training.eval_accuracy_rows=16 training.save_steps=20 "data.cache_dir=$out/cache")
check qlora-bf16 "${train[@]}" training.max_steps=40 "training.output_dir=$out/qlora"
check resume "${train[@]}" training.max_steps=60 "training.output_dir=$out/qlora" training.resume_from_checkpoint=latest
# LLM.int8 (load_in_8bit) on the GPU: the mixed int8 product with outlier columns, in bf16 under autocast.
check int8-bf16 "${train[@]}" training.max_steps=20 training.bf16=true model.quantization_config.load_in_4bit=false \
  model.quantization_config.load_in_8bit=true model.quantization_config.bnb_4bit_compute_dtype=float32 \
  model.quantization_config.bnb_4bit_quant_type=fp4 model.quantization_config.bnb_4bit_use_double_quant=false \
  "training.output_dir=$out/int8"
check launch-nccl "$bin" launch --nproc-per-node 1 --standalone -- train "$root/configs/quickstart.yaml" \
  model.name_or_path=tiny-llama runtime.device=cuda data.max_seq_length=128 memory.device_limit=null \
  training.max_steps=10 training.eval_steps=0 training.eval_accuracy_rows=0 training.save_steps=0 \
  "data.cache_dir=$out/cache" "training.output_dir=$out/launch"
for run in qlora int8 launch; do
  [ -f "$out/$run/metrics.jsonl" ] && echo "gpu_check: $run: $(grep -c '"loss"' "$out/$run/metrics.jsonl") metric rows," \
    "last: $(grep '"loss"' "$out/$run/metrics.jsonl" | tail -1 | cut -c1-200)"
done
grep -hE "device map|compute dtype|LLM.int8|eval|accuracy|resum|distributed" "$logs/qlora-bf16.log" "$logs/resume.log" \
  "$logs/int8-bf16.log" "$logs/launch-nccl.log" 2>/dev/null | cut -c1-220 | head -20
exit $failed
