#include "runtime/keyed_dropout.h"

#include <cmath>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "runtime/cpu_features.h"
#if MEMTUNE_X86
#include <immintrin.h>
#endif

#include "runtime/error.h"

namespace memtune {

namespace {

thread_local DropoutKeys t_keys;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Row b's seed at dropout site `site` (attention dropout salts its sites apart).
uint64_t row_seed(const DropoutKeys& k, int64_t b, uint64_t site) {
  return mix(k.keys[static_cast<size_t>(b)] ^ mix(site));
}

}  // namespace

const DropoutKeys& current_dropout_keys() { return t_keys; }

DropoutKeysScope::DropoutKeysScope(DropoutKeys keys) : previous_(std::exchange(t_keys, std::move(keys))) {}

DropoutKeysScope::~DropoutKeysScope() { t_keys = std::move(previous_); }

uint64_t dropout_row_key(uint64_t seed, int64_t step, int64_t sample_index) {
  uint64_t h = mix(seed ^ 0x6D656D74756E65ull);
  h = mix(h ^ static_cast<uint64_t>(step));
  h = mix(h ^ static_cast<uint64_t>(sample_index));
  // Once more, as when a fourth term was mixed in (0 unless a sample came twice in a step):
  // the same keys, so earlier runs' checkpoints resume with the same masks.
  return mix(h);
}

uint64_t dropout_site(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

namespace {

// Row b's element e (its position times the width, plus the column) is kept when
// fmix32(seed ^ e * 0x9E3779B9) < threshold; y = x * scale where kept, else 0. The same
// function turns the output's gradient into the input's.
void drop_span_scalar(const float* x, float* y, int64_t n, uint32_t seed, uint32_t e0, uint32_t threshold,
                      float scale) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t e = e0 + static_cast<uint32_t>(j);
    y[j] = fmix32(seed ^ (e * 0x9E3779B9u)) < threshold ? x[j] * scale : 0.0f;
  }
}

#if MEMTUNE_X86
__attribute__((target("avx2"))) void drop_span_avx2(const float* x, float* y, int64_t n, uint32_t seed, uint32_t e0,
                                                    uint32_t threshold, float scale) {
  const __m256i golden = _mm256_set1_epi32(static_cast<int>(0x9E3779B9u));
  const __m256i c1 = _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu));
  const __m256i c2 = _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u));
  // Unsigned h < threshold as a signed compare: both with the sign bit flipped.
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(threshold ^ 0x80000000u));
  const __m256i s = _mm256_set1_epi32(static_cast<int>(seed)), eight = _mm256_set1_epi32(8);
  const __m256 vs = _mm256_set1_ps(scale);
  __m256i e = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(e0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t j = 0;
  for (; j + 8 <= n; j += 8, e = _mm256_add_epi32(e, eight)) {
    __m256i h = _mm256_xor_si256(s, _mm256_mullo_epi32(e, golden));
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), c1);
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 13)), c2);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    const __m256i keep = _mm256_cmpgt_epi32(limit, _mm256_xor_si256(h, sign));
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j), vs);
    _mm256_storeu_ps(y + j, _mm256_and_ps(v, _mm256_castsi256_ps(keep)));
  }
  drop_span_scalar(x + j, y + j, n - j, seed, e0 + static_cast<uint32_t>(j), threshold, scale);
}
#endif

bool t_portable = false;

// x (B, T, width...) contiguous fp32 on the CPU: y = x with row b's kept elements of its first
// lengths[b] positions scaled, every other element 0.
at::Tensor drop_rows(const at::Tensor& x, const std::vector<uint32_t>& seeds, const std::vector<int64_t>& lengths,
                     uint32_t threshold, float scale) {
  const int64_t B = x.size(0), T = x.size(1), width = x.numel() / std::max<int64_t>(1, B * T);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if MEMTUNE_X86
  const bool avx2 = !t_portable && cpu_has_avx2();
#endif
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));  // positions per task
  at::parallel_for(0, B * T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / T, t = i % T;
      const float* xi = xp + i * width;
      float* yi = yp + i * width;
      if (t >= lengths[static_cast<size_t>(b)]) {
        std::fill(yi, yi + width, 0.0f);
        continue;
      }
      const uint32_t e0 = static_cast<uint32_t>(t * width);
#if MEMTUNE_X86
      if (avx2) {
        drop_span_avx2(xi, yi, width, seeds[static_cast<size_t>(b)], e0, threshold, scale);
        continue;
      }
#endif
      drop_span_scalar(xi, yi, width, seeds[static_cast<size_t>(b)], e0, threshold, scale);
    }
  });
  return y;
}

