#pragma once
// The memory supervisor. The effective batch is the unit of the math; the micro-batch is an
// execution detail the supervisor may change at any moment without changing the math. A
// step owns a fixed set of samples; the supervisor runs them as micro-batches; when memory
// runs out anywhere in the step, the step's gradients are dropped, the micro-batch is made
// smaller (accumulation larger) and the same samples run again. Once the micro-batch is 1,
// a ladder of further savings is tried (checkpoint more layers, activation offload, optimizer
// offload, offload layers), then the run stops with a report. After a run of steps with
// headroom it grows back: the rungs undone in reverse, then the micro-batch.
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace memtune {

struct SupervisorOptions {
  bool enabled = true;            // false: an out-of-memory error stops the run (MemoryExhausted)
  int64_t samples_per_step = 1;   // per rank: micro_batch x accumulation
  int64_t micro_batch = 1;        // the configured (largest) micro-batch
  double shrink_factor = 0.5;
  bool shrink = true;             // false: the micro-batch stays; an out-of-memory error climbs the ladder
  int max_retries = 16;
  int64_t grow_after_steps = 50;
  double grow_threshold = 0.6;    // peak share of the limit that counts as headroom
  double warning = 0.85, critical = 0.90, emergency = 0.95;
};

struct SupervisorEvent {
  int64_t step = 0;
  std::string kind;    // oom, shrink, grow, grow_failed, ladder, release, warning, emergency
  std::string detail;
  nlohmann::json to_json() const { return {{"step", step}, {"kind", kind}, {"detail", detail}}; }
};

// One step, in the stages the supervisor needs to keep several ranks in agreement.
struct StepStages {
  std::function<void(int64_t micro_batch)> compute;  // forward + backward of the step's samples; may run out of memory
  std::function<void()> prepare;                     // reduce gradients, clip, check; changes no parameter
  std::function<void()> apply;                       // the update itself; allocates nothing
  std::function<void()> cleanup;                     // after an OOM: drop gradients, release cached memory
};

// Thrown when even micro-batch 1 with every rung of the ladder does not fit.
class MemoryExhausted : public UserError {
 public:
  using UserError::UserError;
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);

  int64_t micro_batch() const { return micro_; }
  int64_t accumulation() const { return (options_.samples_per_step + micro_ - 1) / micro_; }

  // A rung of the ladder, tried in the order added once the micro-batch is 1. It returns
  // what it changed ("checkpointing layer 3"), or "" when it has nothing left to give.
  // `undo` (optional) reverts its latest change and says what it reverted: after a run of
  // steps with headroom the supervisor grows back by undoing the rungs in the reverse order
  // they were taken, then by growing the micro-batch. A rung without one stays taken.
  // `undo_fits` (optional): whether the memory model says the plan fits without the rung's
  // latest change. An undo that allocates (state or weights back on the device) runs between
  // steps, where running out of memory ends the run: where it says no, the rung stays, and
  // so do those taken before it.
  void add_ladder_rung(std::string name, std::function<std::string()> rung,
                       std::function<std::string()> undo = nullptr, std::function<bool()> undo_fits = nullptr);
  // A rung the caller took itself before the first step (the memory model said the run
  // cannot start without it): recorded as taken at `step`, with a ladder event, as if
  // climbed after an out-of-memory error. `name` is a rung's name as added.
  void record_rung(int64_t step, const std::string& name, const std::string& changed);
  // Agreement across ranks: given this rank's (out_of_memory, proposed micro-batch), returns
  // (any rank out of memory, smallest proposal). Single process: the identity.
  void set_agreement(std::function<std::pair<bool, int64_t>(bool, int64_t)> agree);
  // What to say when the run stops (the estimate, what would fit).
  void set_report(std::function<std::string()> report);
  // The memory model's verdict on the plan at a micro-batch, with the rungs taken now. After
  // an out-of-memory error at micro-batch 1 the ladder climbs, without running the step in
  // between, until it says the plan fits (at least one rung per error, as without it). A
  // shrink goes to the largest micro-batch it says fits, where it agrees that the failed one
  // does not; where it said that one fits, it has just been proved wrong there, and the
  // shrink takes the fixed factor (memory.on_oom.shrink_factor) instead.
  void set_fits(std::function<bool(int64_t micro_batch)> fits);
  // The rung to start the climb at, by name as added ("" or an unknown name: the first): the
  // memory model's cheapest rung that fits alone, so that the rungs before it, which would
  // not have been enough, are not taken (trainer::cheapest_fitting_rung).
  void set_first_rung(std::function<std::string()> first_rung);

  // Runs the step to completion, retrying the same samples after an out-of-memory error.
  void run_step(int64_t step, const StepStages& stages);
  // Seconds from the last run_step's first out-of-memory error to its completion: what an
  // error cost (the failed attempt's remainder, the plan's change, the retries); 0 without one.
  double recovery_seconds() const { return recovery_seconds_; }
  // After a completed step: its peak memory as a share of the limit (0 when no limit).
  void observe_peak(int64_t step, double peak_fraction, const std::function<void()>& release_cached,
                    const std::function<std::string()>& suggestion);

  std::vector<SupervisorEvent> take_events();
  const std::vector<std::string>& history() const { return history_; }

  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  bool attempt(int64_t step, const StepStages& stages, std::string* what);
  void shrink(int64_t step, const std::string& why);
  void event(int64_t step, std::string kind, std::string detail);

  SupervisorOptions options_;
  int64_t micro_;
  int64_t good_steps_ = 0;          // consecutive steps under grow_threshold
  int64_t grow_wait_;               // steps to wait before the next grow attempt
  int64_t grown_from_ = 0;          // micro-batch before the last grow, 0 when not growing
  struct Rung {
    std::string name;
    std::function<std::string()> apply, undo;
    std::function<bool()> undo_fits;
  };
  std::vector<Rung> ladder_;
  std::vector<int> taken_;          // rungs applied, in order (an index each time one gave something)
  int undone_ = -1;                 // the rung the last grow undid, until a step completes without it
  bool grow_back(int64_t step);     // undoes the latest rung with an undo; false when none is left
  std::function<std::pair<bool, int64_t>(bool, int64_t)> agree_;
  std::function<std::string()> report_;
  std::function<bool(int64_t)> fits_;
  std::function<std::string()> first_rung_;
  std::vector<SupervisorEvent> events_;
  std::vector<std::string> history_;  // everything tried, for the final report
  double recovery_seconds_ = 0.0;
};

}  // namespace memtune
