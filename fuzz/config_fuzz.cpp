// The YAML training config (trainer/config.h parse_config: strict keys, types, ranges),
// then its effective config printed and parsed again, as a checkpoint's config.yaml is.
#include "fuzz_util.h"
#include "trainer/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string text = fuzz::as_string(data, size);
  fuzz::expect_clean([&] {
    trainer::Config c = trainer::parse_config(text, "fuzz.yaml");
    trainer::Config again = trainer::parse_config(trainer::to_yaml(c), "fuzz.yaml (effective)");
    (void)again;
  });
  return 0;
}
