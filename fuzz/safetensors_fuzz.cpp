// A safetensors file: the 8-byte length, the JSON header and the data section, read as
// memtune reads a downloaded model (models/io/safetensors.h), then every tensor loaded,
// viewed and evicted.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "fuzz_util.h"
#include "models/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const auto path = fuzz::write_file("model.safetensors", data, size);
  fuzz::expect_clean([&] {
    models::SafetensorsFile file(path);
    for (const auto& name : file.names()) {
      const auto& info = file.info(name);
      (void)info.numel();
      at::Tensor a = file.load(name);
      at::Tensor b = file.view(name);
      // The copy and the view hold the same bytes (NaNs compare unequal, so not at::equal).
      at::Tensor bc = b.contiguous();
      if (a.nbytes() != bc.nbytes() || (a.nbytes() > 0 && std::memcmp(a.data_ptr(), bc.data_ptr(), a.nbytes()) != 0)) std::abort();
      file.evict(name);
    }
  });
  return 0;
}
