#pragma once
// Learning-rate schedules with Hugging Face's semantics (transformers' optimization.py):
// optimizer step k (0-based) uses learning_rate * lambda(k), lambda the schedule's factor as
// transformers computes it (so a LambdaLR over the same learning rate gives the same
// doubles); with warmup, lambda rises linearly from 0 (cosine_warmup_with_min_lr: from its
// warmup_lr_rate, or 1 / warmup_steps).
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memtune::trainer {

struct Schedule {
  // constant | constant_with_warmup | linear | cosine | cosine_with_restarts | polynomial |
  // inverse_sqrt | cosine_with_min_lr | cosine_warmup_with_min_lr
  std::string kind = "linear";
  double learning_rate = 2e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  // lr_scheduler_kwargs, as transformers' schedule functions take them.
  std::optional<double> num_cycles;       // cosine kinds: 0.5 (a half wave); cosine_with_restarts: 1
  double lr_end = 1e-7, power = 1.0;      // polynomial
  std::optional<double> timescale;        // inverse_sqrt: warmup_steps, or 10000 without warm-up
  double min_lr_rate = 0;                 // the *_min_lr kinds: min_lr / learning_rate, or min_lr_rate
  std::optional<double> warmup_lr_rate;   // cosine_warmup_with_min_lr

  double lr(int64_t step) const;
};

// The schedule types and, for each, the lr_scheduler_kwargs its transformers function takes.
const std::vector<std::pair<std::string, std::vector<std::string>>>& schedule_kwargs();

// Why transformers would refuse lr_scheduler_kwargs entry `key: value` for schedule `kind` at
// `learning_rate` (a key its function does not take: a TypeError; lr_end not below the
// learning rate: a ValueError), or "" where it takes it. An unknown kind: "".
std::string schedule_kwarg_error(const std::string& kind, const std::string& key, double value, double learning_rate);
// For the *_min_lr kinds: why min_lr / min_lr_rate as given would be refused (both set, or
// neither), or "".
std::string min_lr_error(const std::string& kind, bool min_lr, bool min_lr_rate);

// `schedule` with lr_scheduler_kwargs applied (min_lr becomes min_lr_rate, as transformers
// divides it by the learning rate). Throws UserError for a key the kind does not take, or
// values transformers refuses (both min_lr and min_lr_rate, neither for a *_min_lr kind,
// lr_end not below the learning rate).
Schedule with_kwargs(Schedule schedule, const std::vector<std::pair<std::string, double>>& kwargs);

}  // namespace memtune::trainer
