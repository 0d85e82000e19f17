#include "models/layers/norm_act.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers/cpu_vec.h"
#include "runtime/step_profiler.h"

#ifdef MEMTUNE_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/layers/cuda/norm_act_cuda_kernels.h"
#endif

namespace memtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kElementsPerTask = 16384;  // at::parallel_for's grain for the CPU kernels

// Rows of x's last dimension.
int64_t rows_of(const at::Tensor& x) { return x.numel() == 0 ? 0 : x.numel() / x.size(-1); }

// fp32 SwiGLU on the CPU takes memtune's kernels (cpu_vec.h): one pass each way, and a
// backward that writes the two gradients alone.
bool swiglu_cpu_kernels(const at::Tensor& gate, const at::Tensor& up) {
  return gate.device().is_cpu() && up.device().is_cpu() && gate.scalar_type() == at::kFloat &&
         up.scalar_type() == at::kFloat && gate.sizes() == up.sizes();
}

// fp32 RMSNorm on the CPU takes memtune's row kernels (cpu_vec.h): one pass for the statistics
// and one for the output, the backward with no intermediate tensor. The weight's gradient is
// summed in fixed runs of rows, so its value does not depend on the number of threads.
bool rms_norm_cpu_kernels(const at::Tensor& x, const at::Tensor& weight) {
  return x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1);
}
constexpr int64_t kRmsNormRun = 64;  // rows per partial sum of the weight's gradient

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1)); }

at::Tensor rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd) {
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t width = x.size(-1), rows = rows_of(x);
  at::Tensor y = at::empty_like(xc);
  std::vector<int64_t> stat_shape = x.sizes().vec();
  stat_shape.back() = 1;
  *rstd = at::empty(stat_shape, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rstd->data_ptr<float>();
  const auto e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rp[r] = detail::rms_norm_row(xp + r * width, wp, e, yp + r * width, width);
  });
  return y;
}

void rms_norm_backward_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd, const at::Tensor& gy,
                           at::Tensor* grad_x, at::Tensor* grad_weight) {
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), g = gy.to(at::kFloat).contiguous(),
                   rc = rstd.contiguous();
  const int64_t width = x.size(-1), rows = rows_of(x);
  if (grad_x != nullptr) *grad_x = at::empty_like(xc);
  const int64_t runs = (rows + kRmsNormRun - 1) / kRmsNormRun;
  at::Tensor partial = grad_weight != nullptr ? at::zeros({runs, width}, x.options()) : at::Tensor();
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>(), *gp = g.data_ptr<float>(),
              *rp = rc.data_ptr<float>();
  float* dxp = grad_x != nullptr ? grad_x->data_ptr<float>() : nullptr;
  float* pp = partial.defined() ? partial.data_ptr<float>() : nullptr;
  at::parallel_for(0, runs, std::max<int64_t>(1, grain_rows(width) / kRmsNormRun), [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run)
      for (int64_t r = run * kRmsNormRun; r < std::min(rows, (run + 1) * kRmsNormRun); ++r)
        detail::rms_norm_backward_row(xp + r * width, wp, gp + r * width, rp[r],
                                      dxp == nullptr ? nullptr : dxp + r * width,
                                      pp == nullptr ? nullptr : pp + run * width, width);
  });
  if (grad_weight == nullptr) return;
  // The runs' partial sums added in run order, a column per task: the order is memtune's, not
  // whatever a LibTorch version's reduction chooses for the number of threads.
  *grad_weight = at::empty_like(wc);
  float* gw = grad_weight->data_ptr<float>();
  at::parallel_for(0, width, kElementsPerTask / std::max<int64_t>(runs, 1), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float sum = 0.0f;
      for (int64_t run = 0; run < runs; ++run) sum += pp[run * width + c];
      gw[c] = sum;
    }
  });
}

#ifdef MEMTUNE_CUDA
using cuda_math::device_type;

