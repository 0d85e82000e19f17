// The fused RMSNorm, SwiGLU, GELU and GeGLU nodes against the same math as chains of ATen ops
// under autograd (the form of Hugging Face's LlamaRMSNorm, LlamaMLP, GemmaRMSNorm, GemmaMLP).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "models/layers/cpu_vec.h"
#include "models/layers/norm_act.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/memory.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;

at::Tensor hf_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

// bf16 on the CPU takes ATen's op chain, the form of Hugging Face's LlamaRMSNorm.
TEST(RmsNorm, Bf16MatchesTheOpChainAndItsGradients) {
  torch::manual_seed(4);
  for (bool weight_grad : {false, true}) {
    SCOPED_TRACE(weight_grad ? "weight trained" : "weight frozen");
    at::Tensor x = (at::randn({3, 5, 48}) * 3 + 1).to(at::kBFloat16).requires_grad_(true);
    at::Tensor w = (at::rand({48}) + 0.5).to(at::kBFloat16).requires_grad_(weight_grad);
    at::Tensor y = memtune::models::rms_norm(x, w, 1e-6);
    at::Tensor xr = x.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(weight_grad);
    at::Tensor yr = hf_rms_norm(xr, wr, 1e-6);
    expect_close(y, yr, 2e-2, "forward");
    at::Tensor g = at::randn(y.sizes()).to(at::kBFloat16);
    y.backward(g);
    yr.backward(g);
    expect_close(x.grad(), xr.grad(), 5e-2, "grad x");
    if (weight_grad) expect_close(w.grad(), wr.grad(), 5e-2, "grad weight");
    else EXPECT_FALSE(w.grad().defined());
  }
}

// Elementwise: |actual - exact| <= tol x scale + 1e-30 (fp64 math as the exact value; values
// near fp32's smallest normals, as silu(-90) is, need only be as small).
void expect_elementwise(const at::Tensor& actual, const at::Tensor& exact, const at::Tensor& scale, double tol,
                        const std::string& what) {
  const at::Tensor bad = (actual.to(at::kDouble) - exact).abs() > scale * tol + 1e-30;
  const int64_t n = bad.sum().item<int64_t>();
  EXPECT_EQ(n, 0) << what << ": " << n << " elements off, e.g. at "
                  << (n > 0 ? bad.flatten().nonzero()[0].item<int64_t>() : -1);
}

