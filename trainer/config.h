#pragma once
// memtune's configuration: typed structs per concern, in the shape users know from Hugging
// Face / bitsandbytes / PEFT. Each field is declared once: its default here, its YAML name
// and help text in the struct's fields() visitor; parsing, validation, --help-config and the
// effective config written to output_dir/config.yaml all come from that visitor.
// YAML is parsed in trainer/config.cpp (the schema) and trainer/config_reflect (the engine)
// and nowhere else.
// A key named after a Hugging Face / PEFT / bitsandbytes one has that library's default too
// (lora_alpha 8, target_modules by model type, FP4 codes, fp32 compute and no double
// quantization for 4-bit weights, learning rate 5e-5, 3 epochs, micro-batches of 8): a config
// ported from there trains the same without the keys it left out. memtune's own keys say so
// in their help.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/units.h"
#include "trainer/schedule.h"

namespace memtune::trainer {

// bitsandbytes' BitsAndBytesConfig keys.
struct QuantizationConfig {
  bool load_in_4bit = false;                  // 4-bit base weights for the linear layers
  bool load_in_8bit = false;                  // LLM.int8 base weights for the linear layers
  double llm_int8_threshold = 6.0;            // outlier threshold of LLM.int8's mixed product
  bool llm_int8_has_fp16_weight = false;      // false only: the 8-bit weights stay frozen
  bool llm_int8_enable_fp32_cpu_offload = false;  // false only: offloaded projections stay quantized
  std::string quant_method = "bitsandbytes";  // bitsandbytes only (a BitsAndBytesConfig's own tag)
  // Modules kept dense (transformers' should_convert_module); unset: transformers' default,
  // the output layer (models/skip_modules.h).
  std::optional<std::vector<std::string>> llm_int8_skip_modules;
  std::string bnb_4bit_compute_dtype = "float32";  // auto|float32|float16|bfloat16: base matmul dtype
  std::string bnb_4bit_quant_type = "fp4";    // nf4 | fp4 (bitsandbytes' default)
  bool bnb_4bit_use_double_quant = false;     // quantize the absmax values too (~4.127 bits/param)
  std::string bnb_4bit_quant_storage = "uint8";  // storage dtype of the packed codes
  int blocksize = 64;                         // elements per absmax block, power of 2 in 32..4096

  template <class F> void fields(F&& f);
};

// `gradient_checkpointing: true|false` or `{policy: all|every_n|layers, n: 2, layers: [1,3]}`.
struct CheckpointingConfig {
  static inline const std::vector<std::string> kPolicies = {"none", "all", "every_n", "layers"};
  std::string policy = "none";  // one of kPolicies
  int n = 2;                    // every_n: layers 0, n, 2n, ... are checkpointed
  std::vector<int> layers;      // layers: these layer indices are checkpointed
  bool enabled() const { return policy != "none"; }
};

// transformers' gradient_checkpointing_kwargs: torch.utils.checkpoint's arguments.
struct CheckpointKwargsConfig {
  bool use_reentrant = false;  // transformers 5's default; both choices give the same gradients
  template <class F> void fields(F&& f);
};

// `device_map: auto|cpu|cuda:0` or a map from module prefixes to devices
// (`model.layers.0-15: cuda:0`, `lm_head: cpu`, a device being cuda:N, cpu or offload).
struct DeviceMapConfig {
  std::string single = "auto";                              // when entries is empty
  std::vector<std::pair<std::string, std::string>> entries;  // prefix -> device, in order
};

struct ModelConfig {
  std::string name_or_path = "tiny-llama";  // HF model dir (config.json + safetensors) or preset
  std::string architecture;                 // registered architecture for a preset; empty: from the preset or config.json
  std::string tokenizer;                    // tokenizer file or dir; empty: name_or_path's own
  std::string torch_dtype = "float32";      // dense tensors' dtype (trainer::resolve_dense_dtype)
  QuantizationConfig quantization_config;
  DeviceMapConfig device_map;
  std::map<std::string, SizeSpec> max_memory;  // device -> budget for device_map: auto
  bool low_cpu_mem_usage = true;            // true only: loads always stream tensor by tensor
  std::string attn_implementation = "auto";  // auto|eager|sdpa
  uint64_t init_seed = 0;                   // seed for presets' random initialisation

