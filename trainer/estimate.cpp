#include "trainer/estimate.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <set>

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include "models/causal_lm.h"
#include "models/device_map.h"
#include "models/hf_model.h"
#include "models/layers/cross_entropy.h"
#include "models/lora.h"
#include "models/registry.h"
#include "runtime/error.h"
#include "runtime/offload.h"
#include "runtime/supervisor.h"
#include "runtime/units.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {

namespace fs = std::filesystem;

models::ModelSpec model_spec(const Config& c) { return model_spec(c.model); }

std::vector<bool> checkpoint_plan(const CheckpointingConfig& c, int64_t layers) {
  std::vector<bool> out(static_cast<size_t>(layers), false);
  for (int64_t i = 0; i < layers; ++i) {
    if (c.policy == "all") out[i] = true;
    else if (c.policy == "every_n") out[i] = i % c.n == 0;
  }
  if (c.policy == "layers")
    for (int l : c.layers) {
      MEMTUNE_CHECK(l >= 0 && l < layers, "training.gradient_checkpointing.layers: layer ", l,
                    " does not exist (the model has ", layers, " layers)");
      out[l] = true;
    }
  return out;
}

EstimateInput estimate_input(const Config& c, const models::ModelSpec& s, int64_t micro_batch) {
  EstimateInput in;
  std::shared_ptr<const models::CausalLM> structure = models::build_model(s);  // no tensor memory
  in.model = structure;
  in.num_layers = s.num_layers;

  const auto& q = c.model.quantization_config;
  in.load_in_4bit = q.load_in_4bit;
  in.load_in_8bit = q.load_in_8bit;
  in.quant_type = quant_type(q);
  in.double_quant = q.bnb_4bit_use_double_quant;
  in.blocksize = q.blocksize;
  // A model stored in bitsandbytes' 4-bit form is read as stored (models::load_hf_model): its
  // config.json's quantization_config, not this config's keys, says what the weights are.
  const nlohmann::json stored = s.extra.value("quantization_config", nlohmann::json());
  // A field of it, absent: bitsandbytes' default; present: of the type bitsandbytes reads.
  auto field = [&](const char* key, const nlohmann::json& absent, bool (nlohmann::json::*is_type)() const) {
    const nlohmann::json v = stored.value(key, absent);
    MEMTUNE_CHECK((v.*is_type)(), "config.json: quantization_config.", key, " is ", v.dump(),
                  ", not of the type bitsandbytes reads (absent, it is ", absent.dump(), ")");
    return v;
  };
  if (stored.is_object() && stored.value("quant_method", nlohmann::json()) == "bitsandbytes" &&
      field("load_in_4bit", false, &nlohmann::json::is_boolean).get<bool>()) {
    in.load_in_4bit = true;
    in.load_in_8bit = false;
    const std::string type = field("bnb_4bit_quant_type", "fp4", &nlohmann::json::is_string).get<std::string>();
    MEMTUNE_CHECK(type == "nf4" || type == "fp4", "config.json: quantization_config.bnb_4bit_quant_type is '", type,
                  "'; bitsandbytes' 4-bit codes are nf4 and fp4");
    in.quant_type = quant_type_from_name(type);
    in.double_quant = field("bnb_4bit_use_double_quant", false, &nlohmann::json::is_boolean).get<bool>();
  } else if (stored.is_object() && stored.value("quant_method", nlohmann::json()) == "bitsandbytes" &&
             field("load_in_8bit", false, &nlohmann::json::is_boolean).get<bool>()) {
    in.load_in_4bit = false;
    in.load_in_8bit = true;
  }

  // Projections kept dense: a stored model's own llm_int8_skip_modules, or the config's.
  if (models::bnb_quantized(s)) {
    in.dense_projections = models::dense_projections(*structure, models::stored_skip_modules(s, "config.json"),
                                                     "config.json: quantization_config.llm_int8_skip_modules");
  } else if (q.llm_int8_skip_modules) {
    const std::string where = "model.quantization_config.llm_int8_skip_modules";
    models::check_skip_modules(*structure, *q.llm_int8_skip_modules, where);  // what train would refuse
    in.dense_projections = models::dense_projections(*structure, q.llm_int8_skip_modules, where);
  }

  in.finetune = c.training.finetune;
  in.lora_r = c.lora.r;
  in.lora_dropout = c.lora.lora_dropout;
  in.lora_dora = c.lora.use_dora;
  if (in.finetune == "lora") {
    // The model's own projections, matched as PEFT does, and the tensors trained whole.
    const models::LoraTargets targets = lora_targets(c.lora, s.model_type);
    models::check_lora_targets(*structure, targets);  // what train would refuse
    std::vector<const models::TensorSlot*> whole =
        models::modules_to_save_tensors(*structure, c.lora.modules_to_save, "lora.modules_to_save");
    // lora.bias: the biases trained beside the adapters (of the targeted projections, for lora_only).
    std::set<const models::Linear*> targeted;
    for (const models::TensorSlot& t : structure->tensors())
      if (t.role == models::TensorRole::kLinearWeight && models::lora_targets(targets, t.linear->name(), t.layer))
        targeted.insert(t.linear);
    for (const models::TensorSlot* t :
         models::lora_bias_tensors(*structure, c.lora.bias, [&](const models::Linear& l) { return targeted.count(&l) > 0; }))
      if (std::find(whole.begin(), whole.end(), t) == whole.end()) whole.push_back(t);
    const models::LoraPatterns patterns = lora_patterns(c.lora);
    models::check_lora_patterns(*structure, targets, patterns, "lora");  // what train would refuse
    const models::LoraOptions options = lora_options(c.lora);
    for (const models::TensorSlot& t : structure->tensors()) {
      const bool adapted = t.role == models::TensorRole::kLinearWeight && targeted.count(t.linear) > 0;
      in.adapted.push_back(adapted);
      in.lora_ranks.push_back(adapted ? patterns.options_for(options, t.linear->name()).r : 0);
      in.trained.push_back(std::find(whole.begin(), whole.end(), &t) != whole.end());
    }
  }

  in.micro_batch = micro_batch > 0 ? micro_batch
                   : c.training.per_device_train_batch_size == TrainingConfig::kAuto
                       ? 1
                       : c.training.per_device_train_batch_size;
  in.accumulation_steps = c.training.gradient_accumulation_steps;
  in.seq_length = c.data.max_seq_length;
  in.checkpoint_layers = checkpoint_plan(c.training.gradient_checkpointing, s.num_layers);
  const c10::Device device = resolve_device(c.runtime.device);
  // An explicit device map's offloaded layers (`auto` depends on the device's budget: the
  // trainer sets them once the model is placed).
  if (!c.model.device_map.entries.empty())
    in.offloaded_layers = models::plan_entries(*structure, c.model.device_map.entries, device).offloaded;
  in.offload_activations = c.training.activation_offload == "checkpoints";
  OptimizerOptions oo;
  set_optimizer_kind(c.training.optim, oo);
  in.optimizer = oo.kind;
  in.sgd_momentum = c.training.momentum != 0;
  in.optimizer_paged = oo.paged || c.memory.optimizer_offload == "cpu";
  in.gradients_offloaded = c.memory.optimizer_offload == "cpu";
  in.sharding = c.distributed.sharding;  // world_size stays 1: the caller knows the ranks
  in.prefetch = c.distributed.prefetch;
  in.bucket_bytes = c.distributed.bucket_size_mb << 20;
  std::string note;
  const at::ScalarType compute_dtype = resolve_compute_dtype(c, device, &note);
  in.compute_bytes = static_cast<int64_t>(c10::elementSize(compute_dtype));
  in.adapter_bytes = autocast_on(c) ? in.compute_bytes : 4;
  in.loss_bf16 = models::loss_matmul_dtype(compute_dtype) == at::kBFloat16;
  in.label_smoothing = c.training.label_smoothing_factor > 0;
  in.logit_softcap = s.final_logit_softcapping.has_value();
  // Activations are in the dense dtype (model.torch_dtype) whatever the compute dtype: each
  // projection casts its output back, so in an fp32 model q, k and v reach attention in fp32
  // and on the CPU take the fused kernel (its rule: fp32 CPU tensors) unless the config asks
  // for another.
  in.dense_bytes = static_cast<int64_t>(c10::elementSize(resolve_dense_dtype(c, s, compute_dtype)));
  in.fused_cpu_attention = device.is_cpu() && in.dense_bytes == 4 && c.model.attn_implementation == "auto";
#ifdef MEMTUNE_CUDA
  in.cuda_kernels = device.is_cuda();  // the activations are fp32, fp16 or bf16: the kernels' types
  in.optimizer_streamed = oo.paged && device.is_cuda();  // where the gradients stay on the device
#endif
  in.cpu_update = device.is_cpu();
  in.prefetch_activations = offload_prefetches(device);
  in.threads = at::get_num_threads();
  return in;
}

