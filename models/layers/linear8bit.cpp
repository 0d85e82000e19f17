#include "models/layers/linear8bit.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "models/layers/panel_product.h"
#include "runtime/error.h"
#include "runtime/int8.h"

namespace memtune::models {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dtype a product of `dtype` operands runs in: float16 on a CPU, which has no float16
// GEMM, as fp32 sums of the float16 values rounded once (what cuBLAS does).
at::ScalarType wide(const at::Tensor& on, at::ScalarType dtype) {
  return on.device().is_cpu() && dtype == at::kHalf ? at::kFloat : dtype;
}

int64_t panel_rows(int64_t in, at::ScalarType dt) {
  return models::panel_rows(in, static_cast<int64_t>(c10::elementSize(dt)));
}

// On a CPU in fp32 or bf16: y [M, out] = x [M, in] @ deq(W)^T (+ bias), each panel of W's rows
// dequantized into one buffer and multiplied into its columns of y (each output element the
// same sum as one GEMM's).
bool cpu_panels(const at::Tensor& x, at::ScalarType dt) {
  return x.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16);
}

at::Tensor matmul_wt_panels(const at::Tensor& x, const Int8Weight& w, const at::Tensor& bias) {
  const int64_t out = w.codes.size(0), in = w.codes.size(1);
  return panel_matmul_wt(x, out, in, panel_rows(in, x.scalar_type()), bias,
                         [&](int64_t r0, int64_t r, at::Tensor& panel) {
                           memtune::int8_dequantize_rows_into(w.codes, w.absmax, r0, r, panel);
                         });
}

// gx [M, in] = g [M, out] @ deq(W) in fp32 on a CPU, summed over panels of W's rows (a 16-bit
// gx would be rounded once per panel: those take one GEMM over the whole dequantized W).
at::Tensor matmul_w_panels(const at::Tensor& g, const at::Tensor& codes, const at::Tensor& absmax) {
  const int64_t out = codes.size(0), in = codes.size(1);
  return panel_matmul_w(g, out, in, panel_rows(in, at::kFloat), [&](int64_t r0, int64_t r, at::Tensor& panel) {
    memtune::int8_dequantize_rows_into(codes, absmax, r0, r, panel);
  });
}

