// The supervisor's decisions, with stages that run out of memory on cue.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include <c10/util/Exception.h>

#include "runtime/supervisor.h"

namespace memtune {
namespace {

[[noreturn]] void throw_oom() {
  C10_THROW_ERROR(OutOfMemoryError, "CPU out of memory. Tried to allocate 2.00 MiB");
}

struct Recorder {
  std::vector<int64_t> micro_batches;  // one per compute call
  int applied = 0, cleaned = 0;
  std::function<bool(int64_t micro)> oom_in_compute = [](int64_t) { return false; };
  bool oom_in_prepare_once = false;

  StepStages stages() {
    StepStages s;
    s.compute = [this](int64_t m) {
      micro_batches.push_back(m);
      if (oom_in_compute(m)) throw_oom();
    };
    s.prepare = [this] {
      if (oom_in_prepare_once) {
        oom_in_prepare_once = false;
        throw_oom();
      }
    };
    s.apply = [this] { ++applied; };
    s.cleanup = [this] { ++cleaned; };
    return s;
  }
};

SupervisorOptions options(int64_t samples, int64_t micro) {
  SupervisorOptions o;
  o.samples_per_step = samples;
  o.micro_batch = micro;
  o.grow_after_steps = 2;
  return o;
}

// A rung that turns `name` on in `on` (the rungs in effect) and its undo that turns it off.
void add_switch_rung(Supervisor& s, std::vector<std::string>& on, const std::string& name,
                     std::function<bool()> undo_fits = nullptr) {
  s.add_ladder_rung(
      name,
      [&on, name]() -> std::string {
        if (std::find(on.begin(), on.end(), name) != on.end()) return "";
        on.push_back(name);
        return name + " on";
      },
      [&on, name]() -> std::string {
        auto it = std::find(on.begin(), on.end(), name);
        if (it == on.end()) return "";
        on.erase(it);
        return name;
      },
      std::move(undo_fits));
}

TEST(Supervisor, ShrinksUntilItFitsAndKeepsTheStepsSamples) {
  Supervisor s(options(8, 8));
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 2; };
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{8, 4, 2}));
  EXPECT_EQ(s.micro_batch(), 2);
  EXPECT_EQ(s.accumulation(), 4);  // 2 x 4 = the step's 8 samples
  EXPECT_EQ(r.applied, 1);
  EXPECT_EQ(r.cleaned, 2);
}

// A factor of 0.5 takes 3 to 2 (rounded up): 2 may fit, and going to 1 would skip it.
TEST(Supervisor, ShrinkRoundsUpSoNoSizeThatMightFitIsSkipped) {
  Supervisor s(options(6, 3));
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 2; };
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(s.accumulation(), 3);
}

// With a memory model that knows the failed size does not fit, the shrink goes straight to
// the largest size it says fits (6), where the factor would have given 4.
TEST(Supervisor, ShrinkGoesToTheLargestSizeTheMemoryModelSaysFits) {
  Supervisor s(options(24, 8));
  s.set_fits([](int64_t m) { return m <= 6; });
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 6; };
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{8, 6}));
  EXPECT_EQ(s.accumulation(), 4);  // 6 x 4 = the step's 24 samples
  const auto events = s.take_events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].kind, "shrink");
  EXPECT_NE(events[1].detail.find("micro-batch 8 -> 6, the largest the memory model says fits"), std::string::npos)
      << events[1].detail;
}

// A model that said the failed size fits has just been proved wrong there: the shrink keeps
// the fixed factor (8 -> 4 -> 2), rather than stepping down one size per error on its word.
TEST(Supervisor, AMemoryModelProvedWrongLeavesTheShrinkToTheFactor) {
  Supervisor s(options(8, 8));
  s.set_fits([](int64_t) { return true; });
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 2; };
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{8, 4, 2}));
}