// fp32 on the CPU runs memtune's kernels (cpu_vec.h), AVX2 and portable: each value within a
// few roundings of the exact math (fp64), as close as ATen's ops under autograd (Hugging
// Face's `silu(gate) * up`), NaN carried through, and a backward that holds the two gradients
// alone (swiglu_backward_transient), measured by the budget allocator. An odd size: the
// vector loops' tails and several tasks.
TEST(Swiglu, MatchesTheExactMathAndAutogradsChain) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(5);
  const int64_t rows = 4 * 61, width = 333;
  at::Tensor gate0 = at::randn({4, 61, width}) * 4;
  gate0.view(-1).slice(0, 0, 6).copy_(at::tensor({0.0f, 30.0f, -30.0f, 90.0f, -90.0f, -1.2785f}));
  const at::Tensor up0 = at::randn({4, 61, width}), g0 = at::randn({4, 61, width});
  // The exact values, in fp64.
  const at::Tensor g = gate0.to(at::kDouble), u = up0.to(at::kDouble), gy = g0.to(at::kDouble);
  const at::Tensor s = at::sigmoid(g), silu = g * s;
  const at::Tensor y_exact = silu * u, du_exact = silu * gy, dg_exact = gy * u * s * (1 + g * (1 - s));
  const at::Tensor dg_scale = (gy * u * s).abs() * (1 + g.abs() * (1 - s));
  for (bool portable : {false, true}) {
    memtune::models::detail::use_portable_cpu_kernels(portable);
    for (bool up_grad : {false, true}) {
      SCOPED_TRACE(std::string(portable ? "portable" : "AVX2 where the CPU has it") + (up_grad ? ", up trained" : ", up frozen"));
      at::Tensor gate = gate0.clone().requires_grad_(true), up = up0.clone().requires_grad_(up_grad);
      at::Tensor y = memtune::models::swiglu(gate, up);
      expect_elementwise(y, y_exact, y_exact.abs(), 1e-6, "forward");
      {
        const int64_t before = memtune::cpu_allocated_bytes();
        memtune::ScopedPeakReset peak;
        y.backward(g0);
        EXPECT_LE(peak.peak() - before, memtune::models::swiglu_backward_transient(rows, width, 4, false))
            << "the backward's transient";
      }
      expect_elementwise(gate.grad(), dg_exact, dg_scale, 2e-6, "grad gate");
      if (up_grad) expect_elementwise(up.grad(), du_exact, du_exact.abs(), 1e-6, "grad up");
      else EXPECT_FALSE(up.grad().defined());

      at::Tensor gr = gate0.clone().requires_grad_(true), ur = up0.clone().requires_grad_(up_grad);
      at::Tensor yr = at::silu(gr) * ur;
      yr.backward(g0);
      expect_elementwise(yr, y_exact, y_exact.abs(), 1e-6, "ATen's forward (the bound holds for the reference too)");
      expect_elementwise(gr.grad(), dg_exact, dg_scale, 2e-6, "ATen's grad gate");
      expect_close(y, yr, 1e-6, "forward against ATen's");
      expect_close(gate.grad(), gr.grad(), 1e-6, "grad gate against autograd's");
    }
  }
  memtune::models::detail::use_portable_cpu_kernels(false);

  // NaN in, NaN out, on both paths of each direction.
  at::Tensor gate = gate0.clone();
  gate.view(-1)[7] = std::numeric_limits<float>::quiet_NaN();
  gate.view(-1)[rows * width - 1] = std::numeric_limits<float>::quiet_NaN();
  gate.requires_grad_(true);
  at::Tensor up = up0.clone().requires_grad_(true);
  at::Tensor y = memtune::models::swiglu(gate, up);
  y.backward(g0);
  for (const at::Tensor& t : {y, gate.grad(), up.grad()}) {
    EXPECT_TRUE(std::isnan(t.view(-1)[7].item<float>()));
    EXPECT_TRUE(std::isnan(t.view(-1)[rows * width - 1].item<float>()));
    EXPECT_EQ(at::isnan(t).sum().item<int64_t>(), 2);
  }
}

