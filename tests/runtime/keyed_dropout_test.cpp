// Keyed dropout (runtime/keyed_dropout.h): a row's mask follows its key and its own length,
// not the batch around it; the kept share, the scaling and the gradient are dropout's.
#include <cmath>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/keyed_dropout.h"

namespace memtune {
namespace {

constexpr double kP = 0.25;

// keyed_dropout of all-ones input (B, T, C) under the given keys and lengths.
at::Tensor masks(const std::vector<uint64_t>& keys, const std::vector<int64_t>& lengths, int64_t T, int64_t C,
                 uint64_t site = 11) {
  DropoutKeysScope scope(DropoutKeys{keys, lengths});
  return keyed_dropout(at::ones({static_cast<int64_t>(keys.size()), T, C}), kP, site);
}

TEST(KeyedDropout, ARowsMaskIsTheSameInAnyBatchAndAnyPadding) {
  const at::Tensor alone = masks({42}, {13}, 16, 24);
  const at::Tensor among = masks({7, 42, 9}, {16, 13, 5}, 24, 24);  // other rows, more padding
  EXPECT_TRUE(at::equal(alone[0].narrow(0, 0, 13), among[1].narrow(0, 0, 13)));
  // Padding is never kept.
  EXPECT_EQ(alone[0].narrow(0, 13, 3).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(among[1].narrow(0, 13, 11).abs().sum().item<double>(), 0.0);
  // The neighbours' masks are not the row's.
  EXPECT_FALSE(at::equal(among[0].narrow(0, 0, 13), among[1].narrow(0, 0, 13)));
}

TEST(KeyedDropout, SitesAndKeysDrawDifferentMasks) {
  const at::Tensor a = masks({42}, {16}, 16, 32, 1), b = masks({42}, {16}, 16, 32, 2), c = masks({43}, {16}, 16, 32, 1);
  EXPECT_FALSE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
  EXPECT_TRUE(at::equal(a, masks({42}, {16}, 16, 32, 1)));
  EXPECT_NE(dropout_site("model.layers.0.self_attn.q_proj"), dropout_site("model.layers.0.self_attn.k_proj"));
  EXPECT_NE(dropout_row_key(1, 0, 5), dropout_row_key(1, 1, 5));
}

TEST(KeyedDropout, KeepsOneMinusPScaledAndPassesTheGradientThroughTheMask) {
  at::Tensor x = at::randn({4, 64, 256}).requires_grad_(true);
  at::Tensor y;
  {
    DropoutKeysScope scope(DropoutKeys{{1, 2, 3, 4}, {64, 64, 64, 64}});
    y = keyed_dropout(x, kP, 5);
  }
  const at::Tensor kept = y.ne(0);
  const double share = kept.to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(share, 1 - kP, 0.01) << "65536 draws: 0.01 is 9 standard deviations";
  EXPECT_TRUE(at::allclose(y.masked_select(kept), (x.detach() * (1 / (1 - kP))).masked_select(kept), 0, 0))
      << "scaled as at::dropout scales: x * (1 / (1 - p))";
  y.sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), kept.to(at::kFloat) * (1 / (1 - kP))));
}

// fp32 on the CPU draws its mask in one pass, AVX2 where the CPU has it: the portable pass
// draws the same bits for widths around the 8 lanes, and backward draws them again.
TEST(KeyedDropout, TheCpuPassDrawsTheSameBitsPortableAndVectorised) {
  for (int64_t width : {1, 7, 8, 9, 37, 256}) {
    at::Tensor x = at::randn({3, 11, width});
    at::Tensor fast, portable, grad_fast, grad_portable;
    for (bool p : {false, true}) {
      use_portable_dropout_kernel(p);
      at::Tensor xi = x.clone().requires_grad_(true);
      DropoutKeysScope scope(DropoutKeys{{5, 6, 7}, {11, 4, 0}});
      at::Tensor y = keyed_dropout(xi, kP, 3);
      y.backward(at::ones_like(y));
      (p ? portable : fast) = y.detach();
      (p ? grad_portable : grad_fast) = xi.grad();
    }
    use_portable_dropout_kernel(false);
    EXPECT_TRUE(at::equal(fast, portable)) << width;
    EXPECT_TRUE(at::equal(grad_fast, grad_portable)) << width;
    EXPECT_TRUE(at::equal(grad_fast, fast.ne(0).to(at::kFloat) * (1 / (1 - kP)))) << width;
    EXPECT_EQ(fast[2].abs().sum().item<double>(), 0.0);  // a row of length 0
    EXPECT_FALSE(keyed_dropout_keeps_mask(x));
    EXPECT_TRUE(keyed_dropout_keeps_mask(x.to(at::kBFloat16)));
  }
}

