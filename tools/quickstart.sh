#!/usr/bin/env bash
# The quickstart on a fresh machine: set-up, build, then QLoRA fine-tuning of a tiny model
# on the bundled tasks (configs/quickstart.yaml). Extra arguments are config overrides.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/tools/build.sh" --target memtune
cd "$root"
"${BUILD_DIR:-$root/build}/memtune" train configs/quickstart.yaml "$@"
