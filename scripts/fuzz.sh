#!/usr/bin/env bash
# Fuzzes every parser of outside input (fuzz/*_fuzz.cpp, docs/hardening.md): installs clang
# and libFuzzer when missing, builds the targets into build-fuzz/ (clang, ASan, UBSan,
# MEMTUNE_FUZZ=ON), seeds each corpus from the project's own files, then runs each target
# for SECONDS (default 15) and prints its executions, coverage and any crash.
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      (targets: safetensors, config, ...)
# Corpora grow in build-fuzz/corpus/<target> across runs; a crashing input is saved as
# build-fuzz/crashes/<target>-crash-<sha1>. Exit 1 when any target found something.
# Environment: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_SEED (default 1), FUZZ_RUNS
# (executions per target instead of SECONDS), FUZZ_FRESH=1 (start from the seeds only), JOBS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-15}
shift || true
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}

bash "$root/scripts/setup.sh"
missing=()
for p in clang-14 libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fuzz: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

start=$(date +%s)
export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
if [ ! -f "$build/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" "${generator[@]}" -DMEMTUNE_FUZZ=ON \
    -DMEMTUNE_BUILD_TESTS=OFF -DMEMTUNE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" >/dev/null
fi
all_targets=()
for src in "$root"/fuzz/*_fuzz.cpp; do
  name=$(basename "$src" _fuzz.cpp)
  all_targets+=("$name")
done
if (($#)); then targets=("$@"); else targets=("${all_targets[@]}"); fi
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]/#/fuzz_}"
echo "fuzz: build $(( $(date +%s) - start )) s in $build"

# Seeds: committed ones (fuzz/corpus/<target>, fuzz/regressions/<target>-*) and the
# project's own files; made again each run (cheap), next to the corpus the fuzzer grows.
seeds=$build/seeds
rm -rf "$seeds"
mkdir -p "$seeds" "$build/crashes"
for t in "${all_targets[@]}"; do
  [ "${FUZZ_FRESH:-0}" = 1 ] && rm -rf "$build/corpus/$t"
  mkdir -p "$seeds/$t" "$build/corpus/$t"
  [ -d "$root/fuzz/corpus/$t" ] && cp "$root/fuzz/corpus/$t"/* "$seeds/$t/" 2>/dev/null || true
  for f in "$root"/fuzz/regressions/"$t"-*; do [ -f "$f" ] && cp "$f" "$seeds/$t/"; done
done
python3 "$root/fuzz/make_seeds.py" "$root" "$seeds"

# LibTorch's and OpenBLAS's thread pools keep allocations for the process's life, which
# LeakSanitizer reports at exit; leaks are not what these targets look for.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=passive

failed=()
printf '%-18s %10s %8s %8s %8s  %s\n' target executions exec/s cov ft result
for t in "${targets[@]}"; do
  log=$build/fuzz-$t.log
  rc=0
  # A fixed seed: a run explores the same inputs in the same order, so a shorter run (a
  # slower machine) tries a prefix of what a longer one did and CI does not turn on luck.
  # FUZZ_RUNS bounds each target by executions instead of time: then a run is the same on a
  # fast or a slow machine (CI uses it, so what passed here passes there).
  bound=(-max_total_time="$seconds")
  [ -n "${FUZZ_RUNS:-}" ] && bound=(-runs="$FUZZ_RUNS")
  "$build/fuzz/fuzz_$t" -seed="${FUZZ_SEED:-1}" "${bound[@]}" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 \
    -max_len=65536 -artifact_prefix="$build/crashes/$t-" "$build/corpus/$t" "$seeds/$t" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -oE '(DONE|pulse|NEW|REDUCE|INITED) +cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 | awk '{print $3, $5}')
  result=ok
  if [ "$rc" -ne 0 ]; then
    result="FINDING (exit $rc): $(grep -E '^(FINDING|==[0-9]+==ERROR|SUMMARY|.*runtime error)' "$log" | head -2 | tr '\n' ' ')"
    failed+=("$t")
  fi
  printf '%-18s %10s %8s %8s %8s  %s\n' "$t" "${execs:-?}" "${speed:-?}" ${cov:-? ?} "$result"
done
echo "fuzz: $(( $(date +%s) - start )) s in all; logs in $build/fuzz-*.log"
if ((${#failed[@]})); then
  echo "fuzz: findings in ${failed[*]}; inputs in $build/crashes/ (reproduce: $build/fuzz/fuzz_TARGET FILE)"
  exit 1
fi
