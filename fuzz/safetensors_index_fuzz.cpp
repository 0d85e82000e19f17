// model.safetensors.index.json ({"metadata": {...}, "weight_map": {name: shard}}) over two
// valid shards made at start-up, read by CheckpointReader as a sharded model is.
#include <ATen/ATen.h>

#include "fuzz_util.h"
#include "models/io/safetensors.h"

namespace {
const std::filesystem::path& model_dir() {
  static const std::filesystem::path dir = [] {
    auto d = memtune::fuzz::scratch_dir() / "model";
    std::filesystem::create_directories(d);
    memtune::models::save_safetensors(d / "model-00001-of-00002.safetensors",
                                      {{"a", at::arange(6, at::kFloat).reshape({2, 3})}}, {{"format", "pt"}});
    memtune::models::save_safetensors(d / "model-00002-of-00002.safetensors",
                                      {{"b", at::ones({4}, at::kBFloat16)}, {"c", at::zeros({1}, at::kLong)}},
                                      {{"format", "pt"}});
    return d;
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const auto& dir = model_dir();
  fuzz::write_file("model/model.safetensors.index.json", data, size);
  fuzz::expect_clean([&] {
    models::CheckpointReader reader(dir);
    (void)reader.total_bytes();
    (void)reader.metadata();
    for (const auto& name : reader.names()) {
      (void)reader.file_of(name);
      (void)reader.info(name);
      (void)reader.load(name);
    }
  });
  return 0;
}
