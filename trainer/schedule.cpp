#include "trainer/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/json_input.h"

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
      {"warmup_stable_decay",
       {"num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio", "num_cycles"}},
      {"reduce_lr_on_plateau",
       {"mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps"}},
  };
  return kinds;
}

std::string arg_text(const ScheduleArg& value) {
  if (const auto* name = std::get_if<std::string>(&value)) return *name;
  return str_cat(std::get<double>(value));
}

namespace {
// The names a kwarg takes, where it takes a name; empty for a number.
std::vector<std::string> names_of(const std::string& key) {
  if (key == "warmup_type" || key == "decay_type") return {"linear", "cosine", "1-sqrt"};
  if (key == "mode") return {"min", "max"};
  if (key == "threshold_mode") return {"rel", "abs"};
  return {};
}
bool is_count_kwarg(const std::string& key) {
  return key == "num_decay_steps" || key == "num_stable_steps" || key == "patience" || key == "cooldown";
}
}  // namespace

std::string schedule_kwarg_error(const std::string& kind, const std::string& key, const ScheduleArg& value,
                                 double learning_rate) {
  const auto& kinds = schedule_kwargs();
  const auto k = std::find_if(kinds.begin(), kinds.end(), [&](const auto& e) { return e.first == kind; });
  if (k == kinds.end()) return "";
  if (std::find(k->second.begin(), k->second.end(), key) == k->second.end()) {
    std::string takes;
    for (const auto& t : k->second) takes += (takes.empty() ? "" : ", ") + t;
    return "lr_scheduler_type " + kind + " takes " + (takes.empty() ? std::string("no kwargs") : "only " + takes) +
           " (transformers' schedule function would raise a TypeError)";
  }
  if (const std::vector<std::string> names = names_of(key); !names.empty()) {
    const auto* name = std::get_if<std::string>(&value);
    if (!name || std::find(names.begin(), names.end(), *name) == names.end()) {
      std::string list;
      for (size_t i = 0; i < names.size(); ++i) list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
      return "expected " + list + ", as " +
             (kind == "reduce_lr_on_plateau" ? "torch's ReduceLROnPlateau" : "transformers' get_wsd_schedule");
    }
    return "";
  }
  if (!std::holds_alternative<double>(value)) return "expected a number";
  const double x = std::get<double>(value);
  const bool positive = key == "num_cycles" || key == "timescale";
  if (!std::isfinite(x) || (positive && x <= 0)) return "must be a number" + std::string(positive ? " > 0" : "");
  if (is_count_kwarg(key) && !(x >= 0 && x == std::floor(x) && x < 1e15))
    return key == "patience" || key == "cooldown" ? "must be a whole number of evaluations >= 0"
                                                  : "must be a whole number of steps >= 0";
  if (kind == "reduce_lr_on_plateau" && key == "factor" && !(x > 0 && x < 1))
    return "must be in (0, 1): the learning rate's share after a plateau (torch refuses 1 and above)";
  if (kind == "reduce_lr_on_plateau" && (key == "min_lr" || key == "eps") && x < 0) return "must be >= 0";
  if (key == "min_lr_ratio" && !(x >= 0 && x <= 1))
    return "must be in [0, 1]: the share of the learning rate the warm-up starts from and the decay ends at";
  if (key == "lr_end" && !(x < learning_rate))
    return str_cat("must be below the learning rate (", learning_rate, "), as transformers requires");
  return "";
}

