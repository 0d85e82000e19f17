// The fused RMSNorm and SwiGLU nodes against the same math as chains of ATen ops under
// autograd (the form of Hugging Face's LlamaRMSNorm and LlamaMLP).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "models/layers/norm_act.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;

at::Tensor hf_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

TEST(RmsNorm, MatchesTheOpChainAndItsGradients) {
  torch::manual_seed(4);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (bool weight_grad : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (weight_grad ? " weight trained" : " weight frozen"));
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      at::Tensor x = (at::randn({3, 5, 48}) * 3 + 1).to(dtype).requires_grad_(true);
      at::Tensor w = (at::rand({48}) + 0.5).to(dtype).requires_grad_(weight_grad);
      at::Tensor y = memtune::models::rms_norm(x, w, 1e-6);
      at::Tensor xr = x.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(weight_grad);
      at::Tensor yr = hf_rms_norm(xr, wr, 1e-6);
      expect_close(y, yr, tol, "forward");
      at::Tensor g = at::randn(y.sizes()).to(dtype);
      y.backward(g);
      yr.backward(g);
      expect_close(x.grad(), xr.grad(), dtype == at::kFloat ? 1e-5 : 5e-2, "grad x");
      if (weight_grad) expect_close(w.grad(), wr.grad(), dtype == at::kFloat ? 1e-5 : 5e-2, "grad weight");
      else EXPECT_FALSE(w.grad().defined());
    }
  }
}

TEST(Swiglu, MatchesTheOpChainAndItsGradients) {
  torch::manual_seed(5);
  for (bool up_grad : {false, true}) {
    at::Tensor gate = (at::randn({4, 6, 32}) * 4).requires_grad_(true);
    at::Tensor up = at::randn({4, 6, 32}).requires_grad_(up_grad);
    at::Tensor y = memtune::models::swiglu(gate, up);
    at::Tensor gr = gate.detach().clone().requires_grad_(true), ur = up.detach().clone().requires_grad_(up_grad);
    at::Tensor yr = at::silu(gr) * ur;
    expect_close(y, yr, 1e-6, "forward");
    at::Tensor g = at::randn(y.sizes());
    y.backward(g);
    yr.backward(g);
    expect_close(gate.grad(), gr.grad(), 1e-5, "grad gate");
    if (up_grad) expect_close(up.grad(), ur.grad(), 1e-5, "grad up");
    else EXPECT_FALSE(up.grad().defined());
  }
}

}  // namespace
