// memtune estimate CONFIG [--device-memory SIZE] [--nproc N] [--plan] [--json] [key=value ...]:
// the memory plan of a training step (weights by storage, LoRA, gradients, optimizer states,
// activations per layer, loss, workspace), the predicted peak, and the largest micro-batch
// and sequence length that fit the device; with --nproc, per rank of N, and the optimizer
// state, gradients and peak of each distributed.sharding level. With --plan, instead, the
// fastest configurations that fit the device and keep the effective batch (trainer/plan.h),
// as overrides to paste.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/nf4.h"
#include "runtime/units.h"
#include "tools/commands.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/model_setup.h"
#include "trainer/plan.h"
#include "trainer/trainer.h"

namespace memtune::cli {

using trainer::Estimate;
using trainer::EstimateInput;
using trainer::estimate_memory;
using trainer::estimate_peak;
using trainer::max_micro_batch;
using trainer::max_seq_length;

namespace {

// The training set's stats, loaded as the trainer loads it (the same tokenization cache), so
// the estimate is bounded by the real data (trainer::fit_to_data). None when data.train_file
// is unset or missing, or `skip`; `note` says which data the estimate assumed.
std::optional<data::DatasetStats> training_data(const trainer::Config& c, const models::ModelSpec& spec, bool skip,
                                                std::string* note) {
  const std::string& file = c.data.train_file;
  if (skip || file.empty() || !std::filesystem::exists(file)) {
    *note = str_cat("rows of data.max_seq_length (", c.data.max_seq_length, "), every position trained (",
                    skip ? "--no-data" : file.empty() ? "no data.train_file" : "data.train_file " + file + " not found",
                    ")");
    return std::nullopt;
  }
  const std::unique_ptr<data::Tokenizer> tokenizer = trainer::load_tokenizer(c.model);
  // The loader's progress lines would land in the middle of the estimate (and --json's
  // object): its warnings (truncated or skipped records) still show; the note says the rest.
  struct WarningsOnly {
    spdlog::level::level_enum was = spdlog::get_level();
    WarningsOnly() { spdlog::set_level(std::max(was, spdlog::level::warn)); }
    ~WarningsOnly() { spdlog::set_level(was); }
  } quiet;
  data::DatasetOptions options = trainer::dataset_options(c.data, c.training.output_dir);
  options.vocab_size = spec.vocab_size;  // as training checks it
  options.hold_out = trainer::eval_split_side(c, false);  // what trains
  const data::Dataset set(file, tokenizer.get(), options);
  const data::DatasetStats& s = set.stats();
  *note = str_cat(file, ": ", s.samples, " samples, the longest ", s.longest_sample, " tokens, at most ",
                  s.most_sample_targets, " trained");
  return s;
}

// How many plans that fit --plan shows.
constexpr size_t kPlansShown = 3;

// An override as a shell takes it: quoted when YAML's flow map needs its spaces.
std::string shell_word(const std::string& s) {
  return s.find_first_of(" {}") == std::string::npos ? s : "'" + s + "'";
}

std::string override_line(const std::vector<std::string>& overrides) {
  if (overrides.empty()) return "(as configured)";
  std::string line;
  for (const auto& o : overrides) line += (line.empty() ? "" : " ") + shell_word(o);
  return line;
}

nlohmann::json plan_json(const trainer::Config& c, const trainer::Plan& p, int64_t budget) {
  nlohmann::json checkpointing = {{"policy", p.checkpointing.policy}};
  if (p.checkpointing.policy == "every_n") checkpointing["n"] = p.checkpointing.n;
  return {{"fits", p.peak_bytes <= budget},
          {"peak_bytes", p.peak_bytes},
          {"relative_step_time", p.relative_time},
          {"overrides", trainer::plan_overrides(c, p)},
          {"configured", p.configured},
          {"per_device_train_batch_size", p.micro_batch},
          {"gradient_accumulation_steps", p.accumulation},
          {"gradient_checkpointing", checkpointing},
          {"activation_offload", p.activation_offload ? "checkpoints" : "false"},
          {"optimizer_offload", p.optimizer_offload ? "cpu" : "none"}};
}

// --plan: the best plans that fit `budget`, or the smallest one when none does (exit 0, as
// the estimate of a run that does not fit).
void print_plans(const trainer::Config& c, const models::ModelSpec& spec, int64_t world_size,
                 const data::DatasetStats* data, int64_t budget, const std::string& budget_from, bool json) {
  const std::vector<trainer::Plan> all = trainer::candidate_plans(c, spec, world_size, data);
  std::vector<trainer::Plan> fit = trainer::fitting_plans(all, budget);
  const size_t fitting = static_cast<size_t>(
      std::count_if(all.begin(), all.end(), [&](const trainer::Plan& p) { return p.peak_bytes <= budget; }));
  if (fit.size() > kPlansShown) fit.resize(kPlansShown);
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : fit) out.push_back(plan_json(c, p, budget));
    if (fit.empty()) out.push_back(plan_json(c, trainer::smallest_plan(all), budget));
    std::cout << out.dump(2) << "\n";
    return;
  }
  const int64_t effective = int64_t{c.training.per_device_train_batch_size} * c.training.gradient_accumulation_steps;
  std::printf("plans for %s (%s), keeping %lld samples per step%s (micro-batch x accumulation), fastest first:\n",
              format_bytes(budget).c_str(), budget_from.c_str(), static_cast<long long>(effective),
              world_size > 1 ? " per rank" : "");
  if (fit.empty()) {
    const trainer::Plan& p = trainer::smallest_plan(all);
    std::printf("no plan fits: the smallest needs %s (step time %.3fx the configured run's):\n  %s\n",
                format_bytes(p.peak_bytes).c_str(), p.relative_time, override_line(trainer::plan_overrides(c, p)).c_str());
  }
  for (size_t i = 0; i < fit.size(); ++i)
    std::printf("%zu. predicted peak %s, step time %.3fx the configured run's\n   %s\n", i + 1,
                format_bytes(fit[i].peak_bytes).c_str(), fit[i].relative_time,
                override_line(trainer::plan_overrides(c, fit[i])).c_str());
  const trainer::PlanCostModel m = trainer::plan_cost_model(c);
  std::printf("%zu of %zu candidates fit; step times by the %s cost model (trainer/plan.cpp: %g TFLOP/s, "
              "%g tokens of work per micro-batch, host copies at %g GB/s, a checkpointed layer's forward again)\n",
              fitting, all.size(), m.name.c_str(), m.flops_per_second / 1e12, m.micro_batch_overhead,
              m.host_bytes_per_second / 1e9);
}

