// The rotary node against Hugging Face's apply_rotary_pos_emb written with ATen ops under
// autograd (x * cos + rotate_half(x) * sin): output and gradient, on the CPU's fp32 kernel
// and on the ATen path other dtypes take, with x as the strided view a projection gives.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "models/layers/rotary.h"
#include "runtime/error.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;

at::Tensor hf_rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.slice(-1, h), x.slice(-1, 0, h)}, -1);
}

TEST(Rotary, MatchesHuggingFacesOpsAndTheirGradient) {
  torch::manual_seed(5);
  const int64_t B = 2, T = 7, H = 3, D = 10;
  // cos and sin with unequal halves (HF's are cat(freqs, freqs)): every index pairing shows.
  const at::Tensor cos = at::randn({B, T, 1, D}), sin = at::randn({B, T, 1, D});
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    for (bool strided : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (strided ? " strided" : " contiguous"));
      at::Tensor base = at::randn({B, T, strided ? 2 * H * D : H * D}).to(dtype);
      at::Tensor x = base.slice(2, 0, H * D).view({B, T, H, D});
      if (strided) x = base.view({B, T, 2 * H, D}).slice(2, H);
      x = x.detach().requires_grad_(true);
      at::Tensor y = memtune::models::apply_rotary(x, cos, sin);
      at::Tensor xr = x.detach().clone().requires_grad_(true);
      const at::Tensor c = cos.to(dtype), s = sin.to(dtype);
      at::Tensor yr = xr * c + hf_rotate_half(xr) * s;
      const double tol = dtype == at::kBFloat16 ? 2e-2 : 1e-6;
      expect_close(y, yr, tol, "forward", 1.0);
      at::Tensor g = at::randn(y.sizes()).to(dtype);
      y.backward(g);
      yr.backward(g);
      expect_close(x.grad(), xr.grad(), tol, "grad x", 1.0);
    }
  }
}

// The CUDA kernel (models/layers/cuda/): in fp32 the CPU kernel's values to the bit (the
// same products and sums, each rounded once), in bf16 and fp16 Hugging Face's ATen ops
// under autograd on the same GPU to the bit (their roundings: cos and sin cast to x's
// dtype, each product and the sum rounded), forward and backward, x strided as a
// projection's view gives it.
TEST(Rotary, OnCudaEqualsTheCpuKernelAndHuggingFacesOpsBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(6);
  const int64_t B = 2, T = 9, H = 4, D = 64;
  const at::Tensor cos = at::randn({B, T, 1, D}), sin = at::randn({B, T, 1, D});
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor base = at::randn({B, T, 2 * H * D}).to(dtype);
    const at::Tensor g0 = at::randn({B, T, H, D}).to(dtype);
    at::Tensor x = base.to(cuda).view({B, T, 2 * H, D}).slice(2, H).detach().requires_grad_(true);
    at::Tensor y = memtune::models::apply_rotary(x, cos.to(cuda), sin.to(cuda));
    ASSERT_TRUE(y.is_cuda());
    y.backward(g0.to(cuda));
    at::Tensor want, want_grad;
    if (dtype == at::kFloat) {
      at::Tensor xc = base.view({B, T, 2 * H, D}).slice(2, H).detach().requires_grad_(true);
      want = memtune::models::apply_rotary(xc, cos, sin);
      want.backward(g0);
      want_grad = xc.grad();
    } else {
      at::Tensor xr = base.to(cuda).view({B, T, 2 * H, D}).slice(2, H).detach().requires_grad_(true);
      const at::Tensor c = cos.to(cuda).to(dtype), s = sin.to(cuda).to(dtype);
      want = xr * c + hf_rotate_half(xr) * s;
      want.backward(g0.to(cuda));
      want_grad = xr.grad();
    }
    EXPECT_TRUE(at::equal(y.cpu(), want.cpu()))
        << "forward: " << (y.cpu() != want.cpu()).sum().item<int64_t>() << " elements differ";
    EXPECT_TRUE(at::equal(x.grad().cpu(), want_grad.cpu()))
        << "grad x: " << (x.grad().cpu() != want_grad.cpu()).sum().item<int64_t>() << " elements differ";
  }
}

TEST(Rotary, AnOddHeadSizeOrMismatchedTablesIsAnInternalError) {
  const at::Tensor x = at::randn({1, 2, 1, 5});
  EXPECT_THROW(memtune::models::apply_rotary(x, at::ones({1, 2, 1, 5}), at::ones({1, 2, 1, 5})), memtune::InternalError);
  const at::Tensor y = at::randn({1, 2, 1, 4});
  EXPECT_THROW(memtune::models::apply_rotary(y, at::ones({1, 3, 1, 4}), at::ones({1, 3, 1, 4})), memtune::InternalError);
}

}  // namespace
