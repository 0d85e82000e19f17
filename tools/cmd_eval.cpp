// memtune eval: loss, perplexity and tokens of a model (and adapter) on a dataset.
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "tools/commands.h"
#include "tools/model_files.h"
#include "trainer/evaluate.h"

namespace memtune::cli {

namespace fs = std::filesystem;

void add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "loss, perplexity and token count of a model on a dataset");
  struct A {
    std::string model, adapter, data, format = "auto", tokenizer, device = "cpu", dtype = "fp32";
    int64_t max_seq_length = 1024, max_rows = -1, batch = 4;
    bool json = false;
  };
  auto a = std::make_shared<A>();
  cmd->add_option("--model", a->model, "model directory")->required();
  cmd->add_option("--adapter", a->adapter, "PEFT adapter directory");
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer (default: the model directory's)");
  cmd->add_option("--data", a->data, ".jsonl, .txt or llm.c .bin token file")->required();
  cmd->add_option("--format", a->format, "auto, text, instruction, chat, tokens, plain")->capture_default_str();
  cmd->add_option("--max-seq-length", a->max_seq_length)->capture_default_str();
  cmd->add_option("--max-rows", a->max_rows, "evaluate the first N rows only");
  cmd->add_option("--batch", a->batch, "rows per forward pass")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_flag("--json", a->json, "print one JSON object: loss, perplexity, tokens");
  cmd->add_option("--device", a->device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  cmd->add_option("--dtype", a->dtype,
                  "fp32, bf16 or fp16 (GPUs): the dtype the model's weights are kept and its products run in, "
                  "as from_pretrained's dtype; adapters stay fp32")
      ->capture_default_str();
  cmd->callback([a] {
    auto model = load_for_inference(a->model, a->adapter, a->device, a->dtype);
    std::unique_ptr<data::Tokenizer> tok;
    fs::path tp = a->tokenizer.empty() ? fs::path(a->model) : fs::path(a->tokenizer);
    if (fs::exists(tp / "tokenizer.json") || fs::is_regular_file(tp)) tok = data::Tokenizer::load(tp);
    if (tok) check_tokenizer_fits(*tok, *model);
    data::DatasetOptions o;
    o.format = a->format;
    o.max_seq_length = a->max_seq_length;
    o.pack_sequences = true;
    o.train_on_prompt = true;
    data::Dataset ds(a->data, tok.get(), o);
    // Out of memory at --batch: half as many rows at a time, the same rows, the same figures
    // (to the last bits; over an LLM.int8 base to its choice of outlier columns per batch).
    trainer::EvalResult r = trainer::evaluate(*model, ds, a->batch, a->max_rows, {}, [] { return true; });
    if (r.oom_retries > 0)
      std::fprintf(stderr, "eval: out of memory at --batch %lld; finished at %lld rows at a time\n",
                   static_cast<long long>(a->batch), static_cast<long long>(r.micro_batch));
    if (a->json)
      std::cout << nlohmann::json{{"loss", r.loss}, {"perplexity", r.perplexity}, {"tokens", r.tokens}}.dump() << "\n";
    else
      std::printf("loss %.6f  perplexity %.4f  tokens %lld\n", r.loss, r.perplexity, static_cast<long long>(r.tokens));
  });
}

}  // namespace memtune::cli
