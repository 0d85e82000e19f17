#include "runtime/supervisor.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <spdlog/spdlog.h>

#include "runtime/compat.h"
#include "runtime/json_input.h"

namespace memtune {

Supervisor::Supervisor(SupervisorOptions options)
    : options_(options), micro_(std::max<int64_t>(1, std::min(options.micro_batch, options.samples_per_step))),
      grow_wait_(options.grow_after_steps) {
  agree_ = [](bool oom, int64_t proposal) { return std::make_pair(oom, proposal); };
}

void Supervisor::set_fits(std::function<bool(int64_t)> fits) { fits_ = std::move(fits); }

void Supervisor::add_ladder_rung(std::string name, std::function<std::string()> rung,
                                 std::function<std::string()> undo, std::function<bool()> undo_fits) {
  ladder_.push_back({std::move(name), std::move(rung), std::move(undo), std::move(undo_fits)});
}

void Supervisor::record_rung(int64_t step, const std::string& name, const std::string& changed) {
  const auto it = std::find_if(ladder_.begin(), ladder_.end(), [&](const Rung& r) { return r.name == name; });
  MEMTUNE_INTERNAL_ASSERT(it != ladder_.end(), "record_rung: no rung named '", name, "'");
  taken_.push_back(static_cast<int>(it - ladder_.begin()));
  event(step, "ladder", name + ": " + changed);
}

bool Supervisor::grow_back(int64_t step) {
  // The latest one stays where it cannot be undone: so do those before it.
  if (taken_.empty() || !ladder_[taken_.back()].undo) return false;
  if (ladder_[taken_.back()].undo_fits && !ladder_[taken_.back()].undo_fits()) return false;
  const int index = taken_.back();
  const std::string what = ladder_[index].undo();
  if (what.empty()) {  // nothing of it left to revert
    taken_.pop_back();
    return grow_back(step);
  }
  taken_.pop_back();
  undone_ = index;
  event(step, "grow", ladder_[index].name + ": undid " + what + " after " + std::to_string(grow_wait_) +
                          " steps with headroom");
  return true;
}

void Supervisor::set_agreement(std::function<std::pair<bool, int64_t>(bool, int64_t)> agree) {
  agree_ = std::move(agree);
}

void Supervisor::set_first_rung(std::function<std::string()> first_rung) { first_rung_ = std::move(first_rung); }

void Supervisor::set_report(std::function<std::string()> report) { report_ = std::move(report); }

void Supervisor::event(int64_t step, std::string kind, std::string detail) {
  spdlog::log(kind == "warning" ? spdlog::level::warn : spdlog::level::info, "memory: step {}: {}: {}", step,
              kind, detail);
  history_.push_back("step " + std::to_string(step) + ": " + kind + ": " + detail);
  events_.push_back({step, std::move(kind), std::move(detail)});
}

std::vector<SupervisorEvent> Supervisor::take_events() {
  std::vector<SupervisorEvent> out;
  out.swap(events_);
  return out;
}

// One try of the step. Returns false after an out-of-memory error, with every tensor of
// the attempt released (the exception is gone before cleanup runs).
bool Supervisor::attempt(int64_t step, const StepStages& stages, std::string* what) {
  bool oom = false;
  auto guarded = [&](const std::function<void()>& stage) {
    if (oom) return;
    try {
      stage();
    } catch (const std::exception& e) {
      if (!compat::is_out_of_memory(e)) throw;
      if (!options_.enabled) {
        const std::string message = e.what();
        throw MemoryExhausted(str_cat("out of memory in step ", step, " at micro-batch ", micro_, ": ",
                                      message.substr(0, message.find('\n')),
                                      "\nmemory.supervise is false, so the step was not retried at a smaller "
                                      "micro-batch or with the ladder's savings. Hint: memory.supervise: true\n",
                                      report_ ? report_() : ""));
      }
      *what = e.what();
      oom = true;
    }
  };
  guarded([&] { stages.compute(micro_); });
  // Every rank learns whether any ran out before anyone enters a collective.
  auto [any_oom, proposal] = agree_(oom, micro_);
  oom = any_oom;
  if (!oom) {
    guarded(stages.prepare);
    std::tie(any_oom, proposal) = agree_(oom, micro_);
    oom = any_oom;
  }
  if (oom) {
    if (what->empty()) *what = "another rank ran out of memory";
    stages.cleanup();
    return false;
  }
  stages.apply();
  return true;
}

void Supervisor::shrink(int64_t step, const std::string& why) {
  // Rounded up, so no size is skipped that might fit (3 x 0.5 -> 2, not 1), and at least one less.
  int64_t next = std::min<int64_t>(micro_ - 1, static_cast<int64_t>(std::ceil(micro_ * options_.shrink_factor)));
  next = std::max<int64_t>(1, next);
  std::string chosen;
  if (fits_ && !fits_(micro_)) {
    // The memory model agrees the failed size does not fit: the largest it says does (8 -> 6
    // where the factor would give 4), or 1 and then the ladder.
    next = micro_ - 1;
    while (next > 1 && !fits_(next)) --next;
    chosen = ", the largest the memory model says fits";
  }
  const int64_t before = micro_;
  micro_ = next;
  event(step, "shrink", "micro-batch " + std::to_string(before) + " -> " + std::to_string(micro_) + chosen +
                            ", accumulation " + std::to_string(accumulation()) + " (" + why + ")");
}

void Supervisor::run_step(int64_t step, const StepStages& stages) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point first_oom;
  recovery_seconds_ = 0.0;
  for (int tries = 0;; ++tries) {
    std::string what;
    if (attempt(step, stages, &what)) {
      if (tries > 0) recovery_seconds_ = std::chrono::duration<double>(Clock::now() - first_oom).count();
      return;
    }
    if (tries == 0) first_oom = Clock::now();
    // Keep only the first line of the allocator's message in the event.
    std::string first_line = what.substr(0, what.find('\n'));
    event(step, "oom", first_line);
    if (undone_ >= 0) {
      // The undone rung was needed: take it again and wait twice as long before the next try.
      const Rung& r = ladder_[undone_];
      const std::string again = r.apply();
      if (!again.empty()) taken_.push_back(undone_);
      undone_ = -1;
      grow_wait_ *= 2;
      good_steps_ = 0;
      event(step, "grow_failed", r.name + " is needed (" + again + "); next try after " + std::to_string(grow_wait_) +
                                     " steps");
      continue;
    }
    if (grown_from_ > 0) {
      // The larger size failed: go back and wait twice as long before trying again.
      const int64_t larger = micro_;
      micro_ = grown_from_;
      grown_from_ = 0;
      grow_wait_ *= 2;
      good_steps_ = 0;
      event(step, "grow_failed", "micro-batch " + std::to_string(larger) + " does not fit; back to " +
                                     std::to_string(micro_) + ", next try after " + std::to_string(grow_wait_) +
                                     " steps");
      continue;
    }
    if (tries + 1 >= options_.max_retries)
      throw MemoryExhausted(str_cat("out of memory: step ", step, " failed ", tries + 1,
                                    " times (memory.on_oom.max_retries)\n", report_ ? report_() : ""));
    if (micro_ > 1 && options_.shrink) {
      shrink(step, "out of memory");
      good_steps_ = 0;
      continue;
    }
    // One rung, then more while the memory model says the plan still does not fit, from the
    // cheapest rung that it says fits alone where there is one.
    size_t first = 0;
    if (first_rung_) {
      const std::string name = first_rung_();
      for (size_t i = 0; i < ladder_.size(); ++i)
        if (ladder_[i].name == name) first = i;
      // Every rank takes the same rungs: the earliest any rank chose (each estimates its own
      // limit, which a fraction of a device's memory makes differ between devices).
      if (agree_) first = static_cast<size_t>(agree_(false, static_cast<int64_t>(first)).second);
    }
    std::string changed;
    bool climbed = false;
    for (size_t i = first; i < ladder_.size();) {
      changed = ladder_[i].apply();
      if (changed.empty()) {
        ++i;
        // The chosen rung and those after it had nothing left to give: the ones before it.
        if (i == ladder_.size() && !climbed && first > 0) i = first = 0;
        continue;
      }
      climbed = true;
      taken_.push_back(static_cast<int>(i));
      event(step, "ladder", ladder_[i].name + ": " + changed);
      if (!fits_ || fits_(micro_)) break;
    }
    if (climbed) changed = "climbed";
    if (changed.empty()) {
      std::string tried;
      for (const auto& h : history_) tried += "  " + h + "\n";
      throw MemoryExhausted(str_cat("out of memory at micro-batch ", micro_,
                                    " with every saving enabled that memory.on_oom.ladder allows (step ", step,
                                    ").\nWhat was tried:\n", tried, report_ ? report_() : ""));
    }
  }
}