// GELU with tanh's approximation (GPT-2's gelu_new) on fp32 CPU tensors: memtune's kernels,
// AVX2 and portable, against the exact math in fp64 (Hugging Face's form, 0.5 x (1 + tanh(u)))
// and ATen's gelu(approximate="tanh") under autograd; extremes saturate (0 and x, gradients
// 0 and gy), NaN is carried through, and the backward holds the one gradient alone.
TEST(GeluTanh, MatchesTheExactMathAndAtensGelu) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(6);
  const int64_t rows = 3 * 67, width = 517;
  at::Tensor x0 = at::randn({3, 67, width}) * 3;
  x0.view(-1).slice(0, 0, 8).copy_(at::tensor({0.0f, -0.0f, 12.0f, -12.0f, 80.0f, -80.0f, 1e-30f, -0.7f}));
  const at::Tensor g0 = at::randn({3, 67, width});
  const at::Tensor x = x0.to(at::kDouble), gy = g0.to(at::kDouble);
  const double beta = std::sqrt(2.0 / M_PI), kappa = 0.044715;
  const at::Tensor t = at::tanh(beta * (x + kappa * x.pow(3)));
  const at::Tensor y_exact = 0.5 * x * (1 + t);
  const at::Tensor d_exact = gy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * beta * (1 + 3 * kappa * x * x));
  // Each term's size: the bound for a few roundings of each.
  const at::Tensor d_scale = gy.abs() * (0.5 * (1 + t) + (0.5 * x * (1 - t * t) * beta * (1 + 3 * kappa * x * x)).abs()) + 1e-7 * gy.abs();
  for (bool portable : {false, true}) {
    memtune::models::detail::use_portable_cpu_kernels(portable);
    SCOPED_TRACE(portable ? "portable" : "AVX2 where the CPU has it");
    at::Tensor xin = x0.clone().requires_grad_(true);
    at::Tensor y = memtune::models::gelu_tanh(xin);
    expect_elementwise(y, y_exact, y_exact.abs() + 1e-7 * x.abs(), 2e-6, "forward");
    {
      const int64_t before = memtune::cpu_allocated_bytes();
      memtune::ScopedPeakReset peak;
      y.backward(g0);
      EXPECT_LE(peak.peak() - before, memtune::models::gelu_backward_transient(rows, width)) << "the backward's transient";
    }
    expect_elementwise(xin.grad(), d_exact, d_scale, 4e-6, "gradient");
    at::Tensor xr = x0.clone().requires_grad_(true);
    at::Tensor yr = at::gelu(xr, "tanh");
    yr.backward(g0);
    expect_close(y, yr, 2e-6, "forward against ATen's");
    expect_close(xin.grad(), xr.grad(), 4e-6, "gradient against ATen's");
    // Saturation: far left 0 (gradient 0; the AVX2 exponential stops at 2^127, so under 1e-30
    // rather than 0), far right x (gradient gy).
    EXPECT_LT(std::abs(y.view(-1)[5].item<float>()), 1e-30f);
    EXPECT_EQ(y.view(-1)[4].item<float>(), 80.0f);
    EXPECT_LT(std::abs(xin.grad().view(-1)[5].item<float>()), 1e-30f);
    EXPECT_EQ(xin.grad().view(-1)[4].item<float>(), g0.view(-1)[4].item<float>());
  }
  memtune::models::detail::use_portable_cpu_kernels(false);

  at::Tensor xn = x0.clone();
  xn.view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
  xn.view(-1)[rows * width - 1] = std::numeric_limits<float>::quiet_NaN();
  xn.requires_grad_(true);
  at::Tensor y = memtune::models::gelu_tanh(xn);
  y.backward(g0);
  for (const at::Tensor& out : {y, xn.grad()}) {
    EXPECT_TRUE(std::isnan(out.view(-1)[3].item<float>()));
    EXPECT_EQ(at::isnan(out).sum().item<int64_t>(), 2);
  }
}

