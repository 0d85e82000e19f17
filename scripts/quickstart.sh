#!/usr/bin/env bash
# The quickstart on a fresh machine: set-up, build, a tiny base model (configs/quickstart-base.yaml),
# then its QLoRA fine-tuning on the bundled tasks (configs/quickstart.yaml). Extra arguments
# are overrides for the second stage.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh" --target memtune
cd "$root"
memtune="${BUILD_DIR:-$root/build}/memtune"
# Stage 1: a tiny base model learns the bundled English corpus (full training, dense); an
# interrupted stage 1 continues from its last checkpoint.
[ -f runs/quickstart-base/model/config.json ] ||
  "$memtune" train configs/quickstart-base.yaml training.resume_from_checkpoint=latest
# Stage 2: QLoRA of that base on the bundled instruction tasks; it prints the exact-match
# accuracy on held-out tasks before and after. A rerun starts it over (memtune refuses to
# start a run among another run's checkpoints).
rm -rf runs/quickstart
"$memtune" train configs/quickstart.yaml "$@"
# One held-out prompt (the eval split's first parity task, never trained on), answered by the
# base alone and with the adapter, in the template the tasks were trained in.
instruction=$(grep -m1 '"task": "parity"' examples/data/tasks_eval.jsonl | sed 's/.*"instruction": "\([^"]*\)".*/\1/')
prompt=$'### Instruction:\n'"$instruction"$'\n\n### Response:\n'
# generate prints the prompt and its continuation: the lines after the prompt's four.
answer() { "$memtune" generate --model runs/quickstart-base/model --tokenizer examples/char-tokenizer \
             --greedy --max-new-tokens 8 --prompt "$prompt" "$@" | tail -n +5; }
echo "== memtune generate on the held-out prompt \"$instruction\""
echo "the base alone:   $(answer)"
echo "with the adapter: $(answer --adapter runs/quickstart/adapter)"
