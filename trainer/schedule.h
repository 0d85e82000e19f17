#pragma once
// Learning-rate schedules with Hugging Face's semantics (transformers' optimization.py):
// optimizer step k (0-based) uses learning_rate * lambda(k), lambda the schedule's factor as
// transformers computes it (so a LambdaLR over the same learning rate gives the same
// doubles); with warmup, lambda rises linearly from 0 (cosine_warmup_with_min_lr: from its
// warmup_lr_rate, or 1 / warmup_steps; warmup_stable_decay: from min_lr_ratio, in the shape
// of its warmup_type).
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace memtune::trainer {

// A value of lr_scheduler_kwargs: a number, or a name (warmup_stable_decay's warmup_type
// and decay_type, reduce_lr_on_plateau's mode and threshold_mode).
using ScheduleArg = std::variant<double, std::string>;
using ScheduleKwargs = std::vector<std::pair<std::string, ScheduleArg>>;

// reduce_lr_on_plateau: torch's ReduceLROnPlateau as transformers' Trainer steps it, once
// after each periodic evaluation with its eval_loss (metric_for_best_model's default), the
// learning rate in between what the last one left. Its settings (lr_scheduler_kwargs, torch's
// defaults) and its state, which a checkpoint keeps.
struct Plateau {
  std::string mode = "min", threshold_mode = "rel";  // min | max; rel | abs
  double factor = 0.1, threshold = 1e-4, min_lr = 0, eps = 1e-8;
  int64_t patience = 10, cooldown = 0;

  double lr = 0;       // the learning rate now
  double best = 0;     // the best metric so far; before the first, torch's mode_worse (+-inf)
  int64_t bad_evaluations = 0, cooldown_counter = 0, evaluations = 0;

  void start(double learning_rate);  // the state before any evaluation
  // One evaluation's metric, as torch's step(metrics); true where it lowered lr.
  bool step(double metric);
  nlohmann::json state() const;
  // The state `state()` wrote; throws UserError naming `origin` where a field is missing or
  // of another type.
  void restore(const nlohmann::json& state, const std::string& origin);
};

struct Schedule {
  // constant | constant_with_warmup | linear | cosine | cosine_with_restarts | polynomial |
  // inverse_sqrt | cosine_with_min_lr | cosine_warmup_with_min_lr | warmup_stable_decay |
  // reduce_lr_on_plateau
  std::string kind = "linear";
  double learning_rate = 2e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  // lr_scheduler_kwargs, as transformers' schedule functions take them.
  std::optional<double> num_cycles;       // cosine kinds: 0.5 (a half wave); cosine_with_restarts: 1
  double lr_end = 1e-7, power = 1.0;      // polynomial
  std::optional<double> timescale;        // inverse_sqrt: warmup_steps, or 10000 without warm-up
  double min_lr_rate = 0;                 // the *_min_lr kinds: min_lr / learning_rate, or min_lr_rate;
                                          // warmup_stable_decay: min_lr_ratio
  std::optional<double> warmup_lr_rate;   // cosine_warmup_with_min_lr
  // warmup_stable_decay (transformers' get_wsd_schedule): warm-up from min_lr_ratio, a stable
  // phase at the learning rate (num_stable_steps, or what warm-up and decay leave of the
  // steps: negative where they overlap, as transformers computes it), a decay of
  // num_decay_steps to min_lr_ratio, then min_lr_ratio.
  int64_t decay_steps = 0;
  std::optional<int64_t> stable_steps;
  std::string warmup_type = "linear", decay_type = "cosine";  // linear | cosine | 1-sqrt

  Plateau plateau;  // reduce_lr_on_plateau: lr(step) is its lr now

  // warmup_stable_decay's stable phase in steps, as transformers derives it.
  int64_t wsd_stable_steps() const { return stable_steps.value_or(total_steps - warmup_steps - decay_steps); }

  double lr(int64_t step) const;
};

// The schedule types and, for each, the lr_scheduler_kwargs its transformers function takes.
const std::vector<std::pair<std::string, std::vector<std::string>>>& schedule_kwargs();

// Why transformers would refuse lr_scheduler_kwargs entry `key: value` for schedule `kind` at
// `learning_rate` (a key its function does not take: a TypeError; lr_end not below the
// learning rate: a ValueError; a name where a number belongs, or the reverse), or "" where
// it takes it. An unknown kind: "".
std::string schedule_kwarg_error(const std::string& kind, const std::string& key, const ScheduleArg& value,
                                 double learning_rate);
// Why the kwargs `given` (their keys) would be refused as a whole for schedule `kind`: the
// *_min_lr kinds with both min_lr and min_lr_rate, or neither; warmup_stable_decay without
// num_decay_steps (transformers: a TypeError). "" where they are taken.
std::string missing_kwarg_error(const std::string& kind, const std::vector<std::string>& given);

// `schedule` with lr_scheduler_kwargs applied (min_lr becomes min_lr_rate, as transformers
// divides it by the learning rate). Throws UserError for a key the kind does not take, or
// values transformers refuses (both min_lr and min_lr_rate, neither for a *_min_lr kind,
// lr_end not below the learning rate, warmup_stable_decay without num_decay_steps).
Schedule with_kwargs(Schedule schedule, const ScheduleKwargs& kwargs);

// The text of a kwarg's value, for messages.
std::string arg_text(const ScheduleArg& value);

}  // namespace memtune::trainer
