#include "trainer/schedule.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace memtune::trainer {

const std::vector<std::pair<std::string, std::vector<std::string>>>& schedule_kwargs() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kinds = {
      {"constant", {}},
      {"constant_with_warmup", {}},
      {"linear", {}},
      {"cosine", {"num_cycles"}},
      {"cosine_with_restarts", {"num_cycles"}},
      {"polynomial", {"lr_end", "power"}},
      {"inverse_sqrt", {"timescale"}},
      {"cosine_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate"}},
      {"cosine_warmup_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"}},
  };
  return kinds;
}

Schedule with_kwargs(Schedule s, const std::vector<std::pair<std::string, double>>& kwargs) {
  const auto& kinds = schedule_kwargs();
  const auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == s.kind; });
  MEMTUNE_CHECK(kind != kinds.end(), "training.lr_scheduler_type: unknown schedule '", s.kind, "'");
  std::optional<double> min_lr, min_lr_rate;
  for (const auto& [key, value] : kwargs) {
    const auto& takes = kind->second;
    std::string list;
    for (const auto& t : takes) list += (list.empty() ? "" : ", ") + t;
    MEMTUNE_CHECK(std::find(takes.begin(), takes.end(), key) != takes.end(), "training.lr_scheduler_kwargs.", key,
                  ": lr_scheduler_type ", s.kind, " takes ", list.empty() ? "no kwargs" : "only " + list,
                  " (transformers' schedule function would raise a TypeError)");
    MEMTUNE_CHECK(std::isfinite(value), "training.lr_scheduler_kwargs.", key, ": ", value, " is not a number");
    if (key == "num_cycles") {
      MEMTUNE_CHECK(value > 0, "training.lr_scheduler_kwargs.num_cycles: ", value, " must be > 0");
      s.num_cycles = value;
    } else if (key == "lr_end") {
      s.lr_end = value;
    } else if (key == "power") {
      s.power = value;
    } else if (key == "timescale") {
      MEMTUNE_CHECK(value > 0, "training.lr_scheduler_kwargs.timescale: ", value, " must be > 0");
      s.timescale = value;
    } else if (key == "min_lr") {
      min_lr = value;
    } else if (key == "min_lr_rate") {
      min_lr_rate = value;
    } else if (key == "warmup_lr_rate") {
      s.warmup_lr_rate = value;
    }
  }
  if (s.kind == "polynomial")
    MEMTUNE_CHECK(s.lr_end < s.learning_rate, "training.lr_scheduler_kwargs.lr_end: ", s.lr_end,
                  " must be below the learning rate (", s.learning_rate, "), as transformers requires");
  if (s.kind == "cosine_with_min_lr" || s.kind == "cosine_warmup_with_min_lr") {
    MEMTUNE_CHECK(!(min_lr && min_lr_rate), "training.lr_scheduler_kwargs: both min_lr and min_lr_rate are set; "
                                            "set one (transformers: only one of min_lr or min_lr_rate)");
    MEMTUNE_CHECK(min_lr || min_lr_rate, "training.lr_scheduler_type ", s.kind,
                  " needs lr_scheduler_kwargs min_lr or min_lr_rate, as transformers does");
    s.min_lr_rate = min_lr ? *min_lr / s.learning_rate : *min_lr_rate;
  }
  return s;
}

double Schedule::lr(int64_t step) const {
  // Each factor as transformers' lr_lambda computes it, in doubles, then learning_rate times it.
  const double s = static_cast<double>(step), warmup = static_cast<double>(warmup_steps);
  const double total = static_cast<double>(total_steps);
  if (kind == "constant") return learning_rate;
  if (kind == "cosine_warmup_with_min_lr") {
    double factor;
    if (s < warmup) {
      factor = warmup_lr_rate ? *warmup_lr_rate + (1.0 - *warmup_lr_rate) * s /
                                                      static_cast<double>(std::max<int64_t>(1, warmup_steps - 1))
                              : (s + 1.0) / std::max(1.0, warmup);
    } else {
      const double progress = (s - warmup + 1.0) / std::max(1.0, total - warmup);
      factor = 0.5 * (1.0 + std::cos(M_PI * num_cycles.value_or(0.5) * 2.0 * progress));
      factor = std::max(0.0, factor * (1 - min_lr_rate) + min_lr_rate);
    }
    return learning_rate * factor;
  }
  if (step < warmup_steps) return learning_rate * (s / static_cast<double>(std::max<int64_t>(1, warmup_steps)));
  if (kind == "constant_with_warmup") return learning_rate;
  if (kind == "inverse_sqrt") {
    const double t = timescale.value_or(warmup_steps > 0 ? warmup : 10000.0);
    return learning_rate * (1.0 / std::sqrt((s + (t - warmup)) / t));
  }
  if (kind == "polynomial") {
    if (step > total_steps) return learning_rate * (lr_end / learning_rate);
    const double remaining = 1 - (s - warmup) / (total - warmup);
    return learning_rate * (((learning_rate - lr_end) * std::pow(remaining, power) + lr_end) / learning_rate);
  }
  const double progress = (s - warmup) / static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  if (kind == "linear")
    return learning_rate * std::max(0.0, (total - s) / static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps)));
  if (kind == "cosine")
    return learning_rate * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * num_cycles.value_or(0.5) * 2.0 * progress)));
  if (kind == "cosine_with_restarts") {
    if (progress >= 1.0) return 0.0;
    return learning_rate *
           std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * std::fmod(num_cycles.value_or(1.0) * progress, 1.0))));
  }
  if (kind == "cosine_with_min_lr") {
    double factor = 0.5 * (1.0 + std::cos(M_PI * num_cycles.value_or(0.5) * 2.0 * progress));
    return learning_rate * std::max(0.0, factor * (1 - min_lr_rate) + min_lr_rate);
  }
  fail("training.lr_scheduler_type: unknown schedule '", kind, "'");
}

}  // namespace memtune::trainer
