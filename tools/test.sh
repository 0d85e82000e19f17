#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, build, then every test through CTest.
# Extra arguments go to ctest: `bash tools/test.sh -L unit` runs the quick subset.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/build.sh"
bash "$root/tools/setup_node.sh"
cd "${BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "${CTEST_JOBS:-2}" "$@"