std::string missing_kwarg_error(const std::string& kind, const std::vector<std::string>& given) {
  const auto has = [&](const char* key) { return std::find(given.begin(), given.end(), key) != given.end(); };
  if (kind == "warmup_stable_decay" && !has("num_decay_steps"))
    return "needs lr_scheduler_kwargs num_decay_steps (the steps of its decay), as transformers' get_wsd_schedule "
           "does; e.g. lr_scheduler_kwargs: {num_decay_steps: 100}";
  if (kind != "cosine_with_min_lr" && kind != "cosine_warmup_with_min_lr") return "";
  if (has("min_lr") && has("min_lr_rate"))
    return "sets both min_lr and min_lr_rate; set one (transformers: only one of min_lr or min_lr_rate)";
  if (!has("min_lr") && !has("min_lr_rate"))
    return "needs lr_scheduler_kwargs min_lr or min_lr_rate (the learning rate it ends at), as transformers does; "
           "e.g. lr_scheduler_kwargs: {min_lr_rate: 0.1}";
  return "";
}

Schedule with_kwargs(Schedule s, const ScheduleKwargs& kwargs) {
  const auto& kinds = schedule_kwargs();
  MEMTUNE_CHECK(std::any_of(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == s.kind; }),
                "training.lr_scheduler_type: unknown schedule '", s.kind, "'");
  std::optional<double> min_lr, min_lr_rate;
  std::vector<std::string> given;
  for (const auto& [key, arg] : kwargs) {
    const std::string error = schedule_kwarg_error(s.kind, key, arg, s.learning_rate);
    MEMTUNE_CHECK(error.empty(), "training.lr_scheduler_kwargs.", key, ": ", arg_text(arg), ": ", error);
    given.push_back(key);
    if (!names_of(key).empty()) {
      const std::string& name = std::get<std::string>(arg);
      if (key == "warmup_type") s.warmup_type = name;
      else if (key == "decay_type") s.decay_type = name;
      else if (key == "mode") s.plateau.mode = name;
      else if (key == "threshold_mode") s.plateau.threshold_mode = name;
      continue;
    }
    const double value = std::get<double>(arg);
    if (s.kind == "reduce_lr_on_plateau") {
      if (key == "factor") s.plateau.factor = value;
      else if (key == "patience") s.plateau.patience = static_cast<int64_t>(value);
      else if (key == "threshold") s.plateau.threshold = value;
      else if (key == "cooldown") s.plateau.cooldown = static_cast<int64_t>(value);
      else if (key == "min_lr") s.plateau.min_lr = value;
      else if (key == "eps") s.plateau.eps = value;
      continue;
    }
    if (key == "num_cycles") s.num_cycles = value;
    else if (key == "lr_end") s.lr_end = value;
    else if (key == "power") s.power = value;
    else if (key == "timescale") s.timescale = value;
    else if (key == "min_lr") min_lr = value;
    else if (key == "min_lr_rate" || key == "min_lr_ratio") min_lr_rate = value;
    else if (key == "warmup_lr_rate") s.warmup_lr_rate = value;
    else if (key == "num_decay_steps") s.decay_steps = static_cast<int64_t>(value);
    else if (key == "num_stable_steps") s.stable_steps = static_cast<int64_t>(value);
  }
  const std::string error = missing_kwarg_error(s.kind, given);
  MEMTUNE_CHECK(error.empty(), "training.lr_scheduler_kwargs: ", error);
  if (min_lr || min_lr_rate) s.min_lr_rate = min_lr ? *min_lr / s.learning_rate : *min_lr_rate;
  s.plateau.start(s.learning_rate);
  return s;
}

void Plateau::start(double learning_rate) {
  lr = learning_rate;
  best = mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  bad_evaluations = cooldown_counter = evaluations = 0;
}

// torch's step, _is_better and _reduce_lr, in the same doubles.
bool Plateau::step(double metric) {
  ++evaluations;
  const bool better = mode == "min" ? (threshold_mode == "rel" ? metric < best * (1.0 - threshold)
                                                                : metric < best - threshold)
                                    : (threshold_mode == "rel" ? metric > best * (threshold + 1.0)
                                                                : metric > best + threshold);
  if (better) {
    best = metric;
    bad_evaluations = 0;
  } else {
    ++bad_evaluations;
  }
  if (cooldown_counter > 0) {
    --cooldown_counter;
    bad_evaluations = 0;  // bad evaluations in cooldown do not count
  }
  if (bad_evaluations <= patience) return false;
  cooldown_counter = cooldown;
  bad_evaluations = 0;
  const double lowered = std::max(lr * factor, min_lr);
  if (!(lr - lowered > eps)) return false;
  lr = lowered;
  return true;
}

