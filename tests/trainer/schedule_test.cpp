// Learning-rate schedules against transformers' own: the lists below are what
// transformers 5.x's get_scheduler(name, SGD(lr=2e-4), num_warmup_steps, num_training_steps=10,
// scheduler_specific_kwargs) set as the learning rate before each of 12 optimizer steps
// (LambdaLR: base lr times the schedule's factor, in Python doubles). memtune computes the
// same factors in the same order, so they agree bit for bit (this machine's C library
// rounds cos, pow and sqrt as the one Python used did; `1 - progress` for linear's factor,
// as memtune had it, differs in the last bit at 3 of the steps). Steps past the 10th only
// where the schedule defines them as transformers does (polynomial holds lr_end).
#include <gtest/gtest.h>

#include <limits>

#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "trainer/schedule.h"

namespace {

using memtune::trainer::Schedule;
using memtune::trainer::ScheduleKwargs;
using memtune::trainer::with_kwargs;

struct Case {
  const char* kind;
  int64_t warmup;
  ScheduleKwargs kwargs;
  std::vector<double> transformers;
};

TEST(Schedule, EveryKindIsTransformersGetScheduler) {
  const std::vector<Case> cases = {
      {"constant", 3, {},
       {0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002}},
      {"constant_with_warmup", 3, {},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002}},
      {"linear", 3, {},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00017142857142857143, 0.00014285714285714287, 0.00011428571428571428, 8.571428571428571e-05, 5.714285714285714e-05, 2.857142857142857e-05, 0.0, 0.0}},
      {"cosine", 3, {},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.0001900968867902419, 0.00016234898018587337, 0.00012225209339563145, 7.774790660436858e-05, 3.7651019814126654e-05, 9.903113209758096e-06, 0.0, 9.903113209758086e-06}},
      {"cosine", 3, {{"num_cycles", 1.5}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00012225209339563145, 9.903113209758096e-06, 3.765101981412663e-05, 0.00016234898018587334, 0.00019009688679024194, 7.774790660436859e-05, 0.0, 7.774790660436852e-05}},
      {"cosine_with_restarts", 3, {{"num_cycles", 2.0}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00016234898018587337, 7.774790660436858e-05, 9.903113209758096e-06, 0.00019009688679024194, 0.00012225209339563145, 3.765101981412669e-05, 0.0, 0.0}},
      {"polynomial", 3, {{"lr_end", 1e-05}, {"power", 2.0}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.0001495918367346939, 0.00010693877551020411, 7.20408163265306e-05, 4.4897959183673474e-05, 2.5510204081632654e-05, 1.3877551020408166e-05, 1e-05, 1e-05}},
      {"inverse_sqrt", 3, {},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00017320508075688776, 0.0001549193338482967, 0.0001414213562373095, 0.0001309307341415954, 0.0001224744871391589, 0.00011547005383792517, 0.00010954451150103321, 0.00010444659357341871}},
      {"inverse_sqrt", 0, {},
       {0.0002, 0.00019999000074993753, 0.00019998000299950014, 0.00019997000674831295, 0.00019996001199600142, 0.0001999500187421909, 0.0001999400269865071, 0.00019993003672857563, 0.0001999200479680224, 0.00019991006070447338, 0.00019990007493755465, 0.00019989009066689252}},
      {"inverse_sqrt", 2, {{"timescale", 5.0}},
       {0.0, 0.0001, 0.0002, 0.0001825741858350554, 0.00016903085094570333, 0.00015811388300841897, 0.00014907119849998598, 0.0001414213562373095, 0.0001348399724926484, 0.00012909944487358058, 0.00012403473458920844, 0.00011952286093343937}},
      {"cosine_with_min_lr", 3, {{"min_lr", 2e-05}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00019108719811121772, 0.00016611408216728603, 0.00013002688405606828, 8.997311594393172e-05, 5.3885917832713996e-05, 2.891280188878229e-05, 2e-05, 2.891280188878228e-05}},
      {"cosine_warmup_with_min_lr", 3, {{"min_lr_rate", 0.1}},
       {6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.00019108719811121772, 0.00016611408216728603, 0.00013002688405606828, 8.997311594393172e-05, 5.3885917832713996e-05, 2.891280188878229e-05, 2e-05, 2.891280188878228e-05, 5.3885917832713976e-05}},
      {"cosine_warmup_with_min_lr", 3, {{"min_lr_rate", 0.1}, {"warmup_lr_rate", 0.2}},
       {4e-05, 0.00012000000000000003, 0.0002, 0.00019108719811121772, 0.00016611408216728603, 0.00013002688405606828, 8.997311594393172e-05, 5.3885917832713996e-05, 2.891280188878229e-05, 2e-05, 2.891280188878228e-05, 5.3885917832713976e-05}},
      // warmup_stable_decay (transformers 5.12): each warm-up and decay shape, min_lr_ratio,
      // num_cycles, a given num_stable_steps (short of the steps: the rest at the floor),
      // warm-up and decay overlapping (stable -2: the decay starts a quarter in), no warm-up.
      {"warmup_stable_decay", 3, {{"num_decay_steps", 4.0}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.0002, 0.0002, 0.0002, 0.00017071067811865476, 0.0001, 2.9289321881345254e-05, 0.0, 0.0}},
      {"warmup_stable_decay", 3, {{"num_decay_steps", 4.0}, {"decay_type", "linear"}, {"min_lr_ratio", 0.1}},
       {2e-05, 8e-05, 0.00014, 0.0002, 0.0002, 0.0002, 0.0002, 0.000155, 0.00011000000000000002, 6.500000000000001e-05, 2e-05, 2e-05}},
      {"warmup_stable_decay", 3, {{"num_decay_steps", 3.0}, {"warmup_type", "cosine"}, {"decay_type", "1-sqrt"}, {"min_lr_ratio", 0.25}},
       {5e-05, 8.75e-05, 0.0001625, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.00011339745962155615, 7.75255128608411e-05, 5e-05, 5e-05}},
      {"warmup_stable_decay", 2, {{"num_decay_steps", 5.0}, {"warmup_type", "1-sqrt"}, {"num_cycles", 1.5}},
       {0.0, 5.857864376269049e-05, 0.0002, 0.0002, 0.0002, 0.0002, 6.909830056250527e-05, 1.9098300562505246e-05, 0.00018090169943749476, 0.00013090169943749476, 0.0, 0.0}},
      {"warmup_stable_decay", 3, {{"num_decay_steps", 4.0}, {"num_stable_steps", 1.0}},
       {0.0, 6.666666666666667e-05, 0.00013333333333333334, 0.0002, 0.0002, 0.00017071067811865476, 0.0001, 2.9289321881345254e-05, 0.0, 0.0, 0.0, 0.0}},
      {"warmup_stable_decay", 4, {{"num_decay_steps", 8.0}, {"decay_type", "linear"}},
       {0.0, 5e-05, 0.0001, 0.00015000000000000001, 0.00015000000000000001, 0.000125, 0.0001, 7.500000000000001e-05, 5e-05, 2.5e-05, 0.0, 0.0}},
      {"warmup_stable_decay", 0, {{"num_decay_steps", 10.0}, {"decay_type", "1-sqrt"}},
       {0.0002, 0.0001367544467966324, 0.00011055728090000843, 9.04554884989668e-05, 7.350889359326483e-05, 5.857864376269049e-05, 4.508066615170332e-05, 3.2667994693184886e-05, 2.111456180001683e-05, 1.0263340389897246e-05, 0.0, 0.0}},
  };
  for (const Case& c : cases) {
    Schedule s;
    s.kind = c.kind;
    s.learning_rate = 2e-4;
    s.warmup_steps = c.warmup;
    s.total_steps = 10;
    s = with_kwargs(s, c.kwargs);
    const int64_t steps = s.kind == "polynomial" || s.kind == "inverse_sqrt" || s.kind == "constant" ||
                                  s.kind == "constant_with_warmup" || s.kind == "warmup_stable_decay"
                              ? 12
                              : 10;
    for (int64_t k = 0; k < steps; ++k)
      EXPECT_EQ(s.lr(k), c.transformers[static_cast<size_t>(k)])
          << c.kind << " warmup " << c.warmup << " kwargs " << c.kwargs.size() << " step " << k;
  }
}