// The CUDA kernels take tensors of fp32, fp16 or bf16 on one CUDA device; other dtypes
// (fp64) take the ATen ops below, and so do shapes the kernels do not take (where ATen
// raises its error or broadcasts).
bool cuda_kernels(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cuda() && b.device() == a.device() && device_type(a.scalar_type()) && device_type(b.scalar_type());
}
bool rms_norm_kernels(const at::Tensor& x, const at::Tensor& weight) {
  return cuda_kernels(x, weight) && x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1);
}
bool swiglu_kernels(const at::Tensor& gate, const at::Tensor& up) {
  return cuda_kernels(gate, up) && gate.scalar_type() == up.scalar_type() && gate.sizes() == up.sizes();
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// How many runs of rows the weight's gradient is summed in (each run's column sums are one
// thread's loop; the runs' partials are summed by ATen).
int64_t weight_grad_chunks(int64_t rows) { return std::clamp<int64_t>(rows / 64, 1, 1024); }

at::Tensor rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd) {
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t width = x.size(-1), rows = rows_of(x);
  at::Tensor y = at::empty_like(xc);
  std::vector<int64_t> stat_shape = x.sizes().vec();
  stat_shape.back() = 1;
  *rstd = at::empty(stat_shape, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(norm_act_cuda::rms_norm_forward(xc.data_ptr(), *device_type(x.scalar_type()), wc.data_ptr(),
                                                 *device_type(weight.scalar_type()), rows, width,
                                                 static_cast<float>(eps), y.data_ptr(), rstd->data_ptr<float>(),
                                                 stream_of(x)));
  return y;
}

void rms_norm_backward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                            const at::Tensor& gy, at::Tensor* grad_x, at::Tensor* grad_weight) {
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), rc = rstd.contiguous();
  const at::Tensor gc = gy.to(x.scalar_type()).contiguous();
  const int64_t width = x.size(-1), rows = rows_of(x);
  const cuda_math::DType xt = *device_type(x.scalar_type());
  if (grad_x != nullptr) {
    *grad_x = at::empty_like(xc);
    C10_CUDA_CHECK(norm_act_cuda::rms_norm_backward_input(xc.data_ptr(), xt, wc.data_ptr(),
                                                          *device_type(weight.scalar_type()), rc.data_ptr<float>(),
                                                          gc.data_ptr(), rows, width, grad_x->data_ptr(),
                                                          stream_of(x)));
  }
  if (grad_weight != nullptr) {
    const int64_t chunks = weight_grad_chunks(rows);
    at::Tensor partial = at::zeros({chunks, width}, x.options().dtype(at::kFloat));  // no rows: zeros
    C10_CUDA_CHECK(norm_act_cuda::rms_norm_backward_weight(xc.data_ptr(), xt, rc.data_ptr<float>(), gc.data_ptr(),
                                                           rows, width, chunks, partial.data_ptr<float>(),
                                                           stream_of(x)));
    *grad_weight = partial.sum(0).to(x.scalar_type()).to(weight.scalar_type());
  }
}
#endif

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
#ifdef MEMTUNE_CUDA
    if (rms_norm_kernels(x, weight)) {
      at::Tensor rstd;
      at::Tensor y = rms_norm_forward_cuda(x, weight, eps, &rstd);
      ctx->save_for_backward({x, weight, rstd});
      return y;
    }
#endif
    if (rms_norm_cpu_kernels(x, weight)) {
      at::Tensor rstd;
      at::Tensor y = rms_norm_forward_cpu(x, weight, eps, &rstd);
      ctx->save_for_backward({x, weight, rstd});
      return y;
    }
    at::Tensor h = x.to(at::kFloat);
    at::Tensor rstd = h.square().mean(-1, true).add_(eps).rsqrt_();  // (..., 1) fp32
    at::Tensor n = h * rstd;                                          // a new tensor even when h is x
    at::Tensor y = n.to(x.scalar_type()).mul_(weight.to(x.scalar_type()));
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor& gy = grads[0];
#ifdef MEMTUNE_CUDA
    if (rms_norm_kernels(x, weight)) {
      at::Tensor grad_x, grad_weight;
      rms_norm_backward_cuda(x, weight, rstd, gy, ctx->needs_input_grad(0) ? &grad_x : nullptr,
                             ctx->needs_input_grad(1) ? &grad_weight : nullptr);
      return {grad_x, grad_weight, at::Tensor()};
    }
#endif
    if (rms_norm_cpu_kernels(x, weight)) {
      at::Tensor grad_x, grad_weight;
      rms_norm_backward_cpu(x, weight, rstd, gy, ctx->needs_input_grad(0) ? &grad_x : nullptr,
                            ctx->needs_input_grad(1) ? &grad_weight : nullptr);
      return {grad_x, grad_weight, at::Tensor()};
    }
    at::Tensor n = x.to(at::kFloat) * rstd;  // the normalised rows, rebuilt
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(1)) {
      at::Tensor prod = gy * n.to(x.scalar_type());
      grad_weight = prod.reshape({-1, x.size(-1)}).sum(0).to(weight.scalar_type());
    }
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      // dx = rstd * (dn - n * mean(dn * n)) with dn = gy * weight, in fp32.
      at::Tensor dn = (gy * weight.to(gy.scalar_type())).to(at::kFloat);
      at::Tensor dot = (dn * n).mean(-1, true);
      grad_x = dn.sub_(n.mul_(dot)).mul_(rstd).to(x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor()};
  }
};