EstimateInput fit_to_data(EstimateInput in, const data::DatasetStats& stats) {
  if (stats.longest_sample > 0) in.seq_length = std::min(in.seq_length, stats.longest_sample);
  if (stats.samples > 0) in.max_sample_targets = std::max<int64_t>(1, stats.most_sample_targets);
  return in;
}

bool gradient_offload_applies(const Config& c, int64_t world_size) {
  return gradients_can_leave(world_size, resolve_device(c.runtime.device).is_cpu());
}

EstimateInput with_every_saving(EstimateInput in) {
  in.checkpoint_layers.assign(static_cast<size_t>(in.num_layers), true);
  return in;
}

int64_t auto_micro_batch(const Config& c, const EstimateInput& in, int64_t budget, int64_t cap) {
  const int64_t under = static_cast<int64_t>(static_cast<double>(budget) * c.memory.warning_threshold);
  cap = std::max<int64_t>(1, cap);
  return std::clamp<int64_t>(max_micro_batch(in, under, cap), 1, cap);
}

namespace {

// The optimizer offload rung: the state in host memory, and the gradients where they can leave.
void offload_optimizer(const Config& c, EstimateInput& in, int64_t world_size) {
  in.optimizer_paged = true;
  in.gradients_offloaded = in.gradients_offloaded || gradient_offload_applies(c, world_size);
}

}  // namespace

