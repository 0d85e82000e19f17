#include "trainer/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "data/batch.h"
#include "data/chat_template.h"
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
#include "runtime/keyed_dropout.h"
#include "runtime/log.h"
#include "runtime/memory.h"
#include "runtime/process_group.h"
#include "runtime/rng.h"
#include "runtime/step_profiler.h"
#include "runtime/supervisor.h"
#include "runtime/threads.h"
#include "runtime/units.h"
#include "trainer/accuracy.h"
#include "trainer/best_model.h"
#include "trainer/estimate.h"
#include "trainer/evaluate.h"
#include "trainer/grad_scaler.h"
#include "trainer/gradient_offload.h"
#include "trainer/layer_shards.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"
#include "trainer/schedule.h"
#include "trainer/sharding.h"
#include "trainer/metrics_log.h"
#include "trainer/oom_injector.h"
#include "trainer/train_state.h"

namespace memtune::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// A stop request is honoured in every phase: evaluations end at their next batch.
bool stop_requested() { return g_stop_signal.load() != 0; }

// Per decoder layer: offloaded (the device map's, and the ladder's layer rung).
std::vector<bool> offloaded_layers(const models::CausalLM& model) {
  std::vector<bool> out;
  for (int i = 0; i < static_cast<int>(model.num_layers()); ++i) out.push_back(model.offloaded(i));
  return out;
}

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

// Whether the samples are drawn in a shuffled order: data.shuffle, unless transformers 5's
// train_sampling_strategy says sequential.
bool shuffled(const Config& c) { return c.data.shuffle && c.training.train_sampling_strategy != "sequential"; }

}  // namespace

data::HoldOut eval_split_side(const Config& c, bool held_out) {
  data::HoldOut h;
  h.split = c.data.eval_split;
  h.seed = c.training.seed;
  h.shuffle = shuffled(c);
  h.held_out = held_out;
  return h;
}

namespace {

std::string progress_bar(int64_t done, int64_t total) {
  const int width = 24;
  int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What one optimizer step did: the row of metrics.jsonl and the progress line.
struct StepRecord {
  int64_t step = 0;        // steps done, counting this one (as logged)
  int64_t epoch = 0;
  double loss = 0;         // mean loss per target token
  double lr = 0;
  double grad_norm = NAN;  // before clipping; NaN when the update was skipped
  bool skipped = false;    // fp16 overflow: no update, the loss scale halved
  int64_t tokens = 0;      // target tokens of the step, over every rank
  int64_t positions = 0, padding = 0;  // this rank's computed positions (rows x padded length), and those on padding
  int64_t samples = 0;     // samples of the step, over every rank (an epoch's last step may have fewer)
  int64_t micro_batch = 0, accumulation = 0;  // as the step ran (the supervisor may since have changed them)
  double seconds = 0;
  int64_t allocated = 0;   // device memory after the step
  int64_t peak = 0;        // device peak over the step
  std::vector<SupervisorEvent> events;
  std::vector<int64_t> sent_bytes;  // distributed: bytes each rank sent in the step's collectives
  double oom_recovery_seconds = 0;  // from the step's first out-of-memory error to its end (0: none)
};

// One run of `memtune train`. The constructor sets everything up (process group, memory
// plan, model, data, optimizer, supervisor) and restores a checkpoint when asked; run()
// is the loop: step() under the supervisor, log_step(), evaluations and checkpoints at
// their intervals, finish(). Every piece of the run's state is a member, so a step, the
// checkpoint and the log read the same values.
class Trainer {
 public:
  explicit Trainer(const Config& config);
  TrainResult run();

 private:
  void join_and_plan();   // logging, threads, device, process group, the pre-flight memory plan
  void load_model();      // model, placement, the device budget
  void load_data();       // datasets, micro-batch (auto resolved), sampler, run length
  void build_update();    // schedule, optimizer, loss scaler
  void build_supervisor();
  // Optimizer offload's two halves: the state, and the gradients where they can leave the
  // device. offload_optimizer() returns what moved ("" when nothing did).
  std::string offload_optimizer();
  bool optimizer_offloaded() const;
  // The plan with the state (and its gradients) back on the device, for grow-back's undo.
  bool fits_with_optimizer_on_device() const;
  EstimateInput plan_now() const;  // plan_ with the supervisor's micro-batch and the rungs in effect
  void resume();          // training.resume_from_checkpoint
  void refuse_another_runs_checkpoints() const;
  // Runs `fn` with the model's trainable tensors whole on rank 0 (distributed.sharding: full
  // gathers the layers' into host memory; LayerShards::with_trainable_whole). Every rank calls it.
  void with_trainable_whole(const std::function<void()>& fn);

  StepRecord step();
  void log_step(const StepRecord& r);
  void write_row(const StepRecord& r, double tokens_per_s);
  void save_checkpoint();
  bool evaluate_loss(const char* when);  // false: a signal stopped it before its row was written
  void step_plateau(double metric);  // reduce_lr_on_plateau: the periodic evaluation's metric steps it
  void track_best(double metric);    // metric_for_best_model: a new best evaluation
  double agreed_metric() const;      // the last evaluation's metric_for_best_model, one value on every rank
  void load_best();                  // load_best_model_at_end
  void copy_trainable(const std::map<std::string, at::Tensor>& from, const fs::path& dir);
  void evaluate_accuracy(const char* when);
  int stop_signal() const;  // 0, or the signal to stop for (distributed: agreed in the step)
  void evaluate_periodic();
  // Whether an evaluation stops (or does not start) for a signal. Under sharded layers every
  // rank runs the same forwards (each gathers with the others): only the agreed stop counts.
  bool eval_stopped() const { return layer_shards_ ? stop_signal() != 0 : stop_requested(); }
  TrainResult stop(int sig);
  TrainResult finish();
  void note_peak(int phase);

  const Config& c_;
  const fs::path out_dir_;
  const DistEnv dist_;
  const bool writer_;  // rank 0 writes the run's files
  std::string config_yaml_;
  c10::Device device_ = c10::kCPU;
  std::unique_ptr<ProcessGroup> pg_;  // distributed only
  MemoryBackend* mem_ = nullptr;
  int64_t limit_ = 0;   // memory.device_limit in bytes, 0: none
  int64_t budget_ = 0;  // the limit, else the device's memory
  int64_t load_peak_ = 0;
  EstimateInput plan_;

  ModelBundle bundle_;
  std::unique_ptr<LayerShards> layer_shards_;  // distributed.sharding: full (destroyed before the model)
  std::unique_ptr<data::Dataset> train_set_, eval_set_;
  int32_t pad_id_ = 0;
  int64_t micro_batch_ = 1;  // the configured (largest) micro-batch
  int64_t samples_per_step_ = 1;
  int64_t steps_per_epoch_ = 1;
  int64_t total_steps_ = 1;
  int64_t log_every_ = 1, save_every_ = 0, eval_every_ = 0;  // logging/save/eval_steps in steps (steps_of)
  int64_t saved_at_ = -1;  // the step of the last checkpoint written or resumed from
  bool eval_due_ = false;  // the periodic evaluation at step_ was stopped before its row was written
  EvalResult last_eval_;  // the last evaluation's figures
  // metric_for_best_model (TrainState's best_*): the best value, its evaluation's step, and
  // the checkpoint written at that step.
  std::optional<double> best_metric_;
  int64_t best_step_ = 0, best_checkpoint_ = 0;
  std::unique_ptr<data::Sampler> sampler_;

  Schedule schedule_;
  std::unique_ptr<Sharding> sharding_;  // distributed.sharding: which rank owns which tensors' state
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  // memory.optimizer_offload's gradients (trainer/gradient_offload.h), where they can leave
  // the device (gradient_offload_applies); with the optimizer's state, one setting and one rung.
  std::unique_ptr<GradientOffload> grad_offload_;
  bool grads_can_leave_ = false;
  std::string offloaded_at_start_;  // what the ladder's optimizer offload moved before the first step, or ""
  bool eight_bit_at_start_ = false;  // the ladder's optimizer_8bit taken before the first step
  std::unique_ptr<GradScaler> scaler_;
  std::vector<bool> ckpt_layers_;  // the checkpoint policy; the ladder may add layers
  std::vector<bool> configured_ckpt_, configured_offload_;  // what the config asked for: the floor of grow-back
  bool offload_activations_ = false;  // checkpointed layers' inputs in host memory; the ladder may turn it on
  std::unique_ptr<Supervisor> supervisor_;

  int64_t step_ = 0;  // optimizer steps done
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<OomInjector> injector_;
  StepProfiler profiler_;
  int64_t phase_peak_[3] = {0, 0, 0};    // forward, backward, optimizer: over the run's completed steps
  int64_t attempt_peak_[3] = {0, 0, 0};  // the same over the step's current attempt
  int64_t step_peak_ = 0;                // over the step's current attempt
  at::Tensor dist_extra_;              // distributed: [loss sum, stop requested], reduced with the gradients
  bool dist_stop_ = false;
  bool tty_ = false;
  std::chrono::steady_clock::time_point start_;
  int64_t steps_this_run_ = 0, tokens_this_run_ = 0;
  TrainResult result_;
};

Trainer::Trainer(const Config& c)
    : c_(c), out_dir_(c.training.output_dir), dist_(DistEnv::from_environment()), writer_(dist_.rank == 0) {
  join_and_plan();
  load_model();
  load_data();
  build_update();
  build_supervisor();
  resume();
  refuse_another_runs_checkpoints();
  // Only now: a run refused while setting up (a resume whose config changed the math, say)
  // leaves the config of the run that wrote output_dir's checkpoints.
  if (writer_) write_file_atomic(out_dir_ / "config.yaml", config_yaml_);
  // A rung taken before the first step is the run's first ladder event (a resumed run's
  // supervisor state has it already).
  if (!offloaded_at_start_.empty() && step_ == 0)
    supervisor_->record_rung(step_, "offload optimizer state", offloaded_at_start_);
  if (eight_bit_at_start_ && step_ == 0)
    supervisor_->record_rung(step_, "8-bit optimizer state",
                             str_cat("AdamW's state made in bitsandbytes' 8-bit form before the first step: the memory "
                                     "model says it does not fit in ", format_bytes(budget_),
                                     " in fp32 even with every other saving the ladder allows; the update is adamw_8bit's"));
}

void Trainer::join_and_plan() {
  create_output_directory(out_dir_, "training.output_dir");
  init_logging({c_.runtime.log_level, writer_ ? (out_dir_ / "train.log").string() : std::string(),
                dist_.enabled() ? dist_.rank : -1, true});
  spdlog::info("memtune train: {}", c_.source);
  spdlog::info("{}", configure_threads(c_.runtime.num_threads));
  if (const std::string hint = blas_core_hint(); !hint.empty()) spdlog::info("{}", hint);
  config_yaml_ = to_yaml(c_);  // written once the run is set up (the constructor's end)
  spdlog::debug("effective config:\n{}", config_yaml_);
  for (const auto& note : compatibility_notes(c_)) log_once(note, note);

  // Memory: count every CPU byte from here on; a device_limit emulates a smaller device.
  install_cpu_budget_allocator();
  device_ = resolve_device(c_.runtime.device);
  // distributed: each rank on its LOCAL_RANK device; the group joins before the model loads.
  if (dist_.enabled() && device_.is_cuda())
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dist_.local_rank));
  if (dist_.enabled()) {
    ProcessGroupOptions po;
    po.backend = c_.distributed.backend;
    po.timeout_s = c_.distributed.timeout;
    po.bucket_size_mb = c_.distributed.bucket_size_mb;
    po.device = device_.str();
    pg_ = std::make_unique<ProcessGroup>(dist_, po);
  }
  mem_ = &memory_backend(device_);
  limit_ = c_.memory.device_limit.is_set() ? c_.memory.device_limit.resolve(mem_->stats().total) : 0;