struct SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
#ifdef MEMTUNE_CUDA
    if (swiglu_kernels(gate, up)) {
      const c10::cuda::CUDAGuard guard(gate.device());
      const at::Tensor g = gate.contiguous(), u = up.contiguous();
      at::Tensor y = at::empty_like(g);
      C10_CUDA_CHECK(norm_act_cuda::swiglu_forward(g.data_ptr(), u.data_ptr(), *device_type(g.scalar_type()),
                                                   g.numel(), y.data_ptr(), stream_of(g)));
      return y;
    }
#endif
    if (swiglu_cpu_kernels(gate, up)) {
      const at::Tensor g = gate.contiguous(), u = up.contiguous();
      at::Tensor y = at::empty_like(g);
      const float *gp = g.data_ptr<float>(), *up_ = u.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
        detail::swiglu_forward(gp + begin, up_ + begin, yp + begin, end - begin);
      });
      return y;
    }
    return at::silu(gate).mul_(up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const at::Tensor& gy = grads[0];
#ifdef MEMTUNE_CUDA
    if (swiglu_kernels(gate, up)) {
      const c10::cuda::CUDAGuard guard(gate.device());
      const at::Tensor g = gate.contiguous(), u = up.contiguous(), d = gy.to(gate.scalar_type()).contiguous();
      at::Tensor grad_gate = ctx->needs_input_grad(0) ? at::empty_like(g) : at::Tensor();
      at::Tensor grad_up = ctx->needs_input_grad(1) ? at::empty_like(g) : at::Tensor();
      C10_CUDA_CHECK(norm_act_cuda::swiglu_backward(
          g.data_ptr(), u.data_ptr(), d.data_ptr(), *device_type(g.scalar_type()), g.numel(),
          grad_gate.defined() ? grad_gate.data_ptr() : nullptr, grad_up.defined() ? grad_up.data_ptr() : nullptr,
          stream_of(g)));
      return {grad_gate, grad_up};
    }
#endif
    if (swiglu_cpu_kernels(gate, up)) {
      const at::Tensor g = gate.contiguous(), u = up.contiguous(), d = gy.to(at::kFloat).contiguous();
      at::Tensor grad_gate = ctx->needs_input_grad(0) ? at::empty_like(g) : at::Tensor();
      at::Tensor grad_up = ctx->needs_input_grad(1) ? at::empty_like(g) : at::Tensor();
      const float *gp = g.data_ptr<float>(), *up_ = u.data_ptr<float>(), *dp = d.data_ptr<float>();
      float* dg = grad_gate.defined() ? grad_gate.data_ptr<float>() : nullptr;
      float* du = grad_up.defined() ? grad_up.data_ptr<float>() : nullptr;
      at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
        detail::swiglu_backward(gp + begin, up_ + begin, dp + begin, dg == nullptr ? nullptr : dg + begin,
                                du == nullptr ? nullptr : du + begin, end - begin);
      });
      return {grad_gate, grad_up};
    }
    // Other dtypes (bf16 and fp16 on the CPU): autograd's own chain through HF's
    // `silu(gate) * up`: up's gradient silu(gate) * gy, gate's ATen's silu_backward of gy * up.
    at::Tensor grad_up;
    if (ctx->needs_input_grad(1)) grad_up = at::silu(gate).mul_(gy);
    at::Tensor grad_gate;
    if (ctx->needs_input_grad(0)) grad_gate = at::silu_backward(gy * up, gate);
    return {grad_gate, grad_up};
  }
};

// GELU (tanh approximation) on fp32 CPU tensors: one kernel pass each way (cpu_vec.h), where
// ATen's tanh-based forward and backward ran at about 1.4 ns an element on a 2-core Zen 4.
// Keeps x, as at::gelu does.
struct GeluTanhFunction : public torch::autograd::Function<GeluTanhFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    const at::Tensor xc = x.contiguous();
    ctx->save_for_backward({xc});
    at::Tensor y = at::empty_like(xc);
    const float* xp = xc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, xc.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
      detail::gelu_tanh_forward(xp + begin, yp + begin, end - begin);
    });
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor gy = grads[0].to(at::kFloat).contiguous();
    at::Tensor dx = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *gp = gy.data_ptr<float>();
    float* dp = dx.data_ptr<float>();
    at::parallel_for(0, x.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
      detail::gelu_tanh_backward(xp + begin, gp + begin, dp + begin, end - begin);
    });
    return {dx};
  }
};