TEST(KeyedDropout, WithoutKeysItIsPlainDropoutAndScopesNest) {
  EXPECT_TRUE(current_dropout_keys().empty());
  {
    DropoutKeysScope outer(DropoutKeys{{1}, {4}});
    {
      DropoutKeysScope inner(DropoutKeys{{2, 3}, {4, 4}});
      EXPECT_EQ(current_dropout_keys().keys.size(), 2u);
    }
    EXPECT_EQ(current_dropout_keys().keys, std::vector<uint64_t>{1});
  }
  EXPECT_TRUE(current_dropout_keys().empty());
  const at::Tensor y = keyed_dropout(at::ones({2, 8, 8}), kP, 1);
  EXPECT_TRUE((y.eq(0) | y.eq(1 / (1 - kP))).all().item<bool>());
}

}  // namespace
// NEFTune's noise (keyed_uniform_noise): a row's noise follows its key and length, not the
// batch; it lies in [-bound, bound) with a uniform's mean 0 and variance bound^2 / 3, and
// padding gets none; a bf16 input gets the fp32 draw rounded.
TEST(KeyedUniformNoise, ARowsNoiseIsTheSameInAnyBatchUniformInItsBoundAndNoneOnPadding) {
  auto noise = [](const std::vector<uint64_t>& keys, const std::vector<int64_t>& lengths, int64_t T,
                  const std::vector<double>& bounds, at::ScalarType dtype = at::kFloat) {
    DropoutKeysScope scope(DropoutKeys{keys, lengths});
    return keyed_uniform_noise(at::zeros({static_cast<int64_t>(keys.size()), T, 64}, dtype), bounds,
                               dropout_site("neftune"));
  };
  const at::Tensor alone = noise({42}, {100}, 104, {0.5});
  const at::Tensor among = noise({7, 42}, {30, 100}, 128, {0.25, 0.5});
  EXPECT_TRUE(at::equal(alone[0].narrow(0, 0, 100), among[1].narrow(0, 0, 100)));
  EXPECT_EQ(alone[0].narrow(0, 100, 4).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(among[0].narrow(0, 30, 98).abs().sum().item<double>(), 0.0);
  const at::Tensor row = alone[0].narrow(0, 0, 100).to(at::kDouble);  // 6400 draws
  EXPECT_LT(row.max().item<double>(), 0.5);
  EXPECT_GE(row.min().item<double>(), -0.5);
  EXPECT_GT(row.max().item<double>(), 0.49);
  EXPECT_LT(row.min().item<double>(), -0.49);
  EXPECT_NEAR(row.mean().item<double>(), 0.0, 4 * 0.5 / std::sqrt(3.0 * 6400));  // 4 standard errors
  EXPECT_NEAR(row.var().item<double>(), 0.25 / 3, 0.05 * 0.25 / 3);
  EXPECT_LE(among[0].abs().max().item<double>(), 0.25);  // each row its own bound
  EXPECT_FALSE(at::equal(noise({43}, {100}, 104, {0.5}), alone));
  const at::Tensor bf16 = noise({42}, {100}, 104, {0.5}, at::kBFloat16);
  EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(bf16, alone.to(at::kBFloat16)));
}

}  // namespace memtune
