#!/usr/bin/env bash
# The unit tests under AddressSanitizer and UndefinedBehaviorSanitizer (docs/hardening.md):
# configures build-asan with g++ (the compiler Debian's LibTorch is built with) and
# MEMTUNE_SANITIZE=ON, builds the unit test binaries, runs `ctest -L unit` there. Any
# sanitizer report fails its test (UBSan does not recover; ASan aborts).
#   bash scripts/sanitize.sh [extra ctest arguments, e.g. -R test_runtime]
# Environment: SANITIZE_BUILD_DIR (default build-asan), JOBS, CTEST_JOBS (default 2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${SANITIZE_BUILD_DIR:-$root/build-asan}
bash "$root/scripts/setup.sh"
export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
start=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  # -O1 keeps the build and the run short; no debug info beyond line tables.
  cmake -S "$root" -B "$build" "${generator[@]}" -DMEMTUNE_SANITIZE=ON -DMEMTUNE_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" >/dev/null
fi
# Every unit test binary (tests/CMakeLists.txt: test_<area> from <area>/*_test.cpp; there
# is none for tools/, whose tests are all integration tests).
targets=()
for area in runtime models data trainer tools; do
  compgen -G "$root/tests/$area/*_test.cpp" >/dev/null && targets+=("test_$area")
done
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
echo "sanitize: build $(( $(date +%s) - start )) s in $build"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$build"
ctest --output-on-failure -L unit -j "${CTEST_JOBS:-2}" "$@"
echo "sanitize: $(( $(date +%s) - start )) s in all"
