#include "models/hf_model.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/io/bnb_nf4.h"
#include "models/io/safetensors.h"
#include "models/registry.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/json_input.h"
#include "runtime/nf4.h"

namespace memtune::models {

namespace fs = std::filesystem;
using nlohmann::json;

ModelSpec read_hf_config(const fs::path& dir) {
  fs::path file = fs::is_directory(dir) ? dir / "config.json" : dir;
  std::ifstream in(file);
  MEMTUNE_CHECK(in.good(), file.string(), ": cannot read (is '", dir.string(),
                "' a Hugging Face model directory with config.json?)");
  std::stringstream text;
  text << in.rdbuf();
  return spec_from_hf_config(parse_json(text.str(), file.string()), file.string());
}

namespace {

// Buffers some checkpoints carry that are not parameters.
bool ignorable(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends("rotary_emb.inv_freq") || ends(".attn.bias") || ends(".attn.masked_bias");
}

// GPT-2 checkpoints from the original repository lack the "transformer." prefix.
std::string find_name(const CheckpointReader& ckpt, const std::string& name) {
  if (ckpt.contains(name)) return name;
  const std::string prefix = "transformer.";
  if (name.rfind(prefix, 0) == 0 && ckpt.contains(name.substr(prefix.size()))) return name.substr(prefix.size());
  return "";
}

}  // namespace

bool bnb_quantized(const ModelSpec& spec) {
  const auto q = spec.extra.find("quantization_config");
  return q != spec.extra.end() && q->is_object() && q->value("quant_method", json()) == "bitsandbytes";
}

SkipModules stored_skip_modules(const ModelSpec& spec, const std::string& config_file) {
  if (!bnb_quantized(spec)) return std::nullopt;
  const json& q = spec.extra.at("quantization_config");
  if (!q.contains("llm_int8_skip_modules") || q["llm_int8_skip_modules"].is_null()) return std::nullopt;
  const json& list = q["llm_int8_skip_modules"];
  MEMTUNE_CHECK(list.is_array(), config_file, ": quantization_config.llm_int8_skip_modules is ", list.dump(),
                "; bitsandbytes reads a list of module names, or null");
  std::vector<std::string> names;
  for (const json& e : list) {
    MEMTUNE_CHECK(e.is_string(), config_file, ": quantization_config.llm_int8_skip_modules holds ", e.dump(),
                  "; bitsandbytes reads a list of module names");
    names.push_back(e.get<std::string>());
  }
  return names;
}

std::unique_ptr<CausalLM> load_hf_model(const fs::path& dir, const LoadOptions& options) {
  ModelSpec spec = read_hf_config(dir);
  std::unique_ptr<CausalLM> model = build_model(spec);
  CheckpointReader ckpt(dir);
  std::vector<std::string> keys = ckpt.names();
  std::set<std::string> used;
  const int64_t total = static_cast<int64_t>(model->tensors().size());
  int64_t done = 0;
  at::NoGradGuard no_grad;
  const std::vector<bool> skip = options.skip ? options.skip(*model) : std::vector<bool>();
  bool loaded_nf4 = false;  // a projection read from bitsandbytes' 4-bit tensors
  bool loaded_int8 = false;  // or from its 8-bit ones
  // A checkpoint's own quantization_config names the threshold its 8-bit layers were saved
  // for (transformers takes it over the one passed).
  double stored_threshold = options.int8_threshold;
  if (spec.extra.contains("quantization_config") && spec.extra["quantization_config"].is_object()) {
    const json& q = spec.extra["quantization_config"];
    if (q.contains("llm_int8_threshold") && q["llm_int8_threshold"].is_number())
      stored_threshold = q["llm_int8_threshold"].get<double>();
  }
  // A checkpoint bitsandbytes quantized keeps the projections its own llm_int8_skip_modules
  // names dense, and stores every other one quantized (transformers reads it so, whatever
  // the caller asked).
  const std::string config_file = (dir / "config.json").string();
  const bool pre_quantized = bnb_quantized(spec);
  const SkipModules stored_skip = stored_skip_modules(spec, config_file);
  const SkipMatcher stored_dense(stored_skip, config_file + ": quantization_config.llm_int8_skip_modules");
  const SkipMatcher asked_dense(options.skip_modules, "model.quantization_config.llm_int8_skip_modules");
  std::vector<std::string> dense_unlisted;  // stored dense in a quantized checkpoint, not in its list
  for (TensorSlot& slot : model->tensors()) {
    const bool skipped = !skip.empty() && skip[static_cast<size_t>(&slot - model->tensors().data())];
    const bool projection = slot.role == TensorRole::kLinearWeight;
    const std::string module = projection ? slot.name.substr(0, slot.name.size() - 6) : "";  // "...q_proj."
    const bool stored_quantized = projection && (ckpt.contains(module + "SCB") || is_bnb_4bit(keys, slot.name));
    // A checkpoint already quantized: its list and its tensors agree. Any other: a dense
    // projection is quantized here unless the caller's list keeps it dense.
    bool quantize_here = false;
    if (projection && pre_quantized) {
      const int entry = stored_dense.match(slot.linear->name());
      MEMTUNE_CHECK(!(stored_quantized && entry >= 0), config_file, ": quantization_config.llm_int8_skip_modules "
                    "keeps '", slot.linear->name(), "' dense (entry '",
                    stored_dense.patterns()[static_cast<size_t>(std::max(entry, 0))], "'), and the checkpoint stores "
                    "it quantized. transformers would read its quantized tensors as a dense weight. Hint: remove the "
                    "entry from config.json");
      if (!stored_quantized && entry < 0) dense_unlisted.push_back(slot.linear->name());
    } else if (projection) {
      quantize_here = !stored_quantized && !asked_dense.keeps_dense(slot.linear->name());
    }
    const bool to_4bit = quantize_here && options.load_in_4bit, to_8bit = quantize_here && options.load_in_8bit;
    if (projection && ckpt.contains(module + "SCB")) {
      // bitsandbytes' 8-bit state dict: weight int8 [out, in], SCB fp32 [out], weight_format
      // (a uint8 0: row-major, the only layout it still writes).
      const std::string where = ckpt.file_of(slot.name).string();
      at::Tensor codes = ckpt.load(slot.name), absmax = ckpt.load(module + "SCB");
      MEMTUNE_CHECK(codes.scalar_type() == at::kChar, where, ": '", slot.name, "' is ", codes.scalar_type(),
                    " beside '", module, "SCB', which marks bitsandbytes' 8-bit weights (int8)");
      if (ckpt.contains(module + "weight_format")) {
        const at::Tensor f = ckpt.load(module + "weight_format");
        MEMTUNE_CHECK(f.numel() == 1, where, ": '", module, "weight_format' holds ", f.numel(),
                      " values; bitsandbytes writes one (0: row-major)");
        const int64_t format = f.to(at::kLong).item<int64_t>();
        static const char* const kFormats[] = {"row", "col32", "col_turing", "col_ampere"};
        MEMTUNE_CHECK(format == 0, where, ": '", module, "weight_format' is ", format,
                      format > 0 && format < 4 ? str_cat(" (", kFormats[format], ")") : std::string(),
                      ", not 0 (row-major): a layout of older bitsandbytes releases (col32 / col_turing / col_ampere) "
                      "memtune does not read. Hint: save the model again with a recent bitsandbytes, or use its "
                      "dense weights");
        used.insert(module + "weight_format");
      }
      slot.linear->set_int8(codes.contiguous(), absmax.to(at::kFloat).contiguous(), stored_threshold);
      loaded_int8 = true;
      used.insert(slot.name);
      used.insert(module + "SCB");
    } else if (stored_quantized) {
      auto get = [&](const std::string& key) { return ckpt.contains(key) ? ckpt.load(key) : at::Tensor(); };
      slot.linear->set_quantized(std::make_shared<NF4Tensor>(nf4_from_bnb(get, slot.name)));
      loaded_nf4 = true;
      for (const auto& k : keys)
        if (k.rfind(slot.name, 0) == 0) used.insert(k);
    } else {
      std::string stored = find_name(ckpt, slot.name);
      MEMTUNE_CHECK(!stored.empty(), ckpt.file_of(ckpt.names().front()).parent_path().string(),
                    ": tensor '", slot.name, "' is missing from the checkpoint (architecture ",
                    spec.architecture, ")");
      used.insert(stored);
      const SafetensorsTensorInfo& info = ckpt.info(stored);
      MEMTUNE_CHECK(info.shape == slot.shape, ckpt.file_of(stored).string(), ": tensor '", stored,
                    "' has shape ", at::IntArrayRef(info.shape), ", expected ", at::IntArrayRef(slot.shape),
                    " from config.json");
      MEMTUNE_CHECK(!(skipped && to_8bit),
                    "load: 8-bit quantization needs every weight read (each row's absmax), and '", slot.name,
                    "' was to be skipped (distributed.sharding: full)");
      if (skipped) {  // checked, not read
        const bool floating =
            info.dtype == at::kFloat || info.dtype == at::kHalf || info.dtype == at::kBFloat16;
        if (to_4bit) {
          std::vector<int64_t> out_in = info.shape;
          if (slot.linear->fan_in_fan_out()) std::swap(out_in[0], out_in[1]);
          slot.linear->set_quantized(std::make_shared<NF4Tensor>(
              nf4_meta(out_in, options.dense_dtype != at::kFloat ? options.dense_dtype : floating ? info.dtype : at::kFloat,
                       options.blocksize, options.double_quant,
                       options.quant_type)));
        } else {
          *slot.tensor = at::empty(info.shape, at::TensorOptions(options.dense_dtype).device(at::kMeta));
        }
        if (options.on_tensor) options.on_tensor(slot.name, ++done, total);
        continue;
      }
      at::Tensor view = ckpt.view(stored);  // zero-copy over the mapping
      if (to_4bit) {
        // From the stored floating dtype (exactly its fp32 value), or from the 16-bit dense
        // dtype asked for: transformers casts to torch_dtype before bitsandbytes quantizes.
        at::Tensor w = options.dense_dtype != at::kFloat ? view.to(options.dense_dtype)
                       : view.scalar_type() == at::kFloat || view.scalar_type() == at::kHalf ||
                               view.scalar_type() == at::kBFloat16
                           ? view
                           : view.to(at::kFloat);
        at::Tensor out_in = slot.linear->fan_in_fan_out() ? w.t().contiguous() : w;
        slot.linear->set_quantized(std::make_shared<NF4Tensor>(
            nf4_quantize(out_in, options.blocksize, options.double_quant, slot.name, options.quant_type)));
      } else if (to_8bit) {
        // transformers casts to torch_dtype, then bitsandbytes to float16 and quantizes.
        *slot.tensor = view.to(options.dense_dtype);
        slot.linear->quantize_int8(options.int8_threshold);
      } else {
        *slot.tensor = view.to(options.dense_dtype, /*non_blocking=*/false, /*copy=*/true);
      }
      view.reset();
      ckpt.evict(stored);  // the file's pages leave this process's resident memory
    }
    if (options.on_tensor) options.on_tensor(slot.name, ++done, total);
  }
  // config.json's quantization_config describes the stored tensors: over dense projections
  // transformers would quantize on load (bitsandbytes) or expect another format's tensors.
  if (spec.extra.contains("quantization_config") && !loaded_nf4 && !loaded_int8) {
    const json& q = spec.extra["quantization_config"];
    const std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                                   ? q["quant_method"].get<std::string>()
                                   : "unnamed";
    fail((dir / "config.json").string(), ": quantization_config (quant_method ", method,
         ") describes quantized weights, and the checkpoint's projections are dense. Hint: remove "
         "quantization_config from config.json; to quantize on load, set model.quantization_config.load_in_4bit");
  }
  if (!dense_unlisted.empty()) {
    const std::string list = stored_skip ? quoted_list(*stored_skip) : "unset: transformers' default, the output layer";
    fail(config_file, ": quantization_config (bitsandbytes) describes quantized projections, and ",
         dense_unlisted.size(), " projection", dense_unlisted.size() > 1 ? "s are" : " is", " stored dense though "
         "its llm_int8_skip_modules (", list, ") does not keep ", dense_unlisted.size() > 1 ? "them" : "it",
         " dense: '", dense_unlisted.front(), "'", dense_unlisted.size() > 1 ? str_cat(" and ", dense_unlisted.size() - 1, " more") : "",
         ". transformers would look for quantized tensors there. Hint: name the dense projections in config.json's "
         "quantization_config.llm_int8_skip_modules, or write the model again with memtune quantize");
  }
  for (const auto& k : keys)
    MEMTUNE_CHECK(used.count(k) || ignorable(k) ||
                      (spec.tie_word_embeddings && k == "lm_head.weight"),
                  ckpt.file_of(k).string(), ": tensor '", k, "' is not part of ", spec.architecture,
                  " as memtune builds it (wrong architecture in config.json?)");
  return model;
}

std::unique_ptr<CausalLM> init_random_model(const ModelSpec& spec, uint64_t seed) {
  std::unique_ptr<CausalLM> model = build_model(spec);
  model->init_random(seed);
  return model;
}

void save_hf_model(const CausalLM& model, const fs::path& dir, const SaveOptions& options) {
  create_output_directory(dir, "saving the model");
  json config = spec_to_hf_config(model.spec());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const NF4Tensor* any_nf4 = nullptr;
  // The projections written dense beside 4-bit ones: the list transformers reads them by.
  nlohmann::json dense = nlohmann::json::array({kOutputModule});
  for (const TensorSlot& slot : model.tensors()) {
    if (slot.role == TensorRole::kLinearWeight && !(options.keep_4bit && slot.linear->quantized()))
      dense.push_back(slot.linear->name());
    if (slot.role == TensorRole::kLinearWeight && (slot.linear->quantized() || slot.linear->int8())) {
      if (options.keep_4bit && slot.linear->quantized()) {
        any_nf4 = slot.linear->qweight().get();
        for (auto& kv : nf4_to_bnb(slot.name, *slot.linear->qweight())) tensors.push_back(std::move(kv));
      } else {
        at::Tensor w = slot.linear->dense_weight();  // [out, in]
        if (slot.linear->fan_in_fan_out()) w = w.t().contiguous();
        tensors.emplace_back(slot.name, w.to(options.dtype));
      }
      continue;
    }
    tensors.emplace_back(slot.name, slot.tensor->detach().to(options.dtype).contiguous());
  }
  config["torch_dtype"] = options.dtype == at::kBFloat16 ? "bfloat16"
                          : options.dtype == at::kHalf   ? "float16"
                                                         : "float32";
  // transformers 5 writes (and reads first) dtype: one kept from the loaded config.json would
  // name the dtype it was loaded from.
  if (config.contains("dtype")) config["dtype"] = config["torch_dtype"];
  // The tensors written decide: a model saved dense carries no quantization_config (one kept
  // from the loaded config.json would tell transformers its dense tensors are quantized).
  config.erase("quantization_config");
  if (any_nf4) {
    config["quantization_config"] = {
        {"quant_method", "bitsandbytes"},
        {"load_in_4bit", true},
        {"load_in_8bit", false},
        {"bnb_4bit_quant_type", quant_type_name(any_nf4->quant_type)},
        {"bnb_4bit_use_double_quant", any_nf4->double_quant},
        {"bnb_4bit_compute_dtype", "float32"},
        {"bnb_4bit_quant_storage", "uint8"},
        {"llm_int8_skip_modules", dense.size() > 1 ? dense : nlohmann::json()},
        {"llm_int8_threshold", 6.0},
        {"llm_int8_has_fp16_weight", false},
        {"llm_int8_enable_fp32_cpu_offload", false}};
  }
  CheckpointWriterOptions wopts;
  wopts.max_shard_bytes = options.max_shard_bytes;
  save_checkpoint(dir, tensors, wopts);
  write_file_atomic(dir / "config.json", config.dump(2) + "\n");
}

}  // namespace memtune::models