void Supervisor::observe_peak(int64_t step, double peak, const std::function<void()>& release_cached,
                              const std::function<std::string()>& suggestion) {
  if (!options_.enabled || peak <= 0) return;
  grown_from_ = 0;  // the step completed at this size
  undone_ = -1;     // and without the rung a grow undid
  if (peak >= options_.emergency && micro_ > 1 && options_.shrink) {
    shrink(step, "peak " + std::to_string(static_cast<int>(peak * 100)) + "% of the limit, above the emergency threshold");
    good_steps_ = 0;
    return;
  }
  if (peak >= options_.critical) {
    release_cached();
    event(step, "release", "peak " + std::to_string(static_cast<int>(peak * 100)) +
                               "% of the limit: released cached memory");
  } else if (peak >= options_.warning) {
    std::string s = suggestion ? suggestion() : "";
    event(step, "warning", "peak " + std::to_string(static_cast<int>(peak * 100)) + "% of the limit" +
                               (s.empty() ? "" : "; " + s));
  }
  if (peak < options_.grow_threshold && (micro_ < options_.micro_batch || !taken_.empty())) {
    if (++good_steps_ >= grow_wait_ && grow_back(step)) {
      good_steps_ = 0;
    } else if (good_steps_ >= grow_wait_ && micro_ < options_.micro_batch) {
      const int64_t before = micro_;
      micro_ = std::min<int64_t>(options_.micro_batch,
                                 std::max<int64_t>(micro_ + 1, static_cast<int64_t>(std::ceil(micro_ / options_.shrink_factor))));
      grown_from_ = before;
      good_steps_ = 0;
      event(step, "grow", "micro-batch " + std::to_string(before) + " -> " + std::to_string(micro_) + " after " +
                              std::to_string(grow_wait_) + " steps with headroom");
    }
  } else {
    good_steps_ = 0;
  }
}