EstimateInput with_ladder(const Config& c, EstimateInput in, int64_t world_size, bool optimizer_offload,
                          bool optimizer_8bit) {
  if (c.memory.on_oom.allows("micro_batch")) in.micro_batch = 1;
  if (c.memory.on_oom.allows("checkpointing")) in = with_every_saving(in);
  in.world_size = world_size;
  const bool ladder = c.memory.supervise;
  in.offload_activations = in.offload_activations || (ladder && c.memory.on_oom.allows("activation_offload"));
  if (optimizer_offload && ladder && c.memory.on_oom.allows("optimizer_offload")) offload_optimizer(c, in, world_size);
  // (a state in host memory already gains nothing on the device from 8 bits)
  if (optimizer_8bit && ladder && c.memory.on_oom.allows("optimizer_8bit") && !in.optimizer_paged &&
      (in.optimizer == "adamw" || in.optimizer == "adamw_32bit"))
    in.optimizer = "adamw_8bit";
  // With the ladder's layer offload (LoRA on a frozen base), every decoder layer can leave the
  // device but the one running. Sharded layers (distributed.sharding: full) are not
  // offloaded: the estimate counts 1/W of them.
  const bool sharded = world_size > 1 && c.distributed.sharding == "full";
  if (in.finetune == "lora" && !sharded && c.memory.on_oom.allows("layer_offload"))
    in.offloaded_layers.assign(static_cast<size_t>(in.num_layers), true);
  return in;
}

bool optimizer_offload_at_start(const Config& c, const EstimateInput& in, int64_t budget, int64_t world_size) {
  if (budget <= 0 || !c.memory.supervise || !c.memory.on_oom.allows("optimizer_offload") ||
      c.memory.optimizer_offload == "cpu")
    return false;
  // (nor with 8 bits: the optimizer makes its state in fp32)
  return estimate_peak(with_ladder(c, in, world_size, /*optimizer_offload=*/false, /*optimizer_8bit=*/false)) > budget;
}

