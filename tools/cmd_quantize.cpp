// memtune quantize: a model with 4-bit (NF4 or FP4) projections in bitsandbytes' checkpoint format.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <CLI/CLI.hpp>

#include "models/hf_model.h"
#include "models/registry.h"
#include "models/skip_modules.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "runtime/units.h"
#include "tools/commands.h"
#include "tools/model_files.h"

namespace memtune::cli {

void add_quantize_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "write a model with 4-bit projections in bitsandbytes' format");
  struct A {
    std::string model, out, quant_type = "nf4";
    int64_t blocksize = 64;
    bool no_double_quant = false;
    std::vector<std::string> skip_modules;
  };
  auto a = std::make_shared<A>();
  cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
  cmd->add_option("--out", a->out, "output directory")->required();
  cmd->add_option("--quant-type", a->quant_type,
                  "4-bit code (bnb_4bit_quant_type); nf4 here, what QLoRA recipes use, where a training "
                  "config that leaves the key out takes bitsandbytes' default, fp4")
      ->check(CLI::IsMember({"nf4", "fp4"}))
      ->capture_default_str();
  cmd->add_option("--blocksize", a->blocksize, "elements per absmax block")->capture_default_str();
  cmd->add_flag("--no-double-quant", a->no_double_quant, "keep the absmax values in fp32");
  cmd->add_option("--llm-int8-skip-modules", a->skip_modules,
                  "modules kept dense, as bitsandbytes' llm_int8_skip_modules (comma separated; a list replaces "
                  "transformers' default and must name lm_head), written to config.json's quantization_config")
      ->delimiter(',');
  cmd->callback([a] {
    models::LoadOptions lo;
    lo.load_in_4bit = true;
    lo.quant_type = quant_type_from_name(a->quant_type);
    lo.blocksize = a->blocksize;
    lo.double_quant = !a->no_double_quant;
    lo.on_tensor = [](const std::string&, int64_t d, int64_t t) { progress("quantize", d, t); };
    if (!a->skip_modules.empty()) {
      models::check_skip_modules(*models::build_model(models::read_hf_config(a->model)), a->skip_modules,
                                 "--llm-int8-skip-modules");
      lo.skip_modules = a->skip_modules;
    }
    auto model = models::load_hf_model(a->model, lo);
    for (const models::Linear* l : model->linears())
      MEMTUNE_CHECK(!l->int8(), a->model, ": ", l->name(), " is stored in bitsandbytes' 8-bit form (LLM.int8); "
                    "quantize reads dense or 4-bit models. Hint: quantize the model's dense checkpoint");
    models::save_hf_model(*model, a->out, {});
    copy_tokenizer_files(a->model, a->out);
    int64_t n = 0, bytes = 0, dense = 0;
    for (models::Linear* l : model->linears()) {
      if (!l->quantized()) {
        ++dense;
        continue;
      }
      n += l->qweight()->numel();
      bytes += l->qweight()->storage_bytes();
    }
    std::printf("quantized %lld projection parameters to %s (%.3f bits per parameter)%s -> %s\n",
                static_cast<long long>(n), format_bytes(bytes).c_str(), 8.0 * bytes / std::max<int64_t>(1, n),
                dense ? str_cat(", ", dense, " projection", dense > 1 ? "s" : "", " kept dense").c_str() : "",
                a->out.c_str());
  });
}

}  // namespace memtune::cli
