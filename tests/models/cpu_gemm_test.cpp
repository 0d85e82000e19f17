// narrow_mm (models/layers/cpu_gemm.h), the register-tiled GEMM the LoRA adapters' narrow
// products take on the CPU: against the product in fp64 within the rounding bound of an
// fp32 sum, for operands in place with any strides (transposed views), panels cut short,
// rows off the tile, alpha and accumulation, in its AVX-512 form (where the CPU has it) and
// its AVX2 one; a column-major output with the row-major one's bits; the same bits whatever
// the thread count.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>

#include "models/layers/cpu_gemm.h"
#include "models/layers/cpu_vec.h"
#include "runtime/error.h"
#include "test_util.h"

namespace {

using memtune::models::detail::avx2_kernels_active;
using memtune::models::detail::narrow_mm;
using memtune::models::detail::narrow_mm_applies;

struct Dims {
  int64_t M, K, N;
};

// |C - C64| <= gamma_K (|a| |b|), gamma_K = K u / (1 - K u): the bound of any order of an fp32
// sum of K products (Higham, Accuracy and Stability, 3.1), with u = 2^-24; the accumulated
// form adds one more rounding.
void expect_within_fp32_sum_bound(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                                  const at::Tensor& c0, const std::string& what) {
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  at::Tensor want = alpha * at::mm(a64, b64);
  const double u = std::ldexp(1.0, -24), k = static_cast<double>(a.size(1) + 2);
  at::Tensor bound = std::abs(alpha) * at::mm(a64.abs(), b64.abs()) * (k * u / (1 - k * u));
  if (c0.defined()) {
    want = want + c0.to(at::kDouble);
    bound = bound + want.abs() * u;
  }
  const at::Tensor excess = (c.to(at::kDouble) - want).abs() - bound;
  EXPECT_LE(excess.max().item<double>(), 0.0) << what << ": beyond the bound by " << excess.max().item<double>();
}

class NarrowMm : public ::testing::TestWithParam<Dims> {
 protected:
  void SetUp() override {
    if (!avx2_kernels_active()) GTEST_SKIP() << "no AVX2 + FMA on this CPU: narrow_mm is not taken";
  }
};

TEST_P(NarrowMm, IsTheProductWithinTheRoundingOfAnFp32Sum) {
  const Dims d = GetParam();
  at::manual_seed(d.M * 131 + d.K * 7 + d.N);
  for (bool avx2_at_most : {false, true}) {
    memtune::models::detail::use_avx2_cpu_kernels_at_most(avx2_at_most);
    SCOPED_TRACE(avx2_at_most ? "AVX2 at most" : "the best kernel this CPU has");
  for (bool a_transposed : {false, true}) {
    for (bool b_transposed : {false, true}) {
      // Stored the other way round and seen through .t(), or strided by a slice.
      at::Tensor a = a_transposed ? at::randn({d.K, d.M}).t() : at::randn({d.M, d.K + 3}).slice(1, 0, d.K);
      at::Tensor b = b_transposed ? at::randn({d.N, d.K}).t() : at::randn({d.K, d.N});
      const std::string what = "a" + std::string(a_transposed ? "^T" : "") + " b" + (b_transposed ? "^T" : "");
      ASSERT_TRUE(narrow_mm_applies(a, b)) << what;
      expect_within_fp32_sum_bound(narrow_mm(a, b), a, b, 1.0, {}, what);
      expect_within_fp32_sum_bound(narrow_mm(a, b, -0.75), a, b, -0.75, {}, what + " alpha -0.75");
      at::Tensor c0 = at::randn({d.M, d.N}), c = c0.clone();
      EXPECT_EQ(narrow_mm(a, b, 0.5, c, /*accumulate=*/true).data_ptr(), c.data_ptr()) << what;
      expect_within_fp32_sum_bound(c, a, b, 0.5, c0, what + " accumulated");
      // Into a row-major slice of a wider buffer: the columns beside it untouched.
      at::Tensor wide = at::full({d.M, d.N + 5}, 7.0f), into = wide.slice(1, 2, 2 + d.N);
      narrow_mm(a, b, 1.0, into);
      expect_within_fp32_sum_bound(into, a, b, 1.0, {}, what + " into a slice");
      EXPECT_TRUE(wide.slice(1, 0, 2).eq(7.0f).all().item<bool>()) << what;
      EXPECT_TRUE(wide.slice(1, 2 + d.N).eq(7.0f).all().item<bool>()) << what;
      // Column-major, into a slice of a wider and taller N x M buffer (its columns further
      // apart than M): the row-major product's bits, alone and accumulated, the rows and
      // columns around it untouched.
      at::Tensor tall = at::full({d.N + 4, d.M + 3}, 7.0f);
      at::Tensor across = tall.slice(0, 1, 1 + d.N).slice(1, 0, d.M).t();
      narrow_mm(a, b, -0.75, across);
      EXPECT_TRUE(memtune::testing::same_bits(across.contiguous(), narrow_mm(a, b, -0.75))) << what << " across";
      at::Tensor c1 = c0.clone();
      narrow_mm(a, b, 0.5, c1, /*accumulate=*/true);
      across.copy_(c0);
      narrow_mm(a, b, 0.5, across, /*accumulate=*/true);
      EXPECT_TRUE(memtune::testing::same_bits(across.contiguous(), c1)) << what << " across, accumulated";
      EXPECT_TRUE(tall.slice(0, 0, 1).eq(7.0f).all().item<bool>()) << what;
      EXPECT_TRUE(tall.slice(0, 1 + d.N).eq(7.0f).all().item<bool>()) << what;
      EXPECT_TRUE(tall.slice(1, d.M).eq(7.0f).all().item<bool>()) << what;
    }
  }
  }
  memtune::models::detail::use_avx2_cpu_kernels_at_most(false);
}

// Rows as LoRA has them (micro-batch x tokens) and the edges of the 6 x 16 tile: one row, a
// remainder of every size, a panel cut short, two and four panels (r 17 to 64), K of one,
// one column.
INSTANTIATE_TEST_SUITE_P(Shapes, NarrowMm,
                         ::testing::Values(Dims{1, 1, 1}, Dims{1, 40, 16}, Dims{5, 3, 7}, Dims{7, 19, 16},
                                           Dims{13, 64, 17}, Dims{64, 33, 8}, Dims{97, 128, 32},
                                           Dims{250, 96, 64}, Dims{512, 768, 16}, Dims{23, 1, 48},
                                           Dims{29, 5, 1}),
                         [](const ::testing::TestParamInfo<Dims>& info) {
                           return "M" + std::to_string(info.param.M) + "K" + std::to_string(info.param.K) + "N" +
                                  std::to_string(info.param.N);
                         });

TEST_F(NarrowMm, GivesTheSameBitsOnOneThreadAsOnMany) {
  at::manual_seed(3);
  const at::Tensor a = at::randn({1000, 300}), b = at::randn({300, 16});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = narrow_mm(a, b);
  at::Tensor one_across = at::empty({16, 1000});
  narrow_mm(a, b, 1.0, one_across.t());
  at::set_num_threads(std::max(threads, 4));  // more tasks than this machine may have cores
  const at::Tensor many = narrow_mm(a, b);
  at::Tensor many_across = at::empty({16, 1000});
  narrow_mm(a, b, 1.0, many_across.t());
  at::set_num_threads(threads);
  EXPECT_TRUE(memtune::testing::same_bits(one, many));
  EXPECT_TRUE(memtune::testing::same_bits(one_across, many_across));
  EXPECT_TRUE(memtune::testing::same_bits(one_across.t().contiguous(), one));
}

TEST(NarrowMmApplies, OnlyToFp32CpuProductsAtMost64Wide) {
  const at::Tensor a = at::randn({8, 32});
  EXPECT_EQ(narrow_mm_applies(a, at::randn({32, 64})), avx2_kernels_active());
  EXPECT_FALSE(narrow_mm_applies(a, at::randn({32, 65})));                    // a BLAS product
  EXPECT_FALSE(narrow_mm_applies(a, at::randn({31, 16})));                    // shapes that do not chain
  EXPECT_FALSE(narrow_mm_applies(a.to(at::kBFloat16), at::randn({32, 16}).to(at::kBFloat16)));
  EXPECT_FALSE(narrow_mm_applies(a.to(at::kDouble), at::randn({32, 16}, at::kDouble)));
  memtune::models::detail::use_portable_cpu_kernels(true);
  EXPECT_FALSE(narrow_mm_applies(a, at::randn({32, 16})));
  memtune::models::detail::use_portable_cpu_kernels(false);
}

TEST_F(NarrowMm, RefusesAnOutputOfTheWrongShapeOrLayout) {
  const at::Tensor a = at::randn({8, 32}), b = at::randn({32, 16});
  EXPECT_THROW(narrow_mm(a, at::randn({32, 100})), memtune::UserError);
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({8, 15})), memtune::UserError);
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({8, 16}).t()), memtune::UserError);  // the wrong shape, [16, 8]
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({8, 32}).slice(1, 0, 32, 2)), memtune::UserError);  // no stride 1
  // Elements sharing addresses, which the threads would write at once.
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({1, 16}).expand({8, 16})), memtune::UserError);
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({23}).as_strided({8, 16}, {1, 1})), memtune::UserError);
  EXPECT_THROW(narrow_mm(a, b, 1.0, at::empty({68}).as_strided({8, 16}, {1, 4})), memtune::UserError);
}

}  // namespace
