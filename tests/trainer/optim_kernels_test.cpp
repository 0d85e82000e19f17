// AdamW with fp32 states on the CPU (trainer/optim_kernels.h): torch.optim.AdamW's update
// against its formula worked out in double precision, the AVX2 kernels against the scalar
// ones bit for bit (ragged lengths, specials, scaled and unscaled gradients), and the
// threaded entry points against the kernels on one thread. bitsandbytes' 32-bit update is
// also checked bit for bit against its NumPy reference (adamw8bit_test.cpp, the "small" case).
// Adafactor's fused passes against the ATen ops they replace, and the gradients' sum of squares.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "trainer/optim_kernels.h"

namespace {

namespace tr = memtune::trainer;

struct State {
  std::vector<float> p, g, m, v;
  bool operator==(const State& o) const {
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    return same(p, o.p) && same(g, o.g) && same(m, o.m) && same(v, o.v);
  }
};

// n elements of a state some steps into training, specials sprinkled in when asked.
State random_state(int64_t n, std::mt19937& rng, bool specials) {
  std::normal_distribution<float> normal;
  State s;
  for (int64_t j = 0; j < n; ++j) {
    s.p.push_back(normal(rng) * 0.05f);
    s.g.push_back(normal(rng) * 1e-3f);
    s.m.push_back(normal(rng) * 1e-4f);
    s.v.push_back(std::fabs(normal(rng)) * 1e-7f);
  }
  if (specials) {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < n; ++j) {
      switch (rng() % 41) {
        case 0: s.g[j] = inf; break;
        case 1: s.g[j] = nan; break;
        case 2: s.g[j] = -1e-40f; break;  // denormal
        case 3: s.g[j] = -0.0f; break;
        case 4: s.v[j] = 0.0f, s.m[j] = 0.0f, s.g[j] = 0.0f; break;  // an untouched element: 0 / eps
        case 5: s.g[j] = 3e30f; break;  // g^2 overflows
        default: break;
      }
    }
  }
  return s;
}

tr::TorchAdamW torch_scalars(int t, double lr, double wd, double scale) {
  const double b1 = 0.9, b2 = 0.999;
  return {static_cast<float>(scale), static_cast<float>(1.0 - lr * wd), static_cast<float>(b1),
          static_cast<float>(1.0 - b1), static_cast<float>(b2), static_cast<float>(1.0 - b2),
          static_cast<float>(std::sqrt(1.0 - std::pow(b2, t))), 1e-8f,
          static_cast<float>(-lr / (1.0 - std::pow(b1, t)))};
}

// torch.optim.AdamW's update (decoupled decay, bias corrections) in double precision from the
// same inputs: the fp32 kernel may differ from it by its roundings only.
TEST(AdamW32Kernels, TorchUpdateIsAdamWsFormula) {
  std::mt19937 rng(3);
  const int64_t n = 1000;
  State s = random_state(n, rng, false);
  const State before = s;
  const int t = 7;
  const double lr = 2e-3, wd = 0.1, scale = 0.5, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  double moved = 0;
  tr::torch_adamw_scalar(torch_scalars(t, lr, wd, scale), s.p.data(), s.g.data(), s.m.data(), s.v.data(), n);
  for (int64_t j = 0; j < n; ++j) {
    const double g = static_cast<double>(before.g[j]) * scale;
    const double m = b1 * before.m[j] + (1 - b1) * g, v = b2 * before.v[j] + (1 - b2) * g * g;
    const double mhat = m / (1 - std::pow(b1, t)), vhat = v / (1 - std::pow(b2, t));
    // torch divides sqrt(v) by sqrt(1 - b2^t) before adding eps: eps is not bias-corrected
    const double p = before.p[j] * (1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + eps);
    ASSERT_NEAR(s.g[j], g, 1e-7 * std::fabs(g)) << j;  // the scaled gradient is written back
    // fp32 roundings of the terms (which may cancel), not of the result
    ASSERT_NEAR(s.m[j], m, 1e-6 * (b1 * std::fabs(before.m[j]) + (1 - b1) * std::fabs(g))) << j;
    ASSERT_NEAR(s.v[j], v, 1e-6 * v + 1e-18) << j;
    ASSERT_NEAR(s.p[j], p, 1e-6 * (std::fabs(before.p[j]) + std::fabs(p - before.p[j]))) << j;
    moved += std::fabs(p - before.p[j] * (1 - lr * wd));
  }
  EXPECT_GT(moved / n, 1e-2 * lr);  // the steps are far above the tolerance above
}