  // Plan memory before allocating it: refuse a run that cannot fit even at micro-batch 1
  // with every layer checkpointed, and log the estimate of the configured one.
  budget_ = limit_ > 0 ? limit_ : mem_->stats().total;
  const models::ModelSpec spec = model_spec(c_);
  check_fits(c_, spec, budget_, dist_.world_size);
  plan_ = estimate_input(c_, spec);
  plan_.world_size = dist_.world_size;  // per-rank figures under distributed.sharding
  spdlog::info("memory plan: estimated peak {} at micro-batch {} x {} tokens, budget {} (memtune estimate)",
               format_bytes(estimate_peak(plan_)), plan_.micro_batch, plan_.seq_length, format_bytes(budget_));
}

void Trainer::load_model() {
  const bool shard_layers = pg_ && pg_->world_size() > 1 && shard_level(c_.distributed.sharding) == ShardLevel::full;
  // distributed.sharding: full: a rank reads only its share of the layers from the checkpoint.
  SkipTensors skip;
  if (shard_layers)
    skip = [rank = pg_->rank(), world = pg_->world_size(),
            trained = c_.training.finetune == "full"](const models::CausalLM& built) {
      const std::vector<int> owner = LayerShards::owners(built, world, trained);
      std::vector<bool> out(owner.size());
      for (size_t i = 0; i < owner.size(); ++i) out[i] = owner[i] >= 0 && owner[i] != rank;
      return out;
    };
  bundle_ = setup_model(c_, {}, skip);
  models::CausalLM& model = *bundle_.model;
  for (const auto& n : bundle_.notes) spdlog::info("{}", n);
  for (const auto& w : bundle_.warnings) spdlog::warn("{}", w);
  MEMTUNE_CHECK(c_.training.eval_accuracy_rows == 0 || bundle_.tokenizer, "training.eval_accuracy_rows: ",
                c_.training.eval_accuracy_rows, " rows are answered by rendering their prompts and reading the "
                "generated text, and model '", c_.model.name_or_path, "' has no tokenizer. Hint: set model.tokenizer, "
                "or drop the key");
  // Each rank keeps its share of every layer's frozen weights, moved to the device before
  // the model is placed (the device never holds the whole base).
  if (shard_layers) {
    if (const int n = share_dora_magnitudes(model, *pg_, c_.training.finetune == "full"))
      spdlog::info("DoRA: {} magnitudes from the row norms of their weights' owners", n);
    layer_shards_ = std::make_unique<LayerShards>(model, *pg_);
    layer_shards_->set_prefetch(c_.distributed.prefetch);
    spdlog::info("{}", layer_shards_->describe());
  }
  std::vector<models::DeviceBudget> budgets = auto_budgets(c_, device_, limit_, dist_.enabled());
  // Sharded layers are not offloaded (device_map: auto): each rank keeps 1/W of every layer.
  if (shard_layers)
    for (auto& b : budgets) b.bytes = 0;
  spdlog::info("{}", models::apply_device_map(model, c_.model.device_map.single, c_.model.device_map.entries, device_,
                                              budgets));
  const std::vector<c10::Device> devices = models::devices_of(model.placement());
  // distributed: gradients are reduced in per-dtype buckets on the rank's one device.
  MEMTUNE_CHECK(!pg_ || devices.size() == 1, "model.device_map places the model on ", devices.size(),
                " devices; with several processes each rank trains on its own device (LOCAL_RANK). Hint: map "
                "layers to ", device_.str(), " or offload");
  if (devices.size() > 1)
    spdlog::info("memory: the supervisor watches {}; the model also computes on {} other device(s), whose "
                 "memory it does not watch", device_.str(), devices.size() - 1);
  // The budget applies once the model is placed: loading goes through host memory, and
  // offloaded layers live outside the device (as on a GPU).
  if (limit_ > 0) {
    mem_->set_limit(limit_);
    spdlog::info("memory: {} limited to {} (memory.device_limit), {} in use after placing the model", mem_->device(),
                 format_bytes(limit_), format_bytes(mem_->stats().allocated));
  }
  load_peak_ = mem_->stats().peak;
  // The memory plan follows the placement (device_map: auto decides it only now).
  plan_.offloaded_layers = offloaded_layers(model);
  pad_id_ = bundle_.tokenizer && bundle_.tokenizer->pad_id ? *bundle_.tokenizer->pad_id : 0;
}

