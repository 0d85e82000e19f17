#include "trainer/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/compat.h"
#include "runtime/error.h"
#include "trainer/best_model.h"
#include "trainer/config_reflect.h"
#include "trainer/schedule.h"

// memtune's config schema: every key declared once (fields()), how memtune's own value types
// read and write, and the checks across keys. The YAML machinery is trainer/config_reflect.h.

namespace memtune::trainer {

using reflect::Field;
static_assert(TrainingConfig::kAuto == reflect::kAuto, "per_device_train_batch_size: auto is the engine's auto");

namespace {

// Spellings of a dtype as Hugging Face configs write them: torch.float16, fp16, half, bf16...
std::string normalize_dtype(const std::string& s, bool /*quoted*/ = false) {
  std::string l = reflect::lower(s);
  if (l.rfind("torch.", 0) == 0) l = l.substr(6);
  if (l == "float16" || l == "fp16" || l == "half") return "float16";
  if (l == "bfloat16" || l == "bf16") return "bfloat16";
  if (l == "float32" || l == "fp32" || l == "float") return "float32";
  if (l == "auto") return "auto";
  return s;  // refused by the choices, as written
}

// resume_from_checkpoint: an unquoted true means latest, false none (HF's TrainingArguments).
std::string normalize_checkpoint_ref(const std::string& s, bool quoted) {
  bool b = false;
  const std::string l = reflect::lower(s);
  if (!quoted && reflect::parse_bool(s, b) && (l == "true" || l == "false")) return b ? "latest" : "";
  return s;
}

Field dtype_field() {
  Field f{"auto", "float32", "float16", "bfloat16"};
  f.normalize = normalize_dtype;
  return f;
}
Field checkpoint_ref_field() {
  Field f;
  f.type = "latest|path|true|false";
  f.normalize = normalize_checkpoint_ref;
  return f;
}
// distributed.sharding: DeepSpeed's stage names are the same levels.
std::string normalize_sharding(const std::string& s, bool /*quoted*/) {
  const std::string l = reflect::lower(s);
  if (l == "zero1") return "optimizer";
  if (l == "zero2") return "gradients";
  if (l == "zero3") return "full";
  return s;
}

Field sharding_field() {
  Field f{"none", "optimizer", "gradients", "full"};
  f.normalize = normalize_sharding;
  return f;
}
const Field kDtype = dtype_field();
const Field kSharding = sharding_field();
const Field kCheckpointRef = checkpoint_ref_field();

Field kwargs_field() {
  Field f;
  f.type = "map of argument name to number or name";
  return f;
}

}  // namespace

// ---- The one declaration of every key: YAML name, member, help. ----

template <class F>
void QuantizationConfig::fields(F&& f) {
  f("load_in_4bit", load_in_4bit, "4-bit base weights for the linear layers (bitsandbytes' format)");
  f("load_in_8bit", load_in_8bit,
    "LLM.int8 base weights for the linear layers (bitsandbytes' Linear8bitLt: int8 rows and their absmax, "
    "about 8 bits per parameter); the products run in the model's dtype (training.bf16 / fp16's under autocast), "
    "bnb_4bit_* keys do not apply. LoRA only");
  f("llm_int8_threshold", llm_int8_threshold,
    "LLM.int8's outlier threshold: input columns holding a value of at least this magnitude multiply in 16 bits, "
    "the rest in int8 (on a GPU, and on a CPU outside training; a CPU in training multiplies by the dequantized "
    "weight, as bitsandbytes); 0: every column in int8");
  f("llm_int8_skip_modules", llm_int8_skip_modules,
    "modules left dense under load_in_4bit / load_in_8bit, matched as transformers 5 matches them: an entry "
    "matching the start of a module's name as a regex (model.layers.1.mlp: that block's projections; "
    "model.layers.1 and model.layers.1. also reach layers 10-19: a dot matches any character), or its end "
    "(down_proj). null: transformers' default, the output "
    "layer. A list replaces that default, so it must name lm_head (memtune's output layer is always dense). A "
    "model stored quantized keeps its config.json's list");
  f("llm_int8_enable_fp32_cpu_offload", llm_int8_enable_fp32_cpu_offload,
    "false only: projections model.device_map places on cpu or offload keep their 4-bit / 8-bit form there (a "
    "CPU multiplies them as they are; offloaded layers are fetched quantized), not an fp32 copy. To keep modules "
    "dense, name them in llm_int8_skip_modules");
  f("quant_method", quant_method, "bitsandbytes only: the tag transformers writes in BitsAndBytesConfig's dict",
    Field::one_of({"bitsandbytes"}, "memtune quantizes in bitsandbytes' formats only"));
  f("llm_int8_has_fp16_weight", llm_int8_has_fp16_weight,
    "false only: 16-bit master weights trained beside the 8-bit ones are not supported");
  f("bnb_4bit_compute_dtype", bnb_4bit_compute_dtype,
    "dtype of the matmuls (torch.float16, fp16, half, bf16, fp32 accepted; float32 when absent, as bitsandbytes); "
    "auto: bfloat16 on GPUs with it "
    "(sm_80 and newer), float16 on older GPUs, float32 on CPUs. float16 turns on fp16's loss scaling as "
    "training.fp16 does; training.fp16 / bf16 override this key", kDtype);
  f("bnb_4bit_quant_type", bnb_4bit_quant_type,
    "4-bit code: nf4 (QLoRA's normal float, what recipes set) or fp4 (a 4-bit float; bitsandbytes' default)",
    Field::one_of({"nf4", "fp4"}, "bitsandbytes' 4-bit codes are nf4 and fp4"));
  f("bnb_4bit_use_double_quant", bnb_4bit_use_double_quant,
    "quantize the absmax values too (about 4.127 bits per parameter)");
  f("bnb_4bit_quant_storage", bnb_4bit_quant_storage, "storage dtype of the packed codes",
    Field::one_of({"uint8"}, "packed codes are stored as uint8"));
  f("blocksize", blocksize, "elements per absmax block: a power of 2 in 32..4096");
}

template <class F>
void ModelConfig::fields(F&& f) {
  f("name_or_path", name_or_path, "HF model directory (config.json + safetensors) or a built-in preset");
  f("architecture", architecture,
    "registered architecture for a preset; empty: from the preset or config.json");
  f("tokenizer", tokenizer, "tokenizer file or directory; empty: name_or_path's own");
  f("torch_dtype", torch_dtype,
    "dtype the dense weights (embeddings, norms, unquantized projections, head) and so the activations are kept "
    "in, as from_pretrained's dtype; auto: config.json's. The default is transformers 4's (float32; transformers 5 "
    "reads auto when from_pretrained is given none). bfloat16 / float16 need the same compute dtype (training.bf16 "
    "/ fp16) and a LoRA run (trained tensors stay float32); float32 with training.bf16 is mixed precision",
    kDtype);
  f("quantization_config", quantization_config, "bitsandbytes' BitsAndBytesConfig");
  f("device_map", device_map,
    "auto|cpu|cuda|cuda:N, or a map from module prefix to device (cuda:N, cpu, offload), in order");
  f("max_memory", max_memory, "budget per device for device_map: auto, e.g. {cuda:0: 20GiB, cpu: 64GiB}");
  f("low_cpu_mem_usage", low_cpu_mem_usage,
    "true only: memtune always loads tensor by tensor from the memory-mapped safetensors");
  f("attn_implementation", attn_implementation,
    "attention kernel (transformers' eager semantics in all three): auto, memtune's fused kernel on a CPU in fp32, "
    "SDPA on a GPU where it applies, else the blocked one; eager, the blocked one (linear memory); sdpa, "
    "at::scaled_dot_product_attention (LibTorch >= 2.0), refused with attention dropout and for soft-capped "
    "scores (Gemma 2's attn_logit_softcapping), which SDPA cannot compute",
    {"auto", "eager", "sdpa"});
  f("init_seed", init_seed, "seed for the random initialisation of presets");
}

template <class F>
void LoraConfig::fields(F&& f) {
  f("r", r, "rank of A [r,in] and B [out,r]");
  f("lora_alpha", lora_alpha, "scaling = lora_alpha / r (or / sqrt(r) with use_rslora)");
  f("lora_dropout", lora_dropout, "dropout on the adapter's input, in [0, 1)");
  f("target_modules", target_modules,
    "all-linear, a list of module names, or one string (a regex over full module names, as PEFT); absent: PEFT's "
    "default for the model type (q_proj, v_proj for the Llama family; c_attn for GPT-2). A target that also "
    "selects a module other than a decoder layer's projection (a norm, a block, an embedding, lm_head) is refused");
  f("exclude_modules", exclude_modules, "module names never adapted");
  f("layers_to_transform", layers_to_transform, "layer indices to adapt; empty: every layer");
  f("rank_pattern", rank_pattern,
    "ranks other than r: {pattern: rank}, a module taking the first pattern, in order, that matches its full "
    "name as the regex (.*\\.)?(pattern)$ (PEFT's); e.g. {model.layers.0.mlp.down_proj: 4, q_proj: 16}. A pattern "
    "that decides no adapted module (it matches none, or only ones an earlier pattern decides) is refused");
  f("alpha_pattern", alpha_pattern, "lora_alpha other than lora_alpha, as rank_pattern: {pattern: alpha}");
  f("use_rslora", use_rslora, "rank-stabilised scaling lora_alpha / sqrt(r)");
  f("use_dora", use_dora,
    "DoRA (PEFT's): a trained magnitude per output row rescales W + s B A to it, its norm detached; the "
    "magnitude starts at the base's row norms. Not with load_in_8bit or distributed.sharding: full");
  f("init_lora_weights", init_lora_weights, "true: kaiming-uniform A, zero B; gaussian: normal A, zero B",
    {"true", "gaussian"});
  f("bias", bias,
    "base biases trained beside the adapters (PEFT's): none; all (every bias: the projections' and the norms'); "
    "lora_only (the adapted projections' biases). Trained in fp32 (so not on a 16-bit model.torch_dtype, where PEFT "
    "trains them in 16 bits) and saved in the adapter as PEFT saves them",
    {"none", "all", "lora_only"});
  f("modules_to_save", modules_to_save,
    "modules trained in full beside the adapters and saved in the adapter (PEFT's): module names matched as a "
    "suffix (lm_head, embed_tokens, model.norm; GPT-2: wpe, ln_f), outside the decoder layers, not tied");
  f("fan_in_fan_out", fan_in_fan_out, "weights stored [in,out] (GPT-2 Conv1D); set for gpt2 by itself");
  f("task_type", task_type, "PEFT task type", {"CAUSAL_LM"});
}

template <class F>
void CheckpointKwargsConfig::fields(F&& f) {
  f("use_reentrant", use_reentrant,
    "torch.utils.checkpoint's implementation (transformers 5: false); both compute the same gradients, and "
    "memtune recomputes layers by its own checkpointing: accepted for compatibility, changes nothing");
}

template <class F>
void TrainingConfig::fields(F&& f) {
  f("output_dir", output_dir, "where config.yaml, train.log, metrics.jsonl and checkpoints go");
  f("finetune", finetune, "what is trained: LoRA adapters or every weight", {"lora", "full"});
  f("per_device_train_batch_size", per_device_train_batch_size,
    "micro-batch rows per device, or auto (the largest that the estimate says fits)",
    Field::integer_or_auto());
  f("per_device_eval_batch_size", per_device_eval_batch_size,
    "rows per evaluation batch, at most the training micro-batch in effect (halved after an out-of-memory error "
    "under the supervisor; its loss is a sum over tokens, which the batch changes only in the last bits, and over "
    "an 8-bit base by LLM.int8's choice of outlier columns)");
  f("gradient_accumulation_steps", gradient_accumulation_steps, "micro-batches per optimizer step");
  f("gradient_checkpointing", gradient_checkpointing,
    "true|false, or {policy: none|all|every_n|layers, n: 2, layers: [1, 3]}");
  f("gradient_checkpointing_kwargs", gradient_checkpointing_kwargs,
    "transformers' arguments for torch.utils.checkpoint: use_reentrant only");
  f("activation_offload", activation_offload,
    "checkpoints: each checkpointed layer's input (all it keeps) waits for backward in host memory, outside the "
    "device budget, and comes back just before its recomputation; all: refused (needs saved-tensor hooks)",
    {"false", "checkpoints", "all"});
  f("fp16", fp16,
    "fp16 autocast with dynamic loss scaling, as the Trainer's: LoRA adapters keep fp32 weights and multiply "
    "in fp16, as PEFT's under autocast (bnb_4bit_compute_dtype alone: the base only)");
  f("bf16", bf16,
    "bf16 autocast, as the Trainer's: LoRA adapters keep fp32 weights and multiply in bf16, as PEFT's under "
    "autocast (bnb_4bit_compute_dtype alone: the base only)");
  f("learning_rate", learning_rate, "peak learning rate");
  f("num_train_epochs", num_train_epochs,
    "passes over the training data (may be fractional); as the Trainer's, each epoch is a whole pass, its last "
    "step on the samples it has left");
  f("max_steps", max_steps, "optimizer steps; > 0 overrides num_train_epochs, -1: from the epochs");
  f("lr_scheduler_type", lr_scheduler_type,
    "learning-rate schedule (transformers' get_scheduler, the same factors in doubles)",
    {"constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
     "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "reduce_lr_on_plateau"});
  f("lr_scheduler_kwargs", lr_scheduler_kwargs,
    "the schedule function's own arguments (transformers'): cosine num_cycles (0.5); cosine_with_restarts "
    "num_cycles (1); polynomial lr_end (1e-7), power (1.0); inverse_sqrt timescale (warmup_steps, or 10000); "
    "cosine_with_min_lr min_lr or min_lr_rate (one of them), num_cycles; cosine_warmup_with_min_lr those and "
    "warmup_lr_rate; warmup_stable_decay num_decay_steps (needed), num_stable_steps (the steps warm-up and "
    "decay leave), warmup_type (linear) and decay_type (cosine): linear, cosine or 1-sqrt, min_lr_ratio (0: "
    "where warm-up starts and decay ends), num_cycles (0.5); reduce_lr_on_plateau torch's ReduceLROnPlateau's: "
    "mode (min), factor (0.1), patience (10 evaluations), threshold (1e-4), threshold_mode (rel), cooldown (0), "
    "min_lr (0), eps (1e-8), stepped by each periodic evaluation's eval_loss. A key the schedule does not take "
    "is refused (transformers raises a TypeError)",
    kwargs_field());
  f("warmup_ratio", warmup_ratio,
    "share of the steps spent warming up, in [0, 1] (transformers 5 deprecates it: warmup_steps below 1)");
  f("warmup_steps", warmup_steps,
    "warm-up steps, or in (0, 1) their share of the steps, rounded up (transformers 5); set it or warmup_ratio");
  f("weight_decay", weight_decay, "decoupled weight decay");
  f("adam_beta1", adam_beta1, "AdamW beta1, in [0, 1)");
  f("adam_beta2", adam_beta2, "AdamW beta2, in [0, 1)");
  f("adam_epsilon", adam_epsilon, "AdamW epsilon");
  f("optim", optim,
    "optimizer (Hugging Face's names): adamw_torch, adamw_torch_fused (transformers 5's default: the same update "
    "in one kernel) and adamw are torch's AdamW (fp32 states); adamw_bnb_8bit and "
    "adamw_8bit bitsandbytes' 8-bit AdamW; paged_* bitsandbytes' paged AdamW (states in host memory outside the "
    "device budget; on a GPU they pass through two device slots of at most 64 MiB during the update); adafactor transformers' Adafactor as the Trainer builds it (factored second moments, "
    "the schedule's learning rate; reads no adam_* key)",
    {"adamw_torch", "adamw_torch_fused", "adamw", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
     "paged_adamw_32bit", "adafactor", "sgd"});
  f("momentum", momentum, "SGD momentum, in [0, 1); at 0 SGD keeps no state (as torch.optim.SGD); optim: sgd only");
  f("max_grad_norm", max_grad_norm, "clip the global gradient norm to this; <= 0: no clipping");
  f("label_smoothing_factor", label_smoothing_factor,
    "label smoothing of the loss (transformers' LabelSmoother): each trained token's loss is (1 - f) of its "
    "cross-entropy plus f of the mean of -log softmax over the vocabulary, in training and in the eval loss "
    "(the eval perplexity stays that of the cross-entropy). Normalized over the step's target tokens, as memtune's "
    "loss always is; transformers' smoother averages each micro-batch on its own, so with gradient accumulation "
    "over micro-batches of different token counts its step weighs tokens differently");
  f("neftune_noise_alpha", neftune_noise_alpha,
    "NEFTune (transformers'): in training, uniform noise in +-alpha / sqrt(T x hidden) added to the input "
    "embeddings, T the padded length of the row's micro-batch as configured; each sample's noise is drawn from its "
    "own key, so a smaller micro-batch after an out-of-memory error adds the same. 0: none (transformers' null); "
    "the paper uses 5");
  f("logging_steps", logging_steps, "log metrics every this many steps, or in (0, 1) that share of the steps");
  f("logging_first_step", logging_first_step, "also a metrics row at the first step (HF's)");
  f("logging_strategy", logging_strategy,
    "when metrics.jsonl gets a step's row (HF's): steps (every logging_steps, and the last step), epoch (each "
    "epoch's last step), no (none); a step where something happened (an out-of-memory error, a skipped update) "
    "gets its row under each",
    {"steps", "epoch", "no"});
  f("save_steps", save_steps,
    "checkpoint every this many steps, or in (0, 1) that share of the steps; 0: only at the end");
  f("save_strategy", save_strategy,
    "when checkpoints are written (HF's): steps (every save_steps, and at the end), epoch (each epoch's end), no "
    "(none, not even at the end: the adapter or model is still written; SIGINT/SIGTERM still checkpoint, so that "
    "the run can resume)",
    {"steps", "epoch", "no"});
  f("save_total_limit", save_total_limit, "checkpoints kept; 0: all");
  f("eval_steps", eval_steps,
    "evaluate every this many steps, or in (0, 1) that share of the steps; 0: no periodic evaluation");
  f("eval_strategy", eval_strategy,
    "when the eval loss is measured (HF's): steps (every eval_steps; unset, every logging_steps, as transformers), "
    "epoch (each epoch's end), no (never: no eval data is read). Unset: memtune's own, every eval_steps when set. "
    "Under each but no, also before and after training when there is eval data",
    Field::one_of({"", "steps", "epoch", "no"}, "transformers' IntervalStrategy"));
  f("eval_accuracy_rows", eval_accuracy_rows,
    "> 0: before and after training, greedy exact-match accuracy on this many records of the "
    "instruction eval file");
  f("metric_for_best_model", metric_for_best_model,
    "the evaluation metric that ranks checkpoints and steps reduce_lr_on_plateau (HF's): loss, perplexity or "
    "token_accuracy (eval_ prefix optional); unset: loss where load_best_model_at_end or reduce_lr_on_plateau "
    "needs one",
    Field::one_of({"", "loss", "eval_loss", "perplexity", "eval_perplexity", "token_accuracy", "eval_token_accuracy"},
                  "memtune's evaluation metrics"));
  f("greater_is_better", greater_is_better,
    "whether a larger metric_for_best_model is better; unset: true unless the metric's name ends in loss (HF's)",
    Field::one_of({"", "true", "false"}, "a boolean, or unset"));
  f("load_best_model_at_end", load_best_model_at_end,
    "at the end, the trainable tensors of the checkpoint with the best metric_for_best_model go into the final "
    "evaluation and the saved adapter or model (HF's); save_total_limit keeps that checkpoint and the newest. "
    "Needs checkpoints at evaluations: eval_strategy and save_strategy alike, save_steps a multiple of eval_steps");
  f("seed", seed, "seed of the sampler, dropout and LoRA initialisation");
  f("resume_from_checkpoint", resume_from_checkpoint,
    "latest (or true): the newest checkpoint in output_dir, or a fresh start when there is none yet (one "
    "command starts and restarts a run; Hugging Face's Trainer refuses true without one); a "
    "checkpoints/step-N path; empty: none",
    kCheckpointRef);
  f("fp16_init_scale", fp16_init_scale, "initial loss scale for fp16");
  f("fp16_growth_interval", fp16_growth_interval, "good steps before the loss scale doubles");
  f("group_by_length", group_by_length,
    "HF's LengthGroupedSampler: each epoch's shuffled samples cut into megabatches of up to 50 steps (at least 4 "
    "megabatches), each sorted by length, the longest sample of the epoch first, so that a step pads its rows to "
    "similar lengths (packed rows are full anyway; metrics.jsonl's padding is the share of a step's positions "
    "on padding)");
  f("train_sampling_strategy", train_sampling_strategy,
    "transformers 5's name for the order: random (data.shuffle's), sequential (as data.shuffle: false), "
    "group_by_length (as group_by_length: true)",
    {"random", "sequential", "group_by_length"});
  f("dataloader_pin_memory", dataloader_pin_memory, "accepted for compatibility; changes nothing");
  f("dataloader_num_workers", dataloader_num_workers, "accepted for compatibility; changes nothing");
  f("remove_unused_columns", remove_unused_columns, "accepted for compatibility; changes nothing");
  f("report_to", report_to, "experiment trackers: none only (metrics go to output_dir/metrics.jsonl and train.log)",
    Field::one_of({"none"}, "memtune reports to no experiment tracker; its metrics are in output_dir/metrics.jsonl "
                            "and train.log. Hint: set report_to: none, or drop the key"));
}

template <class F>
void DataConfig::fields(F&& f) {
  f("train_file", train_file, ".jsonl, .bin (llm.c tokens), .txt, or a directory of .txt");
  f("eval_file", eval_file, "evaluation data; empty: none");
  f("eval_split", eval_split,
    "documents (records) of train_file held out for evaluation, as datasets' train_test_split(test_size): in (0, "
    "1) ceil(share x documents) of them, a whole number >= 1 that many; drawn by training.seed (without "
    "data.shuffle, the file's last ones), the rest trains. 0: none. Not with data.eval_file. The documents are "
    "those that make tokens (records skipped as invalid or tokenizing to nothing do not count, where datasets "
    "counts every row), and in a token file those its eos separators end");
  f("format", format, "what a sample is; auto: from the file", {"auto", "text", "instruction", "chat", "tokens", "plain"});
  f("template_name", template_name, "chat/instruction template", {"llama-3", "chatml", "alpaca", "gemma"});
  f("chat_template", chat_template, "a template string; overrides template_name");
  f("text_field", text_field, "JSON field holding the text of a text sample");
  f("max_seq_length", max_seq_length, "tokens per sequence (at least 8)");
  f("pack_sequences", pack_sequences, "pack several samples into each sequence");
  f("truncation", truncation, "longer samples: right cuts the end, drop leaves them out", {"right", "drop"});
  f("train_on_prompt", train_on_prompt,
    "chat and instruction: false puts only the replies (assistant messages, outputs, with their template's closing "
    "tokens) in the loss, true every token; text, plain and tokens train every token either way");
  f("skip_invalid", skip_invalid, "skip (and count) malformed lines instead of failing");
  f("add_eos_token", add_eos_token, "end each sample with the EOS token");
  f("shuffle", shuffle, "shuffle the samples each epoch");
  f("cache_dir", cache_dir, "tokenized cache; empty: output_dir/.cache");
}

bool OnOomConfig::allows(const std::string& rung) const {
  return std::find(ladder.begin(), ladder.end(), rung) != ladder.end();
}

template <class F>
void OnOomConfig::fields(F&& f) {
  f("shrink_factor", shrink_factor,
    "micro-batch *= factor on OOM (at least one less), in (0, 1); under a budget the memory model's largest "
    "fitting micro-batch instead, unless it had said the failed one fits");
  f("max_retries", max_retries, "attempts of one step before giving up");
  f("ladder", ladder,
    "the savings an out-of-memory error may take, in order; each keeps the math: micro_batch (shrink it, the "
    "step's samples kept; first when listed), checkpointing (more layers), activation_offload (checkpointed layers' "
    "inputs in host memory), optimizer_offload (the optimizer's state and the gradients in host memory), layer_offload (frozen "
    "layers' weights in host memory); optimizer_8bit (not by default: it changes the numerics) turns AdamW's fp32 "
    "state into bitsandbytes' 8-bit state and update (adamw_8bit) from the next step. The order is the order of "
    "cost. Under memory.device_limit the memory model decides how far to climb, takes only the first rung that "
    "fits alone where one does (the rungs before it would not have been enough), and takes optimizer_offload before the first step when the optimizer's state cannot stay on the "
    "device under memory.device_limit even with every other rung",
    Field{"micro_batch", "checkpointing", "activation_offload", "optimizer_offload", "layer_offload",
          "optimizer_8bit"});
}

template <class F>
void MemoryConfig::fields(F&& f) {
  f("device_limit", device_limit,
    "emulate a device of this size (6GiB, 512MiB, 0.9 of the device); null: the device's own");
  f("warning_threshold", warning_threshold, "share of the limit at which suggestions are logged");
  f("critical_threshold", critical_threshold, "share of the limit at which cached memory is released");
  f("emergency_threshold", emergency_threshold,
    "share of the limit at which the micro-batch shrinks before an OOM");
  f("optimizer_offload", optimizer_offload,
    "cpu: the optimizer's state lives in host memory outside the device budget, and each gradient moves there as "
    "backward produces it and accumulates there (DeepSpeed's offload_optimizer: cpu, ZeRO-Offload); the update "
    "is the same, bit for bit (on the host for parameters on a GPU). Several ranks on GPUs keep the gradients on "
    "the device (NCCL reduces device memory)",
    {"none", "cpu"});
  f("on_oom", on_oom,
    "what an out-of-memory error does (metrics.jsonl: the step's events, and oom_recovery_s, the seconds "
    "from its first error to its end)");
  f("grow_after_steps", grow_after_steps,
    "steps under grow_threshold before growing back: the latest ladder rung undone, else a larger micro-batch");
  f("grow_threshold", grow_threshold, "peak share of the limit that counts as headroom, in (0, 1)");
  f("supervise", supervise, "false: an OOM stops the run");
  f("inject_oom", inject_oom, "testing: step:phase[:rank] list, e.g. 3:backward,5:optimizer");
}

template <class F>
void RuntimeConfig::fields(F&& f) {
  f("device", device, "auto|cpu|cuda|cuda:N");
  f("num_threads", num_threads, "intra-op threads; 0: OMP_NUM_THREADS or this process's CPUs");
  f("log_level", log_level, "what the log shows", {"trace", "debug", "info", "warn", "error", "critical", "off"});
}

template <class F>
void DistributedConfig::fields(F&& f) {
  f("backend", backend, "collectives; auto: nccl on CUDA, gloo on CPU", {"auto", "gloo", "nccl"});
  f("timeout", timeout, "seconds allowed for each collective");
  f("bucket_size_mb", bucket_size_mb, "MiB per gradient bucket");
  f("sharding", sharding,
    "ZeRO across ranks: optimizer (zero1): each rank keeps and updates 1/W of the optimizer state; gradients "
    "(zero2): also each gradient reduced to its owner only, as backward produces it; full (zero3): also the "
    "layers' weights, frozen and trainable, each rank keeping 1/W of them and gathering a layer just before it "
    "runs (every layer checkpointed). One process: as none",
    kSharding);
  f("prefetch", prefetch,
    "sharding full: the next layer's gather starts while a layer computes, so it overlaps the computation (one "
    "more gathered layer on the device); false: each layer is gathered when it runs");
}

// `source` is not a key: it says where the config came from.
template <class F>
void Config::fields(F&& f) {
  f("model", model, "the model: weights, quantization, placement");
  f("lora", lora, "LoRA adapters (PEFT's LoraConfig names)");
  f("training", training, "the training loop (HF TrainingArguments names)");
  f("data", data, "the dataset and how samples become sequences");
  f("memory", memory, "the memory supervisor");
  f("runtime", runtime, "threads, device, logging");
  f("distributed", distributed, "several processes");
}

namespace {

// HF writes devices as integers too: 0 means cuda:0.
std::string normalize_device(const std::string& s) {
  int64_t index = 0;
  if (reflect::parse_int64(s, index) && index >= 0) return "cuda:" + std::to_string(index);
  return s;
}

bool is_device(const std::string& s, bool allow_auto, bool allow_offload) {
  if (s == "cpu" || s == "cuda") return true;
  if (allow_auto && s == "auto") return true;
  if (allow_offload && s == "offload") return true;
  if (s.rfind("cuda:", 0) != 0 || s.size() == 5) return false;
  return std::all_of(s.begin() + 5, s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

}  // namespace

// ---- memtune's own value types in the reflection engine (found through its arguments) ----

namespace reflect {

std::string type_name(const SizeSpec&, const Field&) { return "size"; }
std::string type_name(const std::map<std::string, SizeSpec>&, const Field&) { return "map of device to size"; }
template <class V>
std::string type_name(const std::vector<std::pair<std::string, V>>&, const Field& f) {
  if (f.type) return f.type;
  return std::is_integral_v<V> ? "map of module pattern to rank" : "map of module pattern to number";
}
std::string type_name(const CheckpointingConfig&, const Field&) { return "bool or {policy, n, layers}"; }
std::string type_name(const DeviceMapConfig&, const Field&) { return "device or map of module prefix to device"; }
std::string type_name(const std::optional<std::vector<std::string>>&, const Field&) {
  return "list of strings, or null";
}

std::string type_name(const ScheduleArg&, const Field&) { return "number or name"; }

// lr_scheduler_kwargs' values: a number where the text reads as one (1e-5, 100), else a name
// (cosine, 1-sqrt); a quoted value is a name, as in Python.
void read_value(const Item& it, ScheduleArg& v, Ctx& ctx, const Field& f) {
  const std::string text = scalar(it, ctx, type_name(v, f));
  double x = 0;
  if (it.node.Tag() != "!" && parse_double(text, x))
    v = x;
  else
    v = text;
}
void write(YAML::Emitter& e, const ScheduleArg& v, const Field& f) {
  if (const auto* x = std::get_if<double>(&v))
    write(e, *x, f);
  else
    e << std::get<std::string>(v);
}

// null: unset; a list, even an empty one: set. A single string is refused: Python code that
// takes the list would iterate the string's characters.
void read_value(const Item& it, std::optional<std::vector<std::string>>& v, Ctx& ctx, const Field& f) {
  v.reset();
  if (it.node.IsNull()) return;
  if (it.node.IsScalar())
    fail(ctx.at(it.mark), ": ", it.path, ": expected ", type_name(v, f), ", got the string '", it.node.Scalar(),
         "' (transformers would read its characters as the entries). Hint: [", it.node.Scalar(), "]");
  v.emplace();
  read_value(it, *v, ctx, f);
}

// null or empty: not set.
void read_value(const Item& it, SizeSpec& v, Ctx& ctx, const Field& f) {
  if (it.node.IsNull() || (it.node.IsScalar() && it.node.Scalar().empty())) {
    v = SizeSpec{};
    return;
  }
  v = parse_size(scalar(it, ctx, "size (6GiB, 512MiB, 0.9 of the device)"), ctx.at(it.mark) + ": " + it.path);
}

void read_value(const Item& it, std::map<std::string, SizeSpec>& v, Ctx& ctx, const Field& f) {
  v.clear();
  if (it.node.IsNull()) return;
  if (!it.node.IsMap()) wrong_type(ctx, it, type_name(v, f));
  for (const auto& kv : it.node) {
    Item key{kv.first, it.path, kv.first.Mark()};
    std::string device = normalize_device(scalar(key, ctx, "device name (cuda:N or cpu)"));
    Item value{kv.second, join(it.path, device), mark_of(kv.second, kv.first)};
    MEMTUNE_CHECK(!v.count(device), ctx.at(key.mark), ": ", value.path, ": duplicate key");
    read(value, v[device], ctx, Field{});
  }
}

// rank_pattern / alpha_pattern: patterns to values, in the YAML's order.
template <class V>
void read_value(const Item& it, std::vector<std::pair<std::string, V>>& v, Ctx& ctx, const Field& f) {
  v.clear();
  if (it.node.IsNull()) return;
  if (!it.node.IsMap()) wrong_type(ctx, it, type_name(v, f));
  for (const auto& kv : it.node) {
    Item key{kv.first, it.path, kv.first.Mark()};
    std::string pattern = scalar(key, ctx, "module name pattern");
    Item value{kv.second, join(it.path, pattern), mark_of(kv.second, kv.first)};
    for (const auto& [p, x] : v) MEMTUNE_CHECK(p != pattern, ctx.at(key.mark), ": ", value.path, ": duplicate key");
    V x{};
    read(value, x, ctx, Field{});
    v.emplace_back(std::move(pattern), x);
  }
}

// A value replaces the whole setting (an override `gradient_checkpointing=false` or
// `={policy: layers, layers: [0]}` leaves no n or layers of the config's own value behind).
void read_value(const Item& it, CheckpointingConfig& v, Ctx& ctx, const Field& f) {
  v = CheckpointingConfig{};
  if (it.node.IsScalar()) {
    bool on = false;
    v.policy = parse_bool(it.node.Scalar(), on) ? (on ? "all" : "none") : it.node.Scalar();
    return;
  }
  if (!it.node.IsMap()) wrong_type(ctx, it, type_name(v, f));
  check_keys(it, {"policy", "n", "layers"}, ctx);
  bool has_policy = false, has_n = false, has_layers = false;
  for (const auto& kv : it.node) {
    const std::string& name = kv.first.Scalar();
    Item value{kv.second, join(it.path, name), mark_of(kv.second, kv.first)};
    if (name == "policy") has_policy = true, read(value, v.policy, ctx, Field{});
    if (name == "n") has_n = true, read(value, v.n, ctx, Field{});
    if (name == "layers") has_layers = true, read(value, v.layers, ctx, Field{});
  }
  if (!has_policy) v.policy = has_layers ? "layers" : has_n ? "every_n" : "all";
}

void read_value(const Item& it, DeviceMapConfig& v, Ctx& ctx, const Field& f) {
  if (it.node.IsScalar()) {
    v.single = normalize_device(it.node.Scalar());
    v.entries.clear();
    return;
  }
  if (!it.node.IsMap()) wrong_type(ctx, it, type_name(v, f));
  v.single = DeviceMapConfig().single;
  v.entries.clear();
  for (const auto& kv : it.node) {
    Item key{kv.first, it.path, kv.first.Mark()};
    std::string prefix = scalar(key, ctx, "module prefix");
    Item value{kv.second, join(it.path, prefix), mark_of(kv.second, kv.first)};
    ctx.seen[value.path] = {ctx.at(value.mark), text_of(value.node)};
    for (const auto& [p, d] : v.entries)
      MEMTUNE_CHECK(p != prefix, ctx.at(key.mark), ": ", value.path, ": duplicate key");
    v.entries.emplace_back(prefix, normalize_device(scalar(value, ctx, "device (cuda:N, cpu or offload)")));
  }
}

void write(YAML::Emitter& e, const SizeSpec& v, const Field&) {
  if (v.is_set())
    e << format_size(v);
  else
    e << YAML::Null;
}
void write(YAML::Emitter& e, const std::map<std::string, SizeSpec>& v, const Field&) {
  e << YAML::Flow << YAML::BeginMap;
  for (const auto& [device, size] : v) {
    e << YAML::Key << device << YAML::Value;
    write(e, size, Field{});
  }
  e << YAML::EndMap;
}
template <class V>
void write(YAML::Emitter& e, const std::vector<std::pair<std::string, V>>& v, const Field&) {
  e << YAML::Flow << YAML::BeginMap;
  for (const auto& [pattern, x] : v) {
    e << YAML::Key << pattern << YAML::Value;
    write(e, x, Field{});
  }
  e << YAML::EndMap;
}
void write(YAML::Emitter& e, const CheckpointingConfig& v, const Field&) {
  const CheckpointingConfig d;
  if (v.n == d.n && v.layers.empty() && (v.policy == "all" || v.policy == "none")) {
    e << (v.policy == "all");
    return;
  }
  e << YAML::Flow << YAML::BeginMap << YAML::Key << "policy" << YAML::Value << v.policy << YAML::Key << "n"
    << YAML::Value << v.n << YAML::Key << "layers" << YAML::Value;
  write(e, v.layers, Field{});
  e << YAML::EndMap;
}
void write(YAML::Emitter& e, const DeviceMapConfig& v, const Field&) {
  if (v.entries.empty()) {
    e << v.single;
    return;
  }
  e << YAML::BeginMap;
  for (const auto& [prefix, device] : v.entries) e << YAML::Key << prefix << YAML::Value << device;
  e << YAML::EndMap;
}

void write(YAML::Emitter& e, const std::optional<std::vector<std::string>>& v, const Field& f) {
  if (v)
    write(e, *v, f);
  else
    e << YAML::Null;
}

bool same(const std::optional<std::vector<std::string>>& a, const std::optional<std::vector<std::string>>& b,
          const Field&) {
  return a == b;
}
bool same(const SizeSpec& a, const SizeSpec& b, const Field&) { return a.bytes == b.bytes && a.fraction == b.fraction; }
bool same(const CheckpointingConfig& a, const CheckpointingConfig& b, const Field&) {
  return a.policy == b.policy && a.n == b.n && a.layers == b.layers;
}
bool same(const DeviceMapConfig& a, const DeviceMapConfig& b, const Field&) {
  return a.single == b.single && a.entries == b.entries;
}
bool same(const std::map<std::string, SizeSpec>& a, const std::map<std::string, SizeSpec>& b, const Field& f) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [&](const auto& x, const auto& y) {
           return x.first == y.first && same(x.second, y.second, f);
         });
}

}  // namespace reflect

namespace {

using reflect::Checker;
using reflect::Ctx;
using reflect::format_double;
using reflect::Item;
using reflect::parse_int64;

// ---- Checks across keys: one function per struct, in declaration order ----

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

void validate(const QuantizationConfig& q, const std::string& p, const Checker& c) {
  c.check(!(q.load_in_8bit && q.load_in_4bit), p + ".load_in_8bit", q.load_in_8bit,
          "load_in_4bit is true too; set one of them (bitsandbytes' config refuses both)");
  c.check(q.llm_int8_threshold >= 0 && std::isfinite(q.llm_int8_threshold), p + ".llm_int8_threshold",
          format_double(q.llm_int8_threshold), "must be a finite number >= 0 (6.0, LLM.int8's, when absent)");
  c.check(q.load_in_8bit || q.llm_int8_threshold == QuantizationConfig{}.llm_int8_threshold,
          p + ".llm_int8_threshold", format_double(q.llm_int8_threshold),
          "applies to load_in_8bit's layers, and load_in_8bit is false (a model stored in 8 bits keeps the "
          "threshold of its config.json). Set load_in_8bit: true, or remove the key");
  c.check(!q.llm_int8_skip_modules || q.load_in_4bit || q.load_in_8bit, p + ".llm_int8_skip_modules",
          q.llm_int8_skip_modules,
          "is set while neither load_in_4bit nor load_in_8bit is (a model stored quantized keeps the list of its "
          "config.json). Set one of them, or remove the key");
  c.check(!q.llm_int8_enable_fp32_cpu_offload, p + ".llm_int8_enable_fp32_cpu_offload",
          q.llm_int8_enable_fp32_cpu_offload,
          "fp32 copies of the projections model.device_map places on cpu or offload are not supported: memtune keeps "
          "them quantized there (a CPU multiplies 4-bit and 8-bit weights as they are, and offloaded layers are "
          "fetched quantized), which transformers refuses without this key. To keep modules dense, name them in "
          "llm_int8_skip_modules; or remove the key");
  c.check(!q.llm_int8_has_fp16_weight, p + ".llm_int8_has_fp16_weight", q.llm_int8_has_fp16_weight,
          "16-bit master weights beside the 8-bit ones (trained and re-quantized each step) are not supported; "
          "memtune's 8-bit base stays frozen under LoRA. Remove the key or set false");
  if (q.load_in_8bit) {
    // bitsandbytes' 8-bit layers read none of the 4-bit keys: a value set there would change nothing.
    const QuantizationConfig d;
    c.check(q.bnb_4bit_compute_dtype == d.bnb_4bit_compute_dtype, p + ".bnb_4bit_compute_dtype",
            q.bnb_4bit_compute_dtype,
            "applies to load_in_4bit; 8-bit layers multiply in the model's dtype (model.torch_dtype, or "
            "training.bf16 / fp16 under autocast). Remove the key");
    c.check(q.bnb_4bit_quant_type == d.bnb_4bit_quant_type, p + ".bnb_4bit_quant_type", q.bnb_4bit_quant_type,
            "applies to load_in_4bit, not to load_in_8bit. Remove the key");
    c.check(q.bnb_4bit_use_double_quant == d.bnb_4bit_use_double_quant, p + ".bnb_4bit_use_double_quant",
            q.bnb_4bit_use_double_quant, "applies to load_in_4bit, not to load_in_8bit. Remove the key");
    c.check(q.blocksize == d.blocksize, p + ".blocksize", q.blocksize,
            "applies to load_in_4bit; LLM.int8 keeps one absmax per row. Remove the key");
  }
  c.check(power_of_two(q.blocksize) && q.blocksize >= 32 && q.blocksize <= 4096, p + ".blocksize", q.blocksize,
          "must be a power of two in 32..4096 (bitsandbytes uses 64)");
}

void validate(const ModelConfig& m, const std::string& p, const Checker& c) {
  c.check(!m.name_or_path.empty(), p + ".name_or_path", m.name_or_path, "must name a model directory or a preset");
  validate(m.quantization_config, p + ".quantization_config", c);
  if (m.device_map.entries.empty())
    c.check(is_device(m.device_map.single, true, false), p + ".device_map", m.device_map.single,
            "expected auto, cpu, cuda, cuda:N, or a map from module prefix to device");
  for (const auto& [prefix, device] : m.device_map.entries) {
    c.check(!prefix.empty(), p + ".device_map", prefix, "a module prefix must not be empty");
    c.check(is_device(device, false, true), p + ".device_map." + prefix, device,
            "expected cuda, cuda:N, cpu or offload");
  }
  for (const auto& [device, size] : m.max_memory) {
    c.check(is_device(device, false, false), p + ".max_memory." + device, device,
            "the key must be a device: cpu, cuda or cuda:N");
    c.check(size.is_set(), p + ".max_memory." + device, size, "expected a size such as 20GiB or 0.9");
  }
  c.check(m.low_cpu_mem_usage, p + ".low_cpu_mem_usage", m.low_cpu_mem_usage,
          "memtune always loads tensor by tensor from the memory-mapped safetensors (what true does in "
          "Hugging Face); a load that builds the whole model in memory first is not available. Remove the key "
          "or set true");
  c.check(m.attn_implementation != "sdpa" || MEMTUNE_HAS_SDPA, p + ".attn_implementation", m.attn_implementation,
          "sdpa (at::scaled_dot_product_attention) needs LibTorch 2.0 or later and this build uses " +
              compat::torch_version() + "; auto and eager run memory-efficient attention on every version");
}

void validate(const LoraConfig& l, const std::string& p, const Checker& c) {
  c.check(l.r >= 1, p + ".r", l.r, "the rank must be at least 1");
  c.check(l.lora_alpha > 0, p + ".lora_alpha", l.lora_alpha, "must be > 0 (scaling = lora_alpha / r)");
  c.check(l.lora_dropout >= 0 && l.lora_dropout < 1, p + ".lora_dropout", l.lora_dropout, "must be in [0, 1)");
  for (const auto& name : l.target_modules) {
    c.check(!name.empty(), p + ".target_modules", l.target_modules, "a module name must not be empty");
    c.check(name != "all-linear" || l.target_modules.size() == 1, p + ".target_modules", l.target_modules,
            "all-linear stands alone");
  }
  for (int layer : l.layers_to_transform)
    c.check(layer >= 0, p + ".layers_to_transform", l.layers_to_transform, "layer indices are >= 0");
  for (const auto& name : l.modules_to_save)
    c.check(!name.empty(), p + ".modules_to_save", l.modules_to_save, "a module name must not be empty");
  for (const auto& [pattern, r] : l.rank_pattern) {
    c.check(!pattern.empty(), p + ".rank_pattern", l.rank_pattern, "a pattern must not be empty");
    c.check(r >= 1 && r < (int64_t{1} << 20), p + ".rank_pattern." + pattern, r, "a rank is an integer >= 1");
  }
  for (const auto& [pattern, alpha] : l.alpha_pattern) {
    c.check(!pattern.empty(), p + ".alpha_pattern", l.alpha_pattern, "a pattern must not be empty");
    c.check(alpha > 0 && std::isfinite(alpha), p + ".alpha_pattern." + pattern, alpha,
            "must be a finite number > 0 (scaling = lora_alpha / r)");
  }
}

void validate(const CheckpointingConfig& g, const std::string& p, const Checker& c) {
  c.one_of(p + ".policy", g.policy, CheckpointingConfig::kPolicies, "unknown checkpointing policy");
  if (g.policy == "every_n") c.check(g.n >= 1, p + ".n", g.n, "every_n needs n >= 1");
  if (g.policy == "layers") c.check(!g.layers.empty(), p + ".layers", g.layers, "policy layers needs a list of layer indices");
  c.check(g.policy == "every_n" || g.n == CheckpointingConfig{}.n, p + ".n", g.n,
          "only policy every_n reads n, and the policy is " + g.policy + "; set policy: every_n or drop n");
  c.check(g.policy == "layers" || g.layers.empty(), p + ".layers", g.layers,
          "only policy layers reads the list, and the policy is " + g.policy + "; set policy: layers or drop it");
  for (int layer : g.layers) c.check(layer >= 0, p + ".layers", g.layers, "layer indices are >= 0");
}

void validate(const TrainingConfig& t, const std::string& p, const Checker& c) {
  c.check(!t.output_dir.empty(), p + ".output_dir", t.output_dir, "must name a directory");
  c.check(t.per_device_train_batch_size >= 1 || t.per_device_train_batch_size == TrainingConfig::kAuto,
          p + ".per_device_train_batch_size", t.per_device_train_batch_size, "must be at least 1, or auto",
          Field::integer_or_auto());
  c.check(t.per_device_eval_batch_size >= 1, p + ".per_device_eval_batch_size", t.per_device_eval_batch_size,
          "must be at least 1");
  c.check(t.gradient_accumulation_steps >= 1, p + ".gradient_accumulation_steps", t.gradient_accumulation_steps,
          "must be at least 1");
  validate(t.gradient_checkpointing, p + ".gradient_checkpointing", c);
  // lr_scheduler_kwargs: what the schedule's transformers function takes, and the values it refuses.
  std::vector<std::string> given;
  for (const auto& [key, value] : t.lr_scheduler_kwargs) {
    const std::string error = schedule_kwarg_error(t.lr_scheduler_type, key, value, t.learning_rate);
    c.check(error.empty(), p + ".lr_scheduler_kwargs." + key, value, error);
    given.push_back(key);
  }
  const std::string missing = missing_kwarg_error(t.lr_scheduler_type, given);
  const bool both_min_lr = std::count(given.begin(), given.end(), "min_lr") && std::count(given.begin(), given.end(), "min_lr_rate");
  if (both_min_lr)
    c.check(missing.empty(), p + ".lr_scheduler_kwargs", t.lr_scheduler_kwargs, missing);
  else
    c.check(missing.empty(), p + ".lr_scheduler_type", t.lr_scheduler_type, missing);
  c.check(t.activation_offload != "all", p + ".activation_offload", t.activation_offload,
          "offloading everything a layer keeps for backward needs saved-tensor hooks, which LibTorch's C++ API "
          "lacks; use checkpoints with gradient_checkpointing, where a layer keeps only its input");
  c.check(t.activation_offload != "checkpoints" || t.gradient_checkpointing.enabled(), p + ".activation_offload",
          t.activation_offload,
          "offloads the inputs of checkpointed layers, and gradient_checkpointing is off; turn it on (true, or a "
          "policy), or leave activation_offload false");
  c.check(!(t.fp16 && t.bf16), p + ".bf16", t.bf16, "fp16 and bf16 are both true; choose one");
  c.check(t.learning_rate > 0, p + ".learning_rate", t.learning_rate, "must be > 0");
  c.check(t.num_train_epochs > 0 || t.max_steps > 0, p + ".num_train_epochs", t.num_train_epochs,
          "must be > 0 unless max_steps is set");
  c.check(t.max_steps == -1 || t.max_steps >= 1, p + ".max_steps", t.max_steps, "must be -1 (use epochs) or >= 1");
  c.check(t.warmup_ratio >= 0 && t.warmup_ratio <= 1, p + ".warmup_ratio", t.warmup_ratio, "must be in [0, 1]");
  // transformers' *_steps: a whole number of steps, or a share of them below 1.
  auto steps_key = [&](const char* key, double v, bool zero_allowed, const char* zero) {
    c.check((zero_allowed ? v >= 0 : v > 0) && (v < 1 || v == std::floor(v)) && v <= 0x1p53, p + "." + key, v,
            str_cat(zero_allowed ? "must be >= 0" : "must be > 0", zero, ": a whole number of steps (at most 2^53), "
                    "or in (0, 1) a share of the run's steps (transformers' form: 0.1 is every tenth of the run)"));
  };
  steps_key("warmup_steps", t.warmup_steps, true, "");
  c.check(t.warmup_steps == 0 || t.warmup_ratio == 0, p + ".warmup_ratio", t.warmup_ratio,
          "is set beside warmup_steps: transformers 5 would take warmup_ratio (and deprecates it), transformers 4 "
          "warmup_steps. Set one of them (warmup_steps below 1 is a share of the steps)");
  c.check(t.weight_decay >= 0, p + ".weight_decay", t.weight_decay, "must be >= 0");
  c.check(t.adam_beta1 >= 0 && t.adam_beta1 < 1, p + ".adam_beta1", t.adam_beta1, "must be in [0, 1)");
  c.check(t.adam_beta2 >= 0 && t.adam_beta2 < 1, p + ".adam_beta2", t.adam_beta2, "must be in [0, 1)");
  c.check(t.adam_epsilon > 0, p + ".adam_epsilon", t.adam_epsilon, "must be > 0");
  c.check(t.momentum >= 0 && t.momentum < 1, p + ".momentum", t.momentum, "must be in [0, 1)");
  c.check(t.momentum == 0 || t.optim == "sgd", p + ".momentum", t.momentum,
          "only optim: sgd has a momentum, and optim is " + t.optim + "; drop the key or train with sgd");
  steps_key("logging_steps", t.logging_steps, false, "");
  steps_key("save_steps", t.save_steps, true, " (0: only at the end)");
  c.check(t.save_total_limit >= 0, p + ".save_total_limit", t.save_total_limit, "must be >= 0 (0: keep all)");
  steps_key("eval_steps", t.eval_steps, true, " (0: no periodic evaluation)");
  // A *_steps key that its strategy does not read: refused rather than ignored (transformers ignores it).
  c.check(t.logging_strategy == "steps" || t.logging_steps == 1, p + ".logging_steps", t.logging_steps,
          "logging_strategy is " + t.logging_strategy + ", which does not read logging_steps; drop one of them");
  c.check(t.save_strategy == "steps" || t.save_steps == 0, p + ".save_steps", t.save_steps,
          "save_strategy is " + t.save_strategy + ", which does not read save_steps; drop one of them");
  c.check(t.save_strategy != "no" || t.save_total_limit == 0, p + ".save_total_limit", t.save_total_limit,
          "save_strategy is no: there are no checkpoints to limit; drop one of them");
  c.check(t.eval_strategy == "" || t.eval_strategy == "steps" || t.eval_steps == 0, p + ".eval_steps", t.eval_steps,
          "eval_strategy is " + t.eval_strategy + ", which does not read eval_steps; drop one of them");
  c.check(t.eval_accuracy_rows >= 0, p + ".eval_accuracy_rows", t.eval_accuracy_rows, "must be >= 0");
  c.check(std::isfinite(t.neftune_noise_alpha) && t.neftune_noise_alpha >= 0, p + ".neftune_noise_alpha",
          t.neftune_noise_alpha, "must be >= 0 (0: none)");
  c.check(t.neftune_noise_alpha == 0 || t.per_device_train_batch_size != TrainingConfig::kAuto,
          p + ".neftune_noise_alpha", t.neftune_noise_alpha,
          "NEFTune's noise is scaled by the padded length of each micro-batch, and per_device_train_batch_size: "
          "auto picks the micro-batch from the memory budget, so the noise would depend on the machine; set "
          "per_device_train_batch_size to a number");
  c.check(t.label_smoothing_factor >= 0 && t.label_smoothing_factor < 1, p + ".label_smoothing_factor",
          t.label_smoothing_factor, "must be in [0, 1) (0: none)");
  c.check(t.fp16_init_scale > 0, p + ".fp16_init_scale", t.fp16_init_scale, "must be > 0");
  c.check(t.fp16_growth_interval >= 1, p + ".fp16_growth_interval", t.fp16_growth_interval, "must be at least 1");
  c.check(!(t.group_by_length && t.train_sampling_strategy == "sequential"), p + ".group_by_length",
          t.group_by_length,
          "contradicts train_sampling_strategy: sequential (transformers has one sampler: group_by_length: true "
          "is train_sampling_strategy: group_by_length); keep one of them");
  c.check(t.dataloader_num_workers >= 0, p + ".dataloader_num_workers", t.dataloader_num_workers, "must be >= 0");
}

void validate(const DataConfig& d, const std::string& p, const Checker& c) {
  c.check(std::isfinite(d.eval_split) && d.eval_split >= 0 && (d.eval_split < 1 || d.eval_split == std::floor(d.eval_split)),
          p + ".eval_split", d.eval_split,
          "must be a share in [0, 1) or a whole number of documents (as train_test_split's test_size)");
  c.check(d.eval_split == 0 || d.eval_file.empty(), p + ".eval_split", d.eval_split,
          "holds out evaluation data, and data.eval_file names some too (" + d.eval_file +
              "); keep one of them");
  c.check(!d.text_field.empty(), p + ".text_field", d.text_field, "must name a JSON field");
  c.check(d.max_seq_length >= 8, p + ".max_seq_length", d.max_seq_length, "must be at least 8 tokens");
}

void validate(const OnOomConfig& o, const std::string& p, const Checker& c) {
  c.check(o.shrink_factor > 0 && o.shrink_factor < 1, p + ".shrink_factor", o.shrink_factor, "must be in (0, 1)");
  c.check(o.max_retries >= 1, p + ".max_retries", o.max_retries, "must be at least 1");
  for (size_t i = 0; i < o.ladder.size(); ++i) {
    const std::string& r = o.ladder[i];
    c.check(std::find(o.ladder.begin(), o.ladder.begin() + static_cast<std::ptrdiff_t>(i), r) ==
                o.ladder.begin() + static_cast<std::ptrdiff_t>(i),
            p + ".ladder", r, "listed twice");
    c.check(r != "micro_batch" || i == 0, p + ".ladder", r,
            "the micro-batch shrinks before any other rung: list micro_batch first, or leave it out to keep the "
            "micro-batch");
  }
}

}  // namespace

std::optional<std::vector<OomPoint>> parse_inject_oom(const std::string& s) {
  std::vector<OomPoint> points;
  std::stringstream list(s);
  for (std::string entry; std::getline(list, entry, ',');) {
    if (entry.empty()) continue;
    std::vector<std::string> parts;
    std::stringstream ss(entry);
    for (std::string part; std::getline(ss, part, ':');) parts.push_back(part);
    OomPoint p;
    int64_t rank = -1;
    if (parts.size() < 2 || parts.size() > 3 || !parse_int64(parts[0], p.step) || p.step < 0) return std::nullopt;
    if (parts[1] != "forward" && parts[1] != "backward" && parts[1] != "optimizer") return std::nullopt;
    if (parts.size() == 3 && (!parse_int64(parts[2], rank) || rank < 0 || rank > (1 << 30))) return std::nullopt;
    p.phase = parts[1];
    p.rank = static_cast<int>(rank);
    points.push_back(std::move(p));
  }
  return points;
}

namespace {

void validate(const MemoryConfig& m, const std::string& p, const Checker& c) {
  c.check(m.warning_threshold > 0 && m.warning_threshold <= 1, p + ".warning_threshold", m.warning_threshold,
          "thresholds are shares of the limit in (0, 1]");
  c.check(m.critical_threshold > m.warning_threshold && m.critical_threshold <= 1, p + ".critical_threshold",
          m.critical_threshold,
          str_cat("thresholds must increase in (0, 1]: warning (", format_double(m.warning_threshold),
                  ") < critical < emergency <= 1"));
  c.check(m.emergency_threshold > m.critical_threshold && m.emergency_threshold <= 1, p + ".emergency_threshold",
          m.emergency_threshold,
          str_cat("thresholds must increase in (0, 1]: critical (", format_double(m.critical_threshold),
                  ") < emergency <= 1"));
  validate(m.on_oom, p + ".on_oom", c);
  c.check(m.grow_after_steps >= 1, p + ".grow_after_steps", m.grow_after_steps, "must be at least 1");
  c.check(m.grow_threshold > 0 && m.grow_threshold < 1, p + ".grow_threshold", m.grow_threshold, "must be in (0, 1)");
  c.check(parse_inject_oom(m.inject_oom).has_value(), p + ".inject_oom", m.inject_oom,
          "expected step:phase[:rank] entries separated by commas, phase forward|backward|optimizer");
}

void validate(const RuntimeConfig& r, const std::string& p, const Checker& c) {
  c.check(is_device(r.device, true, false), p + ".device", r.device, "expected auto, cpu, cuda or cuda:N");
  c.check(r.num_threads >= 0, p + ".num_threads", r.num_threads, "must be >= 0 (0: from the CPU affinity)");
}

void validate(const DistributedConfig& d, const std::string& p, const Checker& c) {
  c.check(d.timeout > 0, p + ".timeout", d.timeout, "must be > 0 seconds");
  c.check(d.bucket_size_mb >= 1, p + ".bucket_size_mb", d.bucket_size_mb, "must be at least 1 MiB");
}

void validate(const Config& config, const Checker& c) {
  check_choices(config, "", c);
  validate(config.model, "model", c);
  validate(config.lora, "lora", c);
  validate(config.training, "training", c);
  validate(config.data, "data", c);
  validate(config.memory, "memory", c);
  validate(config.runtime, "runtime", c);
  validate(config.distributed, "distributed", c);
  // Evaluation reads data.eval_file or what data.eval_split holds out; without either,
  // Hugging Face refuses an evaluation schedule.
  const bool eval_data = !config.data.eval_file.empty() || config.data.eval_split > 0;
  const std::string& strategy = config.training.eval_strategy;
  c.check(strategy.empty() || strategy == "no" || eval_data, "training.eval_strategy", strategy,
          "evaluation needs data.eval_file or data.eval_split, and neither is set (transformers refuses an "
          "eval_strategy without an eval_dataset); name the held-out data, or set eval_strategy: no");
  c.check(strategy != "no" || !eval_data, "training.eval_strategy", strategy,
          "nothing would read the eval data that data." +
              std::string(config.data.eval_file.empty() ? "eval_split holds out" : "eval_file names") +
              "; drop it, or evaluate");
  c.check(config.training.greater_is_better.empty() || !best_metric_name(config.training).empty(),
          "training.greater_is_better", config.training.greater_is_better,
          "ranks metric_for_best_model, and nothing here ranks evaluations; set metric_for_best_model, or drop it");
  // Periodic evaluations, which load_best_model_at_end and reduce_lr_on_plateau take their metric from.
  const bool periodic_eval =
      eval_data && (strategy == "steps" || strategy == "epoch" || (strategy.empty() && config.training.eval_steps > 0));
  // load_best_model_at_end ranks the checkpoints written at evaluations: HF requires the
  // strategies to match (the steps' multiple is checked when the run knows its intervals).
  if (config.training.load_best_model_at_end) {
    const std::string eval_kind = strategy.empty() ? "steps" : strategy;
    c.check(periodic_eval, "training.load_best_model_at_end", true,
            "ranks the checkpoints by their evaluations, and this run has none; set eval_strategy: steps with "
            "eval_steps (or epoch), and data.eval_file or data.eval_split");
    c.check(config.training.save_strategy == eval_kind, "training.save_strategy", config.training.save_strategy,
            str_cat("load_best_model_at_end needs a checkpoint at each evaluation: save_strategy must match "
                    "eval_strategy (", eval_kind, "), as transformers requires"));
  }
  // reduce_lr_on_plateau steps at the periodic evaluations (transformers requires an eval
  // strategy) and has no warm-up (get_scheduler returns it before warm-up is read).
  if (config.training.lr_scheduler_type == "reduce_lr_on_plateau") {
    c.check(periodic_eval, "training.lr_scheduler_type", config.training.lr_scheduler_type,
            "steps with each periodic evaluation's eval_loss, and this run has none (transformers requires an eval "
            "strategy); set eval_strategy: steps with eval_steps (or epoch), and data.eval_file or data.eval_split");
    const std::string no_warmup = "reduce_lr_on_plateau has no warm-up: transformers' get_scheduler returns it "
                                  "before reading num_warmup_steps, so the key would change nothing; drop it";
    c.check(config.training.warmup_steps == 0, "training.warmup_steps", config.training.warmup_steps, no_warmup);
    c.check(config.training.warmup_ratio == 0, "training.warmup_ratio", config.training.warmup_ratio, no_warmup);
  }
  c.check(strategy != "no" || config.training.eval_accuracy_rows == 0, "training.eval_strategy", strategy,
          "training.eval_accuracy_rows asks for an evaluation; drop one of them");
  c.check(eval_data || config.training.eval_steps == 0, "training.eval_steps", config.training.eval_steps,
          "evaluation needs data.eval_file or data.eval_split, and neither is set; name the held-out file, or "
          "drop eval_steps");
  c.check(!config.data.eval_file.empty() || config.training.eval_accuracy_rows == 0, "training.eval_accuracy_rows",
          config.training.eval_accuracy_rows,
          config.data.eval_split > 0
              ? "the accuracy generates from data.eval_file's records, and data.eval_split holds out tokenized "
                "documents instead; name an instruction file in data.eval_file, or drop the key"
              : "the accuracy is measured on data.eval_file's rows, and none is set; name the file, or drop the key");
  const bool int8 = config.model.quantization_config.load_in_8bit;
  c.check(!int8 || config.training.finetune != "full", "model.quantization_config.load_in_8bit", int8,
          "training.finetune: full trains every weight, and 8-bit weights stay frozen (transformers refuses to "
          "train a purely quantized model). Hint: finetune: lora, or a dense model");
  const bool dora = config.lora.use_dora && config.training.finetune != "full";
  c.check(!dora || !int8, "lora.use_dora", dora,
          "DoRA on LLM.int8 (load_in_8bit) weights is not supported by memtune. Hint: load_in_4bit, or a dense "
          "base");
  c.check(!int8 || config.distributed.sharding != "full", "model.quantization_config.load_in_8bit", int8,
          "distributed.sharding: full keeps 1/W of each frozen weight per rank and reads no other, and LLM.int8's "
          "quantization needs each weight whole. Hint: sharding: gradients, or load_in_4bit");
  // optimizer_8bit quantizes AdamW's fp32 state on the device: with another optimizer, or a
  // state in host memory from the start, it would do nothing.
  const std::string& optim = config.training.optim;
  const bool eight = config.memory.on_oom.allows("optimizer_8bit");
  c.check(!eight || optim == "adamw_torch" || optim == "adamw_torch_fused" || optim == "adamw" ||
              optim == "paged_adamw_32bit",
          "memory.on_oom.ladder", "optimizer_8bit",
          str_cat("quantizes AdamW's fp32 state, and training.optim: ", optim,
                  " keeps none. Hint: drop optimizer_8bit, or train with adamw_torch"));
  c.check(!eight || (optim != "paged_adamw_32bit" && config.memory.optimizer_offload != "cpu"), "memory.on_oom.ladder",
          "optimizer_8bit",
          "quantizes AdamW's state on the device, and this run keeps it in host memory (paged_adamw_32bit or "
          "memory.optimizer_offload: cpu), where 8 bits would free nothing on the device. Hint: drop optimizer_8bit");
}

}  // namespace

// ---- Public ----

using reflect::help_of;
using reflect::visit;

namespace {

// The YAML text read into a Config, every key's type checked; `ctx` keeps where each key was.
Config read_config(const std::string& yaml_text, const std::string& source, Ctx& ctx) {
  ctx.source = source.empty() ? "config" : source;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail(ctx.at(e.mark), ": not valid YAML: ", e.msg);
  }
  Config config;
  config.source = source;
  read(Item{root, "", root.Mark()}, config, ctx, Field{});
  return config;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  Ctx ctx;
  Config config = read_config(yaml_text, source, ctx);
  for (const auto& text : overrides) apply_override(config, text, ctx);
  validate(config, Checker(ctx.source, &ctx.seen));
  return config;
}

Config parse_saved_config(const std::string& yaml_text, const std::string& source) {
  Ctx ctx;
  return read_config(yaml_text, source, ctx);
}

Config load_config(const std::filesystem::path& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  MEMTUNE_CHECK(std::filesystem::is_regular_file(path) && in, path.string(),
                ": cannot read the config file (check the path)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_config(text.str(), path.string(), overrides);
}

void validate(const Config& config) { validate(config, Checker(config.source, nullptr)); }

std::string to_yaml(const Config& config) {
  YAML::Emitter e;
  e.SetNullFormat(YAML::LowerNull);
  write(e, config, Field{});
  MEMTUNE_CHECK(e.good(), "to_yaml: ", e.GetLastError());
  return std::string(e.c_str()) + "\n";
}

namespace {

// Sections, and model.quantization_config within its section, open into their keys; every
// other value (a scalar, a list, a map-valued key such as device_map) is one flow-form string.
void flatten_node(const YAML::Node& node, const std::string& path, std::map<std::string, std::string>& out) {
  const bool opens = path.empty() || path.find('.') == std::string::npos || path == "model.quantization_config";
  if (node.IsMap() && opens) {
    for (const auto& kv : node)
      flatten_node(kv.second, (path.empty() ? "" : path + ".") + kv.first.as<std::string>(), out);
    return;
  }
  YAML::Emitter e;
  e.SetNullFormat(YAML::LowerNull);
  e << YAML::Flow << node;
  out[path] = e.c_str();
}

}  // namespace

std::map<std::string, std::string> flatten(const Config& config) {
  std::map<std::string, std::string> out;
  flatten_node(YAML::Load(to_yaml(config)), "", out);
  return out;
}

std::string config_help() {
  std::ostringstream out;
  out << "Config keys (YAML sections; override any with key.path=value):\n";
  help_of(Config(), "", out);
  return out.str();
}

std::vector<std::string> compatibility_notes(const Config& config) {
  const TrainingConfig defaults;
  const TrainingConfig& t = config.training;
  std::vector<std::string> notes;
  if (t.dataloader_pin_memory != defaults.dataloader_pin_memory)
    notes.push_back("training.dataloader_pin_memory: accepted for compatibility; memtune moves its own "
                    "batches to the device, so it changes nothing");
  if (t.dataloader_num_workers > 0)
    notes.push_back(str_cat("training.dataloader_num_workers: accepted for compatibility; memtune prepares "
                            "batches in its own process, so ", t.dataloader_num_workers,
                            " workers change nothing"));
  if (t.gradient_checkpointing_kwargs.use_reentrant)
    notes.push_back("training.gradient_checkpointing_kwargs.use_reentrant: accepted for compatibility; memtune "
                    "recomputes checkpointed layers by its own checkpointing, with the gradients either of "
                    "torch's implementations gives, so it changes nothing");
  if (t.remove_unused_columns != defaults.remove_unused_columns)
    notes.push_back("training.remove_unused_columns: accepted for compatibility; memtune builds its own "
                    "batches, so it changes nothing");
  // A full fine-tune builds no adapter (one config may serve both modes, by an override).
  if (t.finetune == "full") {
    const std::string key = reflect::first_difference(config.lora, LoraConfig{});
    if (!key.empty())
      notes.push_back("lora." + key + " is set, and training.finetune is full: every weight trains and no adapter "
                      "is built, so the lora section changes nothing in this run");
  }
  const auto& modules = config.lora.target_modules;
  if (t.finetune != "full" && modules.size() == 1 && modules[0] != "all-linear")
    notes.push_back("lora.target_modules: the one string '" + modules[0] +
                    "' matches modules whose name ends with it or that it matches in full as a regex "
                    "(PEFT reads a single string as a regex)");
  return notes;
}

int64_t steps_of(double value, int64_t total_steps) {
  if (value > 0 && value < 1) return static_cast<int64_t>(std::ceil(value * static_cast<double>(total_steps)));
  return static_cast<int64_t>(value);
}

bool operator==(const Config& a, const Config& b) { return reflect::equal_fields(a, b); }

}  // namespace memtune::trainer