// What transformers refuses, memtune refuses: a kwarg the schedule function does not take,
// both or neither of min_lr and min_lr_rate, lr_end not below the learning rate.
TEST(Schedule, KwargsTransformersRefusesAreRefused) {
  Schedule s;
  s.learning_rate = 1e-4;
  s.kind = "cosine";
  EXPECT_THROW(with_kwargs(s, {{"power", 2.0}}), memtune::UserError);
  s.kind = "linear";
  EXPECT_THROW(with_kwargs(s, {{"num_cycles", 1.0}}), memtune::UserError);
  s.kind = "cosine_with_min_lr";
  EXPECT_THROW(with_kwargs(s, {}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"min_lr", 1e-5}, {"min_lr_rate", 0.1}}), memtune::UserError);
  EXPECT_DOUBLE_EQ(with_kwargs(s, {{"min_lr", 1e-5}}).min_lr_rate, 1e-5 / 1e-4);
  s.kind = "polynomial";
  EXPECT_THROW(with_kwargs(s, {{"lr_end", 1e-4}}), memtune::UserError);
  // get_wsd_schedule: num_decay_steps has no default (a TypeError); its types, ValueErrors.
  s.kind = "warmup_stable_decay";
  EXPECT_THROW(with_kwargs(s, {}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"num_decay_steps", 2.0}, {"decay_type", "exponential"}}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"num_decay_steps", 2.0}, {"warmup_type", 1.0}}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"num_decay_steps", "two"}}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"num_decay_steps", 2.0}, {"min_lr", 1e-5}}), memtune::UserError);
  const Schedule wsd = with_kwargs(s, {{"num_decay_steps", 2.0}, {"decay_type", "1-sqrt"}, {"min_lr_ratio", 0.5}});
  EXPECT_EQ(wsd.decay_steps, 2);
  EXPECT_EQ(wsd.decay_type, "1-sqrt");
  EXPECT_EQ(wsd.min_lr_rate, 0.5);
}

}  // namespace

