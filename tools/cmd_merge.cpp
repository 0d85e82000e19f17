// memtune merge: a LoRA adapter merged into its (dequantized) base, saved as a plain model.
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>

#include "models/hf_model.h"
#include "tools/commands.h"
#include "tools/model_files.h"

namespace memtune::cli {

void add_merge_command(CLI::App& app) {
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

}  // namespace memtune::cli
