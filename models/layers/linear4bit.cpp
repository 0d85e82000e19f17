#include "models/layers/linear4bit.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <string>

#include "models/layers/panel_product.h"
#include "runtime/error.h"

namespace memtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t panel_rows(const NF4Tensor& q, at::ScalarType dt) {
  return models::panel_rows(q.shape[1], static_cast<int64_t>(c10::elementSize(dt)));
}

bool use_panels(const NF4Tensor& q, Nf4MatmulPath path) {
  if (!q.device().is_cpu()) return false;  // elsewhere: tensor-op dequantize, one GEMM
  return path != Nf4MatmulPath::kDequantizeThenMatmul;
}

}  // namespace

int64_t nf4_panel_bytes(int64_t out, int64_t in, int64_t elem_bytes) {
  if (elem_bytes != 4) return out * in * elem_bytes;  // nf4_matmul_w's one GEMM (the forward's panels are smaller)
  return std::min(models::panel_rows(in, elem_bytes), out) * in * elem_bytes;
}

// y [M, out] = x [M, in] @ deq(W)^T
at::Tensor nf4_matmul_wt(const at::Tensor& x, const NF4Tensor& q, at::ScalarType ct, Nf4MatmulPath path,
                         const at::Tensor& bias) {
  if (!use_panels(q, path))
    return bias.defined() ? at::addmm(bias, x, memtune::nf4_dequantize(q, ct).t())
                          : at::mm(x, memtune::nf4_dequantize(q, ct).t());
  const int64_t out = q.shape[0], in = q.shape[1];
  return panel_matmul_wt(x, out, in, panel_rows(q, ct), bias, [&](int64_t r0, int64_t r, at::Tensor& panel) {
    memtune::nf4_dequantize_range_into(q, r0 * in, r * in, panel);
  });
}

// gx [M, in] = g [M, out] @ deq(W)
at::Tensor nf4_matmul_w(const at::Tensor& g, const NF4Tensor& q, at::ScalarType ct, Nf4MatmulPath path) {
  // Summed over panels, a 16-bit gx would be rounded once per panel; one GEMM sums in fp32 and
  // rounds once, as bitsandbytes' product of the dequantized weight does.
  if (!use_panels(q, path) || ct != at::kFloat) return at::mm(g, memtune::nf4_dequantize(q, ct));
  const int64_t out = q.shape[0], in = q.shape[1];
  return panel_matmul_w(g, out, in, panel_rows(q, ct), [&](int64_t r0, int64_t r, at::Tensor& panel) {
    memtune::nf4_dequantize_range_into(q, r0 * in, r * in, panel);
  });
}

// The quantized state travels through saved_data as IValues (tensors share storage): every
// field of NF4Tensor, or backward decodes with another codebook than forward.
void save_nf4(AutogradContext* ctx, const NF4Tensor& q) {
  auto& s = ctx->saved_data;
  s["packed"] = q.packed;
  s["absmax"] = q.absmax;
  s["nested_absmax"] = q.nested_absmax;
  s["nested_quant_map"] = q.nested_quant_map;
  s["nested_offset"] = static_cast<double>(q.nested_offset);
  s["shape"] = q.shape;
  s["blocksize"] = q.blocksize;
  s["double_quant"] = q.double_quant;
  s["quant_type"] = static_cast<int64_t>(q.quant_type);
  s["dtype"] = static_cast<int64_t>(q.dtype);
}

NF4Tensor load_nf4(AutogradContext* ctx) {
  auto& s = ctx->saved_data;
  NF4Tensor q;
  q.packed = s["packed"].toTensor();
  q.absmax = s["absmax"].toTensor();
  q.nested_absmax = s["nested_absmax"].toTensor();
  q.nested_quant_map = s["nested_quant_map"].toTensor();
  q.nested_offset = static_cast<float>(s["nested_offset"].toDouble());
  q.shape = s["shape"].toIntVector();
  q.blocksize = s["blocksize"].toInt();
  q.double_quant = s["double_quant"].toBool();
  q.quant_type = static_cast<QuantType>(s["quant_type"].toInt());
  q.dtype = static_cast<at::ScalarType>(s["dtype"].toInt());
  return q;
}

namespace {

class Linear4bitFunction : public torch::autograd::Function<Linear4bitFunction> {
 public:
  // x (..., in); bias [out] or undefined. W is no autograd input: it gets no gradient.
  // bias travels as an optional: LibTorch 1.13's Function::apply rejects undefined tensors.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& bias_opt,
                            const NF4Tensor* w, at::ScalarType ct, Nf4MatmulPath path) {
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    const int64_t in = w->shape[1], out = w->shape[0];
    at::Tensor x2 = x.reshape({-1, in}).to(ct);
    at::Tensor y = nf4_matmul_wt(x2, *w, ct, path, bias.defined() ? bias.to(ct) : bias);
    save_nf4(ctx, *w);
    ctx->saved_data["compute_dtype"] = static_cast<int64_t>(ct);
    ctx->saved_data["path"] = static_cast<int64_t>(path);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.defined() ? bias.scalar_type() : ct);
    std::vector<int64_t> y_sizes = x.sizes().vec();
    y_sizes.back() = out;
    return y.view(y_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const NF4Tensor w = load_nf4(ctx);
    const auto ct = static_cast<at::ScalarType>(ctx->saved_data["compute_dtype"].toInt());
    const auto path = static_cast<Nf4MatmulPath>(ctx->saved_data["path"].toInt());
    at::Tensor g = grad_outputs[0].reshape({-1, w.shape[0]}).to(ct);
    at::Tensor grad_x, grad_b;
    if (ctx->needs_input_grad(0)) {
      grad_x = nf4_matmul_w(g, w, ct, path)
                   .view(ctx->saved_data["x_sizes"].toIntVector())
                   .to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    }
    // Edges exist only for tensor inputs: x, then bias when given.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1)) {
      grad_b = g.sum(0).to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    }
    // One gradient per forward input: x, bias, and none for the non-tensor arguments.
    return {grad_x, grad_b, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear4bit(const at::Tensor& x, const std::shared_ptr<const NF4Tensor>& w, const at::Tensor& bias,
                      at::ScalarType compute_dtype, Nf4MatmulPath path) {
  MEMTUNE_CHECK(w != nullptr, "linear4bit: no NF4 weight given");
  MEMTUNE_CHECK(w->shape.size() == 2, "linear4bit: NF4 weight must be 2-D [out, in], got ", w->shape.size(), " dims");
  const int64_t out = w->shape[0], in = w->shape[1];
  MEMTUNE_CHECK(x.dim() >= 1 && x.size(-1) == in, "linear4bit: input's last dim is ",
                x.dim() ? x.size(-1) : 0, ", the weight [", out, ", ", in, "] needs ", in);
  MEMTUNE_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out), "linear4bit: bias has shape ",
                bias.defined() ? bias.sizes() : at::IntArrayRef{}, ", expected [", out, "]");
  MEMTUNE_CHECK(x.device() == w->device(), "linear4bit: input on ", x.device(), " but the NF4 weight on ",
                w->device(), "; move them to one device");
  c10::optional<at::Tensor> bias_opt;
  if (bias.defined()) bias_opt = bias;
  return Linear4bitFunction::apply(x, bias_opt, w.get(), compute_dtype, path);
}

}  // namespace memtune::models