void Trainer::load_data() {
  MEMTUNE_CHECK(!c_.data.train_file.empty(), "data.train_file: not set (a .jsonl, .bin or .txt file)");
  data::DatasetOptions dopts = dataset_options(c_.data, out_dir_);
  dopts.vocab_size = bundle_.model->spec().vocab_size;
  dopts.hold_out = eval_split_side(c_, false);
  train_set_ = std::make_unique<data::Dataset>(c_.data.train_file, bundle_.tokenizer.get(), dopts);
  const auto& st = train_set_->stats();
  spdlog::info("data: {} ({} format): {} documents, {} samples, {} target tokens; {} truncated, {} dropped, "
               "{} invalid skipped{}",
               c_.data.train_file, train_set_->format(), st.documents, st.samples, st.target_tokens, st.truncated,
               st.dropped, st.skipped_invalid, train_set_->from_cache() ? " (from cache)" : "");
  // Data without a target token (a chat whose replies are not under the role 'assistant'):
  // training on it would be steps of loss 0 and a zero gradient, an evaluation a loss of 0
  // over nothing, where transformers' mean over no labels is NaN.
  auto require_targets = [](const data::Dataset& set, const char* key, const std::string& path,
                            const char* consequence) {
    MEMTUNE_CHECK(set.stats().target_tokens > 0, key, " ", path, ": none of its ", set.stats().samples,
                  " samples trains a token", set.no_target_reason(), ", so ", consequence, ". Hint: ",
                  set.no_target_hint());
  };
  require_targets(*train_set_, "data.train_file", c_.data.train_file, "training would change nothing");
  if (!c_.data.eval_file.empty()) {
    dopts.hold_out = {};
    eval_set_ = std::make_unique<data::Dataset>(c_.data.eval_file, bundle_.tokenizer.get(), dopts);
    require_targets(*eval_set_, "data.eval_file", c_.data.eval_file, "its loss would be a mean over nothing");
  } else if (c_.data.eval_split > 0) {  // the same file again, from the tokenized cache
    dopts.hold_out = eval_split_side(c_, true);
    eval_set_ = std::make_unique<data::Dataset>(c_.data.train_file, bundle_.tokenizer.get(), dopts);
    require_targets(*eval_set_, "data.eval_split of", c_.data.train_file, "its loss would be a mean over nothing");
    spdlog::info("data: data.eval_split {} holds out {} of the {} documents of {} for evaluation ({} samples)",
                 c_.data.eval_split, eval_set_->stats().documents, st.documents + eval_set_->stats().documents,
                 c_.data.train_file, eval_set_->stats().samples);
  }
  // From here the memory plan knows the data: its longest sample and most targets per sample.
  plan_ = fit_to_data(plan_, st);
  if (plan_.seq_length < c_.data.max_seq_length || plan_.max_sample_targets < plan_.seq_length)
    spdlog::info("memory plan: samples of at most {} tokens, at most {} of them trained: estimated peak {} at "
                 "micro-batch {}",
                 plan_.seq_length, plan_.max_sample_targets, format_bytes(estimate_peak(plan_)), plan_.micro_batch);

  micro_batch_ = c_.training.per_device_train_batch_size;
  if (micro_batch_ == TrainingConfig::kAuto) {
    micro_batch_ = auto_micro_batch(c_, plan_, budget_, train_set_->size());
    EstimateInput at = plan_;
    at.micro_batch = micro_batch_;
    spdlog::info("per_device_train_batch_size: auto -> {} (estimated peak {}, under {:.0f}% of {})", micro_batch_,
                 format_bytes(estimate_peak(at)), 100 * c_.memory.warning_threshold, format_bytes(budget_));
  }
  // Where the supervisor will settle, by the estimate (what `memtune estimate` says).
  EstimateInput configured = plan_;
  configured.micro_batch = micro_batch_;
  if (const LadderPlan ladder = ladder_plan(c_, configured, budget_, dist_.world_size); !ladder.steps.empty())
    spdlog::info("memory plan: the configured run does not fit in {}; the supervisor will settle, by the estimate: {}",
                 format_bytes(budget_), describe(ladder));
  // samples_per_step is per rank; a step trains on world_size times as many.
  samples_per_step_ = micro_batch_ * c_.training.gradient_accumulation_steps;
  const bool shuffle = shuffled(c_);
  sampler_ = std::make_unique<data::Sampler>(train_set_->size(), c_.training.seed, shuffle, dist_.rank,
                                             dist_.world_size);
  // transformers 4's group_by_length and 5's train_sampling_strategy name one sampler.
  if (c_.training.group_by_length || c_.training.train_sampling_strategy == "group_by_length") {
    // Megabatches of whole steps over all ranks (with one process, transformers' own size:
    // per_device_train_batch_size x gradient_accumulation_steps samples per step).
    std::vector<int64_t> lengths(train_set_->size());
    for (int64_t i = 0; i < train_set_->size(); ++i) lengths[i] = train_set_->sample_length(i);
    const int64_t megabatch = data::Sampler::megabatch_size(train_set_->size(), samples_per_step_ * dist_.world_size);
    sampler_->group_by_length(std::move(lengths), megabatch);
    spdlog::info("data: grouped by length (training.group_by_length): each epoch's {} in megabatches of {} samples "
                 "({} steps), each sorted longest first{}",
                 shuffle ? "shuffled samples" : "samples, in file order,", megabatch,
                 megabatch / (samples_per_step_ * dist_.world_size),
                 c_.data.pack_sequences ? "; data.pack_sequences fills rows, so grouping changes little" : "");
  }
  steps_per_epoch_ = sampler_->steps_per_epoch(samples_per_step_ * dist_.world_size);
  total_steps_ = c_.training.max_steps > 0
                     ? c_.training.max_steps
                     : std::max<int64_t>(1, static_cast<int64_t>(std::ceil(c_.training.num_train_epochs *
                                                                           static_cast<double>(steps_per_epoch_))));
  // transformers' IntervalStrategy: steps (the *_steps keys), epoch (each epoch's end: a
  // whole number of steps, data/sampler.h), no.
  const TrainingConfig& t = c_.training;
  const int64_t logging = std::max<int64_t>(1, steps_of(t.logging_steps, total_steps_));
  log_every_ = t.logging_strategy == "no" ? 0 : t.logging_strategy == "epoch" ? steps_per_epoch_ : logging;
  save_every_ = t.save_strategy == "no"      ? 0
                : t.save_strategy == "epoch" ? steps_per_epoch_
                                             : steps_of(t.save_steps, total_steps_);
  eval_every_ = t.eval_strategy == "epoch" ? steps_per_epoch_ : steps_of(t.eval_steps, total_steps_);
  if (t.eval_strategy == "steps" && eval_every_ == 0) {
    eval_every_ = logging;  // transformers' default eval_steps
    if (logging == 1 && total_steps_ > 1)
      spdlog::warn("training.eval_strategy: steps without eval_steps evaluates every logging_steps, as transformers "
                   "does: every step here (memtune's logging_steps defaults to 1, transformers' to 500). Hint: set "
                   "eval_steps");
  }
  // transformers: "--load_best_model_at_end requires the saving steps to be a round multiple of
  // the evaluation steps", so that each checkpoint has its evaluation.
  MEMTUNE_CHECK(!t.load_best_model_at_end || (save_every_ > 0 && eval_every_ > 0 && save_every_ % eval_every_ == 0),
                "training.load_best_model_at_end needs a checkpoint at evaluations: checkpoints every ", save_every_,
                " steps and evaluations every ", eval_every_,
                " (0: none); save_steps must be a round multiple of eval_steps, as transformers requires");
  if (!best_metric_name(t).empty() && t.greater_is_better.empty() && best_is_greater(t))
    spdlog::warn("training.metric_for_best_model: {} does not end in loss, so a larger value ranks better "
                 "(transformers' default for greater_is_better){}", best_metric_name(t),
                 best_metric_name(t) == "perplexity" ? "; for perplexity set greater_is_better: false" : "");
}

void Trainer::build_update() {
  const TrainingConfig& t = c_.training;
  Schedule schedule;
  schedule.kind = t.lr_scheduler_type;
  schedule.learning_rate = t.learning_rate;
  schedule.warmup_steps = t.warmup_steps > 0 ? steps_of(t.warmup_steps, total_steps_)
                                             : static_cast<int64_t>(std::ceil(t.warmup_ratio * total_steps_));
  schedule.total_steps = total_steps_;
  schedule_ = with_kwargs(schedule, t.lr_scheduler_kwargs);
  if (schedule_.kind == "warmup_stable_decay") {
    const int64_t stable = schedule_.wsd_stable_steps();
    const int64_t phases = schedule_.warmup_steps + stable + schedule_.decay_steps;
    spdlog::info("lr schedule warmup_stable_decay: warm-up {} steps, stable {}, decay {} ({}, to {}), of {} steps",
                 schedule_.warmup_steps, stable, schedule_.decay_steps, schedule_.decay_type,
                 schedule_.min_lr_rate * schedule_.learning_rate, total_steps_);
    // transformers computes on with these as they are; where they miss the run's steps, say so.
    if (stable < 0)
      spdlog::warn("training.lr_scheduler_kwargs.num_decay_steps: {} decay steps and {} warm-up steps exceed the run's "
                   "{}: the decay starts {} steps into its course, right after warm-up, as transformers' "
                   "get_wsd_schedule does",
                   schedule_.decay_steps, schedule_.warmup_steps, total_steps_, -stable);
    else if (phases != total_steps_)
      spdlog::warn("training.lr_scheduler_kwargs.num_stable_steps: warm-up, stable and decay make {} steps, the run {}: "
                   "{}, as transformers' get_wsd_schedule does",
                   phases, total_steps_,
                   phases < total_steps_ ? "the last steps hold the final learning rate" : "the decay is cut short");
  }
  OptimizerOptions oo;
  set_optimizer_kind(t.optim, oo);
  // The ladder's optimizer offload, taken now where the state cannot stay on the device (estimate.h).
  const bool at_start = optimizer_offload_at_start(c_, plan_, budget_, dist_.world_size);
  oo.offloaded = c_.memory.optimizer_offload == "cpu" || at_start;
  // Or its optimizer_8bit, where listed: the state made in 8 bits (estimate.h).
  if (optimizer_8bit_at_start(c_, plan_, budget_, dist_.world_size)) {
    oo.ladder_from = oo.kind;
    oo.kind = "adamw_8bit";
    eight_bit_at_start_ = true;
  }
  oo.beta1 = t.adam_beta1;
  oo.beta2 = t.adam_beta2;
  oo.eps = t.adam_epsilon;
  oo.weight_decay = t.weight_decay;
  oo.momentum = t.momentum;
  if (oo.kind == "adafactor" && (t.adam_beta1 != 0.9 || t.adam_beta2 != 0.999 || t.adam_epsilon != 1e-8))
    spdlog::warn("training.optim: adafactor reads no adam_beta1/adam_beta2/adam_epsilon (as in Hugging Face's "
                 "Trainer); the values set are not used");
  // distributed.sharding: this rank keeps state for, and updates, its share of the tensors.
  const auto trainable = bundle_.model->trainable_parameters();
  std::vector<bool> on_demand;  // distributed.sharding: full: the layers' trainable tensors stay with their owners
  for (const auto& [name, p] : trainable) on_demand.push_back(layer_shards_ && layer_shards_->holds(p));
  sharding_ = std::make_unique<Sharding>(shard_level(c_.distributed.sharding), pg_.get(), trainable,
                                         c_.distributed.bucket_size_mb << 20, on_demand);
  optimizer_ = std::make_unique<Optimizer>(bundle_.model->trainable_parameters(), oo, sharding_->owned());
  params_ = optimizer_->params();
  grad_offload_ = std::make_unique<GradientOffload>(params_);
  grads_can_leave_ = gradient_offload_applies(c_, dist_.world_size);
  spdlog::info("{}; optimizer state here: {}", sharding_->describe(), format_bytes(optimizer_->state_bytes()));
  if (c_.memory.optimizer_offload == "cpu" || at_start) {
    const std::string why = at_start ? "memory.on_oom.ladder: optimizer_offload, taken before the first step"
                                     : "memory.optimizer_offload: cpu";
    if (oo.paged) spdlog::info("{}: {} keeps its state in host memory already", why, t.optim);
    std::string moved =
        oo.paged ? "" : str_cat("optimizer state (", format_bytes(optimizer_->state_bytes()), ", made there)");
    if (const std::string grads = offload_optimizer(); !grads.empty()) moved += (moved.empty() ? "" : " and ") + grads;
    if (!moved.empty()) spdlog::info("{}: {} in host memory; the update runs there", why, moved);
    if (!grads_can_leave_)
      spdlog::info("{}: gradients stay on {} ({} ranks reduce them in device memory)", why, device_.str(),
                   dist_.world_size);
    if (at_start)
      offloaded_at_start_ = str_cat(moved.empty() ? "nothing to move" : moved,
                                    " in host memory before the first step: the memory model says the run does not "
                                    "fit in ", format_bytes(budget_), " with the state on ", device_.str(),
                                    " even with every other saving the ladder allows");
  }
  if (pg_) {  // distributed: every rank starts from rank 0's trainable weights (a sharded layer's have)
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!on_demand[i]) pg_->broadcast(params_[i].second, 0);
  }
  scaler_ = std::make_unique<GradScaler>(fp16_loss_scaling(c_, bundle_.compute_dtype), t.fp16_init_scale,
                                         t.fp16_growth_interval);
}

