#include "models/layers/lora_linear.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers/cpu_gemm.h"
#include "models/layers/product_fp32.h"
#include "runtime/error.h"

#ifdef MEMTUNE_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/layers/cuda/lora_cuda_kernels.h"
#endif

namespace memtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The adapter's products all have a side r wide. OpenBLAS splits one r wide in its output
// over its threads at a third of one thread's speed or less; those go through cpu_gemm.h's
// narrow_mm on fp32 CPU tensors instead (bench/lora_bench.cpp). alpha * a b:
at::Tensor adapter_mm(const at::Tensor& a, const at::Tensor& b, double alpha = 1.0) {
  if (detail::narrow_mm_applies(a, b)) return detail::narrow_mm(a, b, alpha);
  at::Tensor c = at::mm(a, b);
  return alpha == 1.0 ? c : c.mul_(alpha);
}
// a^T b with a [M, r]: as (b^T a)^T where that product is the narrow one, stored across
// into the row-major [r, N] result.
at::Tensor adapter_mm_tn(const at::Tensor& a, const at::Tensor& b) {
  if (!detail::narrow_mm_applies(b.t(), a)) return at::mm(a.t(), b);
  at::Tensor c = at::empty({a.size(1), b.size(1)}, b.options());
  detail::narrow_mm(b.t(), a, 1.0, c.t());
  return c;
}

