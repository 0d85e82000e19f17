#include "trainer/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <spdlog/spdlog.h>

#include "data/batch.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "models/device_map.h"
#include "models/hf_model.h"
#include "models/peft.h"
#include "runtime/atomic_file.h"
#include "runtime/compat.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/cuda_info.h"
#include "runtime/dist_env.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/memory.h"
#include "runtime/process_group.h"
#include "runtime/step_profiler.h"
#include "runtime/supervisor.h"
#include "runtime/threads.h"
#include "runtime/units.h"
#include "trainer/accuracy.h"
#include "trainer/estimate.h"
#include "trainer/evaluate.h"
#include "trainer/grad_scaler.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"
#include "trainer/schedule.h"
#include "trainer/train_state.h"

namespace memtune::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

}  // namespace

data::DatasetOptions dataset_options(const DataConfig& d, const fs::path& output_dir) {
  data::DatasetOptions o;
  o.format = d.format;
  o.template_name = d.template_name;
  o.chat_template = d.chat_template;
  o.text_field = d.text_field;
  o.max_seq_length = d.max_seq_length;
  o.pack_sequences = d.pack_sequences;
  o.truncation = d.truncation;
  o.train_on_prompt = d.train_on_prompt;
  o.skip_invalid = d.skip_invalid;
  o.add_eos_token = d.add_eos_token;
  o.cache_dir = d.cache_dir.empty() ? (output_dir / ".cache").string() : d.cache_dir;
  return o;
}

namespace {

// memory.inject_oom: "STEP:PHASE[:RANK],..." with PHASE forward|backward|optimizer. Each
// point fires once, on one attempt: the retry of the same step runs clean, unless the point
// is listed again ("1:forward,1:forward" fails step 1's first two attempts).
struct OomInjector {
  struct Point {
    int64_t step;
    std::string phase;
    bool fired = false;
  };
  std::vector<Point> points;

  OomInjector(const std::string& spec, int rank) {
    const auto parsed = parse_inject_oom(spec);  // validated with the config
    MEMTUNE_INTERNAL_ASSERT(parsed.has_value(), "memory.inject_oom '", spec, "' passed validation");
    for (const OomPoint& p : *parsed)
      if (p.rank < 0 || p.rank == rank) points.push_back({p.step, p.phase});
  }

  // When (step, phase) is a point: forward and backward arm the allocator so that their next
  // allocation fails inside an op, as a real OOM does. The optimizer phase may allocate
  // nothing at all on the CPU (one-pass AdamW, the norm summed in place), so its OOM is
  // raised at the phase's start, with the allocator's error type.
  void at(int64_t step, const char* phase) {
    for (auto& p : points)
      if (!p.fired && p.step == step && p.phase == phase) {
        p.fired = true;
        if (p.phase == "optimizer")
          compat::throw_out_of_memory(str_cat("out of memory at the optimizer phase of step ", step,
                                              " (injected by memory.inject_oom)"));
        inject_oom_on_next_alloc();
        return;
      }
  }
};

std::string progress_bar(int64_t done, int64_t total) {
  const int width = 24;
  int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}

// Resuming at `step`: metrics.jsonl keeps the rows of steps up to it (the steps after it run
// again and write their rows anew, so a plot never shows a step twice) and drops a line a
// kill cut short. Rewritten atomically: a kill here leaves the old file or the new one.
void keep_metrics_through(const fs::path& file, int64_t step) {
  std::ifstream in(file);
  if (!in) return;
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const json row = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_object() && !(row.contains("step") && row["step"].is_number() && row["step"].get<int64_t>() > step))
      kept += line + "\n";
    else
      ++dropped;
  }
  if (dropped == 0) return;
  write_file_atomic(file, kept);
  spdlog::info("metrics.jsonl: {} rows after step {} dropped (those steps run again)", dropped, step);
}