// fp32 on the CPU runs memtune's row kernels (cpu_vec.h), AVX2 and portable: each value within
// a few roundings of the exact math (fp64), as close as Hugging Face's LlamaRMSNorm as ATen
// ops, and the weight's gradient the same to the bit on one thread as on several. An odd width
// (the vector loops' tails) and 3 x 61 rows (runs of 64 rows, the last shorter).
TEST(RmsNorm, Fp32MatchesTheExactMathOnAnyNumberOfThreads) {
  torch::manual_seed(4);
  const at::Tensor x0 = at::randn({3, 61, 333}) * 3 + 1, w0 = at::rand({333}) + 0.5, g0 = at::randn({3, 61, 333});
  const double eps = 1e-6;
  const at::Tensor x = x0.to(at::kDouble), w = w0.to(at::kDouble), gy = g0.to(at::kDouble);
  const at::Tensor rstd = at::rsqrt(x.pow(2).mean(-1, true) + eps), n = x * rstd;
  const at::Tensor y_exact = n * w, dn = gy * w;
  const at::Tensor dx_exact = (dn - n * (dn * n).mean(-1, true)) * rstd;
  const at::Tensor dx_scale = (dn.abs() + n.abs() * (dn * n).abs().mean(-1, true)) * rstd;
  const at::Tensor dw_exact = (gy * n).sum(at::IntArrayRef{0, 1}), dw_scale = (gy * n).abs().sum(at::IntArrayRef{0, 1});
  const int threads = at::get_num_threads();
  at::Tensor dw_first;
  for (bool portable : {false, true}) {
    memtune::models::detail::use_portable_cpu_kernels(portable);
    for (bool weight_grad : {false, true}) {
      for (int t : {threads, 1}) {
        SCOPED_TRACE(std::string(portable ? "portable" : "AVX2 where the CPU has it") +
                     (weight_grad ? ", weight trained, " : ", weight frozen, ") + std::to_string(t) + " threads");
        at::set_num_threads(t);
        at::Tensor xt = x0.clone().requires_grad_(true), wt = w0.clone().requires_grad_(weight_grad);
        at::Tensor y = memtune::models::rms_norm(xt, wt, eps);
        y.backward(g0);
        expect_elementwise(y, y_exact, y_exact.abs(), 2e-6, "forward");
        expect_elementwise(xt.grad(), dx_exact, dx_scale, 4e-6, "grad x");
        if (!weight_grad) {
          EXPECT_FALSE(wt.grad().defined());
          continue;
        }
        expect_elementwise(wt.grad(), dw_exact, dw_scale, 4e-6, "grad weight");
        if (t == threads) dw_first = wt.grad();
        else EXPECT_TRUE(at::equal(wt.grad(), dw_first)) << "the weight's gradient changed with the threads";
        at::Tensor xr = x0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
        at::Tensor yr = hf_rms_norm(xr, wr, eps);
        yr.backward(g0);
        expect_close(y, yr, 1e-6, "forward against HF's");
        expect_close(xt.grad(), xr.grad(), 1e-5, "grad x against autograd's");
        expect_close(wt.grad(), wr.grad(), 1e-5, "grad weight against autograd's");
      }
    }
  }
  at::set_num_threads(threads);
  memtune::models::detail::use_portable_cpu_kernels(false);
  // Many runs of rows (64 of 64 x 1024, spread over the threads): the same bits on one thread
  // as on two or three.
  {
    const at::Tensor xb = at::randn({4096, 1024}), wb = at::rand({1024}) + 0.5, gb = at::randn({4096, 1024});
    at::Tensor first;
    for (int t : {threads, 1, 3}) {
      at::set_num_threads(t);
      at::Tensor xt = xb.clone().requires_grad_(true), wt = wb.clone().requires_grad_(true);
      memtune::models::rms_norm(xt, wt, eps).backward(gb);
      if (!first.defined()) first = wt.grad();
      else EXPECT_TRUE(at::equal(wt.grad(), first)) << t << " threads: the weight's gradient changed";
    }
    at::set_num_threads(threads);
  }
  // No rows: a zero gradient for the weight.
  at::Tensor xe = at::randn({0, 333}).requires_grad_(true), we = w0.clone().requires_grad_(true);
  memtune::models::rms_norm(xe, we, eps).sum().backward();
  EXPECT_TRUE(at::equal(we.grad(), at::zeros_like(w0)));
}

// Other dtypes (bf16 on the CPU) take autograd's own chain through `silu(gate) * up`, to the
// bit.
TEST(Swiglu, Bf16IsAutogradsChainToTheBit) {
  torch::manual_seed(6);
  for (bool up_grad : {false, true}) {
    SCOPED_TRACE(up_grad ? "up trained" : "up frozen");
    const at::Tensor gate0 = (at::randn({4, 6, 40}) * 4).to(at::kBFloat16), up0 = at::randn({4, 6, 40}).to(at::kBFloat16);
    const at::Tensor g0 = at::randn({4, 6, 40}).to(at::kBFloat16);
    at::Tensor gate = gate0.clone().requires_grad_(true), up = up0.clone().requires_grad_(up_grad);
    at::Tensor gr = gate0.clone().requires_grad_(true), ur = up0.clone().requires_grad_(up_grad);
    at::Tensor y = memtune::models::swiglu(gate, up), yr = at::silu(gr) * ur;
    EXPECT_TRUE(at::equal(y, yr)) << "forward";
    y.backward(g0);
    yr.backward(g0);
    EXPECT_TRUE(at::equal(gate.grad(), gr.grad())) << "grad gate";
    if (up_grad) EXPECT_TRUE(at::equal(up.grad(), ur.grad())) << "grad up";
    else EXPECT_FALSE(up.grad().defined());
  }
}

