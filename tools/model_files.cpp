#include "tools/model_files.h"

#include <cstdio>

#include "data/tokenizer.h"
#include "models/hf_model.h"
#include "models/peft.h"
#include "models/placement.h"
#include "runtime/error.h"
#include "trainer/model_setup.h"

namespace memtune::cli {

namespace fs = std::filesystem;

at::ScalarType dtype_arg(const std::string& s) {
  if (s == "fp32" || s == "float32") return at::kFloat;
  if (s == "fp16" || s == "float16") return at::kHalf;
  if (s == "bf16" || s == "bfloat16") return at::kBFloat16;
  fail("--dtype '", s, "' (fp32, fp16, bf16)");
}

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

std::unique_ptr<models::CausalLM> load_for_inference(const std::string& model_dir, const std::string& adapter,
                                                     const std::string& device, const std::string& dtype) {
  const c10::Device d = trainer::resolve_device(device, "--device");
  models::LoadOptions o;
  o.dense_dtype = dtype_arg(dtype);
  MEMTUNE_CHECK(o.dense_dtype != at::kHalf || !d.is_cpu(), "--dtype ", dtype,
                ": CPUs have no fp16 matmul. Hint: --dtype fp32 or bf16 here, fp16 on a GPU");
  auto model = models::load_hf_model(model_dir, o);
  model->set_compute_dtype(o.dense_dtype);
  if (!adapter.empty()) {
    models::load_adapter(*model, adapter);
    // Its modules_to_save tensors in the model's dtype, as PEFT's copies of the model's modules.
    for (auto& slot : model->tensors())
      if (slot.tensor->defined() && slot.tensor->requires_grad()) *slot.tensor = slot.tensor->detach();
    model->set_dense_dtype(o.dense_dtype);
  }
  model->place(models::Placement::all_on(d, model->num_layers()));
  return model;
}

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

}  // namespace memtune::cli