// Where the model says nothing fits, the shrink goes to 1 (and the ladder from there).
TEST(Supervisor, WhereNothingFitsTheShrinkGoesToOne) {
  Supervisor s(options(8, 8));
  int rung = 0;
  s.add_ladder_rung("save", [&]() -> std::string { return rung < 1 ? "saved " + std::to_string(++rung) : ""; });
  s.set_fits([&](int64_t m) { return m == 1 && rung == 1; });
  Recorder r;
  r.oom_in_compute = [&](int64_t m) { return m > 1 || rung == 0; };
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{8, 1, 1}));
  EXPECT_EQ(rung, 1);
}

TEST(Supervisor, OomInPrepareDropsTheStepAndUpdatesOnce) {
  Supervisor s(options(4, 4));
  Recorder r;
  r.oom_in_prepare_once = true;
  s.run_step(0, r.stages());
  EXPECT_EQ(r.applied, 1);
  EXPECT_EQ(r.cleaned, 1);
  EXPECT_EQ(s.micro_batch(), 2);
}

TEST(Supervisor, OtherErrorsPassThrough) {
  Supervisor s(options(4, 4));
  StepStages st;
  st.compute = [](int64_t) { throw std::runtime_error("not memory"); };
  st.prepare = st.apply = st.cleanup = [] {};
  EXPECT_THROW(s.run_step(0, st), std::runtime_error);
}

TEST(Supervisor, LadderThenStopWithReport) {
  Supervisor s(options(2, 2));
  int rungs_left = 2;
  s.add_ladder_rung("checkpoint more layers", [&]() -> std::string {
    return rungs_left-- > 0 ? "checkpointing layer " + std::to_string(1 - rungs_left) : "";
  });
  s.set_report([] { return std::string("estimate: needs 3 GiB"); });
  Recorder r;
  r.oom_in_compute = [](int64_t) { return true; };
  try {
    s.run_step(5, r.stages());
    FAIL() << "did not stop";
  } catch (const MemoryExhausted& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("micro-batch 1"), std::string::npos) << what;
    EXPECT_NE(what.find("checkpointing layer 0"), std::string::npos) << what;
    EXPECT_NE(what.find("estimate: needs 3 GiB"), std::string::npos) << what;
  }
  // 2 -> 1, then two rungs, then nothing left: 4 attempts.
  EXPECT_EQ(r.micro_batches.size(), 4u);
  EXPECT_EQ(r.applied, 0);
}

TEST(Supervisor, GrowsBackAfterHeadroomAndUndoesAFailedGrow) {
  Supervisor s(options(8, 8));
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 4; };
  s.run_step(0, r.stages());
  ASSERT_EQ(s.micro_batch(), 4);
  s.observe_peak(0, 0.3, [] {}, {});
  s.observe_peak(1, 0.3, [] {}, {});
  EXPECT_EQ(s.micro_batch(), 8);  // grew after 2 steps with headroom
  s.run_step(2, r.stages());      // 8 fails again: back to 4, wait doubled
  EXPECT_EQ(s.micro_batch(), 4);
  std::vector<std::string> kinds;
  for (const auto& e : s.take_events()) kinds.push_back(e.kind);
  EXPECT_EQ(kinds, (std::vector<std::string>{"oom", "shrink", "grow", "oom", "grow_failed"}));
  for (int i = 0; i < 3; ++i) s.observe_peak(3 + i, 0.3, [] {}, {});
  EXPECT_EQ(s.micro_batch(), 4);  // now waits 4 steps
  s.observe_peak(6, 0.3, [] {}, {});
  EXPECT_EQ(s.micro_batch(), 8);
}