nlohmann::json Plateau::state() const {
  // JSON has no infinity: before any evaluation best is torch's mode_worse, and a metric of
  // inf may become it; written "inf" / "-inf".
  return {{"lr", lr},
          {"best", std::isfinite(best) ? nlohmann::json(best) : nlohmann::json(best > 0 ? "inf" : "-inf")},
          {"bad_evaluations", bad_evaluations},
          {"cooldown_counter", cooldown_counter},
          {"evaluations", evaluations}};
}

void Plateau::restore(const nlohmann::json& j, const std::string& origin) {
  const std::string where = origin + ".lr_scheduler";
  MEMTUNE_CHECK(j.is_object(), where, " is ", j.dump(), "; expected reduce_lr_on_plateau's state");
  const nlohmann::json& l = json_field(j, "lr", where);
  MEMTUNE_CHECK(l.is_number() && std::isfinite(l.get<double>()) && l.get<double>() >= 0, where, ".lr is ", l.dump(),
                "; expected a learning rate");
  const nlohmann::json& b = json_field(j, "best", where);
  MEMTUNE_CHECK(b.is_number() || b == "inf" || b == "-inf", where, ".best is ", b.dump(),
                "; expected a number, \"inf\" or \"-inf\"");
  start(l.get<double>());
  best = b.is_number() ? b.get<double>()
                       : (b == "inf" ? 1.0 : -1.0) * std::numeric_limits<double>::infinity();
  bad_evaluations = json_int(j, "bad_evaluations", 0, int64_t{1} << 53, where);
  cooldown_counter = json_int(j, "cooldown_counter", 0, int64_t{1} << 53, where);
  evaluations = json_int(j, "evaluations", 0, int64_t{1} << 53, where);
}

namespace {
// get_wsd_schedule's factor at `step`, as transformers' _get_wsd_scheduler_lambda computes it.
double wsd_factor(const Schedule& s, int64_t step) {
  const int64_t warmup = s.warmup_steps, stable = s.wsd_stable_steps(), decay = s.decay_steps;
  const double floor = s.min_lr_rate;
  if (step < warmup) {
    const double progress = static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
    const double factor = s.warmup_type == "linear"   ? progress
                          : s.warmup_type == "cosine" ? 0.5 * (1.0 - std::cos(M_PI * progress))
                                                      : 1.0 - std::sqrt(1.0 - progress);  // 1-sqrt
    return std::max(0.0, factor * (1.0 - floor) + floor);
  }
  if (step < warmup + stable) return 1.0;
  if (step < warmup + stable + decay) {
    const double progress =
        static_cast<double>(step - warmup - stable) / static_cast<double>(std::max<int64_t>(1, decay));
    const double factor = s.decay_type == "linear" ? 1.0 - progress
                          : s.decay_type == "cosine"
                              ? 0.5 * (1.0 + std::cos(M_PI * s.num_cycles.value_or(0.5) * 2.0 * progress))
                              : 1.0 - std::sqrt(progress);  // 1-sqrt
    return std::max(0.0, factor * (1.0 - floor) + floor);
  }
  return floor;
}
}  // namespace

double Schedule::lr(int64_t step) const {
  // Each factor as transformers' lr_lambda computes it, in doubles, then learning_rate times it.
  const double s = static_cast<double>(step), warmup = static_cast<double>(warmup_steps);
  const double total = static_cast<double>(total_steps);
  if (kind == "constant") return learning_rate;
  if (kind == "warmup_stable_decay") return learning_rate * wsd_factor(*this, step);
  if (kind == "reduce_lr_on_plateau") return plateau.lr;
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