namespace {

using memtune::trainer::Schedule;
using memtune::trainer::ScheduleKwargs;
using memtune::trainer::with_kwargs;

// reduce_lr_on_plateau against torch's ReduceLROnPlateau (PyTorch 2.x, in transformers 5.12's
// environment): the learning rate after each of its steps over a fixed sequence of metrics
// (an SGD at 2e-4), and torch's best, num_bad_epochs and cooldown_counter after the last.
TEST(Schedule, ReduceLrOnPlateauIsTorchs) {
  struct PlateauCase {
    ScheduleKwargs kwargs;
    std::vector<double> metrics, torch_lrs;
    double best;
    int64_t bad, cooldown;
  };
  const std::vector<PlateauCase> cases = {
      {{{"patience", 1.0}, {"factor", 0.5}},
       {3.0, 2.9, 2.95, 2.96, 2.97, 2.5, 2.6, 2.7, 2.8},
       {0.0002, 0.0002, 0.0002, 0.0001, 0.0001, 0.0001, 0.0001, 5e-05, 5e-05}, 2.5, 1, 0},
      {{{"mode", "max"}, {"threshold_mode", "abs"}, {"threshold", 0.05}, {"patience", 0.0}, {"cooldown", 2.0},
        {"min_lr", 3e-5}, {"factor", 0.3}},
       {1.0, 1.02, 1.1, 1.12, 1.13, 1.14, 1.3, 1.31, 1.2, 1.0},
       {0.0002, 6e-05, 6e-05, 6e-05, 3e-05, 3e-05, 3e-05, 3e-05, 3e-05, 3e-05}, 1.3, 0, 0},
      // A cut smaller than eps leaves the rate (torch: old - new > eps).
      {{{"factor", 0.9}, {"eps", 1e-4}, {"patience", 0.0}}, {2.0, 2.5, 2.6}, {0.0002, 0.0002, 0.0002}, 2.0, 0, 0},
      {{{"threshold", 0.1}, {"patience", 2.0}},
       {10.0, 9.5, 9.2, 8.9, 8.0, 7.9, 7.5, 7.3, 7.2},
       {0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 2e-05, 2e-05}, 8.0, 1, 0},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    Schedule s;
    s.kind = "reduce_lr_on_plateau";
    s.learning_rate = 2e-4;
    s = with_kwargs(s, cases[c].kwargs);
    EXPECT_EQ(s.lr(0), 2e-4);
    for (size_t i = 0; i < cases[c].metrics.size(); ++i) {
      s.plateau.step(cases[c].metrics[i]);
      EXPECT_EQ(s.lr(static_cast<int64_t>(i) + 1), cases[c].torch_lrs[i]) << "case " << c << " evaluation " << i;
    }
    EXPECT_EQ(s.plateau.best, cases[c].best) << c;
    EXPECT_EQ(s.plateau.bad_evaluations, cases[c].bad) << c;
    EXPECT_EQ(s.plateau.cooldown_counter, cases[c].cooldown) << c;
  }
}

// A checkpoint keeps the state (best unset before the first evaluation: torch's infinity,
// which JSON cannot hold); a resumed plateau steps as the uninterrupted one.
TEST(Schedule, PlateauStateRoundTrips) {
  Schedule s;
  s.kind = "reduce_lr_on_plateau";
  s.learning_rate = 1e-3;
  s = with_kwargs(s, {{"patience", 1.0}, {"cooldown", 1.0}});
  Schedule fresh = s;
  fresh.plateau.restore(s.plateau.state(), "state.json");
  EXPECT_EQ(fresh.plateau.best, std::numeric_limits<double>::infinity());
  for (double m : {5.0, 5.0, 5.0}) s.plateau.step(m);
  Schedule resumed = fresh;
  resumed.plateau.restore(s.plateau.state(), "state.json");
  for (double m : {4.0, 4.5, 4.5, 4.5, 4.5}) {
    EXPECT_EQ(s.plateau.step(m), resumed.plateau.step(m));
    EXPECT_EQ(s.lr(0), resumed.lr(0));
    EXPECT_EQ(s.plateau.cooldown_counter, resumed.plateau.cooldown_counter);
  }
  EXPECT_LT(s.lr(0), 1e-3);
  // mode max: a metric of inf becomes the best (torch: inf > -inf), and stays it over a resume.
  Schedule max = with_kwargs(s, {{"mode", "max"}, {"patience", 0.0}});
  max.plateau.step(std::numeric_limits<double>::infinity());
  Schedule max_resumed = max;
  max_resumed.plateau.restore(max.plateau.state(), "state.json");
  EXPECT_EQ(max_resumed.plateau.best, std::numeric_limits<double>::infinity());
  EXPECT_EQ(max.plateau.step(3.0), max_resumed.plateau.step(3.0));
  EXPECT_EQ(max.lr(0), max_resumed.lr(0));
  EXPECT_THROW(resumed.plateau.restore(nlohmann::json(nullptr), "state.json"), memtune::UserError);
  EXPECT_THROW(resumed.plateau.restore({{"lr", "x"}}, "state.json"), memtune::UserError);
  // torch refuses a factor of 1 or more; mode and threshold_mode are names.
  EXPECT_THROW(with_kwargs(s, {{"factor", 1.0}}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"mode", "lowest"}}), memtune::UserError);
  EXPECT_THROW(with_kwargs(s, {{"patience", 1.5}}), memtune::UserError);
}

}  // namespace