std::string Trainer::offload_optimizer() {
  std::string moved;
  if (!optimizer_->states_offloaded())
    moved = str_cat("optimizer state (", format_bytes(optimizer_->offload_states()), ")");
  if (grads_can_leave_ && !grad_offload_->enabled())
    moved += str_cat(moved.empty() ? "" : " and ", "gradients (", format_bytes(grad_offload_->enable()),
                     ", moved as backward produces them, accumulated there)");
  return moved;
}

bool Trainer::optimizer_offloaded() const {
  return optimizer_->states_offloaded() && (!grads_can_leave_ || grad_offload_->enabled());
}

EstimateInput Trainer::plan_now() const {
  EstimateInput now = plan_;
  now.micro_batch = supervisor_->micro_batch();
  now.samples_per_step = samples_per_step_;
  now.checkpoint_layers = ckpt_layers_;
  now.offload_activations = offload_activations_;
  now.optimizer_paged = now.optimizer_paged || optimizer_->states_offloaded();
  now.gradients_offloaded = grad_offload_->enabled();
  now.offloaded_layers = offloaded_layers(*bundle_.model);  // weights off the device, checkpointed
  if (optimizer_->states_quantized()) now.optimizer = "adamw_8bit";  // the ladder's optimizer_8bit
  return now;
}

bool Trainer::fits_with_optimizer_on_device() const {
  EstimateInput now = plan_now();
  now.optimizer_paged = plan_.optimizer_paged;  // the config's: paged, or nothing
  now.gradients_offloaded = false;
  return estimate_peak(now) <= budget_;
}

void Trainer::build_supervisor() {
  ckpt_layers_ = checkpoint_plan(c_.training.gradient_checkpointing, bundle_.model->num_layers());
  if (layer_shards_) ckpt_layers_.assign(ckpt_layers_.size(), true);  // a sharded layer is always checkpointed
  configured_ckpt_ = ckpt_layers_;
  configured_offload_ = offloaded_layers(*bundle_.model);
  offload_activations_ = c_.training.activation_offload == "checkpoints";
  SupervisorOptions so;
  so.enabled = c_.memory.supervise;
  so.samples_per_step = samples_per_step_;
  so.micro_batch = micro_batch_;
  so.shrink_factor = c_.memory.on_oom.shrink_factor;
  so.shrink = c_.memory.on_oom.allows("micro_batch");
  so.max_retries = c_.memory.on_oom.max_retries;
  so.grow_after_steps = c_.memory.grow_after_steps;
  so.grow_threshold = c_.memory.grow_threshold;
  so.warning = c_.memory.warning_threshold;
  so.critical = c_.memory.critical_threshold;
  so.emergency = c_.memory.emergency_threshold;
  supervisor_ = std::make_unique<Supervisor>(so);
  if (pg_)
    supervisor_->set_agreement([this](bool oom, int64_t micro) {
      // A sharded layer's gather or a reduction in backward may have made this stage's
      // agreement already (layer_shards.h, sharding.h).
      const bool gather = layer_shards_ && layer_shards_->take_agreed_oom();
      if (sharding_->take_agreed_oom() || gather) return std::make_pair(true, micro);
      return pg_->agree(oom, micro);
    });
  // Each rung with its undo: grow-back reverts the ladder's changes, never the config's.
  // Added in memory.on_oom.ladder's order (micro_batch is the supervisor's own shrinking).
  struct Rung {
    const char* name;
    std::function<std::string()> apply, undo;
    std::function<bool()> undo_fits = nullptr;  // for an undo that allocates on the device (supervisor.h)
  };
  const std::map<std::string, Rung> rungs = {
      {"checkpointing",
       {"checkpoint more layers",
        [this]() -> std::string {
          for (size_t i = 0; i < ckpt_layers_.size(); ++i)
            if (!ckpt_layers_[i]) {
              ckpt_layers_[i] = true;
              return "checkpointing layer " + std::to_string(i);
            }
          return "";
        },
        [this]() -> std::string {
          for (size_t i = ckpt_layers_.size(); i-- > 0;)
            if (ckpt_layers_[i] && !configured_ckpt_[i]) {
              ckpt_layers_[i] = false;
              return "checkpointing layer " + std::to_string(i);
            }
          return "";
        }}},
      {"activation_offload",
       {"offload activations",
        [this]() -> std::string {
          if (offload_activations_ || std::count(ckpt_layers_.begin(), ckpt_layers_.end(), true) == 0) return "";
          offload_activations_ = true;
          return "checkpointed layers' inputs kept in host memory (activation offload)";
        },
        [this]() -> std::string {
          if (!offload_activations_ || c_.training.activation_offload == "checkpoints") return "";
          offload_activations_ = false;
          return "activation offload";
        }}},
      {"optimizer_offload",
       {"offload optimizer state",
        [this]() -> std::string {
          const std::string moved = offload_optimizer();
          return moved.empty() ? "" : moved + " moved to host memory";
        },
        [this]() -> std::string {
          if (c_.memory.optimizer_offload == "cpu") return "";
          const int64_t bytes = optimizer_->restore_states();
          const bool grads = grad_offload_->disable() > 0;  // dropped between steps: nothing to move
          if (bytes == 0 && !grads) return "";
          return str_cat("optimizer offload (", format_bytes(bytes), " of state back on the device",
                         grads ? ", gradients kept there again" : "", ")");
        },
        [this] { return fits_with_optimizer_on_device(); }}},
      {"optimizer_8bit",
       {"8-bit optimizer state",
        [this]() -> std::string {
          // (in host memory already, offloaded or paged, it would free nothing on the device)
          if (optimizer_->states_quantized() || optimizer_->states_offloaded()) return "";
          const int64_t freed = optimizer_->quantize_states();
          if (!optimizer_->states_quantized()) return "";
          return str_cat("AdamW's state in bitsandbytes' 8-bit form (", format_bytes(freed),
                         " freed); the update is adamw_8bit's from the next step");
        },
        [this]() -> std::string {
          const int64_t bytes = optimizer_->dequantize_states();
          if (bytes == 0 && optimizer_->states_quantized()) return "";
          return str_cat("8-bit optimizer state (", format_bytes(bytes), " of fp32 state again, ", c_.training.optim,
                         "'s update)");
        },
        [this] {  // the state back in fp32 where it lives
          EstimateInput now = plan_now();
          now.optimizer = plan_.optimizer;
          return estimate_peak(now) <= budget_;
        }}},
      {"layer_offload",
       {"offload layers", [this] { return models::offload_one_more_layer(*bundle_.model); },
        [this]() -> std::string {
          for (int64_t i = 0; i < bundle_.model->num_layers(); ++i)
            if (bundle_.model->offloaded(i) && !configured_offload_[static_cast<size_t>(i)]) {
              bundle_.model->set_offloaded(i, false);
              return "offloading layer " + std::to_string(i);
            }
          return "";
        },
        [this] {  // the layer the undo would bring back (the first the ladder offloaded) on the device
          EstimateInput now = plan_now();
          for (size_t i = 0; i < now.offloaded_layers.size(); ++i)
            if (now.offloaded_layers[i] && !configured_offload_[i]) {
              now.offloaded_layers[i] = false;
              break;
            }
          return estimate_peak(now) <= budget_;
        }}},
  };
  for (const std::string& name : c_.memory.on_oom.ladder) {
    if (name == "micro_batch") continue;
    if (name == "layer_offload" && layer_shards_) {
      spdlog::info("memory.on_oom.ladder: layer_offload is not a rung under distributed.sharding: full (each rank "
                   "keeps 1/{} of every layer already)", pg_->world_size());
      continue;
    }
    const Rung& r = rungs.at(name);
    supervisor_->add_ladder_rung(r.name, r.apply, r.undo, r.undo_fits);
  }
  // With a budget, the ladder climbs as far as the estimate says is needed at once, and a
  // shrink goes to the largest micro-batch it says fits.
  if (limit_ > 0)
    supervisor_->set_fits([this](int64_t micro_batch) {
      EstimateInput now = plan_now();
      now.micro_batch = micro_batch;
      return estimate_peak(now) <= limit_;
    });
  if (limit_ > 0) {
    std::map<std::string, std::string> names;  // config key -> the rung's name as added
    for (const auto& [key, r] : rungs) names[key] = r.name;
    supervisor_->set_first_rung([this, names] {
      const std::string key = cheapest_fitting_rung(c_, plan_now(), limit_, dist_.world_size);
      return key.empty() ? std::string() : names.at(key);
    });
  }
  // When the ladder has nothing left: the plan it reached, by the estimate, and what would fit.
  supervisor_->set_report([this] {
    std::string report = str_cat("memory limit ", limit_ ? format_bytes(limit_) : std::string("none"),
                                 ", load peak ", format_bytes(load_peak_), ".");
    if (budget_ <= 0) return report + " Try a smaller data.max_seq_length, load_in_4bit or fewer LoRA targets.";
    const EstimateInput now = plan_now();
    const int64_t peak = estimate_peak(now);
    report += str_cat(" The estimate of the plan reached (micro-batch ", now.micro_batch, " and the rungs above): ",
                      format_bytes(peak), " of ", format_bytes(budget_));
    if (peak <= budget_)
      return report + ", which says it fits: what ran out is outside the memory model (another process on the "
                      "device, fragmentation) or the model is wrong here (please report it with memory_report.txt).";
    // What would fit with every rung (a stop after memory.on_oom.max_retries may leave some).
    return str_cat(report, ". What would fit", what_would_fit(with_ladder(c_, now, dist_.world_size), budget_), ".");
  });
}

