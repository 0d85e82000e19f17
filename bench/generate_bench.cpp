// memtune generate's speed with the key/value cache (models/layers/kv_cache.h) against the same
// greedy generation running the whole sequence for every new token (use_cache false, what
// memtune did before the cache; transformers' use_cache=False), in one run, on a model of a
// preset's shape with random weights (NF4 base and LoRA r 16 on every projection, as after a
// QLoRA run, unless --dense). Prints per prompt length: seconds per generate call (median of
// the repeats), new tokens per second, the peak memory above the model's own during the call
// (the CPU allocator's count), the large blocks it mapped anew in that call (each a round of
// page faults: 0 when the allocator's block cache serves every one), and whether both ways
// gave the same tokens.
//
//   bench_generate_bench [--preset qwen2-0.5b] [--prompts 16,128,512] [--new 64] [--repeats 3] [--dense]
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench/median_ms.h"
#include "models/causal_lm.h"
#include "models/generate.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "models/model_spec.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/threads.h"

namespace {

using memtune::bench::median_ms;

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::atoll(item.c_str()));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  const std::string threads = memtune::configure_threads(0);
  memtune::install_cpu_budget_allocator();
  std::string preset = "qwen2-0.5b";
  std::vector<int64_t> prompts = {16, 128, 512};
  int64_t new_tokens = 64;
  int repeats = 3;
  bool dense = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--preset") preset = next, ++i;
    else if (a == "--prompts") prompts = parse_list(next), ++i;
    else if (a == "--new") new_tokens = std::atoll(next), ++i;
    else if (a == "--repeats") repeats = std::atoi(next), ++i;
    else if (a == "--dense") dense = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  auto spec = memtune::models::preset(preset);
  if (!spec) {
    std::fprintf(stderr, "unknown preset %s\n", preset.c_str());
    return 2;
  }
  auto model = memtune::models::init_random_model(*spec, 1);
  if (!dense)
    for (memtune::models::Linear* l : model->linears()) l->quantize(64, true, memtune::QuantType::kNF4);
  memtune::models::LoraOptions lo;
  lo.r = 16;
  memtune::models::apply_lora(*model, lo, {});
  {
    at::NoGradGuard g;
    for (memtune::models::Linear* l : model->linears()) l->lora->B.normal_(0, 0.01);
  }
  std::printf("model: %s shape, %s base, LoRA r 16 on every projection; %s; %lld new tokens, greedy\n",
              preset.c_str(), dense ? "fp32" : "NF4", threads.c_str(), static_cast<long long>(new_tokens));
  std::printf("%7s | %9s %7s %9s %5s | %10s %7s %9s %5s | %7s %s\n", "prompt", "cache s", "tok/s", "peak MiB",
              "maps", "no cache s", "tok/s", "peak MiB", "maps", "speedup", "same tokens");
  for (int64_t p : prompts) {
    at::Tensor ids = at::randint(spec->vocab_size, {p}, at::detail::createCPUGenerator(p), at::kInt);
    std::vector<int32_t> prompt(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + p);
    memtune::models::GenerateOptions cached, uncached;
    cached.max_new_tokens = uncached.max_new_tokens = new_tokens;
    uncached.use_cache = false;
    struct Way {
      double s = 0;
      int64_t peak = 0, maps = 0;
      std::vector<int32_t> out;
    } a, b;
    for (auto [way, o] : {std::pair{&a, &cached}, std::pair{&b, &uncached}}) {
      way->s = median_ms(repeats, [&] { way->out = memtune::models::generate(*model, prompt, *o); }) / 1e3;
      const int64_t before = memtune::cpu_allocated_bytes(), maps = memtune::cpu_allocator_counters().maps;
      memtune::ScopedPeakReset peak;
      memtune::models::generate(*model, prompt, *o);
      way->peak = peak.peak() - before;
      way->maps = memtune::cpu_allocator_counters().maps - maps;
    }
    const double n = static_cast<double>(a.out.size());
    std::printf("%7lld | %9.3f %7.1f %9.1f %5lld | %10.3f %7.1f %9.1f %5lld | %6.2fx %s\n", static_cast<long long>(p),
                a.s, n / a.s, static_cast<double>(a.peak) / (1 << 20), static_cast<long long>(a.maps), b.s,
                static_cast<double>(b.out.size()) / b.s, static_cast<double>(b.peak) / (1 << 20),
                static_cast<long long>(b.maps), b.s / a.s, a.out == b.out ? "yes" : "NO");
  }
  return 0;
}
