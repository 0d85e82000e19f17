// Commands on models: init-model, merge, quantize, generate, eval.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/batch.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "models/generate.h"
#include "models/hf_model.h"
#include "models/peft.h"
#include "models/placement.h"
#include "models/registry.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "runtime/units.h"
#include "tools/commands.h"
#include "trainer/evaluate.h"
#include "trainer/model_setup.h"

namespace memtune::cli {

namespace fs = std::filesystem;

namespace {

at::ScalarType dtype_arg(const std::string& s) {
  if (s == "fp32" || s == "float32") return at::kFloat;
  if (s == "fp16" || s == "float16") return at::kHalf;
  if (s == "bf16" || s == "bfloat16") return at::kBFloat16;
  fail("--dtype '", s, "' (fp32, fp16, bf16)");
}

// A failed copy is a UserError naming both paths, never a raw filesystem_error (exit 1).
void copy_file_or_fail(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  MEMTUNE_CHECK(!ec, "cannot copy '", from.string(), "' to '", to.string(), "': ", ec.message());
}

void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "generation_config.json"})
    if (fs::exists(from / f)) copy_file_or_fail(from / f, to / f);
}

// Loads a model dir with an optional adapter onto one device, for inference.
std::unique_ptr<models::CausalLM> load_for_inference(const std::string& model_dir, const std::string& adapter,
                                                     const std::string& device) {
  const c10::Device d = trainer::resolve_device(device, "--device");
  auto model = models::load_hf_model(model_dir, {});
  if (!adapter.empty()) models::load_adapter(*model, adapter);
  model->place(models::Placement::all_on(d, model->num_layers()));
  return model;
}

// A tokenizer with ids past the model's embedding rows would index out of range in the
// first forward: refused up front, as train refuses it.
void check_tokenizer_fits(const data::Tokenizer& tok, const models::CausalLM& model) {
  MEMTUNE_CHECK(tok.vocab_size() <= model.spec().vocab_size, "the tokenizer has ", tok.vocab_size(),
                " ids but the model's vocab_size is ", model.spec().vocab_size,
                "; it is not this model's tokenizer (pass the right one with --tokenizer)");
}