// Grow-back undoes the ladder in the reverse order it was climbed (B before A), then grows
// the micro-batch; an undo whose step runs out of memory takes the rung again and waits
// twice as long. A rung with no undo stays, and so do those taken before it.
TEST(Supervisor, GrowBackUndoesRungsInReverseThenGrowsTheMicroBatch) {
  Supervisor s(options(2, 2));
  std::vector<std::string> on;  // the rungs in effect
  add_switch_rung(s, on, "A");
  add_switch_rung(s, on, "B");
  Recorder r;
  int ooms = 3;  // 2 -> 1, then A, then B
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  ASSERT_EQ(on, (std::vector<std::string>{"A", "B"}));
  ASSERT_EQ(s.micro_batch(), 1);
  s.observe_peak(0, 0.3, [] {}, {});
  s.observe_peak(1, 0.3, [] {}, {});
  EXPECT_EQ(on, std::vector<std::string>{"A"});  // B first
  // The step without B runs out of memory: B is taken again, the wait doubles.
  r.oom_in_compute = [&](int64_t) { return std::find(on.begin(), on.end(), "B") == on.end(); };
  s.run_step(2, r.stages());
  EXPECT_EQ(on, (std::vector<std::string>{"A", "B"}));
  for (int i = 0; i < 3; ++i) s.observe_peak(3 + i, 0.3, [] {}, {});
  EXPECT_EQ(on, (std::vector<std::string>{"A", "B"}));  // 4 steps now
  r.oom_in_compute = [](int64_t) { return false; };
  s.observe_peak(6, 0.3, [] {}, {});
  EXPECT_EQ(on, std::vector<std::string>{"A"});
  for (int i = 0; i < 4; ++i) s.observe_peak(7 + i, 0.3, [] {}, {});
  EXPECT_TRUE(on.empty());
  EXPECT_EQ(s.micro_batch(), 1);  // the rungs first, the micro-batch last
  for (int i = 0; i < 4; ++i) s.observe_peak(11 + i, 0.3, [] {}, {});
  EXPECT_EQ(s.micro_batch(), 2);
  std::vector<std::string> kinds;
  for (const auto& e : s.take_events()) kinds.push_back(e.kind);
  EXPECT_EQ(kinds, (std::vector<std::string>{"oom", "shrink", "oom", "ladder", "oom", "ladder", "grow", "oom",
                                             "grow_failed", "grow", "grow", "grow"}));
  // The taken rungs are part of the state: a resumed run grows back the same way.
  Supervisor t(options(2, 2));
  t.add_ladder_rung("A", [] { return std::string(); }, [] { return std::string("A"); });
  t.load_state(s.state());
  EXPECT_EQ(t.state(), s.state());
}

// A resumed run whose config asks for a smaller micro-batch (to fit a smaller device) runs
// at it: the checkpoint's micro-batch is at most the configured one, as in a fresh run, and
// a growth the checkpoint had pending is undone with it.
TEST(Supervisor, AResumeRunsAtMostTheConfiguredMicroBatch) {
  nlohmann::json saved = Supervisor(options(8, 8)).state();
  EXPECT_EQ(saved["micro_batch"], 8);
  saved["grown_from"] = 4;  // grown 4 -> 8 after the last step
  Supervisor smaller(options(8, 2));
  smaller.load_state(saved);
  EXPECT_EQ(smaller.micro_batch(), 2);
  EXPECT_EQ(smaller.accumulation(), 4);
  EXPECT_EQ(smaller.state()["grown_from"], 0);
  Supervisor same(options(8, 8));  // a shrunk micro-batch stays shrunk
  saved["micro_batch"] = 2;
  saved["grown_from"] = 0;
  same.load_state(saved);
  EXPECT_EQ(same.micro_batch(), 2);
}

// With a memory model, one out-of-memory error climbs as many rungs as it says are needed
// (here three: two of the first, one of the second), instead of one per failed attempt.
TEST(Supervisor, TheMemoryModelChoosesHowFarToClimb) {
  Supervisor s(options(1, 1));
  int first = 0, second = 0;
  s.add_ladder_rung("first", [&]() -> std::string { return first < 2 ? "first " + std::to_string(++first) : ""; });
  s.add_ladder_rung("second", [&]() -> std::string { return second < 2 ? "second " + std::to_string(++second) : ""; });
  s.set_fits([&](int64_t) { return first + second >= 3; });
  Recorder r;
  int ooms = 1;
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  EXPECT_EQ(first, 2);
  EXPECT_EQ(second, 1);
  EXPECT_EQ(r.micro_batches.size(), 2u) << "one failed attempt, one that ran";
  int ladder = 0;
  for (const auto& e : s.take_events()) ladder += e.kind == "ladder";
  EXPECT_EQ(ladder, 3);
}

