// A checkpoint's state.json, read as a resume reads it (trainer/trainer.cpp): the
// TrainState, then each owner's part (sampler, scaler, supervisor, reduce_lr_on_plateau's
// state) by its owner, and the restored sampler asked for its next samples.
#include <vector>

#include <nlohmann/json.hpp>

#include "data/sampler.h"
#include "fuzz_util.h"
#include "runtime/json_input.h"
#include "runtime/supervisor.h"
#include "trainer/grad_scaler.h"
#include "trainer/schedule.h"
#include "trainer/train_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string text = fuzz::as_string(data, size);
  fuzz::expect_clean([&] {
    auto state = trainer::TrainState::from_json(parse_json(text, "state.json"), "state.json");
    (void)state.to_json().dump();
    data::SamplerState ss;
    data::from_json(state.sampler, ss);
    data::Sampler sampler(10, 1234, true, 0, 1);
    sampler.restore(ss);
    (void)sampler.next(7);
    trainer::GradScaler scaler(true);
    scaler.load_state(state.scaler);
    scaler.update(false);
    scaler.update(true);
    SupervisorOptions so;
    so.samples_per_step = 8;
    so.micro_batch = 4;
    Supervisor supervisor(so);
    supervisor.load_state(state.supervisor);
    (void)supervisor.accumulation();
    (void)supervisor.state().dump();
    if (!state.lr_scheduler.is_null()) {
      trainer::Plateau plateau;
      plateau.restore(state.lr_scheduler, "state.json");
      (void)plateau.step(1.5);
      (void)plateau.state().dump();
    }
  });
  return 0;
}