// Resuming compares the checkpoint's config with this run's, key by key. Free to change:
// where and how often the run writes, evaluates and logs; the device, threads and memory
// management; how a step's samples are split into micro-batches (the update is the same,
// their product is compared below) and what is recomputed. Every other key shapes what a
// step computes, so a change is refused by name. The run's length is allowed to change
// with a warning: the learning-rate schedule after the checkpoint follows the new length,
// as in transformers' Trainer.
bool free_to_change_on_resume(const std::string& key) {
  static const std::vector<std::string> free = {
      "memory.", "runtime.", "distributed.", "model.device_map", "model.max_memory", "model.low_cpu_mem_usage",
      "model.attn_implementation", "training.output_dir", "training.resume_from_checkpoint",
      "training.logging_steps", "training.save_steps", "training.save_total_limit", "training.eval_steps",
      "training.eval_accuracy_rows", "training.per_device_eval_batch_size", "training.per_device_train_batch_size",
      "training.gradient_accumulation_steps", "training.gradient_checkpointing", "training.dataloader_",
      "training.report_to", "training.remove_unused_columns", "data.eval_file", "data.cache_dir",
      "training.max_steps", "training.num_train_epochs"};
  return std::any_of(free.begin(), free.end(), [&](const std::string& f) { return key.rfind(f, 0) == 0; });
}

void check_resume_compatible(const Config& now, const Config& then, const fs::path& checkpoint) {
  const auto a = flatten(now), b = flatten(then);
  for (const auto& [key, value] : a) {
    const auto it = b.find(key);
    const std::string before = it == b.end() ? std::string("(not set)") : it->second;
    if (before == value) continue;
    if (key == "training.max_steps" || key == "training.num_train_epochs") {
      spdlog::warn("resume_from_checkpoint: {} changed since the checkpoint ({} -> {}): the learning-rate schedule "
                   "after it follows the new length", key, before, value);
      continue;
    }
    MEMTUNE_CHECK(free_to_change_on_resume(key), "resume_from_checkpoint: ", key, " changed since the checkpoint ('",
                  before, "' -> '", value, "'); it changes what a step computes, so ", checkpoint.string(),
                  " cannot continue under it (start a new training.output_dir, or restore the key)");
  }
  const int64_t per_step_now = now.training.per_device_train_batch_size * now.training.gradient_accumulation_steps;
  const int64_t per_step_then = then.training.per_device_train_batch_size * then.training.gradient_accumulation_steps;
  MEMTUNE_CHECK(per_step_now == per_step_then, "resume_from_checkpoint: training.per_device_train_batch_size x "
                "gradient_accumulation_steps changed since the checkpoint ('", per_step_then, "' -> '", per_step_now,
                "'); the samples per step must stay the same (split them differently, not more or fewer)");
}

std::vector<bool> checkpoint_layers(const CheckpointingConfig& c, int64_t layers) {
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

// distributed: each rank's dropout draws of a step come from (seed, step, rank), so every
// rank resumes exactly from a checkpoint that holds only rank 0's generator.
void seed_cpu_rng(uint64_t seed, int64_t step, int rank) {
  uint64_t x = seed ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(rank) << 48);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(x ^ (x >> 31));
}

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& s) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

// The devices `device_map: auto` fills, in order, each with the bytes its base weights may
// take: 60 % (the rest holds adapters, optimizer states and activations) of model.max_memory's
// size for it, else of the device_limit or, on a GPU, its memory. A CPU without a limit takes
// all (offloading there would only move weights within host memory). Several GPUs are used
// by one process only: those model.max_memory names, else every visible one.
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

}  // namespace