// Gemma's RMSNorm against GemmaRMSNorm's own chain (the normalised rows times 1 + weight in
// fp32, rounded once): bit for bit in bf16, forward and both gradients; in fp32 (memtune's
// RMSNorm kernels with 1 + weight) to rounding, against the chain in fp64.
at::Tensor hf_gemma_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::ScalarType up = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor h = x.to(up);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return (h * (1.0 + w.to(up))).to(x.scalar_type());
}

TEST(GemmaRmsNorm, IsGemmasChainInBf16ToTheBitAndInFp32ToRounding) {
  torch::manual_seed(11);
  for (bool weight_grad : {false, true}) {
    SCOPED_TRACE(weight_grad ? "weight trained" : "weight frozen");
    const at::Tensor x0 = at::randn({3, 5, 48}) * 3, w0 = at::rand({48}) * 0.8 - 0.4, g0 = at::randn({3, 5, 48});
    {
      at::Tensor x = x0.to(at::kBFloat16).requires_grad_(true), w = w0.to(at::kBFloat16).requires_grad_(weight_grad);
      at::Tensor xr = x0.to(at::kBFloat16).requires_grad_(true), wr = w0.to(at::kBFloat16).requires_grad_(weight_grad);
      at::Tensor y = memtune::models::gemma_rms_norm(x, w, 1e-6), yr = hf_gemma_rms_norm(xr, wr, 1e-6);
      // The Llama norm's rounding (before the weight) differs somewhere: the test tells them apart.
      EXPECT_FALSE(at::equal(y, hf_rms_norm(x0.to(at::kBFloat16), (w0 + 1).to(at::kBFloat16), 1e-6)));
      EXPECT_TRUE(at::equal(y, yr)) << "bf16 forward";
      y.backward(g0.to(at::kBFloat16));
      yr.backward(g0.to(at::kBFloat16));
      // Gradients: the same math in fp32, rounded once (autograd's chain rounds each step to
      // bf16 where it meets a bf16 tensor), so within bf16's rounding of it.
      expect_close(x.grad().to(at::kFloat), xr.grad().to(at::kFloat), 2e-2, "bf16 grad x");
      if (weight_grad) expect_close(w.grad().to(at::kFloat), wr.grad().to(at::kFloat), 2e-2, "bf16 grad w");
    }
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(weight_grad);
    at::Tensor xr = x0.to(at::kDouble).requires_grad_(true), wr = w0.to(at::kDouble).requires_grad_(weight_grad);
    at::Tensor y = memtune::models::gemma_rms_norm(x, w, 1e-6), yr = hf_gemma_rms_norm(xr, wr, 1e-6);
    expect_close(y.to(at::kDouble), yr, 1e-6, "fp32 forward");
    y.backward(g0);
    yr.backward(g0.to(at::kDouble));
    expect_close(x.grad().to(at::kDouble), xr.grad(), 1e-5, "fp32 grad x");
    if (weight_grad) expect_close(w.grad().to(at::kDouble), wr.grad(), 1e-5, "fp32 grad w");
    else EXPECT_FALSE(w.grad().defined());
  }
}