// A 16-bit adapter (bf16 or fp16 A and B, or under autocast 16-bit copies of fp32 ones)
// rounds each product, as PEFT's ops do in 16 bits.
bool sixteen_bit(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  // The bias travels as an optional (LibTorch 1.13's apply rejects undefined tensors); a
  // dense W is an input that needs no gradient, an NF4 W a pointer kept as saved data.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const c10::optional<at::Tensor>& h, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& dense, const NF4Tensor* nf4, double scaling,
                            Nf4MatmulPath path, bool autocast) {
    const int64_t in = A.size(1), out = B.size(0);
    at::Tensor x2 = x.reshape({-1, in});
    at::Tensor h2 = h.has_value() ? h->reshape({-1, in}) : x2;  // the adapter's input
    at::Tensor y;
    if (dense.has_value()) {
      y = bias.has_value() ? at::addmm(*bias, x2, dense->t()) : at::mm(x2, dense->t());
    } else if (nf4) {
      y = nf4_matmul_wt(x2, *nf4, x2.scalar_type(), path, bias.has_value() ? *bias : at::Tensor());
    } else {
      y = at::zeros({x2.size(0), out}, x2.options());  // the adapter alone
    }
    // Under autocast fp32 A and B multiply through 16-bit copies in x's dtype (kept for
    // backward), whose gradients come back summed in fp32 (backward).
    const bool cast = autocast && A.scalar_type() == at::kFloat && sixteen_bit(x);
    const at::Tensor Ac = cast ? A.to(x.scalar_type()) : A, Bc = cast ? B.to(x.scalar_type()) : B;
    // An fp32 adapter on a 16-bit base (PEFT's autocast_adapter_dtype): the adapter's input
    // is taken to fp32. PEFT's Linear forms the sum with the base's output in fp32 and rounds
    // it once; its 4-bit Linear rounds the adapter's output to the base's dtype first, then adds.
    const bool mixed = Ac.scalar_type() != x.scalar_type();
    at::Tensor ha = adapter_mm(h2.to(Ac.scalar_type()), Ac.t());  // [M, r]
    if (!mixed && sixteen_bit(Ac))
      detail::add_adapter_output(y, ha, Bc.t(), scaling);
    else if (!mixed)
      y.addmm_(ha, B.t(), /*beta=*/1, /*alpha=*/scaling);
    else if (dense.has_value() && y.is_cuda())
      y.add_(at::mm(ha, B.t()), scaling);  // one kernel: read as fp32, summed, rounded once into y
    else if (dense.has_value())  // the CPU's mixed in-place add would copy y to fp32 and back itself
      y = y.to(A.scalar_type()).addmm_(ha, B.t(), /*beta=*/1, /*alpha=*/scaling).to(x.scalar_type());
    else
      y.add_(at::mm(ha, B.t()).mul_(scaling).to(x.scalar_type()));

    ctx->save_for_backward({h2, ha, Ac, Bc, dense.has_value() ? *dense : at::Tensor()});
    if (nf4) save_nf4(ctx, *nf4);
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["path"] = static_cast<int64_t>(path);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_h"] = h.has_value();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["cast"] = cast;
    ctx->saved_data["has_base"] = dense.has_value() || nf4 != nullptr;
    std::vector<int64_t> y_sizes = x.sizes().vec();
    y_sizes.back() = out;
    return y.view(y_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h2 = saved[0], &ha = saved[1], &A = saved[2], &B = saved[3], &dense = saved[4];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const auto path = static_cast<Nf4MatmulPath>(ctx->saved_data["path"].toInt());
    at::Tensor g = grad_outputs[0].reshape({-1, B.size(0)});
    // A mixed node: the adapter's products in its own dtype (the gradient of a cast is the cast).
    const bool mixed = A.scalar_type() != g.scalar_type();
    at::Tensor ga = mixed ? g.to(A.scalar_type()) : g;

    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const bool has_h = ctx->saved_data["has_h"].toBool();
    // Edges exist for the tensors given: x, A, B, then h and bias when present.
    const size_t h_edge = 3, bias_edge = has_h ? 4 : 3;

    // fp32 A and B cast under autocast: their gradients summed in fp32 from the 16-bit
    // operands (product_fp32.h), not rounded to 16 bits, so a micro-batch split or a retry
    // with fewer rows sums the same products (PyTorch's autocast rounds each to 16 bits).
    const bool cast = ctx->saved_data["cast"].toBool();
    at::Tensor gha = adapter_mm(ga, B, scaling);  // [M, r]: d loss / d (h A^T)
    at::Tensor grad_x, grad_A, grad_B, grad_h, grad_bias;
    if (ctx->needs_input_grad(2) && cast) {
      grad_B = at::zeros(B.sizes(), B.options().dtype(at::kFloat));
      add_product_t_fp32(grad_B, ga.contiguous(), ha);
      grad_B.mul_(scaling);
    } else if (ctx->needs_input_grad(2)) {
      grad_B = adapter_mm(ga.t(), ha, scaling);
    }
    if (mixed) ga = at::Tensor();  // its fp32 copy of g, freed before d x's buffers
    const bool has_base = ctx->saved_data["has_base"].toBool();
    if (ctx->needs_input_grad(0) && !has_base && !has_h) {
      grad_x = at::mm(gha, A).view(x_sizes);  // the adapter alone
    } else if (ctx->needs_input_grad(0) && has_base) {
      grad_x = dense.defined() ? at::mm(g, dense) : nf4_matmul_w(g, load_nf4(ctx), g.scalar_type(), path);
      if (!has_h && mixed)
        grad_x.add_(at::mm(gha, A).to(g.scalar_type()));  // each path's gradient rounded, then summed, as autograd
      else if (!has_h && sixteen_bit(A))
        detail::add_adapter_output(grad_x, gha, A, 1.0);  // ... in 16 bits too
      else if (!has_h)
        grad_x.addmm_(gha, A);  // both paths in one buffer
      grad_x = grad_x.view(x_sizes);
    }
    if (has_h && ctx->needs_input_grad(h_edge)) grad_h = at::mm(gha, A).view(x_sizes);  // h is in A's dtype
    if (ctx->needs_input_grad(1) && cast) {
      grad_A = at::zeros(A.sizes(), A.options().dtype(at::kFloat));
      add_product_t_fp32(grad_A, gha, h2.contiguous());
    } else if (ctx->needs_input_grad(1)) {
      grad_A = adapter_mm_tn(gha, h2.to(A.scalar_type()));
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(bias_edge)) grad_bias = g.sum(0);
    return {grad_x,        grad_A,       grad_B,       grad_h,       grad_bias,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& adapter_input, const FrozenWeight& w,
                       const at::Tensor& bias, const at::Tensor& A, const at::Tensor& B, double scaling,
                       Nf4MatmulPath path, bool autocast) {
  MEMTUNE_CHECK(!(w.dense.defined() && w.nf4), "lora_linear: give at most one of a dense or an NF4 weight");
  MEMTUNE_CHECK(w.dense.defined() || w.nf4 || !bias.defined(), "lora_linear: a bias without a base weight");
  MEMTUNE_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(0) == B.size(1), "lora_linear: A ", A.sizes(), " and B ",
                B.sizes(), " do not form an adapter ([r, in] and [out, r])");
  MEMTUNE_CHECK(x.size(-1) == A.size(1), "lora_linear: input's last dim is ", x.size(-1), ", the adapter needs ",
                A.size(1));
  MEMTUNE_CHECK(!w.dense.defined() || (w.dense.size(0) == B.size(0) && w.dense.size(1) == A.size(1)),
                "lora_linear: weight ", w.dense.sizes(), " does not match the adapter [", B.size(0), ", ",
                A.size(1), "]");
  MEMTUNE_CHECK(!adapter_input.defined() || adapter_input.sizes() == x.sizes(), "lora_linear: adapter input ",
                adapter_input.sizes(), " differs from the input ", x.sizes());
  c10::optional<at::Tensor> h_opt, bias_opt, dense_opt;
  if (adapter_input.defined()) h_opt = adapter_input;
  if (bias.defined()) bias_opt = bias;
  if (w.dense.defined()) dense_opt = w.dense.detach();
  return LoraLinearFunction::apply(x, A, B, h_opt, bias_opt, dense_opt, w.nf4.get(), scaling, path, autocast);
}

namespace detail {
// On CUDA the product's two passes over an (M, N) tensor (written, read back) are not made.
void add_adapter_output(at::Tensor& y, const at::Tensor& a, const at::Tensor& b, double s) {
  MEMTUNE_INTERNAL_ASSERT(a.size(0) == y.size(0) && b.size(1) == y.size(1) && a.size(1) == b.size(0),
                          "add_adapter_output: y ", y.sizes(), " += a ", a.sizes(), " b ", b.sizes());
#ifdef MEMTUNE_CUDA
  if (y.is_cuda() && sixteen_bit(y) && y.dim() == 2 && y.stride(1) == 1 && a.scalar_type() == y.scalar_type() &&
      b.scalar_type() == y.scalar_type()) {
    const c10::cuda::CUDAGuard guard(y.device());
    // The forward's b is B^T, a view of the adapter's B: its rows copied once (r x N, small).
    const at::Tensor ac = a.stride(1) == 1 ? a : a.contiguous(), bc = b.stride(1) == 1 ? b : b.contiguous();
    C10_CUDA_CHECK(lora_cuda::add_scaled_product(
        y.data_ptr(), y.stride(0), ac.data_ptr(), ac.stride(0), bc.data_ptr(), bc.stride(0),
        *cuda_math::device_type(y.scalar_type()), y.size(0), y.size(1), a.size(1), static_cast<float>(s),
        c10::cuda::getCurrentCUDAStream(y.device().index()).stream()));
    return;
  }
#endif
  at::Tensor o = at::mm(a, b);
  // A power of two scales exactly: then one kernel scales and adds.
  int exponent = 0;
  if (std::frexp(s, &exponent) == 0.5)
    y.add_(o, s);
  else
    y.add_(o.mul_(s));
}
}  // namespace detail

}  // namespace memtune::models
