#include "models/layers/norm_act.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace memtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
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
    return at::silu(gate).mul_(up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const at::Tensor& gy = grads[0];
    at::Tensor sig = at::sigmoid(gate);
    at::Tensor grad_up;
    if (ctx->needs_input_grad(1)) grad_up = gy * gate * sig;  // gy * silu(gate)
    at::Tensor grad_gate;
    if (ctx->needs_input_grad(0)) {
      // silu'(g) = sig * (1 + g * (1 - sig))
      at::Tensor d = gate * (1 - sig);
      grad_gate = d.add_(1).mul_(sig).mul_(gy).mul_(up);
    }
    return {grad_gate, grad_up};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return SwigluFunction::apply(gate, up); }

}  // namespace memtune::models
