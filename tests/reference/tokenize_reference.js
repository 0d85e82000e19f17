#!/usr/bin/env node
// Reference ids from the Hugging Face tokenizers library (npm `tokenizers`, a native build
// of the Rust crate), for memtune's tokenizer tests.
//   node tokenize_reference.js TOKENIZER_JSON INPUT_JSONL OUTPUT_JSONL
// Each input line is a JSON string; each output line is an object with
//   ids           encode(text, addSpecialTokens=false)
//   ids_special   encode(text, addSpecialTokens=true)
//   decode        decode(ids, skipSpecialTokens=false)
//   decode_special decode(ids_special, skipSpecialTokens=false)
//   decode_skip   decode(ids_special, skipSpecialTokens=true)
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require(path.join(__dirname, 'node_modules', 'tokenizers'));

async function main() {
  const [tokPath, inPath, outPath] = process.argv.slice(2);
  if (!outPath) {
    console.error('usage: tokenize_reference.js TOKENIZER_JSON INPUT_JSONL OUTPUT_JSONL');
    process.exit(2);
  }
  const tok = Tokenizer.fromFile(tokPath);
  const lines = fs.readFileSync(inPath, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  for (const line of lines) {
    const text = JSON.parse(line);
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const idsSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    out.push(JSON.stringify({
      ids,
      ids_special: idsSpecial,
      decode: await tok.decode(ids, false),
      decode_special: await tok.decode(idsSpecial, false),
      decode_skip: await tok.decode(idsSpecial, true),
    }));
  }
  fs.writeFileSync(outPath, out.join('\n') + '\n');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
