#!/usr/bin/env node
// The Hugging Face tokenizers library (npm `tokenizers`) on the same corpus as
// bench_tokenizer: encodes each JSONL line without special tokens, one at a time.
//   node bench/tokenizer_bench.js TOKENIZER_JSON CORPUS_JSONL
// Prints one JSON line: {"bytes", "tokens", "wall_s", "cpu_s"}.
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require(path.join(__dirname, '..', 'tests', 'reference', 'node_modules', 'tokenizers'));

async function main() {
  const [tokPath, corpusPath] = process.argv.slice(2);
  const tok = Tokenizer.fromFile(tokPath);
  const docs = fs.readFileSync(corpusPath, 'utf8').split('\n').filter((l) => l.length).map((l) => JSON.parse(l));
  let bytes = 0;
  for (const d of docs) bytes += Buffer.byteLength(d, 'utf8');
  const cpu0 = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  let tokens = 0;
  for (const d of docs) tokens += (await tok.encode(d, null, { addSpecialTokens: false })).getLength();
  const wall = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(cpu0);
  console.log(JSON.stringify({ bytes, tokens, wall_s: wall, cpu_s: (cpu.user + cpu.system) / 1e6 }));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
