#!/usr/bin/env bash
# Installs the Node packages the tests use as references: the Hugging Face tokenizers
# library (a native build of the Rust crate), the Jinja renderer of transformers.js (chat
# templates) and real tokenizer files of Llama 3, Qwen 3, Gemma 2 and 3 and a Llama-2-style
# vocabulary. Into tests/reference/node_modules; idempotent: installs again when
# package-lock.json changed since the last install (a copy of it is kept as the stamp).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/tests/reference"
stamp="$dir/node_modules/.memtune-package-lock.json"
if [ -f "$dir/package.json" ] && ! cmp -s "$dir/package-lock.json" "$stamp"; then
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$dir/package-lock.json" "$stamp"
fi
