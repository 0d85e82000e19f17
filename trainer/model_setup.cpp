#include "trainer/model_setup.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "data/tokenizer.h"
#include "models/hf_model.h"
#include "models/registry.h"
#include "models/skip_modules.h"
#include "runtime/cuda_info.h"
#include "runtime/error.h"
#include "runtime/int8.h"
#include "runtime/memory.h"
#include "runtime/nf4.h"
#include "runtime/units.h"

namespace memtune::trainer {

namespace fs = std::filesystem;

c10::Device resolve_device(const std::string& spec, const std::string& where) {
  if (spec == "auto") return at::hasCUDA() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  c10::Device d = [&] {
    try {
      return c10::Device(spec);
    } catch (const std::exception&) {
      fail(where, ": '", spec, "' is not a device (auto, cpu, cuda, cuda:N)");
    }
  }();
  MEMTUNE_CHECK(d.is_cpu() || (d.is_cuda() && at::hasCUDA()), where, ": '", spec,
                "' is not available here (no CUDA device); use cpu or auto");
  return d;
}

namespace {

at::ScalarType dtype_from_name(const std::string& name) {
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}


// What the config asks of the matmuls before the device has its say: training.fp16 / bf16,
// else bnb_4bit_compute_dtype (auto included).
std::string asked_compute_dtype(const Config& c) {
  if (c.training.fp16) return "float16";
  if (c.training.bf16) return "bfloat16";
  return c.model.quantization_config.bnb_4bit_compute_dtype;
}

}  // namespace

bool fp16_loss_scaling(const Config& c, at::ScalarType compute_dtype) {
  return asked_compute_dtype(c) == "float16" || compute_dtype == at::kHalf;
}

at::ScalarType resolve_compute_dtype(const Config& c, const c10::Device& device, std::string* note) {
  const std::string asked = asked_compute_dtype(c);
  if (asked == "auto") {
    if (device.is_cuda()) {
      const int cc = cuda_compute_capability(device.has_index() ? device.index() : 0);
      const std::string sm = "sm_" + std::to_string(cc);
      *note = has_native_bf16(cc)
                  ? "compute dtype bfloat16 (auto: this GPU, " + sm + ", has bf16)"
                  : "compute dtype float16 (auto: this GPU, " + sm + ", has no native bf16; fp16 loss scaling on)";
      return has_native_bf16(cc) ? at::kBFloat16 : at::kHalf;
    }
    *note = "compute dtype float32 (auto: this CPU has no native bf16/fp16 matmul; bf16 runs about 30x slower "
            "than fp32 here)";
    return at::kFloat;
  }
  // Which key asked, and whether it overrode an explicit bnb_4bit_compute_dtype (as Hugging
  // Face's autocast runs the matmuls in the autocast dtype whatever the quantization config says).
  const std::string& bnb = c.model.quantization_config.bnb_4bit_compute_dtype;
  const bool from_training = c.training.fp16 || c.training.bf16;
  const bool bnb_default = bnb == QuantizationConfig{}.bnb_4bit_compute_dtype;
  std::string by = from_training ? (c.training.fp16 ? "training.fp16" : "training.bf16")
                   : bnb_default ? "the default, as transformers computes float32 weights without training.bf16 or fp16"
                                 : "bnb_4bit_compute_dtype";
  if (from_training && bnb != "auto" && !bnb_default && bnb != asked) by += ", over bnb_4bit_compute_dtype: " + bnb;
  at::ScalarType t = dtype_from_name(asked);
  if (device.is_cpu() && t == at::kHalf) {
    // LibTorch's CPU kernels have no fp16 matmul: the matmuls run in fp32, and fp16's
    // dynamic loss scaling still runs, so the run behaves as it would on a GPU.
    *note = "compute dtype float32: fp16 was asked for (" + by +
            "), but CPUs have no fp16 matmul; its loss scaling stays on";
    return at::kFloat;
  }
  *note = "compute dtype " + asked + " (" + by + ")";
  if (device.is_cpu() && t == at::kBFloat16)
    *note += "; warning: this CPU has no native bf16, matmuls run about 30x slower than fp32 (bnb_4bit_compute_dtype: "
             "auto picks float32 here)";
  return t;
}

at::ScalarType resolve_dense_dtype(const Config& c, const models::ModelSpec& spec, at::ScalarType compute_dtype,
                                   std::string* note) {
  std::string name = c.model.torch_dtype, why = "model.torch_dtype";
  if (name == "auto") {
    // transformers 5 writes dtype, earlier versions torch_dtype.
    const nlohmann::json& d = spec.extra.value("dtype", nlohmann::json());
    name = d.is_string() ? d.get<std::string>() : spec.torch_dtype;
    why = "model.torch_dtype auto: config.json's dtype";
    MEMTUNE_CHECK(name == "float32" || name == "bfloat16" || name == "float16", c.model.name_or_path,
                  "/config.json: dtype '", name, "' is not one memtune keeps dense weights in (float32, bfloat16, "
                  "float16). Hint: set model.torch_dtype");
  }
  const at::ScalarType dtype = dtype_from_name(name);
  if (dtype == at::kFloat) {
    if (note) *note = "dense weights float32 (" + why + ")";
    return dtype;
  }
  const std::string hint = " Hint: model.torch_dtype: float32 with training.bf16 (or fp16): true keeps fp32 weights "
                           "and runs the products in 16 bits";
  MEMTUNE_CHECK(c.training.finetune != "full", why, " is ", name, ", and training.finetune: full trains the dense "
                "weights: transformers would update them in ", name, " itself (AdamW's states too), losing updates "
                "smaller than its rounding, where memtune keeps trained weights in float32.", hint);
  MEMTUNE_CHECK(c.lora.modules_to_save.empty(), why, " is ", name, ", and lora.modules_to_save trains whole tensors, "
                "which memtune keeps in float32 (PEFT would train its copies in ", name, ").", hint);
  MEMTUNE_CHECK(c.lora.bias == "none", why, " is ", name, ", and lora.bias: ", c.lora.bias, " trains the base's biases, ",
                "which memtune keeps in float32 (PEFT would train them in ", name, ").", hint);
  MEMTUNE_CHECK(compute_dtype == dtype, why, " is ", name, ": the dense weights and the activations are ", name,
                ", and the products would run in ", nf4_dtype_name(compute_dtype),
                " (training.bf16 / training.fp16 / quantization_config.bnb_4bit_compute_dtype, resolved for ",
                c.runtime.device, "). memtune runs a ", name, " model's products in ", name,
                ", as transformers' does.",
                dtype == at::kHalf && !c.training.fp16
                    ? " Hint: training.fp16: true on a GPU (CPUs have no fp16 matmul), or model.torch_dtype: float32"
                : dtype == at::kHalf ? " Hint: CPUs have no fp16 matmul: model.torch_dtype: float32 here"
                                     : " Hint: training.bf16: true (on a CPU bf16 runs about 30x slower than fp32), "
                                       "or model.torch_dtype: float32");
  if (note) *note = "dense weights and activations " + name + " (" + why + "); LoRA adapters float32, as PEFT's";
  return dtype;
}

models::ModelSpec model_spec(const ModelConfig& m) {
  if (fs::is_directory(m.name_or_path)) {
    MEMTUNE_CHECK(m.architecture.empty(), "model.architecture: '", m.architecture, "' picks a preset's architecture, "
                  "and model.name_or_path '", m.name_or_path, "' is a model directory, whose config.json names its "
                  "own (architectures). Hint: drop the key, or edit config.json");
    MEMTUNE_CHECK(m.init_seed == ModelConfig{}.init_seed, "model.init_seed: ", m.init_seed,
                  " seeds a preset's random weights, and model.name_or_path '", m.name_or_path,
                  "' is a model directory, whose weights are loaded. Hint: drop the key");
    return models::read_hf_config(m.name_or_path);
  }
  std::optional<models::ModelSpec> spec = models::preset(m.name_or_path);
  if (!spec) {
    std::string names;
    for (const auto& n : models::preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("model.name_or_path: '", m.name_or_path, "' is neither a directory with config.json nor a preset (",
         names, ")");
  }
  if (!m.architecture.empty()) spec->architecture = m.architecture;
  return *spec;
}

std::unique_ptr<models::CausalLM> load_base_model(const ModelConfig& m, at::ScalarType dense_dtype,
                                                  const SkipTensors& skip) {
  const auto& q = m.quantization_config;
  fs::path dir(m.name_or_path);
  if (fs::is_directory(dir)) {
    models::LoadOptions o;
    o.dense_dtype = dense_dtype;
    o.load_in_4bit = q.load_in_4bit;
    o.load_in_8bit = q.load_in_8bit;
    o.int8_threshold = q.llm_int8_threshold;
    o.quant_type = quant_type(q);
    o.blocksize = q.blocksize;
    o.double_quant = q.bnb_4bit_use_double_quant;
    o.skip_modules = q.llm_int8_skip_modules;
    o.skip = skip;
    return models::load_hf_model(dir, o);
  }
  auto model = models::init_random_model(model_spec(m), m.init_seed);
  model->set_dense_dtype(dense_dtype);
  const models::SkipMatcher dense(q.llm_int8_skip_modules, "model.quantization_config.llm_int8_skip_modules");
  for (models::Linear* l : model->linears()) {
    if (dense.keeps_dense(l->name())) continue;
    if (q.load_in_4bit) l->quantize(q.blocksize, q.bnb_4bit_use_double_quant, quant_type(q));
    if (q.load_in_8bit) l->quantize_int8(q.llm_int8_threshold);
  }
  return model;
}

QuantType quant_type(const QuantizationConfig& q) { return quant_type_from_name(q.bnb_4bit_quant_type); }

models::LoraOptions lora_options(const LoraConfig& l) {
  models::LoraOptions o;
  o.r = l.r;
  o.alpha = l.lora_alpha;
  o.dropout = l.lora_dropout;
  o.use_rslora = l.use_rslora;
  o.use_dora = l.use_dora;
  o.init = l.init_lora_weights;
  return o;
}

models::LoraPatterns lora_patterns(const LoraConfig& l) { return {l.rank_pattern, l.alpha_pattern}; }

models::LoraTargets lora_targets(const LoraConfig& l, const std::string& model_type) {
  models::LoraTargets t;
  t.target_modules = l.target_modules.empty() ? models::peft_default_targets(model_type) : l.target_modules;
  MEMTUNE_CHECK(!t.target_modules.empty(), "lora.target_modules is not set, and PEFT has no default for model_type '",
                model_type, "'; name the projections to adapt (e.g. [q_proj, v_proj]) or all-linear");
  t.exclude_modules = l.exclude_modules;
  t.layers_to_transform = l.layers_to_transform;
  t.modules_to_save = l.modules_to_save;
  return t;
}

ModelBundle setup_model(const Config& c, const fs::path& adapter_dir, const SkipTensors& skip) {
  ModelBundle b;
  b.device = resolve_device(c.runtime.device);
  std::string note;
  b.compute_dtype = resolve_compute_dtype(c, b.device, &note);
  b.notes.push_back(note);

  // llm_int8_skip_modules is checked on the model's structure before the weights are read.
  std::vector<std::string> skip_unused;
  if (c.model.quantization_config.llm_int8_skip_modules)
    skip_unused = models::check_skip_modules(*models::build_model(model_spec(c.model)),
                                             *c.model.quantization_config.llm_int8_skip_modules,
                                             "model.quantization_config.llm_int8_skip_modules");
  b.model = load_base_model(c.model, resolve_dense_dtype(c, model_spec(c.model), b.compute_dtype, &note), skip);
  b.notes.push_back(note);
  models::CausalLM& model = *b.model;
  const models::ModelSpec& spec = model.spec();
  MEMTUNE_CHECK(spec.rope_scaling.type != "dynamic" || c.data.max_seq_length <= spec.max_position_embeddings,
                "data.max_seq_length ", c.data.max_seq_length, " is past max_position_embeddings ",
                spec.max_position_embeddings, " of a model with rope_scaling dynamic, whose scaling memtune applies "
                "within max_position_embeddings only (transformers keeps the longest sequence's scaling for the "
                "forwards that follow); set data.max_seq_length <= ", spec.max_position_embeddings);
  const models::DropoutRates dropout = models::dropout_rates(spec);
  MEMTUNE_CHECK(std::max({dropout.residual, dropout.embedding, dropout.attention}) < 1, c.model.name_or_path,
                "/config.json: a dropout rate of 1 drops every value in training, and nothing would train. Hint: a "
                "rate in [0, 1)");
  MEMTUNE_CHECK(model.applies_dropout() || dropout.residual + dropout.embedding + dropout.attention == 0,
                c.model.name_or_path, "/config.json asks for dropout in training (",
                spec.is_gpt2() ? "resid_pdrop, embd_pdrop, attn_pdrop" : "attention_dropout",
                "), which architecture '", spec.architecture, "' does not apply. Hint: set it to 0.0 in config.json, "
                "or apply it in the architecture's layer() (see models/arch/llama.cpp) and override applies_dropout()");
  MEMTUNE_CHECK(dropout.attention == 0 || c.model.attn_implementation != "sdpa", c.model.name_or_path,
                "/config.json drops attention probabilities in training (",
                spec.is_gpt2() ? "attn_pdrop " : "attention_dropout ",
                dropout.attention, "), and model.attn_implementation: sdpa draws its own masks, which cannot follow "
                "each sample through micro-batch splits and retries. Hint: attn_implementation auto or eager, or "
                "set it to 0.0 in config.json");
  if (dropout.residual > 0 || dropout.embedding > 0 || dropout.attention > 0)
    b.notes.push_back(str_cat("dropout in training, from config.json: ",
                              spec.is_gpt2() ? str_cat("resid_pdrop ", dropout.residual, ", embd_pdrop ",
                                                       dropout.embedding, ", attn_pdrop ", dropout.attention)
                                             : str_cat("attention_dropout ", dropout.attention)));
  model.set_compute_dtype(b.compute_dtype, autocast_on(c));
  model.set_attention_kernel(models::parse_attention_kernel(c.model.attn_implementation));

  // Adapters are drawn from the training seed, so a run is reproducible end to end.
  at::manual_seed(c.training.seed);
  if (!adapter_dir.empty()) {
    models::LoraSummary s = models::load_adapter(model, adapter_dir);
    b.adapter = models::read_adapter_config(adapter_dir);
    b.notes.push_back("adapter " + adapter_dir.string() + ": " + s.describe());
  } else if (c.training.finetune == "lora") {
    b.adapter.lora = lora_options(c.lora);
    b.adapter.targets = lora_targets(c.lora, spec.model_type);
    b.adapter.patterns = lora_patterns(c.lora);
    const std::string decided = models::check_lora_patterns(model, b.adapter.targets, b.adapter.patterns, "lora");
    if (!decided.empty()) b.notes.push_back(decided);
    models::LoraSummary s = models::apply_lora(model, b.adapter.lora, b.adapter.targets, b.adapter.patterns);
    b.adapter.base_model_name_or_path = c.model.name_or_path;
    // PEFT takes fan_in_fan_out from the module: true for weights stored [in, out] (GPT-2's
    // Conv1D), false for Linear, warning when the config said otherwise.
    const std::vector<models::Linear*> linears = model.linears();
    const bool stored_in_out =
        std::any_of(linears.begin(), linears.end(), [](const models::Linear* l) { return l->fan_in_fan_out(); });
    b.adapter.fan_in_fan_out = stored_in_out;
    if (c.lora.fan_in_fan_out && !stored_in_out)
      b.warnings.push_back("lora.fan_in_fan_out is true, but this model's projections are Linear layers stored "
                           "[out, in]; setting it to false, as PEFT does");
    if (c.lora.target_modules.empty()) {
      std::string names;
      for (const auto& n : b.adapter.targets.target_modules) names += (names.empty() ? "" : ", ") + n;
      b.notes.push_back("lora.target_modules is not set: PEFT's default for " + spec.model_type + ", [" + names +
                        "] (all-linear adapts every projection)");
    }
    if (c.lora.bias != "none") {
      const auto whole = models::modules_to_save_tensors(model, c.lora.modules_to_save, "lora.modules_to_save");
      const auto biases = models::lora_bias_tensors(model, c.lora.bias);
      for (const models::TensorSlot* t : biases)
        MEMTUNE_CHECK(std::find(whole.begin(), whole.end(), t) == whole.end(), "lora.bias: '", c.lora.bias,
                      "' selects ", t->name, ", which lora.modules_to_save trains whole already (PEFT would keep ",
                      "and save two copies of it). Hint: bias: lora_only, or leave that module out of modules_to_save");
      const int64_t n = models::apply_lora_bias(model, c.lora.bias, "lora.bias");
      s.trainable_parameters += n;
      b.adapter.bias = c.lora.bias;
      b.notes.push_back(str_cat("lora.bias: ", c.lora.bias, ": ", biases.size(), " biases trained (", n,
                                " parameters, fp32)"));
    }
    if (!c.lora.modules_to_save.empty()) {
      const int64_t n = models::apply_modules_to_save(model, c.lora.modules_to_save, "lora.modules_to_save");
      b.adapter.modules_to_save = c.lora.modules_to_save;
      std::string names;
      for (const models::TensorSlot* t : models::modules_to_save_tensors(model, c.lora.modules_to_save, ""))
        names += (names.empty() ? "" : ", ") + t->name;
      b.notes.push_back(str_cat("modules_to_save: ", names, " trained in full (", n, " parameters, fp32)"));
      s.trainable_parameters += n;
      s.total_parameters += n;  // PEFT keeps each module and its trained copy
    }
    // As PEFT's print_trainable_parameters counts them: every trained tensor, of all.
    b.notes.push_back("LoRA on " + std::to_string(s.modules.size()) + " projections: " + s.describe());
  } else {
    int64_t n = models::make_all_trainable(model);
    b.notes.push_back("full fine-tune: " + std::to_string(n) + " trainable parameters");
  }

  int64_t nf4 = 0, nf4_bytes = 0;
  const char* code = "";
  const QuantType asked = quant_type(c.model.quantization_config);
  bool stored_other = false;
  for (models::Linear* l : model.linears())
    if (l->quantized()) {
      nf4 += l->qweight()->numel();
      nf4_bytes += l->qweight()->storage_bytes();
      code = quant_type_label(l->qweight()->quant_type);
      stored_other = stored_other || l->qweight()->quant_type != asked;
    }
  // Weights stored in bitsandbytes' 4-bit form are read as stored (transformers, too, takes a
  // pre-quantized model's own quantization_config over the one passed).
  if (stored_other)
    b.notes.push_back(str_cat("the model's projections are stored as ", code, " and read as they are; "
                              "model.quantization_config.bnb_4bit_quant_type ", quant_type_name(asked),
                              " applies when memtune quantizes"));
  if (nf4 > 0)
    b.notes.push_back(str_cat(code, " base: ", nf4, " parameters in ", format_bytes(nf4_bytes), " (",
                              static_cast<double>(nf4_bytes) * 8.0 / static_cast<double>(nf4),
                              " bits per parameter)"));
  int64_t int8 = 0, int8_bytes = 0;
  double threshold = 0;
  for (models::Linear* l : model.linears())
    if (l->int8()) {
      int8 += l->in_features() * l->out_features();
      int8_bytes += int8_storage_bytes(l->out_features(), l->in_features());
      threshold = l->int8_threshold;
    }
  const auto& q = c.model.quantization_config;
  MEMTUNE_CHECK(int8 == 0 || q.bnb_4bit_compute_dtype == QuantizationConfig{}.bnb_4bit_compute_dtype,
                "model.quantization_config.bnb_4bit_compute_dtype: ", q.bnb_4bit_compute_dtype, " applies to 4-bit "
                "layers, and ", c.model.name_or_path, " is stored in bitsandbytes' 8-bit form, whose layers multiply in "
                "the model's dtype (model.torch_dtype, or training.bf16 / fp16 under autocast). Remove the key");
  MEMTUNE_CHECK(int8 == 0 || c.distributed.sharding != "full", "distributed.sharding: full keeps 1/W of each "
                "frozen weight per rank, and ", c.model.name_or_path, " is stored in bitsandbytes' 8-bit form, whose "
                "layers memtune does not shard. Hint: sharding: gradients");
  if (int8 > 0 && !q.load_in_8bit)
    b.notes.push_back("the model's projections are stored in bitsandbytes' 8-bit form and read as they are "
                      "(transformers, too, takes a pre-quantized model's own quantization_config)");
  if (int8 > 0)
    b.notes.push_back(str_cat("LLM.int8 base: ", int8, " parameters in ", format_bytes(int8_bytes), " (",
                              static_cast<double>(int8_bytes) * 8.0 / static_cast<double>(int8),
                              " bits per parameter), outlier threshold ", threshold, "; the products ",
                              b.device.is_cpu() ? "in training multiply by the dequantized weight (bitsandbytes' "
                                                  "on a CPU), in evaluation by LLM.int8's int8 product"
                                                : "run LLM.int8's int8 product with outlier columns in 16 bits; "
                                                  "the outlier columns are those of the whole micro-batch, so a "
                                                  "micro-batch split after an out-of-memory error moves some "
                                                  "columns between int8 and 16 bits, as bitsandbytes at that "
                                                  "micro-batch would (llm_int8_threshold: 0 takes none out)"));
  std::vector<std::string> dense;
  for (const models::Linear* l : model.linears())
    if (!l->quantized() && !l->int8()) dense.push_back(l->name());
  const bool stored_quantized = models::bnb_quantized(spec);
  if ((nf4 > 0 || int8 > 0) && !dense.empty()) {
    std::string names;
    for (size_t i = 0; i < dense.size() && i < 4; ++i) names += (i ? ", " : "") + dense[i];
    if (dense.size() > 4) names += str_cat(" and ", dense.size() - 4, " more");
    b.notes.push_back(str_cat(dense.size(), " projection", dense.size() > 1 ? "s" : "", " kept dense (",
                              stored_quantized ? "config.json's" : "model.quantization_config's",
                              " llm_int8_skip_modules): ", names));
  }
  if (stored_quantized && q.llm_int8_skip_modules)
    b.notes.push_back("the model is stored quantized: its config.json's llm_int8_skip_modules decides which "
                      "projections are dense, not model.quantization_config.llm_int8_skip_modules (transformers, "
                      "too, takes a pre-quantized model's own quantization_config)");
  else
    for (const std::string& p : skip_unused)
      b.notes.push_back(str_cat("model.quantization_config.llm_int8_skip_modules: '", p,
                                "' keeps no projection of this model dense"));
  b.notes.push_back("base weights: " + format_bytes(model.base_storage_bytes()));

  b.tokenizer = load_tokenizer(c.model, &b.tokenizer_path);
  MEMTUNE_CHECK(!b.tokenizer || b.tokenizer->vocab_size() <= model.spec().vocab_size, "model.tokenizer: ",
                b.tokenizer_path.string(), " has ", b.tokenizer ? b.tokenizer->vocab_size() : 0,
                " ids but the model's vocab_size is ", model.spec().vocab_size);
  return b;
}

std::unique_ptr<data::Tokenizer> load_tokenizer(const ModelConfig& m, fs::path* path) {
  fs::path tok = !m.tokenizer.empty() ? fs::path(m.tokenizer) : fs::path(m.name_or_path);
  if (fs::exists(tok) && (fs::is_regular_file(tok) || fs::exists(tok / "tokenizer.json") ||
                          fs::exists(tok / "tokenizer.model"))) {
    if (path) *path = tok;
    return data::Tokenizer::load(tok);
  }
  MEMTUNE_CHECK(m.tokenizer.empty(), "model.tokenizer: '", m.tokenizer, "' has no tokenizer.json or tokenizer.model");
  return nullptr;
}

// The share is of model.max_memory's size for the device, else of the device_limit or, on a
// GPU, its memory. A CPU without a limit takes all (offloading there would only move weights
// within host memory). Several GPUs are used by one process only: those model.max_memory
// names, else every visible one.
std::vector<models::DeviceBudget> auto_budgets(const Config& c, const c10::Device& device, int64_t limit,
                                               bool distributed) {
  constexpr double kWeightsShare = 0.6;
  std::vector<c10::Device> devices{device};
  if (device.is_cuda() && !distributed) {
    bool names_cuda = false;
    for (const auto& [name, size] : c.model.max_memory) names_cuda = names_cuda || name.rfind("cuda", 0) == 0;
    for (int i = 0; i < cuda_info().device_count; ++i) {
      const c10::Device d(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
      if (d != device && (!names_cuda || c.model.max_memory.count(d.str()))) devices.push_back(d);
    }
  }
  std::vector<models::DeviceBudget> out;
  for (const c10::Device& d : devices) {
    const int64_t total = memory_backend(d).stats().total;
    auto named = c.model.max_memory.find(d.str());
    if (named == c.model.max_memory.end() && d == device && d.is_cuda()) named = c.model.max_memory.find("cuda");
    int64_t bytes = named != c.model.max_memory.end() ? named->second.resolve(total)
                    : d == device && limit > 0       ? limit
                    : d.is_cuda()                    ? total
                                                     : 0;
    out.push_back({d, bytes > 0 ? static_cast<int64_t>(kWeightsShare * static_cast<double>(bytes)) : 0});
  }
  return out;
}

}  // namespace memtune::trainer