bool optimizer_8bit_at_start(const Config& c, const EstimateInput& in, int64_t budget, int64_t world_size) {
  if (budget <= 0 || !c.memory.supervise || !c.memory.on_oom.allows("optimizer_8bit") || in.optimizer_paged ||
      (in.optimizer != "adamw" && in.optimizer != "adamw_32bit"))
    return false;
  if (optimizer_offload_at_start(c, in, budget, world_size)) return false;  // the state goes to host memory instead
  return estimate_peak(with_ladder(c, in, world_size, /*optimizer_offload=*/false, /*optimizer_8bit=*/false)) > budget;
}

namespace {

// Takes `rung` of memory.on_oom.ladder on `in` until `enough()` (as trainer.cpp's rungs take
// it after out-of-memory errors: checkpointing layer by layer from the first, layer offload
// from the last layer down for LoRA) and says what it took in `steps`; false when it took
// nothing (the rung is exhausted or does not apply).
bool climb(const Config& c, EstimateInput& in, const std::string& rung, int64_t world_size,
           const std::function<bool()>& enough, std::vector<std::string>* steps) {
  const bool sharded = world_size > 1 && c.distributed.sharding == "full";
  if (rung == "checkpointing") {
    int64_t first = -1, last = -1;
    for (size_t i = 0; i < in.checkpoint_layers.size() && !enough(); ++i)
      if (!in.checkpoint_layers[i]) {
        in.checkpoint_layers[i] = true;
        if (first < 0) first = static_cast<int64_t>(i);
        last = static_cast<int64_t>(i);
      }
    if (first < 0) return false;
    steps->push_back(first == last ? str_cat("checkpointing layer ", first)
                                   : str_cat("checkpointing layers ", first, "-", last));
  } else if (rung == "activation_offload" && !in.offload_activations &&
             std::count(in.checkpoint_layers.begin(), in.checkpoint_layers.end(), true) > 0) {
    in.offload_activations = true;
    steps->push_back("activation offload");
  } else if (rung == "optimizer_offload" && !in.optimizer_paged) {
    offload_optimizer(c, in, world_size);
    steps->push_back("optimizer offload");
  } else if (rung == "optimizer_8bit" && !in.optimizer_paged && (in.optimizer == "adamw" || in.optimizer == "adamw_32bit")) {
    in.optimizer = "adamw_8bit";
    steps->push_back("8-bit optimizer state");
  } else if (rung == "layer_offload" && in.finetune == "lora" && !sharded) {
    in.offloaded_layers.resize(static_cast<size_t>(in.num_layers), false);
    int64_t count = 0;
    for (int64_t i = in.num_layers - 1; i >= 0 && !enough(); --i)
      if (!in.offloaded_layers[static_cast<size_t>(i)]) {
        in.offloaded_layers[static_cast<size_t>(i)] = true;
        ++count;
      }
    if (count == 0) return false;
    steps->push_back(str_cat("layer offload (", count, " layers)"));
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::string cheapest_fitting_rung(const Config& c, const EstimateInput& in, int64_t budget, int64_t world_size) {
  if (estimate_peak(in) <= budget) return "";  // the estimate has no say: it was proved wrong here
  for (const std::string& rung : c.memory.on_oom.ladder) {
    if (rung == "micro_batch") continue;
    EstimateInput taken = in;
    std::vector<std::string> steps;
    if (climb(c, taken, rung, world_size, [] { return false; }, &steps) && estimate_peak(taken) <= budget) return rung;
  }
  return "";
}

LadderPlan ladder_plan(const Config& c, EstimateInput in, int64_t budget, int64_t world_size) {
  LadderPlan plan;
  in.world_size = world_size;
  auto fits = [&] { return estimate_peak(in) <= budget; };
  if (c.memory.supervise && !fits()) {
    if (optimizer_offload_at_start(c, in, budget, world_size)) {
      offload_optimizer(c, in, world_size);
      plan.steps.push_back("optimizer offload, before the first step");
    } else if (optimizer_8bit_at_start(c, in, budget, world_size)) {
      in.optimizer = "adamw_8bit";
      plan.steps.push_back("8-bit optimizer state, before the first step");
    }
    if (!fits() && c.memory.on_oom.allows("micro_batch") && in.micro_batch > 1) {
      const int64_t before = in.micro_batch;
      in.micro_batch = std::clamp<int64_t>(max_micro_batch(in, budget, before), 1, before);
      plan.steps.push_back(str_cat("micro-batch ", before, " -> ", in.micro_batch));
    }
    if (!fits()) {
      const std::string alone = cheapest_fitting_rung(c, in, budget, world_size);
      if (!alone.empty()) {
        climb(c, in, alone, world_size, fits, &plan.steps);
      } else {
        for (const std::string& rung : c.memory.on_oom.ladder) {
          if (fits()) break;
          climb(c, in, rung, world_size, fits, &plan.steps);
        }
      }
    }
  }
  plan.peak_bytes = estimate_peak(in);
  plan.fits = plan.peak_bytes <= budget;
  plan.settled = std::move(in);
  return plan;
}

std::string describe(const LadderPlan& plan) {
  std::string steps;
  for (const auto& step : plan.steps) steps += (steps.empty() ? "" : "; ") + step;
  return str_cat(steps, ": ", format_bytes(plan.peak_bytes), plan.fits ? " (fits)" : " (does NOT fit)");
}

std::string what_would_fit(const EstimateInput& best, int64_t budget) {
  const int64_t peak = estimate_memory(best).peak_bytes;
  std::string would;
  if (!best.load_in_4bit && best.finetune == "lora") {
    EstimateInput q = best;
    q.load_in_4bit = true;
    q.load_in_8bit = false;
    const int64_t p = estimate_peak(q);
    would += str_cat("; model.quantization_config.load_in_4bit: true", best.load_in_8bit ? " (load_in_8bit: false)" : "",
                     " (estimated ", format_bytes(p), p <= budget ? ", fits" : ", still too large", ")");
  }
  // An fp32 model computing in 16 bits, training only adapters: the model in that dtype, as
  // transformers + PEFT would hold it (half the dense weights and activations).
  const bool trains_whole = std::find(best.trained.begin(), best.trained.end(), true) != best.trained.end();
  if (best.finetune == "lora" && best.dense_bytes == 4 && best.compute_bytes == 2 && !trains_whole) {
    EstimateInput h = best;
    h.dense_bytes = 2;
    h.fused_cpu_attention = false;  // the fused CPU kernel takes fp32 only
    const int64_t p = estimate_peak(h);
    would += str_cat("; model.torch_dtype: ", best.loss_bf16 ? "bfloat16" : "float16", " (estimated ",
                     format_bytes(p), p <= budget ? ", fits" : ", still too large", ")");
  }
  const int64_t t = max_seq_length(best, budget);
  if (t > 0) would += str_cat("; data.max_seq_length: ", t, " (the longest that fits)");
  would += str_cat("; a device with at least ", format_bytes(peak), " (memory.device_limit)");
  return would;
}

void check_fits(const Config& c, const models::ModelSpec& spec, int64_t budget, int64_t world_size) {
  const EstimateInput best = with_ladder(c, estimate_input(c, spec), world_size);
  const int64_t peak = estimate_memory(best).peak_bytes;
  if (peak <= budget) return;
  const std::string would = what_would_fit(best, budget);
  // MemoryExhausted (exit code 3), as when the supervisor runs out of rungs: nothing loaded.
  throw MemoryExhausted(str_cat(
      "memory: this run cannot fit in ", format_bytes(budget), ": the estimate at micro-batch ", best.micro_batch,
      " with every saving memory.on_oom.ladder allows is ", format_bytes(peak), " (", c.model.name_or_path, ", data.max_seq_length ", c.data.max_seq_length,
      ", ", best.load_in_4bit ? "4-bit" : "dense", " weights, finetune ", best.finetune,
      "). What was tried: the estimate before loading the model (memtune estimate). What would fit", would));
}

}  // namespace memtune::trainer