  template <class F> void fields(F&& f);
};

// PEFT's LoraConfig keys.
struct LoraConfig {
  int r = 8;                          // rank of A [r,in] and B [out,r]
  double lora_alpha = 8;              // scaling = lora_alpha / r (or / sqrt(r) with use_rslora)
  double lora_dropout = 0.0;          // dropout on the adapter's input
  // all-linear, or module names. An entry matches a module whose name ends with it, or that it
  // matches in full as a regex: YAML's single string (PEFT: a regex) becomes a one-element list.
  // Empty (the key absent): PEFT's default for the model type (models::peft_default_targets).
  std::vector<std::string> target_modules;
  std::vector<std::string> exclude_modules;
  std::vector<int> layers_to_transform;  // empty: every layer
  // PEFT's rank_pattern / alpha_pattern: module name patterns to a rank / lora_alpha, in the
  // YAML's order (the first that matches a module decides; models::LoraPatterns).
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  bool use_rslora = false;
  bool use_dora = false;                   // DoRA: a trained magnitude per output row (models/layers/dora.h)
  std::string init_lora_weights = "true";  // true (kaiming-uniform A, zero B) | gaussian
  std::string bias = "none";               // none | all | lora_only: base biases trained too (models/lora.h)
  std::vector<std::string> modules_to_save;  // modules trained in full (PEFT suffix match; models/lora.h)
  bool fan_in_fan_out = false;             // weights stored [in,out] (GPT-2 Conv1D); auto-set for gpt2
  std::string task_type = "CAUSAL_LM";

  template <class F> void fields(F&& f);
};

struct TrainingConfig {
  std::string output_dir = "runs/memtune";
  std::string finetune = "lora";              // lora|full
  int per_device_train_batch_size = 8;        // micro-batch rows; kAuto: from the estimate
  int per_device_eval_batch_size = 8;
  int gradient_accumulation_steps = 1;        // micro-batches per optimizer step
  CheckpointingConfig gradient_checkpointing;
  CheckpointKwargsConfig gradient_checkpointing_kwargs;
  std::string activation_offload = "false";  // false|checkpoints: checkpointed layers' inputs in host memory
  bool fp16 = false;                          // fp16 autocast with dynamic loss scaling; adapters fp32
  bool bf16 = false;                          // bf16 autocast; adapters fp32
  double learning_rate = 5e-5;
  double num_train_epochs = 3;
  int64_t max_steps = -1;                     // > 0 overrides num_train_epochs
  std::string lr_scheduler_type = "linear";   // transformers' SchedulerType names (trainer/schedule.h)
  // transformers' lr_scheduler_kwargs: the schedule function's own arguments (num_cycles,
  // lr_end, power, timescale, min_lr, min_lr_rate, warmup_lr_rate, num_decay_steps, ...:
  // numbers, or warmup_stable_decay's warmup_type / decay_type names), in the YAML's order.
  ScheduleKwargs lr_scheduler_kwargs;
  double warmup_ratio = 0;                    // (deprecated in transformers 5 for a warmup_steps below 1)
  // warmup_steps and the *_steps intervals below: a whole number of steps, or in (0, 1) that
  // share of the run's steps, as transformers 5 reads them (steps_of).
  double warmup_steps = 0;
  double weight_decay = 0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  std::string optim = "adamw_torch";          // Hugging Face's names (config.cpp lists them)
  double momentum = 0;                        // sgd only
  double max_grad_norm = 1.0;                 // <= 0: no clipping
  double label_smoothing_factor = 0;          // transformers' LabelSmoother's epsilon, in [0, 1)
  double neftune_noise_alpha = 0;             // NEFTune's alpha; 0: none
  double logging_steps = 1;
  bool logging_first_step = false;            // also a metrics row at step 1 (HF's)
  std::string logging_strategy = "steps";     // steps (logging_steps) | epoch | no (HF's IntervalStrategy)
  double save_steps = 0;                      // 0: only at the end
  std::string save_strategy = "steps";        // steps (save_steps) | epoch | no
  int save_total_limit = 0;                   // 0: keep all checkpoints
  double eval_steps = 0;                      // 0: no periodic evaluation
  std::string eval_strategy;                  // empty (memtune's: eval_steps) | steps | epoch | no
  int64_t eval_accuracy_rows = 0;             // > 0: exact-match accuracy on this many eval records (instruction data)
  // The best evaluation (HF's): its metric ("" unset: loss where load_best_model_at_end or
  // reduce_lr_on_plateau needs one), whether larger is better (unset: not a *loss), and the
  // trainable tensors of its checkpoint in the final adapter or model.
  std::string metric_for_best_model;
  std::string greater_is_better;              // "" (unset) | true | false
  bool load_best_model_at_end = false;
  uint64_t seed = 42;
  std::string resume_from_checkpoint;         // empty | latest | path to checkpoints/step-N
  double fp16_init_scale = 65536;             // loss scaler start
  int64_t fp16_growth_interval = 2000;        // good steps before the scale doubles
  bool group_by_length = false;               // HF's LengthGroupedSampler (transformers 4.x's name)
  std::string train_sampling_strategy = "random";  // random|sequential|group_by_length (transformers 5.x)
  // Accepted for compatibility with HF TrainingArguments; they change nothing here.
  bool dataloader_pin_memory = true;
  int dataloader_num_workers = 0;
  bool remove_unused_columns = true;
  std::string report_to = "none";

