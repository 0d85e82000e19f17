// The 8-bit AdamW kernels against each other (adamw8bit_test holds them to the NumPy
// reference): the code tables against quantize_2D's binary search on every float in the
// range states take, and the AVX2 kernel against the scalar one, byte for byte, on ragged
// tensors with all-zero blocks, non-finite gradients and magnitudes from denormal to overflow.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "trainer/adamw8bit_kernels.h"
#include "trainer/optimizer.h"

namespace {

namespace tr = memtune::trainer;
using tr::CodeTable;

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

TEST(Adam8Kernels, CodeTablesAreTheSearchOnEveryFloat) {
  // Every float whose bucket holds a threshold (2^-24 <= |x| < 1.0, both signs: 4.0e8 per map),
  // and every 61st of the others (tiny, denormal, >= 1.0, inf, NaN with any payload and sign):
  // the table, and its AVX2 form where the CPU has it, against the search.
  for (bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const CodeTable& t = tr::code_table(is_signed);
    const float* code = tr::dynamic_map(is_signed).data_ptr<float>();
    ASSERT_EQ(t.code, code);
    std::atomic<int64_t> checked{0}, bad{0}, bad_avx2{0};
    std::atomic<uint32_t> first_bad{0};
    at::parallel_for(0, int64_t{1} << 16, 64, [&](int64_t h0, int64_t h1) {
      std::vector<float> xs(65536);
      std::vector<uint8_t> got(65536);
      for (int64_t h = h0; h < h1; ++h) {
        const uint32_t mag = static_cast<uint32_t>(h) & 0x7FFFu;
        const uint32_t stride = mag >= CodeTable::kBase && mag < CodeTable::kTop ? 1 : 61;
        int64_t k = 0;
        for (uint32_t low = 0; low < 65536; low += stride) xs[k++] = float_of(static_cast<uint32_t>(h) << 16 | low);
        int64_t wrong = 0, wrong_avx2 = 0;
#ifdef MEMTUNE_X86
        if (memtune::cpu_has_avx2()) tr::quantize_avx2(t, xs.data(), k, got.data());
#endif
        for (int64_t i = 0; i < k; ++i) {
          const uint8_t want = tr::quantize_2d_search(code, is_signed, xs[i]);
          if (t(xs[i]) != want) {
            ++wrong;
            uint32_t b;
            std::memcpy(&b, &xs[i], 4);
            first_bad = b;
          }
#ifdef MEMTUNE_X86
          if (memtune::cpu_has_avx2()) wrong_avx2 += got[i] != want;
#endif
        }
        checked += k;
        bad += wrong;
        bad_avx2 += wrong_avx2;
      }
    });
    // every float of the 2 x (kTop - kBase) threshold-holding buckets, and a sample of the rest
    EXPECT_GT(checked.load(), int64_t{2} * (CodeTable::kTop - CodeTable::kBase) * 65536);
    EXPECT_EQ(bad.load(), 0) << "e.g. bits " << std::hex << first_bad.load();
    EXPECT_EQ(bad_avx2.load(), 0);
  }
}

TEST(Adam8Kernels, EveryEntryIsItsOwnCodeAndNaNIsZero) {
  for (bool is_signed : {true, false}) {
    const CodeTable& t = tr::code_table(is_signed);
    for (int k = 0; k < 256; ++k) EXPECT_EQ(t(t.code[k]), k);
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(t(nan), 0);
    EXPECT_EQ(t(-nan), 0);
    volatile float zero = 0.0f;
    EXPECT_EQ(t(zero / zero), 0);  // the 0/0 of an all-zero block
    EXPECT_EQ(t(inf), 255);
    EXPECT_EQ(t(-inf), 0);
  }
}

// One tensor's 8-bit state, stepped by one kernel.
struct State {
  std::vector<float> p, absmax1, absmax2;
  std::vector<uint8_t> c1, c2;
  bool operator==(const State& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(p, o.p) && same(absmax1, o.absmax1) && same(absmax2, o.absmax2) && same(c1, o.c1) && same(c2, o.c2);
  }
};

template <class Kernel>
void step(State& st, const std::vector<float>& g, const tr::BnbScalars& s, Kernel kernel) {
  const int64_t n = static_cast<int64_t>(st.p.size()), blocks = static_cast<int64_t>(st.absmax1.size());
  const tr::Adam8Tensors t{&tr::code_table(true), &tr::code_table(false), st.p.data(), g.data(), st.c1.data(),
                           st.c2.data(), st.absmax1.data(), st.absmax2.data(), n};
  kernel(s, t, 0, blocks);
}

TEST(Adam8Kernels, Avx2KernelIsTheScalarOneByteForByte) {
#ifndef MEMTUNE_X86
  GTEST_SKIP() << "not an x86 CPU";
#else
  if (!memtune::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 kernels here (the CPU has none, or ATEN_CPU_CAPABILITY=default)";
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  int64_t compared = 0;
  for (int64_t n : {1, 7, 100, 255, 256, 257, 300, 4096, 4096 + 17, 5000, 256 * 37 + 3}) {
    for (bool random_start : {false, true}) {
      SCOPED_TRACE("n " + std::to_string(n) + (random_start ? ", random codes" : ", zero state"));
      const int64_t blocks = (n + tr::kBlock8bit - 1) / tr::kBlock8bit;
      State a;
      a.p.resize(n);
      for (float& x : a.p) x = normal(rng) * 0.05f;
      a.absmax1.assign(blocks, 0.0f);
      a.absmax2.assign(blocks, 0.0f);
      a.c1.assign(n, 0);
      a.c2.assign(n, 0);
      if (random_start) {  // any codes and scales, a block at absmax 0, one at a denormal
        for (auto& c : a.c1) c = static_cast<uint8_t>(rng());
        for (auto& c : a.c2) c = static_cast<uint8_t>(rng());
        for (int64_t b = 0; b < blocks; ++b) {
          a.absmax1[b] = std::pow(10.0f, -8.0f * unit(rng));
          a.absmax2[b] = std::pow(10.0f, -12.0f * unit(rng));
        }
        a.absmax1[0] = 0.0f;
        a.absmax2[blocks - 1] = 1e-42f;
      }
      State b = a;
      std::vector<float> g(n);
      for (int64_t t = 1; t <= 12; ++t) {
        SCOPED_TRACE("step " + std::to_string(t));
        const float scale = std::pow(10.0f, -8.0f + 10.0f * unit(rng));
        for (float& x : g) x = normal(rng) * scale;
        if (t <= 3)  // an all-zero first block (0/0 codes), -0.0 included
          for (int64_t j = 0; j < std::min<int64_t>(n, tr::kBlock8bit); ++j) g[j] = j % 2 ? 0.0f : -0.0f;
        for (int64_t j = 0; j < n; ++j) {  // specials here and there, the tail block's too
          const uint32_t r = rng() % 97;
          if (r == 0) g[j] = inf;
          else if (r == 1) g[j] = -inf;
          else if (r == 2) g[j] = nan;
          else if (r == 3 && t == 6) g[j] = 3e30f;   // v = g^2 overflows: absmax2 inf, then NaN states
          else if (r == 4) g[j] = -1e-40f;           // denormal
          else if (r == 5) g[j] = 1e-30f * normal(rng);
        }
        const tr::BnbScalars s(t, t % 3 ? 1e-3 : 3e-2, t % 2 ? 0.9 : 0.85, t % 4 ? 0.999 : 0.95, 1e-8,
                               t % 5 ? 0.01 : 0.0, t % 3 ? 1.0 : 0.37);
        step(a, g, s, tr::adam8_blocks_scalar);
        step(b, g, s, tr::adam8_blocks_avx2);
        ASSERT_TRUE(a == b);
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 11 * 2 * 12);
#endif
}

}  // namespace