// The mask is drawn again in backward, so only the rows' seeds and lengths are kept.
struct KeyedDropoutFunction : public torch::autograd::Function<KeyedDropoutFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double p,
                            const std::vector<uint32_t>& seeds, const std::vector<int64_t>& lengths) {
    const uint32_t threshold = dropout_keep_threshold(p);
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    ctx->saved_data["p"] = p;
    ctx->saved_data["seeds"] = std::vector<int64_t>(seeds.begin(), seeds.end());
    ctx->saved_data["lengths"] = lengths;
    return drop_rows(x.contiguous(), seeds, lengths, threshold, scale);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double p = ctx->saved_data["p"].toDouble();
    const std::vector<int64_t> s = ctx->saved_data["seeds"].toIntVector();
    const std::vector<uint32_t> seeds(s.begin(), s.end());
    const std::vector<int64_t> lengths = ctx->saved_data["lengths"].toIntVector();
    const at::Tensor g = grads[0].to(at::kFloat).contiguous();
    return {drop_rows(g, seeds, lengths, dropout_keep_threshold(p), static_cast<float>(1.0 / (1.0 - p))),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void use_portable_dropout_kernel(bool portable) { t_portable = portable; }

bool keyed_dropout_keeps_mask(const at::Tensor& x) { return !(x.device().is_cpu() && x.scalar_type() == at::kFloat); }

at::Tensor keyed_dropout(const at::Tensor& x, double p, uint64_t site) {
  const DropoutKeys& k = t_keys;
  if (k.empty()) return at::dropout(x, p, true);
  MEMTUNE_INTERNAL_ASSERT(x.dim() >= 2 && x.size(0) == static_cast<int64_t>(k.keys.size()) &&
                              k.lengths.size() == k.keys.size(),
                          "keyed_dropout: input of shape ", x.sizes(), " for ", k.keys.size(), " row keys");
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t width = x.numel() / std::max<int64_t>(1, B * T);  // elements per position
  if (!keyed_dropout_keeps_mask(x)) {
    MEMTUNE_INTERNAL_ASSERT(T * width <= int64_t{0xFFFFFFFF}, "keyed_dropout: ", T * width,
                            " elements per row, past the 32-bit element index");
    std::vector<uint32_t> seeds(static_cast<size_t>(B));
    std::vector<int64_t> lengths(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      seeds[static_cast<size_t>(b)] = static_cast<uint32_t>(row_seed(k, b, site));
      lengths[static_cast<size_t>(b)] = std::min(k.lengths[static_cast<size_t>(b)], T);
    }
    return KeyedDropoutFunction::apply(x, p, seeds, lengths);
  }
  at::Tensor keep = at::zeros({B, T, width}, x.options().dtype(at::kBool));
  const double keep_p = 1.0 - p;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::min(k.lengths[b], T);
    if (len <= 0) continue;
    at::Tensor row;
    const uint64_t seed = row_seed(k, b, site);
    // The device's default generator, reseeded for the row and given its state back (its
    // mutex is taken around the state changes only: the draw takes it itself). fp16/bf16
    // rows on the CPU draw from a CPU generator.
    if (x.device().is_cpu()) {
      at::Generator gen = at::detail::createCPUGenerator(seed);
      row = at::rand({len, width}, gen, x.options().dtype(at::kFloat)) < keep_p;
    } else {
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
  return x.masked_fill(keep.logical_not().view(x.sizes()), 0).mul_(1.0 / keep_p);
}

at::Tensor keyed_uniform_noise(const at::Tensor& x, const std::vector<double>& bounds, uint64_t site) {
  MEMTUNE_INTERNAL_ASSERT(x.dim() == 3 && static_cast<int64_t>(bounds.size()) == x.size(0),
                          "keyed_uniform_noise: x (B,T,C) and a bound per row");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const DropoutKeys& k = current_dropout_keys();
  if (k.empty()) {
    at::Tensor noise = at::empty_like(x);
    for (int64_t b = 0; b < B; ++b) noise[b].uniform_(-bounds[b], bounds[b]);
    return noise;
  }
  MEMTUNE_INTERNAL_ASSERT(static_cast<int64_t>(k.keys.size()) == B, "keyed_uniform_noise: ", k.keys.size(),
                          " keys for ", B, " rows");
  at::Tensor noise = at::zeros({B, T, C}, x.options().dtype(at::kFloat).device(at::kCPU));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::min(k.lengths[b], T);
    if (len <= 0) continue;
    at::Generator gen = at::detail::createCPUGenerator(row_seed(k, b, site));
    noise[b].narrow(0, 0, len).uniform_(-bounds[b], bounds[b], gen);
  }
  return noise.to(x.device(), x.scalar_type());
}

uint32_t dropout_keep_threshold(double p) {
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
    out[b] = static_cast<int64_t>(row_seed(k, b, site ^ 0xA77E47105ull) & 0xFFFFFFFFull);
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
  return fmix32_tensor(h.bitwise_xor(col)) < static_cast<int64_t>(dropout_keep_threshold(p));
}

}  // namespace memtune