  static constexpr int kAuto = -1;  // per_device_train_batch_size: auto (reflect::kAuto)
  template <class F> void fields(F&& f);
};

struct DataConfig {
  std::string train_file;                 // .jsonl, .bin (llm.c tokens), .txt, or a directory of .txt
  std::string eval_file;                  // empty: no evaluation
  double eval_split = 0;                  // documents of train_file held out: a share in (0, 1), or a count
  std::string format = "auto";            // auto|text|instruction|chat|tokens|plain
  std::string template_name = "alpaca";   // chat/instruction template: llama-3|chatml|alpaca|gemma
  std::string chat_template;              // a template string; overrides template_name
  std::string text_field = "text";
  int max_seq_length = 512;
  bool pack_sequences = true;
  std::string truncation = "right";       // right|drop
  bool train_on_prompt = false;           // false: only assistant messages / outputs are in the loss
  bool skip_invalid = false;              // skip (and count) malformed lines instead of failing
  bool add_eos_token = true;
  bool shuffle = true;
  std::string cache_dir;                  // empty: output_dir/../.cache/tokenized

  template <class F> void fields(F&& f);
};

struct OnOomConfig {
  double shrink_factor = 0.5;     // micro-batch *= factor on OOM (at least one less)
  int max_retries = 16;           // attempts of one step before giving up
  // The savings the supervisor may use after an out-of-memory error, in this order:
  // micro_batch (shrink it, keeping the step's samples; first when listed), checkpointing
  // (more layers), activation_offload, optimizer_offload, layer_offload.
  std::vector<std::string> ladder = {"micro_batch", "checkpointing", "activation_offload", "optimizer_offload",
                                     "layer_offload"};
  bool allows(const std::string& rung) const;
  template <class F> void fields(F&& f);
};

struct MemoryConfig {
  SizeSpec device_limit;                 // emulate a device of this size (CPU budget allocator / CUDA fraction)
  double warning_threshold = 0.85;       // of the limit: log suggestions
  double critical_threshold = 0.90;      // release cached memory
  double emergency_threshold = 0.95;     // shrink the micro-batch before an OOM
  std::string optimizer_offload = "none";  // none|cpu: optimizer state in host memory outside the budget
  OnOomConfig on_oom;
  int64_t grow_after_steps = 50;         // steps under grow_threshold before trying a larger micro-batch
  double grow_threshold = 0.6;           // peak share of the limit that counts as headroom
  bool supervise = true;                 // false: an OOM stops the run
  std::string inject_oom;                // testing: "step:phase[:rank]" list, e.g. "3:backward,5:optimizer"

