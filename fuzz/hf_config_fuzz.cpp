// A Hugging Face config.json, read into a ModelSpec as `memtune train/eval/merge` read
// the base model's (models/hf_model.h read_hf_config), then sized and written back.
#include "fuzz_util.h"
#include "models/hf_model.h"
#include "models/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  fuzz::write_file("config.json", data, size);
  fuzz::expect_clean([&] {
    models::ModelSpec spec = models::read_hf_config(fuzz::scratch_dir());
    (void)models::parameter_count(spec);
    models::ModelSpec again = models::spec_from_hf_config(models::spec_to_hf_config(spec), "round trip");
    (void)again;
  });
  return 0;
}
