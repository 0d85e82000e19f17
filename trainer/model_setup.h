#pragma once
// From the config's model/lora sections to a ready model: a Hugging Face directory or a
// preset, NF4 projections when asked, LoRA adapters or all weights trainable, the compute
// dtype chosen for this machine (and said in the log).
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/causal_lm.h"
#include "models/device_map.h"
#include "models/lora.h"
#include "models/peft.h"
#include "runtime/nf4.h"
#include "trainer/config.h"

namespace memtune::data {
class Tokenizer;
}

namespace memtune::trainer {

struct ModelBundle {
  std::unique_ptr<models::CausalLM> model;
  std::unique_ptr<data::Tokenizer> tokenizer;  // null when the model has none
  std::filesystem::path tokenizer_path;
  c10::Device device = c10::kCPU;
  at::ScalarType compute_dtype = at::kFloat;
  models::AdapterConfig adapter;               // what the adapter will be saved as (LoRA runs)
  std::vector<std::string> notes;              // decisions to log (dtype, device, sizes)
  std::vector<std::string> warnings;           // settings changed to what they must be, to log as warnings
};

// The device runtime.device names (auto: the first CUDA device when present, else CPU).
c10::Device resolve_device(const std::string& spec, const std::string& where = "runtime.device");

// training.bf16 / fp16: the Trainer's autocast, under which LoRA adapters' products run in
// the compute dtype too (models::Linear::autocast); bnb_4bit_compute_dtype alone sets the base's.
inline bool autocast_on(const Config& c) { return c.training.bf16 || c.training.fp16; }

// The dtype of the base matmuls: bnb_4bit_compute_dtype / fp16 / bf16, with auto resolved
// for the device (bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPUs without native
// bf16). `note` receives why, and a warning when an explicit choice will be slow.
at::ScalarType resolve_compute_dtype(const Config& config, const c10::Device& device, std::string* note);

// The dtype the model's dense tensors are kept in (embeddings, norms, dense projections, the
// head), and so the residual stream's: model.torch_dtype, auto being config.json's dtype
// (torch_dtype) or float32 where it names none. float32, or a 16-bit dtype that must be the
// compute dtype (`compute_dtype`, resolve_compute_dtype's): then every dense product runs in
// it as in transformers' model of that dtype (but an fp16 head's, which the loss runs in fp32:
// it forms its gradient before fp16's loss scale applies), with fp32 LoRA adapters as PEFT makes
// them (their products in fp32, as PEFT runs them without autocast). A
// 16-bit dtype with anything trained but adapters, or with another compute dtype, is a
// UserError naming the keys. `note` (optional) receives what was chosen and why.
at::ScalarType resolve_dense_dtype(const Config& config, const models::ModelSpec& spec, at::ScalarType compute_dtype,
                                   std::string* note = nullptr);

// Whether gradients need fp16's dynamic loss scaling: the matmuls run in fp16
// (`compute_dtype`, resolve_compute_dtype's: training.fp16, bnb_4bit_compute_dtype: float16, or
// auto on a GPU without bf16), or fp16 was asked for on a CPU, whose matmuls stay fp32 while the
// scaling runs as it would on a GPU.
bool fp16_loss_scaling(const Config& config, at::ScalarType compute_dtype);

// The model's shape: a Hugging Face directory's config.json, or a preset (with
// model.architecture when set). Throws UserError naming the presets when it is neither.
models::ModelSpec model_spec(const ModelConfig& config);

// The model's structure and weights, without adapters: a Hugging Face directory (loaded
// tensor by tensor, quantized as it arrives) or a preset (random weights from init_seed).
// `skip` (optional, a Hugging Face directory only): the tensors this process does not read
// (models::LoadOptions::skip; distributed.sharding: full).
using SkipTensors = std::function<std::vector<bool>(const models::CausalLM& built)>;
// `dense_dtype`: resolve_dense_dtype's; a projection quantized on load is quantized from its
// weight in that dtype, as transformers casts to torch_dtype before bitsandbytes quantizes.
std::unique_ptr<models::CausalLM> load_base_model(const ModelConfig& config, at::ScalarType dense_dtype = at::kFloat,
                                                  const SkipTensors& skip = {});

// The tokenizer model.tokenizer names, else the model directory's (tokenizer.json or
// tokenizer.model); `path` receives where it was read. Null when a preset or a directory has
// none; a model.tokenizer that holds none is a UserError.
std::unique_ptr<data::Tokenizer> load_tokenizer(const ModelConfig& config, std::filesystem::path* path = nullptr);

// The base model, quantized as configured, with LoRA (or everything trainable), and its
// tokenizer. `adapter_dir` (optional) loads an existing PEFT adapter instead of new LoRA.
ModelBundle setup_model(const Config& config, const std::filesystem::path& adapter_dir = {},
                        const SkipTensors& skip = {});

// The devices `device_map: auto` fills, in order, each with the bytes its base weights may
// take (60 % of the device's budget: the rest holds adapters, optimizer state and
// activations). `limit` is memory.device_limit in bytes (0: none); `distributed` keeps each
// rank on its one device.
std::vector<models::DeviceBudget> auto_budgets(const Config& config, const c10::Device& device, int64_t limit,
                                               bool distributed);

models::LoraOptions lora_options(const LoraConfig& lora);
// lora.rank_pattern and lora.alpha_pattern, in the config's order.
models::LoraPatterns lora_patterns(const LoraConfig& lora);

// The 4-bit code bnb_4bit_quant_type names (validated by the config's schema).
QuantType quant_type(const QuantizationConfig& q);

// The config's targets; target_modules absent takes PEFT's default for `model_type`, and a
// type PEFT has none for is refused, as PEFT refuses it, asking for target_modules.
models::LoraTargets lora_targets(const LoraConfig& lora, const std::string& model_type);

}  // namespace memtune::trainer