nlohmann::json Supervisor::state() const {
  return {{"micro_batch", micro_}, {"good_steps", good_steps_}, {"grow_wait", grow_wait_}, {"grown_from", grown_from_},
          {"taken", taken_}, {"undone", undone_}};
}

void Supervisor::load_state(const nlohmann::json& s) {
  constexpr int64_t kMax = int64_t{1} << 40;
  const int64_t per_step = options_.samples_per_step;
  // The configured micro-batch is the ceiling, as in a fresh run (a resume may lower it to
  // fit a smaller device; growing back never passes it).
  micro_ = std::min(json_int(s, "micro_batch", 1, per_step, "supervisor"), std::min(per_step, options_.micro_batch));
  good_steps_ = json_int(s, "good_steps", 0, kMax, "supervisor");
  grow_wait_ = json_int(s, "grow_wait", 1, kMax, "supervisor");
  grown_from_ = json_int(s, "grown_from", 0, per_step, "supervisor");
  if (grown_from_ >= micro_) grown_from_ = 0;  // the ceiling undid that growth
  taken_.clear();
  undone_ = -1;
  if (s.contains("taken")) {  // absent from checkpoints of earlier versions
    const auto& t = s["taken"];
    MEMTUNE_CHECK(t.is_array(), "supervisor.taken is ", t.dump(), "; expected a list of rung indices");
    for (const auto& v : t) {
      MEMTUNE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < static_cast<int64_t>(ladder_.size()),
                    "supervisor.taken holds ", v.dump(), "; expected rung indices below ", ladder_.size());
      taken_.push_back(v.get<int>());
    }
    undone_ = static_cast<int>(json_int(s, "undone", -1, static_cast<int64_t>(ladder_.size()) - 1, "supervisor"));
  }
}

}  // namespace memtune
