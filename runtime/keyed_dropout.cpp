#include "runtime/keyed_dropout.h"

#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "runtime/error.h"

namespace memtune {

namespace {

thread_local DropoutKeys t_keys;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

const DropoutKeys& current_dropout_keys() { return t_keys; }

DropoutKeysScope::DropoutKeysScope(DropoutKeys keys) : previous_(std::exchange(t_keys, std::move(keys))) {}

DropoutKeysScope::~DropoutKeysScope() { t_keys = std::move(previous_); }

uint64_t dropout_row_key(uint64_t seed, int64_t step, int64_t sample_index, int64_t occurrence) {
  uint64_t h = mix(seed ^ 0x6D656D74756E65ull);
  h = mix(h ^ static_cast<uint64_t>(step));
  h = mix(h ^ static_cast<uint64_t>(sample_index));
  return mix(h ^ static_cast<uint64_t>(occurrence));
}

uint64_t dropout_site(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

at::Tensor keyed_dropout(const at::Tensor& x, double p, uint64_t site) {
  const DropoutKeys& k = t_keys;
  if (k.empty()) return at::dropout(x, p, true);
  MEMTUNE_INTERNAL_ASSERT(x.dim() >= 2 && x.size(0) == static_cast<int64_t>(k.keys.size()) &&
                              k.lengths.size() == k.keys.size(),
                          "keyed_dropout: input of shape ", x.sizes(), " for ", k.keys.size(), " row keys");
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t width = x.numel() / std::max<int64_t>(1, B * T);  // elements per position
  at::Tensor keep = at::zeros({B, T, width}, x.options().dtype(at::kBool));
  const double keep_p = 1.0 - p;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::min(k.lengths[b], T);
    if (len <= 0) continue;
    at::Tensor row;
    const uint64_t seed = mix(k.keys[b] ^ mix(site));
    if (x.device().is_cpu()) {
      at::Generator gen = at::detail::createCPUGenerator(seed);
      row = at::rand({len, width}, gen, x.options().dtype(at::kFloat)) < keep_p;
    } else {
      // The device's default generator, reseeded for the row and given its state back.
      // (Its mutex is taken around the state changes only: the draw takes it itself.)
      at::Generator gen = at::globalContext().defaultGenerator(x.device());
      at::Tensor saved;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        saved = gen.get_state();
        gen.set_current_seed(seed);
      }
      row = at::rand({len, width}, gen, x.options().dtype(at::kFloat)) < keep_p;
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(saved);
    }
    keep[b].narrow(0, 0, len).copy_(row);
  }
  return x.masked_fill(keep.logical_not().view(x.sizes()), 0) * (1.0 / keep_p);
}

}  // namespace memtune