class Linear8bitFunction : public torch::autograd::Function<Linear8bitFunction> {
 public:
  // x (..., in); bias as an optional (LibTorch 1.13's Function::apply rejects undefined
  // tensors). W is no autograd input: it gets no gradient.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& bias_opt,
                            const Int8Weight* w, at::ScalarType autocast, Int8Product product) {
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    const int64_t in = w->codes.size(1), out = w->codes.size(0);
    const at::Tensor x2 = x.reshape({-1, in});
    at::Tensor y;
    if (product == Int8Product::kDequantize) {
      // F.linear(A, deq_A(W), bias), which an autocast region runs in its dtype (the weight
      // dequantized in x's dtype and then cast is the weight dequantized in that dtype).
      const at::ScalarType pt = autocast != at::ScalarType::Undefined ? autocast : x.scalar_type();
      const at::ScalarType mt = wide(x, pt);
      if (cpu_panels(x, pt))
        y = matmul_wt_panels(x2.to(pt).contiguous(), *w, bias.defined() ? bias.to(pt) : bias);
      else
        y = at::linear(x2.to(pt).to(mt), memtune::int8_dequantize(w->codes, w->absmax, pt).to(mt),
                       bias.defined() ? bias.to(pt).to(mt) : bias)
                .to(pt);
    } else {
      y = memtune::int8_mixed_matmul(x2, w->codes, w->absmax, bias, w->threshold,
                                     x.device().is_cuda() ? Int8Flavour::kCuda : Int8Flavour::kDefault, autocast);
    }
    auto& s = ctx->saved_data;
    s["codes"] = w->codes;
    s["absmax"] = w->absmax;
    s["x_sizes"] = x.sizes().vec();
    s["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    s["has_bias"] = bias.defined();
    std::vector<int64_t> y_sizes = x.sizes().vec();
    y_sizes.back() = out;
    return y.view(y_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto& s = ctx->saved_data;
    const at::Tensor codes = s["codes"].toTensor();
    const auto dtype = static_cast<at::ScalarType>(s["x_dtype"].toInt());
    const at::Tensor g = grad_outputs[0].reshape({-1, codes.size(0)});
    at::Tensor grad_x, grad_b;
    // MatMul8bitLt / MatMul8bitFp: grad_output.to(A's dtype) @ CB.to(A's dtype) * SCB / 127.
    if (ctx->needs_input_grad(0)) {
      const at::ScalarType mt = wide(g, dtype);
      const at::Tensor absmax = s["absmax"].toTensor();
      grad_x = (g.device().is_cpu() && dtype == at::kFloat
                    ? matmul_w_panels(g.to(dtype).contiguous(), codes, absmax)
                    : at::mm(g.to(dtype).to(mt), memtune::int8_dequantize(codes, absmax, dtype).to(mt)).to(dtype))
                   .view(s["x_sizes"].toIntVector());
    }
    if (s["has_bias"].toBool() && ctx->needs_input_grad(1)) grad_b = g.sum(0);
    return {grad_x, grad_b, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t int8_panel_bytes(int64_t out, int64_t in, int64_t compute_bytes, int64_t input_bytes) {
  auto panel = [&](int64_t bytes) { return std::min(models::panel_rows(in, bytes), out) * in * bytes; };
  // float16 on a CPU: the whole W in float16, and its fp32 copy for the product.
  const int64_t forward = compute_bytes == 4 || compute_bytes == 2 ? panel(compute_bytes) : out * in * compute_bytes;
  const int64_t backward = input_bytes == 4 ? panel(4) : out * in * input_bytes;
  return std::max(forward, backward);
}

Int8Product int8_product(const c10::Device& device, bool training) {
  return device.is_cpu() && training ? Int8Product::kDequantize : Int8Product::kMixed;
}

at::Tensor linear8bit(const at::Tensor& x, const Int8Weight& w, const at::Tensor& bias, bool training,
                      at::ScalarType autocast, Int8Product product) {
  MEMTUNE_CHECK(w.codes.defined() && w.codes.dim() == 2 && w.codes.scalar_type() == at::kChar,
                "linear8bit: the weight is not an int8 matrix");
  const int64_t out = w.codes.size(0), in = w.codes.size(1);
  MEMTUNE_CHECK(w.absmax.defined() && w.absmax.dim() == 1 && w.absmax.size(0) == out,
                "linear8bit: the weight [", out, ", ", in, "] needs its row absmax [", out, "]");
  MEMTUNE_CHECK(x.dim() >= 1 && x.size(-1) == in, "linear8bit: input's last dim is ", x.dim() ? x.size(-1) : 0,
                ", the weight [", out, ", ", in, "] needs ", in);
  MEMTUNE_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out), "linear8bit: bias has shape ",
                bias.defined() ? bias.sizes() : at::IntArrayRef{}, ", expected [", out, "]");
  MEMTUNE_CHECK(x.device() == w.codes.device() && x.device() == w.absmax.device(), "linear8bit: input on ",
                x.device(), " but the 8-bit weight on ", w.codes.device(), " (row absmax on ", w.absmax.device(),
                "); move them to one device");
  if (product == Int8Product::kAuto) product = int8_product(x.device(), training);
  // Linear8bitLt casts its bias to the input's dtype before the product.
  c10::optional<at::Tensor> bias_opt;
  if (bias.defined()) bias_opt = bias.scalar_type() == x.scalar_type() ? bias : bias.to(x.scalar_type());
  return Linear8bitFunction::apply(x, bias_opt, &w, autocast, product);
}

}  // namespace memtune::models