void progress(const std::string& what, int64_t done, int64_t total) {
  std::fprintf(stderr, "\r%s %lld/%lld tensors", what.c_str(), static_cast<long long>(done),
               static_cast<long long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

}  // namespace

void add_model_commands(CLI::App& app) {
  {
    auto* cmd = app.add_subcommand("init-model", "write a randomly initialised model in Hugging Face format");
    struct A {
      std::string arch = "llama", preset = "tiny", config, out, tokenizer;
      uint64_t seed = 0;
    };
    auto a = std::make_shared<A>();
    cmd->add_option("--arch", a->arch, "llama, gpt2, or a registered architecture name")->capture_default_str();
    auto* preset = cmd->add_option("--preset", a->preset, "tiny, or a preset name (tiny-llama, llama-3.2-1b, gpt2, ...)")
                       ->capture_default_str();
    auto* config = cmd->add_option("--config", a->config,
                                   "a Hugging Face config.json (or its directory) to build instead of a preset")
                       ->excludes(preset);
    cmd->add_option("--out", a->out, "output directory")->required();
    cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
    cmd->add_option("--tokenizer", a->tokenizer, "tokenizer directory or file to copy in");
    cmd->callback([a, config] {
      std::optional<models::ModelSpec> spec;
      if (config->count() > 0) {
        spec = models::read_hf_config(a->config);
      } else {
        std::string name = a->preset == "tiny" ? (a->arch == "gpt2" ? "tiny-gpt2" : "tiny-llama") : a->preset;
        spec = models::preset(name);
        MEMTUNE_CHECK(spec.has_value(), "--preset '", a->preset, "' is not a preset");
        if (a->arch != "llama" && a->arch != "gpt2") spec->architecture = a->arch;
        MEMTUNE_CHECK(!(a->arch == "gpt2" && !spec->is_gpt2()), "--arch gpt2 with a non-GPT-2 preset '", name, "'");
      }
      // Checked before anything is written, so a bad --tokenizer leaves no model behind.
      MEMTUNE_CHECK(a->tokenizer.empty() || fs::exists(a->tokenizer), "--tokenizer '", a->tokenizer,
                    "' does not exist (a tokenizer directory, tokenizer.json or tokenizer.model)");
      auto model = models::init_random_model(*spec, a->seed);
      models::save_hf_model(*model, a->out, {});
      if (!a->tokenizer.empty()) {
        fs::path t(a->tokenizer);
        if (fs::is_directory(t)) copy_tokenizer_files(t, a->out);
        else copy_file_or_fail(t, fs::path(a->out) / t.filename());
      }
      std::cout << "wrote " << a->out << ": " << spec->architecture << ", " << model->base_parameter_count()
                << " parameters, seed " << a->seed << "\n";
    });
  }
  {
    auto* cmd = app.add_subcommand("merge", "merge a LoRA adapter into its (dequantized) base model");
    struct A {
      std::string model, adapter, out, dtype = "fp32";
    };
    auto a = std::make_shared<A>();
    cmd->add_option("--model", a->model, "base model directory")->required();
    cmd->add_option("--adapter", a->adapter, "PEFT adapter directory")->required();
    cmd->add_option("--out", a->out, "output directory")->required();
    cmd->add_option("--dtype", a->dtype, "fp32, fp16 or bf16")->capture_default_str();
    cmd->callback([a] {
      auto model = load_for_inference(a->model, a->adapter, "cpu");
      for (models::Linear* l : model->linears()) l->merge_lora();
      models::SaveOptions o;
      o.dtype = dtype_arg(a->dtype);
      o.keep_4bit = false;
      models::save_hf_model(*model, a->out, o);
      copy_tokenizer_files(a->model, a->out);
      std::cout << "merged " << a->adapter << " into " << a->model << " -> " << a->out << "\n";
    });
  }
  {
    auto* cmd = app.add_subcommand("quantize", "write a model with NF4 projections in bitsandbytes' format");
    struct A {
      std::string model, out;
      int64_t blocksize = 64;
      bool no_double_quant = false;
    };
    auto a = std::make_shared<A>();
    cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
    cmd->add_option("--out", a->out, "output directory")->required();
    cmd->add_option("--blocksize", a->blocksize, "elements per absmax block")->capture_default_str();
    cmd->add_flag("--no-double-quant", a->no_double_quant, "keep the absmax values in fp32");
    cmd->callback([a] {
      models::LoadOptions lo;
      lo.load_in_4bit = true;
      lo.blocksize = a->blocksize;
      lo.double_quant = !a->no_double_quant;
      lo.on_tensor = [](const std::string&, int64_t d, int64_t t) { progress("quantize", d, t); };
      auto model = models::load_hf_model(a->model, lo);
      models::save_hf_model(*model, a->out, {});
      copy_tokenizer_files(a->model, a->out);
      int64_t n = 0, bytes = 0;
      for (models::Linear* l : model->linears()) {
        n += l->qweight()->numel();
        bytes += l->qweight()->storage_bytes();
      }
      std::printf("quantized %lld projection parameters to %s (%.3f bits per parameter) -> %s\n",
                  static_cast<long long>(n), format_bytes(bytes).c_str(), 8.0 * bytes / std::max<int64_t>(1, n),
                  a->out.c_str());
    });
  }
  {
    auto* cmd = app.add_subcommand("generate", "continue a prompt with a model (and adapter)");
    struct A {
      std::string model, adapter, prompt, tokenizer, device = "cpu";
      int64_t max_new_tokens = 64;
      bool greedy = false;
      double temperature = 1.0, top_p = 1.0;
      uint64_t seed = 0;
    };
    auto a = std::make_shared<A>();
    cmd->add_option("--model", a->model, "model directory")->required();
    cmd->add_option("--adapter", a->adapter, "PEFT adapter directory");
    cmd->add_option("--tokenizer", a->tokenizer, "tokenizer (default: the model directory's)");
    cmd->add_option("--prompt", a->prompt, "text to continue")->required();
    cmd->add_option("--max-new-tokens", a->max_new_tokens)->capture_default_str()->check(CLI::NonNegativeNumber);
    cmd->add_flag("--greedy", a->greedy, "always the most likely token");
    cmd->add_option("--temperature", a->temperature)->capture_default_str();
    cmd->add_option("--top-p", a->top_p)->capture_default_str();
    cmd->add_option("--seed", a->seed)->capture_default_str();
    cmd->add_option("--device", a->device, "cpu, cuda, cuda:N or auto")->capture_default_str();
    cmd->callback([a] {
      auto model = load_for_inference(a->model, a->adapter, a->device);
      auto tok = data::Tokenizer::load(a->tokenizer.empty() ? a->model : a->tokenizer);
      check_tokenizer_fits(*tok, *model);
      models::GenerateOptions o;
      o.max_new_tokens = a->max_new_tokens;
      o.greedy = a->greedy;
      o.temperature = a->temperature;
      o.top_p = a->top_p;
      o.seed = a->seed;
      o.eos_id = tok->eos_id;
      std::vector<int32_t> generated = models::generate(*model, tok->encode(a->prompt, true), o);
      std::cout << a->prompt << tok->decode(generated, true) << "\n";
    });
  }
  {
    auto* cmd = app.add_subcommand("eval", "loss, perplexity and token count of a model on a dataset");
    struct A {
      std::string model, adapter, data, format = "auto", tokenizer, device = "cpu";
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
    cmd->callback([a] {
      auto model = load_for_inference(a->model, a->adapter, a->device);
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
      trainer::EvalResult r = trainer::evaluate(*model, ds, a->batch, a->max_rows);
      if (a->json)
        std::cout << nlohmann::json{{"loss", r.loss}, {"perplexity", r.perplexity}, {"tokens", r.tokens}}.dump() << "\n";
      else
        std::printf("loss %.6f  perplexity %.4f  tokens %lld\n", r.loss, r.perplexity, static_cast<long long>(r.tokens));
    });
  }
}

}  // namespace memtune::cli
