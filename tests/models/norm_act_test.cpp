// The fused RMSNorm and SwiGLU nodes against the same math as chains of ATen ops under
// autograd (the form of Hugging Face's LlamaRMSNorm and LlamaMLP).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "models/layers/norm_act.h"
#include "runtime/memory.h"
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

// The share of elements of a and b (same dtype) that are equal, bit for bit.
double equal_share(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu() == b.cpu()).to(at::kDouble).mean().item<double>();
}

// Tensors a run holds at each dtype: the residual stream in T, weights in T too.
struct Case {
  at::ScalarType dtype;
  bool weight_grad;
};

// The CUDA kernels (models/layers/cuda/) against two references: in fp32 the CPU node
// above (the same math, to the order of a row's sum); in bf16 and fp16 Hugging Face's
// module as ATen ops under autograd on the same GPU, whose roundings the kernels repeat, so
// that almost every element is that module's value to the bit.
TEST(RmsNorm, OnCudaEqualsTheCpuNodeAndHuggingFacesRoundings_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(14);
  for (const Case& c : {Case{at::kFloat, true}, Case{at::kFloat, false}, Case{at::kBFloat16, true},
                        Case{at::kHalf, false}}) {
    for (int64_t width : {48, 4096 + 8}) {  // under one CTA's threads, and many per thread
      SCOPED_TRACE(std::string(c10::toString(c.dtype)) + " width " + std::to_string(width) +
                   (c.weight_grad ? " weight trained" : " weight frozen"));
      at::Tensor x0 = (at::randn({3, 70, width}) * 3 + 1).to(c.dtype);
      at::Tensor w0 = (at::rand({width}) + 0.5).to(c.dtype);
      at::Tensor g0 = at::randn({3, 70, width}).to(c.dtype);
      at::Tensor x = x0.to(cuda).requires_grad_(true), w = w0.to(cuda).requires_grad_(c.weight_grad);
      at::Tensor y = memtune::models::rms_norm(x, w, 1e-5);
      ASSERT_TRUE(y.is_cuda());
      y.backward(g0.to(cuda));
      if (c.dtype == at::kFloat) {
        at::Tensor xc = x0.clone().requires_grad_(true), wc = w0.clone().requires_grad_(c.weight_grad);
        at::Tensor yc = memtune::models::rms_norm(xc, wc, 1e-5);
        yc.backward(g0);
        expect_close(y.cpu(), yc, 1e-5, "forward");
        expect_close(x.grad().cpu(), xc.grad(), 1e-5, "grad x");
        if (c.weight_grad) expect_close(w.grad().cpu(), wc.grad(), 1e-5, "grad weight");
      } else {
        at::Tensor xr = x0.to(cuda).requires_grad_(true), wr = w0.to(cuda).requires_grad_(c.weight_grad);
        at::Tensor yr = hf_rms_norm(xr, wr, 1e-5);
        yr.backward(g0.to(cuda));
        EXPECT_GE(equal_share(y, yr), 0.99) << "forward: not Hugging Face's roundings";
        expect_close(y.cpu(), yr.cpu(), 1e-2, "forward");
        expect_close(x.grad().cpu(), xr.grad().cpu(), 5e-2, "grad x");
        if (c.weight_grad) expect_close(w.grad().cpu(), wr.grad().cpu(), 2e-2, "grad weight");
      }
      if (!c.weight_grad) {
        EXPECT_FALSE(w.grad().defined());
      }
    }
  }
  // More rows than the grid has CTAs (65535: a CTA takes several rows), the weight's
  // gradient in runs of rows whose last is shorter, and no rows at all (a zero gradient).
  for (int64_t rows : {70001, 0}) {
    SCOPED_TRACE(std::to_string(rows) + " rows");
    const at::Tensor x0 = at::randn({rows, 40}), w0 = at::rand({40}) + 0.5, g0 = at::randn({rows, 40});
    at::Tensor x = x0.to(cuda).requires_grad_(true), w = w0.to(cuda).requires_grad_(true);
    memtune::models::rms_norm(x, w, 1e-6).backward(g0.to(cuda));
    at::Tensor xc = x0.clone().requires_grad_(true), wc = w0.clone().requires_grad_(true);
    memtune::models::rms_norm(xc, wc, 1e-6).backward(g0);
    if (rows > 0) expect_close(x.grad().cpu(), xc.grad(), 1e-5, "grad x", 1.0);
    expect_close(w.grad().cpu(), wc.grad(), 1e-4, "grad weight", 1.0);
  }
}

TEST(Swiglu, OnCudaEqualsTheCpuNodeAndHuggingFacesRoundings_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(15);
  for (const Case& c : {Case{at::kFloat, true}, Case{at::kFloat, false}, Case{at::kBFloat16, true},
                        Case{at::kHalf, true}}) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + (c.weight_grad ? " up trained" : " up frozen"));
    const at::Tensor gate0 = (at::randn({5, 33, 96}) * 4).to(c.dtype), up0 = at::randn({5, 33, 96}).to(c.dtype);
    const at::Tensor g0 = at::randn({5, 33, 96}).to(c.dtype);
    at::Tensor gate = gate0.to(cuda).requires_grad_(true), up = up0.to(cuda).requires_grad_(c.weight_grad);
    at::Tensor y = memtune::models::swiglu(gate, up);
    ASSERT_TRUE(y.is_cuda());
    // The backward allocates the two gradients and nothing else, as the estimate counts it.
    const at::Tensor gy = g0.to(cuda);
    memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
    const int64_t before = memory.stats().allocated;
    memory.reset_peak();
    y.backward(gy);
    const int64_t transient = memtune::models::swiglu_backward_transient(5 * 33, 96, c10::elementSize(c.dtype), true);
    EXPECT_LE(memory.stats().peak - before, transient + 2048) << "the backward's transient";
    if (c.dtype == at::kFloat) {
      at::Tensor gc = gate0.clone().requires_grad_(true), uc = up0.clone().requires_grad_(c.weight_grad);
      at::Tensor yc = memtune::models::swiglu(gc, uc);
      yc.backward(g0);
      expect_close(y.cpu(), yc, 1e-6, "forward");
      expect_close(gate.grad().cpu(), gc.grad(), 1e-5, "grad gate");
      if (c.weight_grad) expect_close(up.grad().cpu(), uc.grad(), 1e-5, "grad up");
    } else {
      at::Tensor gr = gate0.to(cuda).requires_grad_(true), ur = up0.to(cuda).requires_grad_(c.weight_grad);
      at::Tensor yr = at::silu(gr) * ur;  // LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
      yr.backward(g0.to(cuda));
      EXPECT_GE(equal_share(y, yr), 0.99) << "forward: not Hugging Face's roundings";
      EXPECT_GE(equal_share(gate.grad(), gr.grad()), 0.99) << "grad gate: not autograd's roundings";
      expect_close(gate.grad().cpu(), gr.grad().cpu(), 1e-2, "grad gate");
      if (c.weight_grad) {
        EXPECT_GE(equal_share(up.grad(), ur.grad()), 0.99) << "grad up: not autograd's roundings";
        expect_close(up.grad().cpu(), ur.grad().cpu(), 1e-2, "grad up");
      }
    }
    if (!c.weight_grad) {
      EXPECT_FALSE(up.grad().defined());
    }
  }
}

}  // namespace