// The climb starts at the rung the memory model says fits alone; the rungs before it are not
// taken. Where that rung has nothing left, the climb goes back to the first.
TEST(Supervisor, TheClimbStartsAtTheRungThatFitsAloneAndFallsBackWhereItHasNothingLeft) {
  Supervisor s(options(1, 1));
  std::vector<std::string> on;
  add_switch_rung(s, on, "checkpointing");
  add_switch_rung(s, on, "offload");
  s.set_fits([&](int64_t) { return !on.empty(); });
  s.set_first_rung([] { return std::string("offload"); });
  Recorder r;
  int ooms = 1;
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  EXPECT_EQ(on, (std::vector<std::string>{"offload"}));
  // offload is taken now: the next error falls back to checkpointing.
  ooms = 1;
  s.run_step(1, r.stages());
  EXPECT_EQ(on, (std::vector<std::string>{"offload", "checkpointing"}));
  EXPECT_EQ(r.applied, 2);
}

// Ranks start the climb at the earliest rung any of them chose.
TEST(Supervisor, RanksAgreeOnTheEarliestFirstRung) {
  Supervisor s(options(1, 1));
  std::vector<std::string> on;
  add_switch_rung(s, on, "checkpointing");
  add_switch_rung(s, on, "offload");
  s.set_fits([&](int64_t) { return !on.empty(); });
  s.set_first_rung([] { return std::string("offload"); });  // this rank's choice: index 1
  // Another rank chose index 0 (it proposes 0 to every agreement; a step's attempts use only
  // the out-of-memory flag).
  s.set_agreement([](bool oom, int64_t p) { return std::make_pair(oom, std::min<int64_t>(p, 0)); });
  Recorder r;
  int ooms = 1;
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  EXPECT_EQ(on, (std::vector<std::string>{"checkpointing"}));
}

TEST(Supervisor, ARungWithoutUndoStays) {
  Supervisor s(options(2, 2));
  bool on = false;
  s.add_ladder_rung("permanent", [&]() -> std::string { return on ? "" : (on = true, "on"); });
  Recorder r;
  int ooms = 2;
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  ASSERT_TRUE(on);
  for (int i = 0; i < 2; ++i) s.observe_peak(1 + i, 0.3, [] {}, {});
  EXPECT_TRUE(on);
  EXPECT_EQ(s.micro_batch(), 2);  // the micro-batch grows; the rung stays
}

// An undo that would allocate on the device runs between steps, where running out of
// memory ends the run: where the memory model says the plan does not fit without the rung,
// the rung stays, and so does the one taken before it; the micro-batch still grows.
TEST(Supervisor, AnUndoTheMemoryModelSaysDoesNotFitStaysAndSoDoThoseBeforeIt) {
  Supervisor s(options(2, 2));
  std::vector<std::string> on;
  bool b_fits_without = false;
  add_switch_rung(s, on, "A", [] { return true; });
  add_switch_rung(s, on, "B", [&] { return b_fits_without; });
  Recorder r;
  int ooms = 3;  // 2 -> 1, then A, then B
  r.oom_in_compute = [&](int64_t) { return ooms-- > 0; };
  s.run_step(0, r.stages());
  ASSERT_EQ(on, (std::vector<std::string>{"A", "B"}));
  for (int i = 0; i < 2; ++i) s.observe_peak(1 + i, 0.3, [] {}, {});
  EXPECT_EQ(on, (std::vector<std::string>{"A", "B"})) << "B was undone where the model says it does not fit";
  EXPECT_EQ(s.micro_batch(), 2) << "the micro-batch grows all the same";
  // Once the model says it fits (a larger limit after a resume, say), grow-back goes on.
  b_fits_without = true;
  for (int i = 0; i < 2; ++i) s.observe_peak(3 + i, 0.3, [] {}, {});
  EXPECT_EQ(on, std::vector<std::string>{"A"});
}

