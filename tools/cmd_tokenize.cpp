// memtune tokenize: ids of a file with a tokenizer (--tokenizer), or a whole training set
// pre-tokenized to an llm.c .bin token file (--config CONFIG --out data.bin).
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "data/dataset.h"
#include "data/token_file.h"
#include "tools/tokenize_file.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "tools/commands.h"
#include "trainer/config.h"
#include "trainer/trainer.h"

namespace memtune::cli {

void add_tokenize_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenize", "token ids of a file, or a training set pre-tokenized to a .bin file");
  struct A {
    TokenizeOptions o;
    std::string tokenizer, input, config, out;
    std::vector<std::string> overrides;
  };
  auto a = std::make_shared<A>();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json, .model, or a model directory");
  cmd->add_option("--input", a->input, "input file");
  cmd->add_option("--format", a->o.format, "jsonl (a JSON string per line), ids (a line per line), text (whole file)")
      ->capture_default_str();
  cmd->add_flag("--add-special-tokens", a->o.add_special_tokens, "add bos/eos as the tokenizer's config says");
  cmd->add_flag("--stats", a->o.stats, "print tokens and bytes per token to stderr");
  cmd->add_option("--config", a->config, "a training config: pre-tokenize its data.train_file");
  cmd->add_option("--out", a->out, "with --config: the llm.c .bin token file to write");
  cmd->add_option("overrides", a->overrides, "key=value config overrides (with --config)");
  cmd->callback([a] {
    if (!a->config.empty()) {
      MEMTUNE_CHECK(!a->out.empty(), "tokenize --config needs --out FILE.bin");
      trainer::Config c = trainer::load_config(a->config, a->overrides);
      std::string tok = c.model.tokenizer.empty() ? c.model.name_or_path : c.model.tokenizer;
      auto tokenizer = data::Tokenizer::load(tok);
      const data::DatasetOptions o = trainer::dataset_options(c.data, c.training.output_dir);
      data::Dataset ds(c.data.train_file, tokenizer.get(), o);
      // A .bin token file holds tokens only, no loss mask: training from it learns every
      // token. Written from data whose prompts this config leaves out of the loss, it would
      // train differently from its source without a word.
      MEMTUNE_CHECK(o.train_on_prompt || (ds.format() != "instruction" && ds.format() != "chat"), a->config,
                    ": data.train_file ", c.data.train_file, " is ", ds.format(),
                    " data and data.train_on_prompt is false, so training from it leaves the prompts out of the "
                    "loss; a .bin token file has no loss mask and would train on them. Train from ",
                    c.data.train_file, " itself, or write the .bin with data.train_on_prompt=true to train on "
                    "the prompts too");
      std::vector<uint32_t> stream = ds.token_stream(tokenizer->eos_id);
      data::write_token_file(a->out, stream, tokenizer->vocab_size());
      std::cout << "wrote " << a->out << ": " << ds.stats().documents << " documents, " << stream.size()
                << " tokens\n";
      return;
    }
    MEMTUNE_CHECK(!a->tokenizer.empty() && !a->input.empty(), "tokenize needs --tokenizer and --input (or --config and --out)");
    a->o.tokenizer = a->tokenizer;
    a->o.input = a->input;
    cli::tokenize_file(a->o, std::cout, std::cerr);
  });
}

}  // namespace memtune::cli
