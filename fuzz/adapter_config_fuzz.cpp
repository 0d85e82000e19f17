// A PEFT adapter's adapter_config.json, read as `memtune eval/generate/merge --adapter`
// read it (models/peft.h read_adapter_config).
#include "fuzz_util.h"
#include "models/peft.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  fuzz::write_file("adapter_config.json", data, size);
  fuzz::expect_clean([&] { (void)models::read_adapter_config(fuzz::scratch_dir()); });
  return 0;
}
