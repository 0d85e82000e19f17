#pragma once
// What the model commands (init-model, merge, quantize, generate, eval) share: copying a
// model directory's tokenizer files, loading a model and adapter for inference, --dtype.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <c10/core/ScalarType.h>

#include "models/causal_lm.h"

namespace memtune::data {
class Tokenizer;
}

namespace memtune::cli {

// fp32|float32, fp16|float16, bf16|bfloat16; anything else is a UserError naming --dtype.
at::ScalarType dtype_arg(const std::string& s);

// A failed copy is a UserError naming both paths, never a raw filesystem_error (exit 1).
void copy_file_or_fail(const std::filesystem::path& from, const std::filesystem::path& to);

// tokenizer.json, tokenizer.model and their config files, where `from` has them.
void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to);

// A model directory with an optional PEFT adapter, placed whole on `device` (auto, cpu, cuda:N),
// its dense tensors kept and its products run in `dtype` (dtype_arg's names), as
// from_pretrained(dtype=...) loads and runs it; the adapter stays fp32, as PEFT's.
std::unique_ptr<models::CausalLM> load_for_inference(const std::string& model_dir, const std::string& adapter,
                                                     const std::string& device, const std::string& dtype = "fp32");

// A tokenizer with ids past the model's embedding rows would index out of range in the
// first forward: refused up front, as train refuses it.
void check_tokenizer_fits(const data::Tokenizer& tok, const models::CausalLM& model);

// "\rwhat done/total tensors" on stderr, a newline at the end.
void progress(const std::string& what, int64_t done, int64_t total);

}  // namespace memtune::cli