// What the supervisor settles on by the estimate (trainer::ladder_plan): the steps, and the
// plan they leave, in the fields a run's checkpoint and metrics.jsonl report.
nlohmann::json ladder_json(const trainer::LadderPlan& p) {
  const EstimateInput& in = p.settled;
  return {{"steps", p.steps},
          {"peak_bytes", p.peak_bytes},
          {"fits", p.fits},
          {"micro_batch", in.micro_batch},
          {"checkpoint_layers", in.checkpoint_layers},
          {"activation_offload", in.offload_activations},
          {"optimizer_offload", in.optimizer_paged},
          {"offloaded_layers", std::count(in.offloaded_layers.begin(), in.offloaded_layers.end(), true)}};
}

}  // namespace

void add_estimate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("estimate",
                                "predict a training run's peak memory and what fits the device; with --plan, the "
                                "fastest configurations that fit");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    std::string device_memory;
    bool json = false;
    bool plan = false;
    bool no_data = false;
    int64_t nproc = 1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("config", a->config, "the YAML config (see configs/)")->required();
  cmd->add_option("overrides", a->overrides, "key=value overrides, as for train");
  cmd->add_option("--device-memory", a->device_memory,
                  "device size to fit (e.g. 6GiB); default memory.device_limit, else the device's total");
  cmd->add_flag("--json", a->json, "one JSON object instead of a table (with --plan, an array of plans)");
  cmd->add_flag("--plan", a->plan,
                "the fastest configurations that fit the device and keep the effective batch (micro-batch, "
                "accumulation, checkpointing, activation and optimizer offload), as overrides to paste, with their "
                "predicted peak and step time relative to the configured run");
  cmd->add_flag("--no-data", a->no_data,
                "do not read data.train_file: estimate rows of data.max_seq_length with every position trained (a "
                "bound; by default the data's longest sample and most trained tokens per sample bound the rows)");
  cmd->add_option("--nproc", a->nproc,
                  "data-parallel ranks (memtune launch --nproc-per-node): per-rank figures under distributed.sharding, "
                  "and a line per sharding level");
  cmd->callback([a] {
    const trainer::Config c = trainer::load_config(a->config, a->overrides);
    const models::ModelSpec spec = trainer::model_spec(c);
    MEMTUNE_CHECK(a->nproc >= 1, "memtune estimate: --nproc ", a->nproc, " must be at least 1 (ranks)");
    std::string data_note;
    const std::optional<data::DatasetStats> data = training_data(c, spec, a->no_data, &data_note);
    EstimateInput in = trainer::estimate_input(c, spec);
    if (data) in = trainer::fit_to_data(in, *data);
    in.world_size = a->nproc;
    const Estimate e = estimate_memory(in);
    // Per rank, each sharding level at this size.
    struct Level {
      std::string name;
      Estimate e;
    };
    std::vector<Level> levels;
    for (const char* level : {"none", "optimizer", "gradients", "full"}) {
      EstimateInput l = in;
      l.sharding = level;
      levels.push_back({level, estimate_memory(l)});
    }

    const int64_t total = memory_backend(trainer::resolve_device(c.runtime.device)).stats().total;
    int64_t budget = total;
    std::string budget_from = "the device's total";
    if (!a->device_memory.empty()) {
      budget = parse_size(a->device_memory, "--device-memory").resolve(total);
      budget_from = "--device-memory";
    } else if (c.memory.device_limit.is_set()) {
      budget = c.memory.device_limit.resolve(total);
      budget_from = "memory.device_limit";
    }
    if (a->plan) return print_plans(c, spec, a->nproc, data ? &*data : nullptr, budget, budget_from, a->json);
    const int64_t max_mb = max_micro_batch(in, budget);
    const int64_t max_t = max_seq_length(in, budget);
    const bool is_auto = c.training.per_device_train_batch_size == trainer::TrainingConfig::kAuto;
    const int64_t auto_mb = is_auto ? trainer::auto_micro_batch(c, in, budget, int64_t{1} << 20) : 0;
    const trainer::LadderPlan ladder = trainer::ladder_plan(c, in, budget, a->nproc);
    const int64_t min_peak = estimate_peak(trainer::with_every_saving([&] {
      EstimateInput one = in;
      one.micro_batch = 1;
      return one;
    }()));

    if (a->json) {
      nlohmann::json components = nlohmann::json::array();
      for (const auto& k : e.components) components.push_back({{"name", k.name}, {"bytes", k.bytes}, {"note", k.note}});
      nlohmann::json j = {{"model", c.model.name_or_path},
                          {"micro_batch", in.micro_batch},
                          {"seq_length", in.seq_length},
                          {"max_sample_targets", in.max_sample_targets},
                          {"data", data_note},
                          {"peak_bytes", e.peak_bytes},
                          {"forward_peak_bytes", e.forward_peak},
                          {"backward_peak_bytes", e.backward_peak},
                          {"optimizer_peak_bytes", e.optimizer_peak},
                          {"minimum_peak_bytes", min_peak},
                          {"ladder", ladder_json(ladder)},
                          {"budget_bytes", budget},
                          {"budget_from", budget_from},
                          {"fits", e.peak_bytes <= budget},
                          {"max_micro_batch", max_mb},
                          {"max_seq_length", max_t},
                          {"trainable_parameters", e.trainable_parameters},
                          {"auto_micro_batch", is_auto ? nlohmann::json(auto_mb) : nlohmann::json(nullptr)},
                          {"activations_per_layer", e.activations_per_layer},
                          {"components", components},
                          {"world_size", in.world_size},
                          {"sharding", in.sharding}};
      for (const auto& l : levels)
        j["sharding_levels"].push_back({{"level", l.name},
                                        {"weights", l.e.weights_quantized + l.e.weights_dense},
                                        {"layers_sharded_from", l.e.layers_sharded_from},
                                        {"gathered_layer", l.e.gathered_layer},
                                        {"optimizer_states", l.e.optimizer_states},
                                        {"gradients", l.e.gradients},
                                        {"gradients_after_reduce", l.e.gradients_after_reduce},
                                        {"sharding_buffer", l.e.sharding_buffer},
                                        {"allreduce_buffers", l.e.allreduce_buffers},
                                        {"peak_bytes", l.e.peak_bytes}});
      std::cout << j.dump(2) << "\n";
      return;
    }
    std::printf("memory estimate: %s, micro-batch %lld x %lld tokens, finetune %s%s\n", c.model.name_or_path.c_str(),
                static_cast<long long>(in.micro_batch), static_cast<long long>(in.seq_length), in.finetune.c_str(),
                in.load_in_4bit ? str_cat(", ", quant_type_label(in.quant_type), " base").c_str() : "");
    std::printf("data: %s\n", data_note.c_str());
    for (const auto& k : e.components)
      std::printf("  %-38s %12s  %s\n", k.name.c_str(), format_bytes(k.bytes).c_str(), k.note.c_str());
    std::printf("  %-38s %12s\n", "peak in forward", format_bytes(e.forward_peak).c_str());
    std::printf("  %-38s %12s\n", "peak in backward", format_bytes(e.backward_peak).c_str());
    std::printf("  %-38s %12s\n", "peak in optimizer", format_bytes(e.optimizer_peak).c_str());
    std::printf("predicted peak: %s (%s)\n", format_bytes(e.peak_bytes).c_str(),
                e.peak_bytes <= budget ? "fits" : "does NOT fit");
    std::printf("device memory: %s (%s)\n", format_bytes(budget).c_str(), budget_from.c_str());
    std::printf("largest micro-batch that fits: %lld (at %lld tokens)\n", static_cast<long long>(max_mb),
                static_cast<long long>(in.seq_length));
    std::printf("longest sequence that fits: %lld (at micro-batch %lld)\n", static_cast<long long>(max_t),
                static_cast<long long>(in.micro_batch));
    std::printf("with every layer checkpointed at micro-batch 1: %s\n", format_bytes(min_peak).c_str());
    if (!ladder.steps.empty())
      std::printf("memtune train's supervisor, by this estimate (memory.on_oom.ladder): %s\n",
                  trainer::describe(ladder).c_str());
    if (in.world_size > 1) {
      std::printf("per rank of %lld (distributed.sharding; the update holds the gradients after reduction):\n",
                  static_cast<long long>(in.world_size));
      std::printf("  %-10s %16s %16s %16s %16s %16s\n", "level", "weights", "optimizer state", "gradients",
                  "in the update", "predicted peak");
      for (const auto& l : levels)
        std::printf("  %-10s %16s %16s %16s %16s %16s%s\n", l.name.c_str(),
                    format_bytes(l.e.weights_quantized + l.e.weights_dense + l.e.gathered_layer).c_str(),
                    format_bytes(l.e.optimizer_states).c_str(), format_bytes(l.e.gradients).c_str(),
                    format_bytes(l.e.gradients_after_reduce).c_str(), format_bytes(l.e.peak_bytes).c_str(),
                    l.name == in.sharding ? "  (configured)" : "");
    }
    if (is_auto)
      std::printf("per_device_train_batch_size: auto starts at %lld (under %.0f%% of the device)\n",
                  static_cast<long long>(auto_mb), 100 * c.memory.warning_threshold);
  });
}

}  // namespace memtune::cli
