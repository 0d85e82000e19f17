#!/usr/bin/env bash
# The quickstart on a fresh machine: set-up, build, a tiny base model (configs/quickstart-base.yaml),
# then its QLoRA fine-tuning on the bundled tasks (configs/quickstart.yaml). Extra arguments
# are overrides for the second stage.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh" --target memtune
cd "$root"
memtune="${BUILD_DIR:-$root/build}/memtune"
# Stage 1: a tiny base model learns the bundled English corpus (full training, dense).
[ -f runs/quickstart-base/model/config.json ] || "$memtune" train configs/quickstart-base.yaml
# Stage 2: QLoRA of that base on the bundled instruction tasks.
"$memtune" train configs/quickstart.yaml "$@"