// GeGLU against transformers' act_fn(gate) * up under autograd: in bf16 to the bit (ATen's
// GELU either way), in fp32 with tanh's approximation (memtune's GELU kernels) to rounding
// against the chain in fp64; exact GELU (erf) too.
TEST(Geglu, IsTransformersChainInBf16ToTheBitAndInFp32ToRounding) {
  torch::manual_seed(12);
  for (bool tanh : {true, false})
    for (bool up_grad : {false, true}) {
      SCOPED_TRACE(std::string(tanh ? "gelu_pytorch_tanh" : "gelu") + (up_grad ? ", up trained" : ", up frozen"));
      const char* approximate = tanh ? "tanh" : "none";
      const at::Tensor gate0 = at::randn({4, 6, 40}) * 3, up0 = at::randn({4, 6, 40}), g0 = at::randn({4, 6, 40});
      {
        at::Tensor gate = gate0.to(at::kBFloat16).requires_grad_(true), up = up0.to(at::kBFloat16).requires_grad_(up_grad);
        at::Tensor gr = gate0.to(at::kBFloat16).requires_grad_(true), ur = up0.to(at::kBFloat16).requires_grad_(up_grad);
        at::Tensor y = memtune::models::geglu(gate, up, tanh), yr = at::gelu(gr, approximate) * ur;
        EXPECT_TRUE(at::equal(y, yr)) << "bf16 forward";
        y.backward(g0.to(at::kBFloat16));
        yr.backward(g0.to(at::kBFloat16));
        EXPECT_TRUE(at::equal(gate.grad(), gr.grad())) << "bf16 grad gate";
        if (up_grad) {
          EXPECT_TRUE(at::equal(up.grad(), ur.grad())) << "bf16 grad up";
        }
      }
      at::Tensor gate = gate0.clone().requires_grad_(true), up = up0.clone().requires_grad_(up_grad);
      at::Tensor gr = gate0.to(at::kDouble).requires_grad_(true), ur = up0.to(at::kDouble).requires_grad_(up_grad);
      at::Tensor y = memtune::models::geglu(gate, up, tanh), yr = at::gelu(gr, approximate) * ur;
      expect_close(y.to(at::kDouble), yr, 1e-6, "fp32 forward");
      y.backward(g0);
      yr.backward(g0.to(at::kDouble));
      expect_close(gate.grad().to(at::kDouble), gr.grad(), 1e-5, "fp32 grad gate");
      if (up_grad) expect_close(up.grad().to(at::kDouble), ur.grad(), 1e-5, "fp32 grad up");
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
  // Width 96: every element in the 16-byte vector kernels; 95: those and a scalar tail.
  std::vector<std::pair<Case, int64_t>> runs;
  for (const Case& c : {Case{at::kFloat, true}, Case{at::kFloat, false}, Case{at::kBFloat16, true},
                        Case{at::kHalf, true}, Case{at::kBFloat16, false}})
    for (int64_t width : {96, 95}) runs.emplace_back(c, width);
  for (const auto& [c, width] : runs) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + (c.weight_grad ? " up trained" : " up frozen") + " width " +
                 std::to_string(width));
    const at::Tensor gate0 = (at::randn({5, 33, width}) * 4).to(c.dtype), up0 = at::randn({5, 33, width}).to(c.dtype);
    const at::Tensor g0 = at::randn({5, 33, width}).to(c.dtype);
    at::Tensor gate = gate0.to(cuda).requires_grad_(true), up = up0.to(cuda).requires_grad_(c.weight_grad);
    at::Tensor y = memtune::models::swiglu(gate, up);
    ASSERT_TRUE(y.is_cuda());
    // The backward allocates the two gradients and nothing else, as the estimate counts it.
    const at::Tensor gy = g0.to(cuda);
    memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
    const int64_t before = memory.stats().allocated;
    memory.reset_peak();
    y.backward(gy);
    const int64_t transient = memtune::models::swiglu_backward_transient(5 * 33, width, c10::elementSize(c.dtype), true);
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