TEST(AdamW32Kernels, UnscaledGradientIsLeftAsItIs) {
  std::mt19937 rng(4);
  State s = random_state(333, rng, true);
  const std::vector<float> g = s.g;
  tr::torch_adamw(torch_scalars(2, 1e-3, 0.01, 1.0), s.p.data(), s.g.data(), s.m.data(), s.v.data(), 333);
  EXPECT_EQ(std::memcmp(g.data(), s.g.data(), g.size() * sizeof(float)), 0);
}

TEST(AdamW32Kernels, Avx2KernelsAreTheScalarOnesBitForBit) {
#ifndef MEMTUNE_X86
  GTEST_SKIP() << "not an x86 CPU";
#else
  if (!memtune::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 kernels here (the CPU has none, or ATEN_CPU_CAPABILITY=default)";
  std::mt19937 rng(5);
  int compared = 0;
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 100, 4096 + 5}) {
    for (int t = 1; t <= 6; ++t) {
      SCOPED_TRACE("n " + std::to_string(n) + ", step " + std::to_string(t));
      const State start = random_state(n, rng, true);
      const double scale = t % 2 ? 1.0 : 0.37, wd = t % 3 ? 0.01 : 0.0;
      State a = start, b = start;
      tr::torch_adamw_scalar(torch_scalars(t, 1e-3, wd, scale), a.p.data(), a.g.data(), a.m.data(), a.v.data(), n);
      tr::torch_adamw_avx2(torch_scalars(t, 1e-3, wd, scale), b.p.data(), b.g.data(), b.m.data(), b.v.data(), n);
      ASSERT_TRUE(a == b) << "torch AdamW";
      const tr::BnbScalars bs(t, 1e-3, 0.9, 0.999, 1e-8, wd, scale);
      a = start, b = start;
      tr::bnb_adam32_scalar(bs, a.p.data(), a.g.data(), a.m.data(), a.v.data(), n);
      tr::bnb_adam32_avx2(bs, b.p.data(), b.g.data(), b.m.data(), b.v.data(), n);
      ASSERT_TRUE(a == b) << "bitsandbytes 32-bit";
      if (n > 0) {
        ASSERT_FALSE(a == start);  // the update did something
      }
      ++compared;
    }
  }
  EXPECT_EQ(compared, 10 * 6);
#endif
}

// The threaded entry points split a tensor into tasks at arbitrary offsets; each element's
// update is its own, so the result is the one-thread kernel's.
TEST(AdamW32Kernels, ThreadedUpdatesEqualOneKernelPass) {
  std::mt19937 rng(6);
  const int64_t n = 3 * 16384 + 1001;  // several tasks, the last one ragged
  const State start = random_state(n, rng, true);
  const int threads = at::get_num_threads();
  for (int k : {1, 2, 3}) {
    at::set_num_threads(k);
    State a = start, b = start;
    const auto s = torch_scalars(3, 1e-3, 0.01, 0.5);
    tr::torch_adamw_scalar(s, a.p.data(), a.g.data(), a.m.data(), a.v.data(), n);
    tr::torch_adamw(s, b.p.data(), b.g.data(), b.m.data(), b.v.data(), n);
    EXPECT_TRUE(a == b) << k << " threads, torch AdamW";
    const tr::BnbScalars bs(3, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0);
    a = start, b = start;
    tr::bnb_adam32_scalar(bs, a.p.data(), a.g.data(), a.m.data(), a.v.data(), n);
    tr::bnb_adam32(bs, b.p.data(), b.g.data(), b.m.data(), b.v.data(), n);
    EXPECT_TRUE(a == b) << k << " threads, bitsandbytes 32-bit";
  }
  at::set_num_threads(threads);
}

}  // namespace

namespace {

std::vector<float> random_floats(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng) * std::pow(10.0f, -6.0f * unit(rng));  // magnitudes over six decades
  return x;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The sum of squares is the exact one to double rounding (a long double Kahan sum as the
// yardstick), at lengths around the 16 running sums and the blocks.
TEST(SquareSum, IsTheSumOfSquares) {
  std::mt19937 rng(7);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, tr::kSquareSumBlock,
                    tr::kSquareSumBlock + 1, 3 * tr::kSquareSumBlock + 5, int64_t{1} << 20}) {
    const std::vector<float> x = random_floats(n, rng);
    long double sum = 0, carry = 0;
    for (float v : x) {
      const long double y = static_cast<long double>(v) * v - carry, t = sum + y;
      carry = (t - sum) - y;
      sum = t;
    }
    const double got = tr::square_sum(x.data(), n);
    EXPECT_NEAR(got, static_cast<double>(sum), 1e-14 * static_cast<double>(sum)) << "n " << n;
    if (n > 0) {
      EXPECT_GT(got, 0.0);
    }
  }
}

