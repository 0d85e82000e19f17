#include "runtime/keyed_dropout.h"

#include <cmath>
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

uint32_t attention_keep_threshold(double p) {
  const double keep = std::ldexp(1.0 - p, 32);
  return keep >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(std::llround(keep));
}

at::Tensor attention_dropout_seeds(uint64_t site, int64_t rows, const c10::Device& device) {
  const DropoutKeys& k = t_keys;
  const auto int64 = at::TensorOptions().dtype(at::kLong);
  if (k.empty()) return at::randint(int64_t{1} << 32, {rows}, int64.device(device));
  MEMTUNE_INTERNAL_ASSERT(static_cast<int64_t>(k.keys.size()) == rows, "attention dropout: ", rows, " rows for ",
                          k.keys.size(), " row keys");
  at::Tensor seeds = at::empty({rows}, int64);
  int64_t* out = seeds.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    out[b] = static_cast<int64_t>(mix(k.keys[static_cast<size_t>(b)] ^ mix(site ^ 0xA77E47105ull)) & 0xFFFFFFFFull);
  return seeds.to(device);
}

namespace {

// fmix32 on int64 tensors holding 32-bit values (products wrap modulo 2^64; the mask keeps
// their low 32 bits, which are the 32-bit product's).
at::Tensor fmix32_tensor(at::Tensor x) {
  constexpr int64_t kLow = 0xFFFFFFFFll;
  x = x.bitwise_xor(x.__rshift__(16));
  x = x.mul(int64_t{0x85EBCA6B}).bitwise_and_(kLow);
  x = x.bitwise_xor(x.__rshift__(13));
  x = x.mul(int64_t{0xC2B2AE35}).bitwise_and_(kLow);
  return x.bitwise_xor(x.__rshift__(16));
}

}  // namespace

at::Tensor attention_keep_mask(const at::Tensor& seeds, int64_t heads, int64_t t0, int64_t t1, int64_t s0, int64_t s1,
                               double p) {
  constexpr int64_t kLow = 0xFFFFFFFFll;
  const auto int64 = seeds.options().dtype(at::kLong);
  const at::Tensor seed = seeds.to(at::kLong).view({-1, 1, 1, 1});
  const at::Tensor head = at::arange(heads, int64).view({1, -1, 1, 1});
  const at::Tensor t = at::arange(t0, t1, int64).view({1, 1, -1, 1});
  const at::Tensor s = at::arange(s0, s1, int64).view({1, 1, 1, -1});
  at::Tensor h = fmix32_tensor(seed.add(head.mul(int64_t{0x9E3779B9})).bitwise_and_(kLow));
  h = fmix32_tensor(h.add(t.mul(int64_t{0x85EBCA77})).bitwise_and_(kLow));
  const at::Tensor col = s.mul(int64_t{0xC2B2AE3D}).bitwise_and_(kLow);
  return fmix32_tensor(h.bitwise_xor(col)) < static_cast<int64_t>(attention_keep_threshold(p));
}

}  // namespace memtune
