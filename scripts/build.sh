#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), configures and builds memtune into build/.
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release), JOBS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
build=${BUILD_DIR:-$root/build}
export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" >/dev/null
fi
start=$(date +%s)
cmake --build "$build" -j "${JOBS:-$(nproc)}" "$@"
echo "build: $(( $(date +%s) - start )) s in $build"