// A rung the caller takes before the first step (optimizer state made in host memory when
// the model says the device cannot hold it) is taken as if climbed: a ladder event, part of
// the state, and undone by grow-back like any other.
TEST(Supervisor, ARungRecordedBeforeTheFirstStepIsTakenLikeAClimbedOne) {
  Supervisor s(options(1, 1));
  bool on = true;  // the caller applied it
  s.add_ladder_rung("offload optimizer state", [&]() -> std::string { return on ? "" : (on = true, "moved"); },
                    [&]() -> std::string { return on ? (on = false, "optimizer offload") : ""; });
  s.record_rung(0, "offload optimizer state", "made in host memory before the first step");
  auto events = s.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, "ladder");
  EXPECT_EQ(events[0].detail, "offload optimizer state: made in host memory before the first step");
  EXPECT_EQ(s.state()["taken"], nlohmann::json::array({0}));
  for (int i = 0; i < 2; ++i) s.observe_peak(i, 0.3, [] {}, {});
  EXPECT_FALSE(on);
  EXPECT_THROW(s.record_rung(0, "no such rung", ""), InternalError);
}

// memory.supervise: false: the first out-of-memory error ends the run, said as one (exit
// code 3, with the step and the hint), not as an error outside the step.
TEST(Supervisor, UnsupervisedAnOomStopsTheRunAtItsStep) {
  SupervisorOptions o = options(4, 4);
  o.enabled = false;
  Supervisor s(o);
  Recorder r;
  r.oom_in_compute = [](int64_t) { return true; };
  try {
    s.run_step(7, r.stages());
    FAIL() << "did not stop";
  } catch (const MemoryExhausted& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory in step 7 at micro-batch 4: CPU out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("memory.supervise: true"), std::string::npos) << what;
  }
  EXPECT_EQ(r.micro_batches, std::vector<int64_t>{4}) << "retried without supervision";
  EXPECT_EQ(r.applied, 0);
}

TEST(Supervisor, ThresholdsActBeforeAnOom) {
  Supervisor s(options(8, 8));
  int released = 0;
  s.observe_peak(0, 0.91, [&] { ++released; }, {});
  EXPECT_EQ(released, 1);
  s.observe_peak(1, 0.96, [&] { ++released; }, {});
  EXPECT_EQ(s.micro_batch(), 4);  // emergency: shrink before anything fails
  s.observe_peak(2, 0.86, [] {}, [] { return std::string("checkpoint every layer"); });
  auto events = s.take_events();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].kind, "warning");
  EXPECT_NE(events[2].detail.find("checkpoint every layer"), std::string::npos);
}

TEST(Supervisor, AgreementMakesEveryRankRetry) {
  Supervisor s(options(4, 4));
  Recorder r;
  int calls = 0;
  // This rank never fails, but another rank does on the first attempt.
  s.set_agreement([&](bool oom, int64_t p) { return std::make_pair(oom || calls++ == 0, p); });
  s.run_step(0, r.stages());
  EXPECT_EQ(r.micro_batches, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(r.applied, 1);
}

TEST(Supervisor, StateRoundTrips) {
  Supervisor a(options(8, 8));
  Recorder r;
  r.oom_in_compute = [](int64_t m) { return m > 2; };
  a.run_step(0, r.stages());
  a.observe_peak(0, 0.1, [] {}, {});
  Supervisor b(options(8, 8));
  b.load_state(a.state());
  EXPECT_EQ(b.micro_batch(), 2);
  EXPECT_EQ(b.state(), a.state());
}

}  // namespace
}  // namespace memtune