TrainResult train(const Config& c) {
  const fs::path out_dir(c.training.output_dir);
  create_output_directory(out_dir, "training.output_dir");
  // distributed: this process's rank (torchrun, memtune launch or srun); rank 0 writes the run's files.
  const DistEnv dist = DistEnv::from_environment();
  const bool writer = dist.rank == 0;
  init_logging({c.runtime.log_level, writer ? (out_dir / "train.log").string() : std::string(),
                dist.enabled() ? dist.rank : -1, true});
  spdlog::info("memtune train: {}", c.source);
  spdlog::info("{}", configure_threads(c.runtime.num_threads));
  const std::string config_yaml = to_yaml(c);
  if (writer) write_file_atomic(out_dir / "config.yaml", config_yaml);
  spdlog::debug("effective config:\n{}", config_yaml);
  for (const auto& note : compatibility_notes(c)) log_once(note, note);

  // Memory: count every CPU byte from here on; a device_limit emulates a smaller device.
  install_cpu_budget_allocator();
  c10::Device device = resolve_device(c.runtime.device);
  // distributed: each rank on its LOCAL_RANK device; the group joins before the model loads.
  if (dist.enabled() && device.is_cuda()) device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dist.local_rank));
  std::unique_ptr<ProcessGroup> pg;
  if (dist.enabled()) {
    ProcessGroupOptions po;
    po.backend = c.distributed.backend;
    po.timeout_s = c.distributed.timeout;
    po.bucket_size_mb = c.distributed.bucket_size_mb;
    po.device = device.str();
    pg = std::make_unique<ProcessGroup>(dist, po);
  }
  MemoryBackend& mem = memory_backend(device);
  const int64_t limit = c.memory.device_limit.is_set() ? c.memory.device_limit.resolve(mem.stats().total) : 0;

  // Plan memory before allocating it: refuse a run that cannot fit even at micro-batch 1
  // with every layer checkpointed, and log the estimate of the configured one.
  const int64_t budget = limit > 0 ? limit : mem.stats().total;
  const models::ModelSpec spec = model_spec(c);
  check_fits(c, spec, budget);
  const EstimateInput plan = estimate_input(c, spec);
  spdlog::info("memory plan: estimated peak {} at micro-batch {} x {} tokens, budget {} (memtune estimate)",
               format_bytes(estimate_peak(plan)), plan.micro_batch, plan.seq_length, format_bytes(budget));

  ModelBundle bundle = setup_model(c);
  models::CausalLM& model = *bundle.model;
  for (const auto& n : bundle.notes) spdlog::info("{}", n);
  spdlog::info("{}", models::apply_device_map(model, c.model.device_map.single, c.model.device_map.entries, device,
                                              auto_budgets(c, device, limit, dist.enabled())));
  const std::vector<c10::Device> devices = models::devices_of(model.placement());
  // distributed: gradients are reduced in per-dtype buckets on the rank's one device.
  MEMTUNE_CHECK(!pg || devices.size() == 1, "model.device_map places the model on ", devices.size(),
                " devices; with several processes each rank trains on its own device (LOCAL_RANK). Hint: map "
                "layers to ", device.str(), " or offload");
  if (devices.size() > 1)
    spdlog::info("memory: the supervisor watches {}; the model also computes on {} other device(s), whose "
                 "memory it does not watch", device.str(), devices.size() - 1);
  // The budget applies once the model is placed: loading goes through host memory, and
  // offloaded layers live outside the device (as on a GPU).
  if (limit > 0) {
    mem.set_limit(limit);
    spdlog::info("memory: {} limited to {} (memory.device_limit), {} in use after placing the model", mem.device(),
                 format_bytes(limit), format_bytes(mem.stats().allocated));
  }
  const int64_t load_peak = mem.stats().peak;

  MEMTUNE_CHECK(!c.data.train_file.empty(), "data.train_file: not set (a .jsonl, .bin or .txt file)");
  const data::DatasetOptions dopts = dataset_options(c.data, out_dir);
  data::Dataset train_set(c.data.train_file, bundle.tokenizer.get(), dopts);
  const auto& st = train_set.stats();
  spdlog::info("data: {} ({} format): {} documents, {} samples, {} target tokens; {} truncated, {} dropped, "
               "{} invalid skipped{}",
               c.data.train_file, train_set.format(), st.documents, st.samples, st.target_tokens, st.truncated,
               st.dropped, st.skipped_invalid, train_set.from_cache() ? " (from cache)" : "");
  std::unique_ptr<data::Dataset> eval_set;
  if (!c.data.eval_file.empty()) eval_set = std::make_unique<data::Dataset>(c.data.eval_file, bundle.tokenizer.get(), dopts);

  const int32_t pad_id = bundle.tokenizer && bundle.tokenizer->pad_id ? *bundle.tokenizer->pad_id : 0;
  int64_t micro_cfg = c.training.per_device_train_batch_size;
  if (micro_cfg == TrainingConfig::kAuto) {
    micro_cfg = auto_micro_batch(c, plan, budget, train_set.size());
    EstimateInput at = plan;
    at.micro_batch = micro_cfg;
    spdlog::info("per_device_train_batch_size: auto -> {} (estimated peak {}, under {:.0f}% of {})", micro_cfg,
                 format_bytes(estimate_peak(at)), 100 * c.memory.warning_threshold, format_bytes(budget));
  }
  const int64_t samples_per_step = micro_cfg * c.training.gradient_accumulation_steps;
  // samples_per_step is per rank; a step trains on world_size times as many.
  data::Sampler sampler(train_set.size(), c.training.seed, c.data.shuffle, dist.rank, dist.world_size);
  const int64_t steps_per_epoch = sampler.steps_per_epoch(samples_per_step * dist.world_size);
  const int64_t total_steps = c.training.max_steps > 0
                                  ? c.training.max_steps
                                  : std::max<int64_t>(1, static_cast<int64_t>(std::ceil(c.training.num_train_epochs *
                                                                                        steps_per_epoch)));
  Schedule schedule{c.training.lr_scheduler_type, c.training.learning_rate,
                    c.training.warmup_steps > 0 ? c.training.warmup_steps
                                                : static_cast<int64_t>(std::ceil(c.training.warmup_ratio * total_steps)),
                    total_steps};
  OptimizerOptions oo;
  set_optimizer_kind(c.training.optim, oo);
  oo.beta1 = c.training.adam_beta1;
  oo.beta2 = c.training.adam_beta2;
  oo.eps = c.training.adam_epsilon;
  oo.weight_decay = c.training.weight_decay;
  oo.momentum = c.training.momentum;
  Optimizer optimizer(model.trainable_parameters(), oo);
  if (pg) {  // distributed: every rank starts from rank 0's trainable weights
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : optimizer.params()) pg->broadcast(t, 0);
  }
  GradScaler scaler(c.training.fp16, c.training.fp16_init_scale, c.training.fp16_growth_interval);

  std::vector<bool> ckpt_layers = checkpoint_layers(c.training.gradient_checkpointing, model.num_layers());
  SupervisorOptions so;
  so.enabled = c.memory.supervise;
  so.samples_per_step = samples_per_step;
  so.micro_batch = micro_cfg;
  so.shrink_factor = c.memory.on_oom.shrink_factor;
  so.max_retries = c.memory.on_oom.max_retries;
  so.grow_after_steps = c.memory.grow_after_steps;
  so.grow_threshold = c.memory.grow_threshold;
  so.warning = c.memory.warning_threshold;
  so.critical = c.memory.critical_threshold;
  so.emergency = c.memory.emergency_threshold;
  Supervisor supervisor(so);
  if (pg) supervisor.set_agreement([&](bool oom, int64_t micro) { return pg->agree(oom, micro); });
  if (c.memory.on_oom.checkpoint_more)
    supervisor.add_ladder_rung("checkpoint more layers", [&]() -> std::string {
      for (size_t i = 0; i < ckpt_layers.size(); ++i)
        if (!ckpt_layers[i]) {
          ckpt_layers[i] = true;
          return "checkpointing layer " + std::to_string(i);
        }
      return "";
    });
  if (c.memory.on_oom.offload_layers)
    supervisor.add_ladder_rung("offload layers", [&] { return models::offload_one_more_layer(model); });
  supervisor.set_report([&] {
    return str_cat("memory limit ", limit ? format_bytes(limit) : std::string("none"), ", load peak ",
                   format_bytes(load_peak), ". Try a smaller data.max_seq_length, load_in_4bit, fewer LoRA targets, "
                   "or a larger memory.device_limit.");
  });

  // Resume.
  int64_t step = 0;
  std::string resume = c.training.resume_from_checkpoint;
  if (writer) remove_incomplete_checkpoints(out_dir);
  if (!resume.empty()) {
    fs::path dir = resume == "latest" ? latest_checkpoint(out_dir) : fs::path(resume);
    if (dir.empty()) {
      spdlog::info("resume_from_checkpoint: latest: no checkpoint under {} yet, starting fresh", out_dir.string());
    } else {
      TrainingCheckpoint ck = load_training_checkpoint(dir);
      check_resume_compatible(c, parse_config(ck.config_yaml, (dir / "config.yaml").string()), dir);
      at::NoGradGuard no_grad;
      for (auto& [name, t] : optimizer.params()) {
        auto it = ck.trainable.find(name);
        MEMTUNE_CHECK(it != ck.trainable.end(), dir.string(), ": the checkpoint lacks trainable tensor '", name, "'");
        MEMTUNE_CHECK(it->second.sizes() == t.sizes(), dir.string(), ": '", name, "' has shape ", it->second.sizes(),
                      ", the model's is ", t.sizes());
        const_cast<at::Tensor&>(t).copy_(it->second);
      }
      try {  // each owner checks its part of state.json; the message gains the file's name
        optimizer.load_state(ck.optimizer, ck.state.optimizer);
        data::SamplerState ss;
        data::from_json(ck.state.sampler, ss);
        sampler.restore(ss);
        scaler.load_state(ck.state.scaler);
        supervisor.load_state(ck.state.supervisor);
      } catch (const UserError& e) {
        fail((dir / "state.json").string(), ": ", e.what());
      }
      MEMTUNE_CHECK(ck.state.checkpoint_layers.empty() || ck.state.checkpoint_layers.size() == ckpt_layers.size(),
                    (dir / "state.json").string(), ": checkpoint_layers names ", ck.state.checkpoint_layers.size(),
                    " layers, the model has ", ckpt_layers.size());
      MEMTUNE_CHECK(ck.rng_state.numel() == cpu_rng_state().numel(), (dir / "rng.safetensors").string(),
                    ": the generator state has ", ck.rng_state.numel(), " bytes, this LibTorch's has ",
                    cpu_rng_state().numel());
      set_cpu_rng_state(ck.rng_state);
      step = ck.state.step;
      if (!ck.state.checkpoint_layers.empty()) ckpt_layers = ck.state.checkpoint_layers;
      spdlog::info("resumed from {} at step {}", dir.string(), step);
    }
  }

  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  g_stop_signal.store(0);

  std::ofstream metrics;
  if (writer && step > 0) keep_metrics_through(out_dir / "metrics.jsonl", step);
  if (writer) metrics.open(out_dir / "metrics.jsonl", step > 0 ? std::ios::app : std::ios::trunc);
  OomInjector injector(c.memory.inject_oom, dist.rank);
  StepProfiler profiler;
  mem.release_cached();  // what loading freed is not what training will ask for
  const bool tty = isatty(STDERR_FILENO);
  spdlog::info("training: {} steps ({} per epoch), {} samples per step, micro-batch {} x {}, checkpointing {}/{} layers",
               total_steps, steps_per_epoch, samples_per_step, supervisor.micro_batch(), supervisor.accumulation(),
               std::count(ckpt_layers.begin(), ckpt_layers.end(), true), ckpt_layers.size());

  const auto params = optimizer.params();
  TrainResult result;
  int64_t phase_peak[3] = {0, 0, 0};  // forward, backward, optimizer: over the run
  int64_t step_peak = 0;              // over the current step
  auto note_peak = [&](int phase) {
    const int64_t p = mem.stats().peak;
    phase_peak[phase] = std::max(phase_peak[phase], p);
    step_peak = std::max(step_peak, p);
  };
  auto save_checkpoint = [&]() {
    if (!writer) {  // distributed: rank 0 writes, the others wait for it
      pg->barrier();
      return fs::path();
    }
    TrainState state;
    state.step = step;
    state.sampler = sampler.state();
    state.scaler = scaler.state();
    state.supervisor = supervisor.state();
    state.optimizer = optimizer.state_scalars();
    state.checkpoint_layers = ckpt_layers;
    fs::path p = save_training_checkpoint(out_dir, state, params, optimizer.state_tensors(), cpu_rng_state(),
                                          config_yaml, c.training.save_total_limit);
    result.checkpoint = p.string();
    spdlog::info("checkpoint: {}", p.string());
    if (pg) pg->barrier();
    return p;
  };
  // A stop request is honoured in every phase: evaluations end at their next batch.
  auto stop_requested = [] { return g_stop_signal.load() != 0; };
  auto run_eval = [&](const char* when) {
    if (!eval_set || stop_requested()) return;
    EvalResult r = evaluate(model, *eval_set, c.training.per_device_eval_batch_size, -1, stop_requested);
    if (r.stopped) {
      spdlog::warn("eval ({}): stopped by signal {} after {} tokens; not recorded", when, g_stop_signal.load(),
                   r.tokens);
      return;
    }
    spdlog::info("eval ({}): loss {:.4f}, perplexity {:.2f}, token accuracy {:.1f}%, {} tokens", when, r.loss,
                 r.perplexity, 100.0 * r.token_accuracy, r.tokens);
    metrics << json{{"step", step},
                    {"eval_loss", r.loss},
                    {"eval_perplexity", r.perplexity},
                    {"eval_token_accuracy", r.token_accuracy},
                    {"eval_tokens", r.tokens}}.dump()
            << "\n";
    metrics.flush();
  };

  auto run_accuracy = [&](const char* when) {
    if (c.training.eval_accuracy_rows <= 0 || c.data.eval_file.empty() || !bundle.tokenizer || stop_requested())
      return;
    AccuracyResult a = instruction_accuracy(model, *bundle.tokenizer, c.data.template_name, c.data.eval_file,
                                            c.training.eval_accuracy_rows, 12, stop_requested);
    if (a.stopped) {
      spdlog::warn("accuracy ({}): stopped by signal {} after {} rows; not recorded", when, g_stop_signal.load(),
                   a.total);
      return;
    }
    spdlog::info("accuracy ({}): {}", when, a.describe());
    metrics << json{{"step", step}, {"accuracy", a.share()}, {"accuracy_rows", a.total}}.dump() << "\n";
    metrics.flush();
  };
  if (step == 0) {
    run_eval("before training");
    run_accuracy("before training");
    if (int sig = g_stop_signal.load(); sig && !pg) {  // distributed: the ranks agree in the first step
      spdlog::warn("stopped by signal {} before the first step; nothing to save", sig);
      result.exit_code = 128 + sig;
      return result;
    }
  }

  // distributed: [loss sum, stop requested] reduced with the gradients (no extra collective).
  at::Tensor dist_extra = at::zeros({2}, at::kDouble);
  bool dist_stop = false;
  const auto t_start = std::chrono::steady_clock::now();
  int64_t tokens_done = 0, steps_this_run = 0;
  while (step < total_steps) {
    const int64_t epoch = sampler.epoch();
    std::vector<int64_t> indices = sampler.next(samples_per_step);
    std::vector<data::Sample> samples;
    samples.reserve(indices.size());
    int64_t step_tokens = 0;
    for (int64_t i : indices) {
      samples.push_back(train_set.sample(i));
      step_tokens += samples.back().target_tokens();
    }
    // distributed: every micro-batch's loss is scaled by the target tokens of the GLOBAL step.
    if (pg) step_tokens = pg->allreduce(std::vector<int64_t>{step_tokens}, ReduceOp::sum)[0];
    if (pg) seed_cpu_rng(c.training.seed, step, dist.rank);
    const at::Tensor rng = cpu_rng_state();
    double loss_sum = 0;
    double norm = 0;
    bool found_inf = false;
    const double lr = schedule.lr(step);
    const auto t0 = std::chrono::steady_clock::now();
    mem.reset_peak();
    step_peak = 0;

    StepStages stages;
    stages.compute = [&](int64_t micro) {
      set_cpu_rng_state(rng);  // the same dropout draws on every attempt
      optimizer.zero_grad();
      loss_sum = 0;
      models::ForwardOptions fo;
      fo.training = true;
      fo.checkpoint_layers = ckpt_layers;
      for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(micro)) {
        std::vector<data::Sample> part(samples.begin() + static_cast<std::ptrdiff_t>(i),
                                       samples.begin() + static_cast<std::ptrdiff_t>(std::min(samples.size(), i + micro)));
        data::Batch batch = data::collate(part, 8, pad_id);
        mem.reset_peak();
        injector.at(step, "forward");
        models::ForwardOutput out = model.forward(batch, fo);
        note_peak(0);
        // Each micro-batch weighs by its share of the step's target tokens: the update is
        // that of one big batch, whatever the split.
        at::Tensor loss = out.loss_sum / static_cast<double>(std::max<int64_t>(1, step_tokens)) * scaler.scale();
        mem.reset_peak();
        injector.at(step, "backward");
        if (loss.requires_grad()) loss.backward();
        note_peak(1);
        loss_sum += out.loss_sum.item<double>();
      }
    };
    stages.prepare = [&] {
      if (pg) {  // distributed: sum the gradients over ranks before unscale and clipping
        std::vector<at::Tensor> grads;
        for (const auto& [name, t] : params) {
          if (!t.grad().defined()) t.mutable_grad() = at::zeros_like(t);
          grads.push_back(t.grad());
        }
        dist_extra.data_ptr<double>()[0] = loss_sum;
        dist_extra.data_ptr<double>()[1] = g_stop_signal.load() ? 1 : 0;
        grads.push_back(dist_extra);
        pg->allreduce_sum(grads);
        loss_sum = dist_extra.data_ptr<double>()[0];
        dist_stop = dist_extra.data_ptr<double>()[1] > 0;
      }
      mem.reset_peak();
      injector.at(step, "optimizer");
      found_inf = !scaler.unscale(params);
      norm = found_inf ? NAN : grad_norm(params);
      note_peak(2);
    };
    stages.apply = [&] {
      if (found_inf) {
        scaler.update(true);
        spdlog::warn("step {}: gradients hold inf/nan at loss scale {}; update skipped, scale -> {}", step,
                     scaler.scale() * 2, scaler.scale());
        return;
      }
      // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when above.
      double coef = 1.0;
      if (c.training.max_grad_norm > 0 && norm > c.training.max_grad_norm) coef = c.training.max_grad_norm / (norm + 1e-6);
      optimizer.step(lr, coef);
      scaler.update(false);
    };
    stages.cleanup = [&] {
      optimizer.zero_grad();
      mem.release_cached();
    };
    profiler.begin(step + 1);
    supervisor.run_step(step, stages);
    profiler.end();
    ++step;
    ++steps_this_run;
    tokens_done += step_tokens;

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const MemoryStats ms = mem.stats();
    step_peak = std::max(step_peak, ms.peak);
    supervisor.observe_peak(step - 1, limit > 0 ? static_cast<double>(step_peak) / static_cast<double>(limit) : 0.0,
                            [&] { mem.release_cached(); },
                            [&]() -> std::string {
                              if (std::count(ckpt_layers.begin(), ckpt_layers.end(), false) > 0) {
                                EstimateInput now = plan;
                                now.micro_batch = supervisor.micro_batch();
                                now.checkpoint_layers = ckpt_layers;
                                const int64_t saved = estimate_peak(now) - estimate_peak(with_every_saving(now));
                                return str_cat("gradient_checkpointing every layer would save about ",
                                               format_bytes(saved), " by the estimate");
                              }
                              return "a smaller data.max_seq_length or per_device_train_batch_size would lower it";
                            });
    const double loss = loss_sum / static_cast<double>(std::max<int64_t>(1, step_tokens));
    result.last_loss = loss;
    json events = json::array();
    for (const auto& e : supervisor.take_events()) events.push_back(e.to_json());
    if (found_inf) events.push_back({{"step", step - 1}, {"kind", "skip"}, {"detail", "inf/nan gradients"}});
    const double tok_s = static_cast<double>(step_tokens) / std::max(1e-9, step_s);
    if (step % std::max<int64_t>(1, c.training.logging_steps) == 0 || step == total_steps || !events.empty()) {
      json m = {{"step", step},
                {"epoch", epoch},
                {"loss", loss},
                {"lr", lr},
                {"grad_norm", std::isfinite(norm) ? json(norm) : json(nullptr)},
                {"tokens", step_tokens},
                {"tokens_per_s", tok_s},
                {"loss_scale", scaler.scale()},
                {"micro_batch", supervisor.micro_batch()},
                {"accumulation", supervisor.accumulation()},
                {"memory", {{mem.device(), {{"allocated", ms.allocated}, {"peak", step_peak}, {"limit", limit}}}}},
                {"events", events}};
      metrics << m.dump() << "\n";
      metrics.flush();
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      const double eta = elapsed / static_cast<double>(steps_this_run) * static_cast<double>(total_steps - step);
      const std::string line =
          fmt::format("step {}/{} {} eta {:.0f}s loss {:.4f} lr {:.2e} {:.0f} tok/s mem {} (peak {}) micro {}x{}", step,
                      total_steps, progress_bar(step, total_steps), eta, loss, lr, tok_s, format_bytes(ms.allocated),
                      format_bytes(step_peak), supervisor.micro_batch(), supervisor.accumulation());
      if (tty) {
        std::fprintf(stderr, "\r%s\033[K", line.c_str());
        if (step == total_steps) std::fprintf(stderr, "\n");
      }
      spdlog::get("memtune")->log(tty ? spdlog::level::debug : spdlog::level::info, "{}", line);
    }
    if (c.training.eval_steps > 0 && step % c.training.eval_steps == 0) run_eval("periodic");
    if (c.training.save_steps > 0 && step % c.training.save_steps == 0 && step < total_steps) save_checkpoint();
    // distributed: stop only when the ranks agreed in this step's reduction, all at once.
    if (int sig = pg ? (dist_stop ? (g_stop_signal.load() ? g_stop_signal.load() : SIGTERM) : 0) : g_stop_signal.load()) {
      if (tty) std::fprintf(stderr, "\n");
      save_checkpoint();
      spdlog::warn("stopped by signal {} at step {}; resume with training.resume_from_checkpoint=latest", sig, step);
      result.steps = step;
      result.exit_code = 128 + sig;
      return result;
    }
  }
  save_checkpoint();
  run_eval("final");
  run_accuracy("after training");
  // Stopped during the final evaluations: the last checkpoint is saved; the adapter or
  // model is still written below (a moment's work), the remaining evaluation is skipped.
  if (int sig = g_stop_signal.load()) {
    spdlog::warn("stopped by signal {} during the final evaluation; it was skipped", sig);
    result.exit_code = 128 + sig;
  }

  if (!writer) {  // distributed: only rank 0 saves
  } else if (c.training.finetune == "lora") {
    models::save_adapter(model, bundle.adapter, out_dir / "adapter");
    spdlog::info("adapter (PEFT format): {}", (out_dir / "adapter").string());
  } else {
    models::SaveOptions so2;
    models::save_hf_model(model, out_dir / "model", so2);
    spdlog::info("model (Hugging Face format): {}", (out_dir / "model").string());
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::string report = str_cat("memtune memory report (", mem.device(), ")\n", "limit:            ",
                               limit ? format_bytes(limit) : std::string("none"), "\n", "peak at load:     ",
                               format_bytes(load_peak), "\n", "peak in forward:  ", format_bytes(phase_peak[0]), "\n",
                               "peak in backward: ", format_bytes(phase_peak[1]), "\n", "peak in optimizer: ",
                               format_bytes(phase_peak[2]), "\n", "final micro-batch: ", supervisor.micro_batch(), " x ",
                               supervisor.accumulation(), "\n", "skipped steps (fp16 overflow): ", scaler.skipped_steps(),
                               "\n", "events:\n");
  for (const auto& h : supervisor.history()) report += "  " + h + "\n";
  if (writer) write_file_atomic(out_dir / "memory_report.txt", report);
  if (pg) pg->barrier();  // distributed: the others return once rank 0 has written everything
  spdlog::info("done: {} steps, last loss {:.4f}, {:.0f} tokens/s, peak memory {}", step, result.last_loss,
               static_cast<double>(tokens_done) / std::max(1e-9, elapsed),
               format_bytes(std::max({phase_peak[0], phase_peak[1], phase_peak[2], load_peak})));
  result.steps = step;
  return result;
}

}  // namespace memtune::trainer
