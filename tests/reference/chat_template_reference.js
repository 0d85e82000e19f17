#!/usr/bin/env node
// Reference renderings of a model's own chat template, for memtune's built-in templates'
// tests: the Jinja template of a tokenizer_config.json rendered by @huggingface/jinja (the
// renderer transformers.js uses), then encoded by the Hugging Face tokenizers library.
//   node chat_template_reference.js TOKENIZER_DIR INPUT_JSONL OUTPUT_JSONL
// TOKENIZER_DIR holds tokenizer_config.json (chat_template, bos_token, eos_token) and
// tokenizer.json. Each input line is {"messages": [{"role", "content"}, ...]}; each output
// line is {"text", "ids"} (ids: encode(text, addSpecialTokens=false)), or {"error"} where the
// template raises (raise_exception).
'use strict';
const fs = require('fs');
const path = require('path');
const { Template } = require(path.join(__dirname, 'node_modules', '@huggingface', 'jinja'));
const { Tokenizer } = require(path.join(__dirname, 'node_modules', 'tokenizers'));

// A special token as tokenizer_config.json writes it: a string, or {"content": ...}.
const tokenText = (t) => (t === null || t === undefined ? '' : typeof t === 'string' ? t : t.content);

async function main() {
  const [dir, inPath, outPath] = process.argv.slice(2);
  if (!outPath) {
    console.error('usage: chat_template_reference.js TOKENIZER_DIR INPUT_JSONL OUTPUT_JSONL');
    process.exit(2);
  }
  const config = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
  if (typeof config.chat_template !== 'string') throw new Error(`${dir}: tokenizer_config.json has no chat_template`);
  const template = new Template(config.chat_template);
  const tok = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  const lines = fs.readFileSync(inPath, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  for (const line of lines) {
    const { messages } = JSON.parse(line);
    let text;
    try {
      text = template.render({
        messages,
        bos_token: tokenText(config.bos_token),
        eos_token: tokenText(config.eos_token),
        add_generation_prompt: false,
      });  // raise_exception is the renderer's own: it throws
    } catch (e) {
      out.push(JSON.stringify({ error: String(e.message || e) }));
      continue;
    }
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    out.push(JSON.stringify({ text, ids }));
  }
  fs.writeFileSync(outPath, out.join('\n') + '\n');
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