// Gemma's RMSNorm in 16-bit dtypes (fp32 takes rms_norm with 1 + weight, the same values):
// the normalised rows times (1 + weight) in fp32, rounded once, as GemmaRMSNorm. Keeps x
// and one fp32 value per row; the backward rebuilds the normalised rows.
struct GemmaRmsNormFunction : public torch::autograd::Function<GemmaRmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    at::Tensor h = x.to(at::kFloat);
    at::Tensor rstd = h.square().mean(-1, true).add_(eps).rsqrt_();  // (..., 1) fp32
    at::Tensor y = (h * rstd).mul_(weight.to(at::kFloat) + 1.0).to(x.scalar_type());
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor g = grads[0].to(at::kFloat);
    at::Tensor n = x.to(at::kFloat) * rstd;  // the normalised rows, rebuilt
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(1)) grad_weight = (g * n).reshape({-1, x.size(-1)}).sum(0).to(weight.scalar_type());
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      // dx = rstd * (dn - n * mean(dn * n)) with dn = gy * (1 + weight), in fp32.
      at::Tensor dn = g * (weight.to(at::kFloat) + 1.0);
      at::Tensor dot = (dn * n).mean(-1, true);
      grad_x = dn.sub_(n.mul_(dot)).mul_(rstd).to(x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor()};
  }
};

// GeGLU, gelu(gate) * up, as one node that keeps gate and up (autograd's chain would keep
// gelu(gate) as well). fp32 CPU tensors with tanh's approximation take memtune's GELU kernels;
// the rest ATen's gelu, rounded to the dtype as transformers' act_fn(gate) * up rounds it.
struct GegluFunction : public torch::autograd::Function<GegluFunction> {
  static bool cpu_kernels(const at::Tensor& gate, const at::Tensor& up, bool tanh) {
    return tanh && gate.device().is_cpu() && gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat &&
           gate.sizes() == up.sizes();
  }

  static at::Tensor activation(const at::Tensor& gate, bool tanh) {
    if (!cpu_kernels(gate, gate, tanh)) return at::gelu(gate, tanh ? "tanh" : "none");
    const at::Tensor g = gate.contiguous();
    at::Tensor y = at::empty_like(g);
    const float* gp = g.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
      detail::gelu_tanh_forward(gp + begin, yp + begin, end - begin);
    });
    return y;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up, bool tanh) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["tanh"] = tanh;
    return activation(gate, tanh).mul_(up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const bool tanh = ctx->saved_data["tanh"].toBool();
    const at::Tensor gy = grads[0].to(gate.scalar_type());
    at::Tensor grad_up;
    if (ctx->needs_input_grad(1)) grad_up = activation(gate, tanh).mul_(gy);
    at::Tensor grad_gate;
    if (ctx->needs_input_grad(0)) {
      at::Tensor d = gy * up;
      if (cpu_kernels(gate, up, tanh)) {
        const at::Tensor g = gate.contiguous(), dc = d.contiguous();
        grad_gate = at::empty_like(g);
        const float *gp = g.data_ptr<float>(), *dp = dc.data_ptr<float>();
        float* out = grad_gate.data_ptr<float>();
        at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
          detail::gelu_tanh_backward(gp + begin, dp + begin, out + begin, end - begin);
        });
      } else {
        grad_gate = at::gelu_backward(d, gate, tanh ? "tanh" : "none");
      }
    }
    return {grad_gate, grad_up, at::Tensor()};
  }
};

}  // namespace

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  MEMTUNE_PROFILE_SCOPE("memtune::rms_norm");
  // In fp32, (1 + weight) times the normalised rows is rms_norm's product with one rounding.
  if (x.scalar_type() == at::kFloat) return RmsNormFunction::apply(x, weight.to(at::kFloat) + 1.0, eps);
  return GemmaRmsNormFunction::apply(x, weight, eps);
}

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, bool tanh_approximation) {
  MEMTUNE_PROFILE_SCOPE("memtune::geglu");
  return GegluFunction::apply(gate, up, tanh_approximation);
}

at::Tensor gelu_tanh(const at::Tensor& x, bool as_written) {
  MEMTUNE_PROFILE_SCOPE("memtune::gelu");
  if (x.device().is_cpu() && x.scalar_type() == at::kFloat) return GeluTanhFunction::apply(x);
  if (!as_written || x.scalar_type() == at::kFloat) return at::gelu(x, "tanh");
  // transformers' NewGELUActivation op by op, each rounded to x's dtype as it rounds them; one
  // statement per op, so that each intermediate is freed as Python frees it (a C++ expression
  // would keep every temporary until its end).
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  at::Tensor u = at::pow(x, 3.0);
  u = 0.044715 * u;
  u = x + u;
  u = c * u;
  u = at::tanh(u);
  u = 1.0 + u;
  at::Tensor half = 0.5 * x;
  return half * u;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  MEMTUNE_PROFILE_SCOPE("memtune::rms_norm");
  return RmsNormFunction::apply(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  MEMTUNE_PROFILE_SCOPE("memtune::swiglu");
  return SwigluFunction::apply(gate, up);
}

}  // namespace memtune::models