// Checkpoints in output_dir past the step this run starts at are another run's (a run
// started afresh in its directory, or resumed from an earlier checkpoint of it): this run
// would write its own among them, save_total_limit would prune by step number across both
// (its own newest first), and resume_from_checkpoint=latest would continue the other run.
// Rank 0's output_dir decides (the one that writes checkpoints), for every rank alike.
void Trainer::refuse_another_runs_checkpoints() const {
  const std::vector<fs::path> later = writer_ ? checkpoints_after(out_dir_, step_) : std::vector<fs::path>{};
  const int64_t found =
      pg_ ? pg_->allreduce(std::vector<int64_t>{static_cast<int64_t>(later.size())}, ReduceOp::max)[0]
          : static_cast<int64_t>(later.size());
  if (found == 0) return;
  MEMTUNE_CHECK(writer_, "rank 0's training.output_dir holds another run's checkpoints past step ", step_,
                " (rank 0's message names them)");
  std::string names;
  for (const auto& p : later) names += (names.empty() ? "" : ", ") + p.filename().string();
  fail("training.output_dir ", out_dir_.string(), " holds checkpoints past step ", step_, ", where this run starts (",
       names, "): another run's. This run would write its own among them, save_total_limit would prune by step "
       "number across both, and resume_from_checkpoint=latest would continue the other run. Hint: ",
       step_ == 0 ? "to continue that run, set training.resume_from_checkpoint=latest; " : "",
       "to start over here, move those checkpoints away, or use a new training.output_dir");
}

void Trainer::resume() {
  if (writer_) remove_incomplete_checkpoints(out_dir_);
  const std::string& resume = c_.training.resume_from_checkpoint;
  if (resume.empty()) return;
  const fs::path dir = resume == "latest" ? latest_checkpoint(out_dir_) : fs::path(resume);
  if (dir.empty()) {
    spdlog::info("resume_from_checkpoint: latest: no checkpoint under {} yet, starting fresh", out_dir_.string());
    return;
  }
  // Each rank reads the optimizer state of the tensors it owns, however the writer sharded it.
  TrainingCheckpoint ck =
      load_training_checkpoint(dir, [this](const std::string& key) { return sharding_->owns_state(key); });
  // The ladder's optimizer_8bit had been taken (the checkpoint's run configured AdamW in
  // fp32 and holds 8-bit state): the state is in that form again.
  const Config written = parse_saved_config(ck.config_yaml, (dir / "config.yaml").string());
  OptimizerOptions written_kind;
  set_optimizer_kind(written.training.optim, written_kind);
  if (ck.state.optimizer.value("kind", std::string()) == "adamw_8bit" && written_kind.kind != "adamw_8bit" &&
      written_kind.kind == optimizer_->options().kind) {
    MEMTUNE_CHECK(c_.memory.on_oom.allows("optimizer_8bit"), (dir / "state.json").string(),
                  ": the optimizer state is in bitsandbytes' 8-bit form (the memory ladder's optimizer_8bit rung was "
                  "taken), and memory.on_oom.ladder does not list optimizer_8bit now. Hint: list it in "
                  "memory.on_oom.ladder to resume this checkpoint");
    if (!optimizer_->states_quantized()) optimizer_->quantize_states();
  }
  check_resume_compatible(c_, written, dir, dist_.world_size, ck.state.world_size);
  const auto& data_now = train_set_->stats();
  MEMTUNE_CHECK(ck.state.data_samples == 0 || (ck.state.data_samples == data_now.samples &&
                                               ck.state.data_target_tokens == data_now.target_tokens),
                "resume_from_checkpoint: data.train_file ", c_.data.train_file, " now makes ", data_now.samples,
                " samples (", data_now.target_tokens, " target tokens); the checkpoint's run had ",
                ck.state.data_samples, " samples (", ck.state.data_target_tokens, " target tokens), so the run of ", dir.string(),
                " cannot continue on it (its sampler's order is a permutation of the samples that data made): the file "
                "changed since, or this memtune splits it differently. Hint: resume on the data the checkpoint's run "
                "read, or start a new training.output_dir");
  if (ck.state.data_samples == 0)
    spdlog::info("resume: {} names no data count (an earlier memtune wrote it): its sample order is not checked "
                 "against the data", dir.string());
  copy_trainable(ck.trainable, dir);
  try {  // each owner checks its part of state.json; the message gains the file's name
    optimizer_->load_state(ck.optimizer, ck.state.optimizer);
    data::SamplerState ss;
    data::from_json(ck.state.sampler, ss);
    sampler_->restore(ss);
    scaler_->load_state(ck.state.scaler);
    if (schedule_.kind == "reduce_lr_on_plateau") schedule_.plateau.restore(ck.state.lr_scheduler, "state.json");
    best_metric_ = ck.state.best_metric;
    best_step_ = ck.state.best_step;
    best_checkpoint_ = ck.state.best_checkpoint;
    if (ck.state.world_size <= 0 || ck.state.world_size == dist_.world_size)
      supervisor_->load_state(ck.state.supervisor);
    else  // its micro-batch was per rank of another split of the step
      spdlog::info("resume: {} ranks where the checkpoint's run had {}: the micro-batch plan starts from the config's",
                   dist_.world_size, ck.state.world_size);
  } catch (const UserError& e) {
    fail((dir / "state.json").string(), ": ", e.what());
  }
  MEMTUNE_CHECK(ck.state.checkpoint_layers.empty() || ck.state.checkpoint_layers.size() == ckpt_layers_.size(),
                (dir / "state.json").string(), ": checkpoint_layers names ", ck.state.checkpoint_layers.size(),
                " layers, the model has ", ckpt_layers_.size());
  MEMTUNE_CHECK(ck.rng_state.numel() == cpu_rng_state().numel(), (dir / "rng.safetensors").string(),
                ": the generator state has ", ck.rng_state.numel(), " bytes, this LibTorch's has ",
                cpu_rng_state().numel());
  set_cpu_rng_state(ck.rng_state);
  step_ = ck.state.step;
  std::error_code ec;  // a checkpoint of this output_dir: a stop before the next step need not write it again
  if (fs::equivalent(dir.parent_path(), out_dir_ / "checkpoints", ec)) saved_at_ = step_;
  eval_due_ = ck.state.eval_due;
  if (ck.state.total_steps > 0 && ck.state.total_steps != total_steps_)
    spdlog::warn("resume: the run is {} steps long, where the checkpoint's run was {}: the learning-rate schedule "
                 "after it follows the new length", total_steps_, ck.state.total_steps);
  else if (ck.state.total_steps == 0 && c_.training.max_steps <= 0)
    spdlog::info("resume: {} names no run length (an earlier memtune wrote it); epochs are now the Trainer's (a step "
                 "never reaches into the next epoch), so num_train_epochs may make this run longer than the one it "
                 "continues", dir.string());
  if (!ck.state.checkpoint_layers.empty()) ckpt_layers_ = ck.state.checkpoint_layers;
  offload_activations_ = offload_activations_ || ck.state.activation_offload;
  if (ck.state.optimizer_offload)
    if (const std::string moved = offload_optimizer(); !moved.empty())
      spdlog::info("resume: {} in host memory (the checkpoint's optimizer offload)", moved);
  spdlog::info("resumed from {} at step {}", dir.string(), step_);
}