TEST(SquareSum, Avx2BlockIsTheScalarOneBitForBit) {
#ifndef MEMTUNE_X86
  GTEST_SKIP() << "not an x86 CPU";
#else
  if (!memtune::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 kernels here (the CPU has none, or ATEN_CPU_CAPABILITY=default)";
  std::mt19937 rng(8);
  for (int64_t n : {0, 1, 5, 15, 16, 17, 31, 33, 1000, 16384}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x = random_floats(n, rng);
      for (float& v : x)  // squares of many magnitudes side by side, so the order of the sums shows
        v *= std::pow(2.0f, static_cast<float>(rng() % 40));
      ASSERT_TRUE(same_bits(tr::square_sum_block_scalar(x.data(), n), tr::square_sum_block_avx2(x.data(), n)))
          << "n " << n;
    }
  }
  const float specials[] = {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (float special : specials) {
    std::vector<float> x = random_floats(40, rng);
    x[37] = special;  // in the tail
    EXPECT_TRUE(same_bits(tr::square_sum_block_scalar(x.data(), 40), tr::square_sum_block_avx2(x.data(), 40)));
  }
#endif
}

// The order is the blocks' in turn, whatever the number of threads.
TEST(SquareSum, SameBitsOnAnyNumberOfThreads) {
  std::mt19937 rng(9);
  const int64_t n = 5 * tr::kSquareSumBlock + 123;
  std::vector<float> x = random_floats(n, rng);
  for (float& v : x)
    if (rng() % 5 == 0) v *= 1e9f;
  double want = 0;
  for (int64_t b = 0; b < n; b += tr::kSquareSumBlock)
    want += tr::square_sum_block_scalar(x.data() + b, std::min(tr::kSquareSumBlock, n - b));
  const int threads = at::get_num_threads();
  for (int k : {1, 2, 3}) {
    at::set_num_threads(k);
    EXPECT_TRUE(same_bits(tr::square_sum(x.data(), n), want)) << k << " threads";
  }
  at::set_num_threads(threads);
}

}  // namespace

namespace {

// Adafactor's fused passes (optim_kernels.h) against the ATen ops they replace in
// optimizer.cpp's chain, bit for bit: ragged widths around the 8 lanes, specials, a scaled and
// an unscaled gradient.
at::Tensor with_specials(at::Tensor t, std::mt19937& rng) {
  float* x = t.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t j = 0; j < t.numel(); ++j) {
    switch (rng() % 37) {
      case 0: x[j] = inf; break;
      case 1: x[j] = nan; break;
      case 2: x[j] = -1e-40f; break;  // denormal
      case 3: x[j] = -0.0f; break;
      case 4: x[j] = 3e30f; break;  // its square overflows
      default: break;
    }
  }
  return t;
}

float* f32(const at::Tensor& t) { return t.data_ptr<float>(); }