  template <class F> void fields(F&& f);
};

struct RuntimeConfig {
  std::string device = "auto";  // auto|cpu|cuda|cuda:N
  int num_threads = 0;          // 0: OMP_NUM_THREADS or the CPUs of this process's affinity
  std::string log_level = "info";
  template <class F> void fields(F&& f);
};

struct DistributedConfig {
  std::string backend = "auto";   // auto (nccl on CUDA, gloo on CPU)|gloo|nccl
  double timeout = 300;           // seconds for each collective
  int64_t bucket_size_mb = 25;    // gradient buckets
  // ZeRO stage: none | optimizer (1: optimizer state) | gradients (2: + gradients) | full (3: + the layers' weights)
  std::string sharding = "none";
  bool prefetch = true;           // full: the next layer's gather starts while one computes (one more layer held)
  template <class F> void fields(F&& f);
};

struct Config {
  ModelConfig model;
  LoraConfig lora;
  TrainingConfig training;
  DataConfig data;
  MemoryConfig memory;
  RuntimeConfig runtime;
  DistributedConfig distributed;
  std::string source;  // where it came from (file name), for messages

  template <class F> void fields(F&& f);
};

// Parses YAML text (strict: unknown keys, wrong types and impossible values throw UserError
// naming the key path, line:column, the value and the nearest known key), then applies
// `overrides` ("training.learning_rate=1e-4", values typed as in YAML), then validates.
Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});
// A config memtune wrote (a checkpoint's config.yaml), read as written: unknown keys and wrong
// types throw, values are not validated (the version that wrote it did; a rule added since
// must not make an older checkpoint unresumable).
Config parse_saved_config(const std::string& yaml_text, const std::string& source);
Config load_config(const std::filesystem::path& path, const std::vector<std::string>& overrides = {});
// Refuses impossible values (parse_config calls it; for configs built or changed in code).
void validate(const Config& config);

// The effective config as YAML; parse_config(to_yaml(c)) == c.
std::string to_yaml(const Config& config);
// memory.inject_oom, parsed once for validation and for the trainer: "3:backward,5:optimizer:1"
// is {3, backward, every rank}, {5, optimizer, rank 1}. nullopt when the text is not such a list.
struct OomPoint {
  int64_t step = 0;
  std::string phase;  // forward|backward|optimizer
  int rank = -1;      // -1: every rank
};
std::optional<std::vector<OomPoint>> parse_inject_oom(const std::string& spec);

// Every key as "section.key" (nested: "model.quantization_config.blocksize") -> its value
// in YAML flow form ("[q_proj, v_proj]", "{policy: every_n, n: 2}"), for comparing configs.
std::map<std::string, std::string> flatten(const Config& config);
// Every key with its type, default and help, for `memtune train --help-config`.
std::string config_help();
// Lines to log once: keys accepted for compatibility that change nothing in this run.
std::vector<std::string> compatibility_notes(const Config& config);

// A *_steps key in steps for a run of `total_steps`: a value in (0, 1) is that share of them,
// rounded up (transformers' TrainerState.compute_steps and TrainingArguments.get_warmup_steps),
// any other the value itself.
int64_t steps_of(double value, int64_t total_steps);

// Every key compared (not `source`).
bool operator==(const Config& a, const Config& b);
inline bool operator!=(const Config& a, const Config& b) { return !(a == b); }

}  // namespace memtune::trainer