TrainResult Trainer::run() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  g_stop_signal.store(0);
  metrics_ = std::make_unique<MetricsLog>(out_dir_ / "metrics.jsonl", step_, writer_);
  injector_ = std::make_unique<OomInjector>(c_.memory.inject_oom, dist_.rank);
  dist_extra_ = at::zeros({2}, at::kDouble);
  mem_->release_cached();  // what loading freed is not what training will ask for
  tty_ = isatty(STDERR_FILENO);
  const int64_t last = sampler_->per_rank() - (steps_per_epoch_ - 1) * samples_per_step_;  // an epoch's last step
  spdlog::info("training: {} steps ({} per epoch{}), {} samples per step, micro-batch {} x {}, checkpointing {}/{} "
               "layers{}",
               total_steps_, steps_per_epoch_,
               last < samples_per_step_ ? fmt::format(", the last on the epoch's remaining {}", last) : std::string(),
               samples_per_step_, supervisor_->micro_batch(),
               supervisor_->accumulation(), std::count(ckpt_layers_.begin(), ckpt_layers_.end(), true),
               ckpt_layers_.size(), offload_activations_ ? ", their inputs offloaded to host memory" : "");

  if (step_ == 0) {
    evaluate_loss("before training");
    evaluate_accuracy("before training");
    if (int sig = g_stop_signal.load(); sig && !pg_) {  // distributed: the ranks agree in the first step
      spdlog::warn("stopped by signal {} before the first step; nothing to save", sig);
      result_.exit_code = 128 + sig;
      return result_;
    }
  }
  if (eval_due_) {  // a stop cut short the periodic evaluation at the checkpoint's step
    evaluate_periodic();
    if (int sig = stop_signal()) return stop(sig);
  }
  start_ = std::chrono::steady_clock::now();
  while (step_ < total_steps_) {
    const StepRecord r = step();
    log_step(r);
    if (eval_every_ > 0 && step_ % eval_every_ == 0) evaluate_periodic();
    if (save_every_ > 0 && step_ % save_every_ == 0 && step_ < total_steps_) save_checkpoint();
    if (int sig = stop_signal()) return stop(sig);
  }
  return finish();
}

void Trainer::note_peak(int phase) {
  const int64_t p = mem_->stats().peak;
  attempt_peak_[phase] = std::max(attempt_peak_[phase], p);
  step_peak_ = std::max(step_peak_, p);
}

// One optimizer step on the samples the sampler gives it, run by the supervisor: after an
// out-of-memory error anywhere in it, the same samples run again as smaller micro-batches
// with the same dropout draws, so the update is the one an unconstrained run makes.
StepRecord Trainer::step() {
  StepRecord r;
  std::vector<data::Sample> samples;
  std::vector<uint64_t> dropout_keys;  // per sample: its masks, whatever micro-batch runs it
  // The epoch's last step takes what is left of it, as the Trainer's (data/sampler.h).
  for (int64_t i : sampler_->next(samples_per_step_)) {
    samples.push_back(train_set_->sample(i));
    r.tokens += samples.back().target_tokens();
    dropout_keys.push_back(dropout_row_key(c_.training.seed, step_, i));
  }
  // NEFTune's T for each sample: the padded length of the micro-batch the run is configured
  // with (transformers' batch), whatever micro-batch the supervisor runs it in.
  std::vector<int64_t> noise_lengths;
  if (c_.training.neftune_noise_alpha > 0) {
    noise_lengths.resize(samples.size());
    for (size_t g = 0; g < samples.size(); g += static_cast<size_t>(micro_batch_)) {
      const size_t end = std::min(samples.size(), g + static_cast<size_t>(micro_batch_));
      size_t longest = 0;
      for (size_t i = g; i < end; ++i) longest = std::max(longest, samples[i].input_ids.size());
      std::fill(noise_lengths.begin() + static_cast<std::ptrdiff_t>(g),
                noise_lengths.begin() + static_cast<std::ptrdiff_t>(end), static_cast<int64_t>(longest));
    }
  }
  r.epoch = sampler_->epoch();
  r.samples = static_cast<int64_t>(samples.size());
  // distributed: every micro-batch's loss is scaled by the target tokens of the GLOBAL step.
  if (pg_) {
    const auto sums = pg_->allreduce(std::vector<int64_t>{r.tokens, r.samples}, ReduceOp::sum);
    r.tokens = sums[0];
    r.samples = sums[1];
  }
  if (pg_) seed_cpu_rng(c_.training.seed, step_, dist_.rank);
  const at::Tensor rng = cpu_rng_state();
  const int64_t denominator = std::max<int64_t>(1, r.tokens);
  double loss_sum = 0;
  r.lr = schedule_.lr(step_);
  const auto t0 = std::chrono::steady_clock::now();
  mem_->reset_peak();
  step_peak_ = 0;

  StepStages stages;
  stages.compute = [&](int64_t micro) {
    // A new attempt: the peaks the monitor and the report see are those of the attempt
    // that completes, not of one that ran out of memory.
    step_peak_ = 0;
    std::fill(std::begin(attempt_peak_), std::end(attempt_peak_), 0);
    set_cpu_rng_state(rng);  // the same generator state on every attempt
    r.micro_batch = micro;
    r.accumulation = (static_cast<int64_t>(samples.size()) + micro - 1) / micro;
    optimizer_->zero_grad();
    loss_sum = 0;
    r.positions = r.padding = 0;
    models::ForwardOptions fo;
    fo.training = true;
    fo.label_smoothing = c_.training.label_smoothing_factor;
    fo.neftune_noise_alpha = c_.training.neftune_noise_alpha;
    fo.checkpoint_layers = ckpt_layers_;
    fo.offload_activations = offload_activations_;
    // A tied head's gradient goes to the host as the loss's backward makes it, rather than
    // wait on the device for the embedding's (trainer/gradient_offload.h).
    if (grad_offload_->enabled() && bundle_.model->spec().tie_word_embeddings)
      fo.head_weight_tap = [this](const at::Tensor& w) { return grad_offload_->tap(w); };
    for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(micro)) {
      const auto first = samples.begin() + static_cast<std::ptrdiff_t>(i);
      const std::vector<data::Sample> part(first, first + static_cast<std::ptrdiff_t>(std::min<size_t>(
                                                              samples.size() - i, static_cast<size_t>(micro))));
      data::Batch batch = data::collate(part, 8, pad_id_);
      r.positions += batch.rows() * batch.length();
      for (int64_t len : batch.row_lengths) r.padding += batch.length() - len;
      batch.row_keys.assign(dropout_keys.begin() + static_cast<std::ptrdiff_t>(i),
                            dropout_keys.begin() + static_cast<std::ptrdiff_t>(i + part.size()));
      if (!noise_lengths.empty())
        batch.noise_lengths.assign(noise_lengths.begin() + static_cast<std::ptrdiff_t>(i),
                                   noise_lengths.begin() + static_cast<std::ptrdiff_t>(i + part.size()));
      mem_->reset_peak();
      injector_->at(step_, "forward");
      models::ForwardOutput out = bundle_.model->forward(batch, fo);
      note_peak(0);
      // Each micro-batch weighs by its share of the step's target tokens: the update is
      // that of one big batch, whatever the split.
      at::Tensor loss = out.loss_sum / static_cast<double>(denominator) * scaler_->scale();
      mem_->reset_peak();
      injector_->at(step_, "backward");
      sharding_->backward(loss, grad_offload_->enabled());  // with ZeRO-2's reductions (trainer/sharding.h)
      note_peak(1);
      loss_sum += out.loss_sum.item<double>();
    }
  };
  stages.prepare = [&] {
    if (pg_) {  // distributed: sum the gradients over ranks (to their owners when sharded), then unscale and clip
      dist_extra_.data_ptr<double>()[0] = loss_sum;
      dist_extra_.data_ptr<double>()[1] = g_stop_signal.load() ? 1 : 0;
      sharding_->reduce_gradients(params_, dist_extra_, *scaler_, grad_offload_->enabled());
      loss_sum = dist_extra_.data_ptr<double>()[0];
      dist_stop_ = dist_extra_.data_ptr<double>()[1] > 0;
    }
    mem_->reset_peak();
    injector_->at(step_, "optimizer");
    {
      MEMTUNE_PROFILE_SCOPE("memtune::check_gradients");
      std::tie(r.skipped, r.grad_norm) = sharding_->check_gradients(*scaler_, params_);  // unscaled, inf/nan, norm
    }
    optimizer_->reserve_workspaces();  // what the update allocates, while running out of memory can be retried
    note_peak(2);
  };
  stages.apply = [&] {
    MEMTUNE_PROFILE_SCOPE("memtune::optimizer_step");
    if (r.skipped) {
      scaler_->update(true);
      spdlog::warn("step {}: gradients hold inf/nan at loss scale {}; update skipped, scale -> {}", step_,
                   scaler_->scale() * 2, scaler_->scale());
      return;
    }
    // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when above.
    double coef = 1.0;
    const double max_norm = c_.training.max_grad_norm;
    if (max_norm > 0 && r.grad_norm > max_norm) coef = max_norm / (r.grad_norm + 1e-6);
    sharding_->step(*optimizer_, r.lr, coef);  // this rank's tensors, then every rank gets them all
    scaler_->update(false);
  };
  stages.cleanup = [&] {
    optimizer_->zero_grad();
    mem_->release_cached();
  };
  const std::vector<int64_t> sent_before = pg_ ? pg_->sent_bytes() : std::vector<int64_t>{};
  profiler_.begin(step_ + 1, device_.is_cuda() ? std::max<int>(device_.index(), 0) : -1);
  supervisor_->run_step(step_, stages);
  profiler_.end();
  if (pg_) {
    r.sent_bytes = pg_->sent_bytes();
    for (size_t k = 0; k < r.sent_bytes.size(); ++k) r.sent_bytes[k] -= sent_before[k];
  }
  ++step_;
  r.step = step_;
  r.seconds = seconds_since(t0);
  r.loss = loss_sum / static_cast<double>(denominator);

  const MemoryStats ms = mem_->stats();
  r.allocated = ms.allocated;
  r.peak = step_peak_ = std::max(step_peak_, ms.peak);
  for (int k = 0; k < 3; ++k) phase_peak_[k] = std::max(phase_peak_[k], attempt_peak_[k]);
  supervisor_->observe_peak(step_ - 1, limit_ > 0 ? static_cast<double>(r.peak) / static_cast<double>(limit_) : 0.0,
                            [this] { mem_->release_cached(); },
                            [this]() -> std::string {
                              if (std::count(ckpt_layers_.begin(), ckpt_layers_.end(), false) > 0) {
                                const EstimateInput now = plan_now();
                                const int64_t saved = estimate_peak(now) - estimate_peak(with_every_saving(now));
                                if (saved > 0)
                                  return str_cat("gradient_checkpointing every layer would save about ",
                                                 format_bytes(saved), " by the estimate");
                              }
                              return "a smaller data.max_seq_length or per_device_train_batch_size would lower it";
                            });
  r.events = supervisor_->take_events();
  r.oom_recovery_seconds = supervisor_->recovery_seconds();
  if (r.skipped) r.events.push_back({step_ - 1, "skip", "inf/nan gradients"});
  ++steps_this_run_;
  tokens_this_run_ += r.tokens;
  result_.last_loss = r.loss;
  return r;
}