TEST(AdafactorKernels, EachPassGivesTheBitsOfTheAtenOpsItReplaces) {
  std::mt19937 rng(10);
  at::manual_seed(10);
  int compared = 0;
  for (int64_t rows : {1, 3, 33}) {
    for (int64_t cols : {1, 4, 7, 8, 9, 17, 300}) {
      for (float scale : {1.0f, 0.37f}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + ", scale " + std::to_string(scale));
        const float eps = 1e-30f, lr = 3e-3f;
        const at::Tensor g0 = with_specials(at::randn({rows, cols}) * 1e-3, rng);

        at::Tensor g_want = g0.clone(), u_want = at::empty_like(g0);
        if (scale != 1.0f) g_want.mul_(static_cast<double>(scale));
        at::mul_out(u_want, g_want, g_want);
        u_want.add_(static_cast<double>(eps));
        at::Tensor g = g0.clone(), u = at::empty_like(g0);
        tr::adafactor_square(scale, eps, f32(g), f32(u), g.numel());
        ASSERT_TRUE(memtune::testing::same_bits(g, g_want)) << "the scaled gradient";
        ASSERT_TRUE(memtune::testing::same_bits(u, u_want)) << "g^2 + eps";

        const at::Tensor r = at::rand({rows, 1}) * 4, c = with_specials(at::rand({1, cols}) * 4, rng);
        at::mul_out(u_want, r, c);
        u_want.mul_(g);
        tr::adafactor_factored(f32(r), f32(c), f32(g), f32(u), rows, cols);
        ASSERT_TRUE(memtune::testing::same_bits(u, u_want)) << "(r c) g";

        const at::Tensor d = (at::linalg_vector_norm(u, 2) / 0.25).clamp_min_(1.0);  // a 0-dim tensor, as the step's
        const at::Tensor p0 = at::randn({rows, cols}) * 0.05;
        at::Tensor p_want = p0.clone(), v = u.clone();
        v.div_(d);
        v.mul_(static_cast<double>(lr));
        p_want.sub_(v);
        at::Tensor p = p0.clone();
        tr::adafactor_apply(d.item<float>(), lr, f32(u), f32(p), p.numel());
        ASSERT_TRUE(memtune::testing::same_bits(p, p_want)) << "p - (u / d) lr";
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 3 * 7 * 2);
}

TEST(AdafactorKernels, Avx2KernelsAreTheScalarOnesBitForBit) {
#ifndef MEMTUNE_X86
  GTEST_SKIP() << "not an x86 CPU";
#else
  if (!memtune::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 kernels here (the CPU has none, or ATEN_CPU_CAPABILITY=default)";
  std::mt19937 rng(11);
  at::manual_seed(11);
  for (int64_t cols : {1, 7, 8, 9, 16, 17, 4101}) {
    SCOPED_TRACE("cols " + std::to_string(cols));
    const int64_t rows = 5, n = rows * cols;
    const at::Tensor g0 = with_specials(at::randn({rows, cols}) * 1e-3, rng);
    const at::Tensor r = at::rand({rows}) * 4, c = with_specials(at::rand({cols}) * 4, rng);
    for (float scale : {1.0f, 0.37f}) {
      at::Tensor ga = g0.clone(), gb = g0.clone(), ua = at::empty_like(g0), ub = at::empty_like(g0);
      tr::adafactor_square_scalar(scale, 1e-30f, f32(ga), f32(ua), n);
      tr::adafactor_square_avx2(scale, 1e-30f, f32(gb), f32(ub), n);
      ASSERT_TRUE(memtune::testing::same_bits(ga, gb) && memtune::testing::same_bits(ua, ub)) << "square, scale " << scale;
    }
    at::Tensor ua = at::empty_like(g0), ub = at::empty_like(g0);
    tr::adafactor_factored_scalar(f32(r), f32(c), f32(g0), f32(ua), rows, cols);
    tr::adafactor_factored_avx2(f32(r), f32(c), f32(g0), f32(ub), rows, cols);
    ASSERT_TRUE(memtune::testing::same_bits(ua, ub)) << "factored";
    const at::Tensor p0 = at::randn({rows, cols});
    at::Tensor pa = p0.clone(), pb = p0.clone();
    tr::adafactor_apply_scalar(1.7f, 1e-3f, f32(ua), f32(pa), n);
    tr::adafactor_apply_avx2(1.7f, 1e-3f, f32(ua), f32(pb), n);
    ASSERT_TRUE(memtune::testing::same_bits(pa, pb)) << "apply";
    EXPECT_FALSE(memtune::testing::same_bits(pa, p0));  // the update did something
  }
#endif
}

// The threaded entry points cut at arbitrary elements or rows; each element is its own.
TEST(AdafactorKernels, ThreadedPassesEqualOneKernelPass) {
  std::mt19937 rng(12);
  at::manual_seed(12);
  const int64_t rows = 97, cols = 1031;  // several tasks, ragged rows
  const int64_t n = rows * cols;
  const at::Tensor g0 = with_specials(at::randn({rows, cols}) * 1e-3, rng);
  const at::Tensor r = at::rand({rows}) * 4, c = at::rand({cols}) * 4, p0 = at::randn({rows, cols});
  at::Tensor g_want = g0.clone(), u_want = at::empty_like(g0), f_want = at::empty_like(g0), p_want = p0.clone();
  tr::adafactor_square_scalar(0.5f, 1e-30f, f32(g_want), f32(u_want), n);
  tr::adafactor_factored_scalar(f32(r), f32(c), f32(g_want), f32(f_want), rows, cols);
  tr::adafactor_apply_scalar(1.3f, 1e-2f, f32(f_want), f32(p_want), n);
  const int threads = at::get_num_threads();
  for (int k : {1, 2, 3}) {
    at::set_num_threads(k);
    at::Tensor g = g0.clone(), u = at::empty_like(g0), f = at::empty_like(g0), p = p0.clone();
    tr::adafactor_square(0.5f, 1e-30f, f32(g), f32(u), n);
    tr::adafactor_factored(f32(r), f32(c), f32(g), f32(f), rows, cols);
    tr::adafactor_apply(1.3f, 1e-2f, f32(f), f32(p), n);
    EXPECT_TRUE(memtune::testing::same_bits(g, g_want) && memtune::testing::same_bits(u, u_want)) << k << " threads, square";
    EXPECT_TRUE(memtune::testing::same_bits(f, f_want)) << k << " threads, factored";
    EXPECT_TRUE(memtune::testing::same_bits(p, p_want)) << k << " threads, apply";
  }
  at::set_num_threads(threads);
}

}  // namespace
