#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, build, then every test through CTest.
# Extra arguments go to ctest: `bash scripts/test.sh -L unit` runs the quick subset.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh"
bash "$root/scripts/setup_node.sh"
cd "${BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "${CTEST_JOBS:-2}" "$@"