// The step's row of metrics.jsonl.
void Trainer::write_row(const StepRecord& r, double tokens_per_s) {
  json events = json::array();
  for (const auto& e : r.events) events.push_back(e.to_json());
  json row = {{"step", r.step},
              {"epoch", r.epoch},
              {"loss", r.loss},
              {"lr", r.lr},
              {"grad_norm", std::isfinite(r.grad_norm) ? json(r.grad_norm) : json(nullptr)},
              {"tokens", r.tokens},
              {"samples", r.samples},
              {"tokens_per_s", tokens_per_s},
              {"padding", r.positions ? static_cast<double>(r.padding) / static_cast<double>(r.positions) : 0.0},
              {"loss_scale", scaler_->scale()},
              {"micro_batch", r.micro_batch},
              {"accumulation", r.accumulation},
              {"memory", {{mem_->device(), {{"allocated", r.allocated}, {"peak", r.peak}, {"limit", limit_}}}}},
              {"events", events}};
  if (!r.sent_bytes.empty()) row["sent_bytes"] = r.sent_bytes;
  if (r.oom_recovery_seconds > 0) row["oom_recovery_s"] = r.oom_recovery_seconds;
  metrics_->write(row);
}

// metrics.jsonl every logging_steps, at the last step and whenever something happened; the
// progress line on a terminal (redrawn) or in the log.
void Trainer::log_step(const StepRecord& r) {
  const bool due = (log_every_ > 0 && (r.step % log_every_ == 0 || r.step == total_steps_)) ||
                   (r.step == 1 && c_.training.logging_first_step);
  const bool written = due || !r.events.empty();
  // logging_strategy: no writes no rows, but the progress line (transformers' progress bar) stays.
  const bool progress = written || (c_.training.logging_strategy == "no" &&
                                (tty_ || r.step % std::max<int64_t>(1, total_steps_ / 10) == 0 || r.step == total_steps_));
  if (!progress) return;
  const double tok_s = static_cast<double>(r.tokens) / std::max(1e-9, r.seconds);
  if (written) write_row(r, tok_s);
  const double eta = seconds_since(start_) / static_cast<double>(steps_this_run_) *
                     static_cast<double>(total_steps_ - r.step);
  const std::string line =
      fmt::format("step {}/{} {} eta {:.0f}s loss {:.4f} lr {:.2e} {:.0f} tok/s mem {} (peak {}) micro {}x{}", r.step,
                  total_steps_, progress_bar(r.step, total_steps_), eta, r.loss, r.lr, tok_s,
                  format_bytes(r.allocated), format_bytes(r.peak), r.micro_batch, r.accumulation);
  if (tty_) {
    std::fprintf(stderr, "\r%s\033[K", line.c_str());
    if (r.step == total_steps_) std::fprintf(stderr, "\n");
  }
  spdlog::get("memtune")->log(tty_ ? spdlog::level::debug : spdlog::level::info, "{}", line);
}

void Trainer::with_trainable_whole(const std::function<void()>& fn) {
  if (layer_shards_ && layer_shards_->trainable_tensors() > 0)
    layer_shards_->with_trainable_whole(0, fn);  // rank 0 writes
  else
    fn();
}

void Trainer::save_checkpoint() {
  // transformers' _save_checkpoint: the best evaluation's checkpoint is this one when it was
  // made at this step (evaluations run before the save of their step).
  if (best_step_ > 0 && best_step_ == step_) best_checkpoint_ = step_;
  saved_at_ = step_;  // on every rank: each decides alike whether a stop saves again
  // distributed.sharding: every rank writes its optimizer state's shard first.
  const int shards = sharding_->write_state_shard(out_dir_, step_, *optimizer_);
  // The trainable tensors whole on rank 0 (a sharded layer's gathered to its host memory).
  std::vector<std::pair<std::string, at::Tensor>> trainable = params_;
  with_trainable_whole([&] {
    if (writer_ && layer_shards_) trainable = bundle_.model->trainable_parameters();
  });
  if (!writer_) {  // distributed: rank 0 writes, the others wait for it
    pg_->barrier();
    return;
  }
  TrainState state;
  state.step = step_;
  state.sampler = sampler_->state();
  state.scaler = scaler_->state();
  state.supervisor = supervisor_->state();
  state.optimizer = optimizer_->state_scalars();
  state.checkpoint_layers = ckpt_layers_;
  state.activation_offload = offload_activations_;
  state.optimizer_offload = optimizer_offloaded();
  state.world_size = dist_.world_size;
  state.eval_due = eval_due_;
  state.total_steps = total_steps_;
  if (schedule_.kind == "reduce_lr_on_plateau") state.lr_scheduler = schedule_.plateau.state();
  state.best_metric = best_metric_;
  state.best_step = best_step_;
  state.best_checkpoint = best_checkpoint_;
  state.data_samples = train_set_->stats().samples;
  state.data_target_tokens = train_set_->stats().target_tokens;
  const auto whole_state = shards > 0 ? std::vector<std::pair<std::string, at::Tensor>>{} : optimizer_->state_tensors();
  const fs::path p = save_training_checkpoint(out_dir_, state, trainable, whole_state, cpu_rng_state(), config_yaml_,
                                              c_.training.save_total_limit, shards);
  result_.checkpoint = p.string();
  spdlog::info("checkpoint: {}", p.string());
  if (pg_) pg_->barrier();
}

bool Trainer::evaluate_loss(const char* when) {
  if (!eval_set_) return true;
  // A signal between the step and its evaluation stops it as one during it would: said in the
  // log either way (a rank descheduled there under load met it here).
  if (eval_stopped()) {
    spdlog::warn("eval ({}): stopped by signal {} before its first batch; not recorded", when, g_stop_signal.load());
    return false;
  }
  // Evaluation takes at most the micro-batch that training runs now (which fits with
  // gradients kept), and under the supervisor halves it after an out-of-memory error (before
  // the first step the supervisor has not settled yet), except with layers sharded over ranks,
  // whose forwards are collectives. Its loss is a sum over tokens: the batch changes only the
  // last bits (the padding, and so the kernels' order of summation), except over an LLM.int8
  // base, whose outlier columns are chosen over the rows of each batch (docs/quantization.md).
  const int64_t batch = std::min<int64_t>(c_.training.per_device_eval_batch_size,
                                          supervisor_ ? std::max<int64_t>(1, supervisor_->micro_batch()) : 1);
  std::function<bool()> on_oom;
  if (c_.memory.supervise && !layer_shards_) on_oom = [this] {
    mem_->release_cached();
    return true;
  };
  const EvalResult r = evaluate(*bundle_.model, *eval_set_, batch, -1, [this] { return eval_stopped(); }, on_oom,
                                c_.training.label_smoothing_factor);
  if (r.oom_retries > 0)
    spdlog::warn("eval ({}): out of memory at {} samples at once; ran {} micro-batch(es) again, ending at {}", when,
                 batch, r.oom_retries, r.micro_batch);
  if (r.stopped) {
    spdlog::warn("eval ({}): stopped by signal {} after {} tokens; not recorded", when, g_stop_signal.load(), r.tokens);
    return false;
  }
  spdlog::info("eval ({}): loss {:.4f}, perplexity {:.2f}, token accuracy {:.1f}%, {} tokens", when, r.loss,
               r.perplexity, 100.0 * r.token_accuracy, r.tokens);
  last_eval_ = r;
  metrics_->write({{"step", step_},
                   {"when", when},
                   {"eval_loss", r.loss},
                   {"eval_perplexity", r.perplexity},
                   {"eval_token_accuracy", r.token_accuracy},
                   {"eval_tokens", r.tokens}});
  return true;
}

void Trainer::evaluate_accuracy(const char* when) {
  if (c_.training.eval_accuracy_rows <= 0 || c_.data.eval_file.empty() || !bundle_.tokenizer || eval_stopped())
    return;
  spdlog::info("accuracy ({}): answering up to {} rows of {} by greedy generation", when,
               c_.training.eval_accuracy_rows, c_.data.eval_file);
  const AccuracyResult a = instruction_accuracy(*bundle_.model, *bundle_.tokenizer,
                                                data::ChatTemplate::of(c_.data.template_name, c_.data.chat_template),
                                                c_.data.eval_file, c_.training.eval_accuracy_rows, 12,
                                                [this] { return eval_stopped(); });
  if (a.stopped) {
    spdlog::warn("accuracy ({}): stopped by signal {} after {} rows; not recorded", when, g_stop_signal.load(),
                 a.total);
    return;
  }
  spdlog::info("accuracy ({}): {}", when, a.describe());
  metrics_->write({{"step", step_}, {"when", when}, {"accuracy", a.share()}, {"accuracy_rows", a.total}});
}

// The evaluation at step_; a stop that cuts it short leaves it due, for the checkpoint and the
// resume. distributed: the ranks then agree again, so that a signal that cut one rank's
// evaluation short stops every rank at this step (not at the next step's reduction), each
// with the evaluation due.
void Trainer::evaluate_periodic() {
  eval_due_ = !evaluate_loss("periodic");
  if (pg_) {
    const auto any = pg_->allreduce(std::vector<int64_t>{g_stop_signal.load() != 0, eval_due_}, ReduceOp::max);
    dist_stop_ = dist_stop_ || any[0] > 0;
    eval_due_ = any[1] > 0;
  }
  if (eval_due_ || best_metric_name(c_.training).empty()) return;
  const double metric = agreed_metric();
  track_best(metric);
  if (schedule_.kind == "reduce_lr_on_plateau") step_plateau(metric);
}

// The value the Trainer reads as metrics["eval_" + metric_for_best_model]. distributed: every
// rank evaluated the whole eval set; the ranks take one value (the largest, should their last
// bits differ).
double Trainer::agreed_metric() const {
  const std::string name = best_metric_name(c_.training);
  const double v = name == "perplexity" ? last_eval_.perplexity
                   : name == "token_accuracy" ? last_eval_.token_accuracy
                                              : last_eval_.loss;
  return pg_ ? pg_->allreduce(std::vector<double>{v}, ReduceOp::max)[0] : v;
}

// The Trainer's _determine_best_metric: strictly better than the best so far (the first
// evaluation always is). Its checkpoint is the one written at this step (save_checkpoint).
void Trainer::track_best(double metric) {
  const bool greater = best_is_greater(c_.training);
  if (best_metric_ && !(greater ? metric > *best_metric_ : metric < *best_metric_)) return;
  best_metric_ = metric;
  best_step_ = step_;
}

// The trainable tensors from a checkpoint's (every one present, of the model's shape).
void Trainer::copy_trainable(const std::map<std::string, at::Tensor>& from, const fs::path& dir) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    auto it = from.find(name);
    MEMTUNE_CHECK(it != from.end(), dir.string(), ": the checkpoint lacks trainable tensor '", name, "'");
    MEMTUNE_CHECK(it->second.sizes() == p.sizes(), dir.string(), ": '", name, "' has shape ", it->second.sizes(),
                  ", the model's is ", p.sizes());
    // A sharded layer's tensor: its owner's storage only (another rank's is a placeholder).
    if (layer_shards_ && layer_shards_->holds(p) && !sharding_->owned()[i]) continue;
    const_cast<at::Tensor&>(p).copy_(it->second);
  }
}

// transformers' _load_best_model at the end of train(): the best checkpoint's trainable
// tensors (its adapter, or its weights) replace the last step's, before the final evaluation
// and the saved adapter or model. distributed: every rank reads them (as a resume does).
void Trainer::load_best() {
  if (best_checkpoint_ <= 0) {
    spdlog::warn("training.load_best_model_at_end: no checkpoint was written at a best evaluation; the last step's "
                 "weights stay");
    return;
  }
  const std::string name = best_metric_name(c_.training);
  if (best_checkpoint_ == step_) {
    spdlog::info("load_best_model_at_end: the last step's evaluation is the best (eval_{} {:.6g}); its weights stay",
                 name, *best_metric_);
    return;
  }
  const fs::path dir = out_dir_ / "checkpoints" / str_cat("step-", best_checkpoint_);
  const TrainingCheckpoint ck = load_training_checkpoint(dir, [](const std::string&) { return false; });
  copy_trainable(ck.trainable, dir);
  spdlog::info("load_best_model_at_end: the trainable tensors of {} (eval_{} {:.6g}, the best of the run's "
               "evaluations) replace the last step's", dir.string(), name, *best_metric_);
}

// After the evaluation, as the Trainer's _evaluate steps ReduceLROnPlateau with
// metric_for_best_model's value (eval_loss by default); the next step takes the rate it leaves.
void Trainer::step_plateau(double metric) {
  Plateau& p = schedule_.plateau;
  const double before = p.lr;
  if (p.step(metric))
    spdlog::info("lr schedule reduce_lr_on_plateau: eval_{} {:.6g} is no better than {:.6g} for {} evaluations: "
                 "learning rate {:.6g} -> {:.6g}", best_metric_name(c_.training), metric, p.best, p.patience + 1,
                 before, p.lr);
}

// distributed: a rank stops only when the ranks agreed in this step's reduction, all at
// once (a rank that saw no signal itself stops as for SIGTERM).
int Trainer::stop_signal() const {
  const int sig = g_stop_signal.load();
  if (!pg_) return sig;
  return dist_stop_ ? (sig ? sig : SIGTERM) : 0;
}

TrainResult Trainer::stop(int sig) {
  if (tty_) std::fprintf(stderr, "\n");
  if (saved_at_ != step_) save_checkpoint();  // (the periodic save may have just written this step's)
  spdlog::warn("stopped by signal {} at step {}; resume with training.resume_from_checkpoint=latest", sig, step_);
  result_.steps = step_;
  result_.exit_code = 128 + sig;
  return result_;
}

// The last checkpoint, the final evaluations, the adapter or model, the memory report.
TrainResult Trainer::finish() {
  if (c_.training.save_strategy != "no") save_checkpoint();
  if (c_.training.load_best_model_at_end) load_best();
  evaluate_loss(kFinalEval);
  evaluate_accuracy(kFinalAccuracy);
  // Stopped during the final evaluations: the last checkpoint is saved; the adapter or
  // model is still written below (a moment's work), the remaining evaluation is skipped.
  if (int sig = g_stop_signal.load()) {
    spdlog::warn("stopped by signal {} during the final evaluation; it was skipped", sig);
    result_.exit_code = 128 + sig;
  }
  with_trainable_whole([&] {
    if (!writer_) {  // distributed: only rank 0 saves
    } else if (c_.training.finetune == "lora") {
      models::save_adapter(*bundle_.model, bundle_.adapter, out_dir_ / "adapter");
      spdlog::info("adapter (PEFT format): {}", (out_dir_ / "adapter").string());
    } else {
      models::save_hf_model(*bundle_.model, out_dir_ / "model", models::SaveOptions{});
      spdlog::info("model (Hugging Face format): {}", (out_dir_ / "model").string());
    }
  });
  const double elapsed = seconds_since(start_);
  std::string report = str_cat(
      "memtune memory report (", mem_->device(), ")\n", "limit:            ",
      limit_ ? format_bytes(limit_) : std::string("none"), "\n", "peak at load:     ", format_bytes(load_peak_), "\n",
      "peak in forward:  ", format_bytes(phase_peak_[0]), "\n", "peak in backward: ", format_bytes(phase_peak_[1]),
      "\n", "peak in optimizer: ", format_bytes(phase_peak_[2]), "\n", "final micro-batch: ",
      supervisor_->micro_batch(), " x ", supervisor_->accumulation(), "\n", "skipped steps (fp16 overflow): ",
      scaler_->skipped_steps(), "\n", "events:\n");
  for (const auto& h : supervisor_->history()) report += "  " + h + "\n";
  if (writer_) write_file_atomic(out_dir_ / "memory_report.txt", report);
  if (pg_) pg_->barrier();  // distributed: the others return once rank 0 has written everything
  spdlog::info("done: {} steps, last loss {:.4f}, {:.0f} tokens/s, peak memory {}", step_, result_.last_loss,
               static_cast<double>(tokens_this_run_) / std::max(1e-9, elapsed),
               format_bytes(std::max({phase_peak_[0], phase_peak_[1], phase_peak_[2], load_peak_})));
  result_.steps = step_;
  return result_;
}

}  // namespace

TrainResult train(const Config& config) { return Trainer(config).run(); }

}  // namespace memtune::trainer
