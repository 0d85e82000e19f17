#include "models/layers/cross_entropy.h"

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include "models/layers/cpu_vec.h"
#include "models/layers/product_fp32.h"
#include "runtime/error.h"
#include "runtime/step_profiler.h"

#ifdef MEMTUNE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/layers/cuda/cross_entropy_cuda_kernels.h"
#endif

namespace memtune::models {

int64_t loss_chunk_rows(int64_t vocab_size) {
  const int64_t fit = (int64_t{8} << 20) / (std::max<int64_t>(vocab_size, 1) * 4);
  return std::clamp<int64_t>(fit, 256, 1024);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// For logits e (n,V): the row max m, e = exp(e - m) in place, the row sums s (each (n,1))
// and the first argmax (n,1). In fp32 two passes per row: on the CPU (cpu_vec.h) on the
// intra-op threads, on CUDA a CTA per row (models/layers/cuda/); elsewhere ATen's max,
// sub, exp and sum.
void row_softmax_parts(at::Tensor& e, at::Tensor* m, at::Tensor* s, at::Tensor* first_max) {
  const int64_t n = e.size(0), V = e.size(1);
#ifdef MEMTUNE_CUDA
  if (e.is_cuda() && e.scalar_type() == at::kFloat && e.is_contiguous()) {
    const c10::cuda::CUDAGuard guard(e.device());
    *m = at::empty({n, 1}, e.options());
    *s = at::empty({n, 1}, e.options());
    *first_max = at::empty({n, 1}, e.options().dtype(at::kLong));
    C10_CUDA_CHECK(cross_entropy_cuda::row_softmax_parts(e.data_ptr<float>(), n, V, m->data_ptr<float>(),
                                                         s->data_ptr<float>(), first_max->data_ptr<int64_t>(),
                                                         c10::cuda::getCurrentCUDAStream(e.device().index()).stream()));
    return;
  }
#endif
  if (!e.device().is_cpu() || e.scalar_type() != at::kFloat || !e.is_contiguous()) {
    auto [mx, arg] = e.max(1, true);
    e.sub_(mx).exp_();
    *m = mx;
    *s = e.sum(1, true);
    *first_max = arg;
    return;
  }
  *m = at::empty({n, 1}, e.options());
  *s = at::empty({n, 1}, e.options());
  *first_max = at::empty({n, 1}, e.options().dtype(at::kLong));
  float* x = e.data_ptr<float>();
  float* mp = m->data_ptr<float>();
  float* sp = s->data_ptr<float>();
  int64_t* ap = first_max->data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ap[r] = detail::exp_row_from_max(x + r * V, V, mp + r, sp + r);
  });
}

bool fused_bf16_softmax = true;

// For a chunk's bf16 logits e (n,V) and targets t (n,1) on CUDA: the row max m, sum s, first
// argmax and the targets' logits (each (n,1)) without an fp32 copy of the logits, and where
// `grad`, e overwritten by d loss / d logits in bf16: the bits the fp32 route below gives
// (models/layers/cuda/cross_entropy_cuda_kernels.h). False where it does not apply (not
// CUDA, not contiguous), leaving e as it was.
bool bf16_softmax_grad_in_place(at::Tensor& e, const at::Tensor& t, bool grad, at::Tensor* m, at::Tensor* s,
                                at::Tensor* first_max, at::Tensor* picked) {
#ifdef MEMTUNE_CUDA
  if (fused_bf16_softmax && e.is_cuda() && e.scalar_type() == at::kBFloat16 && e.is_contiguous() &&
      t.is_contiguous()) {
    const c10::cuda::CUDAGuard guard(e.device());
    const int64_t n = e.size(0), V = e.size(1);
    *picked = e.gather(1, t).to(at::kFloat);  // before e is overwritten
    *m = at::empty({n, 1}, e.options().dtype(at::kFloat));
    *s = at::empty({n, 1}, e.options().dtype(at::kFloat));
    *first_max = at::empty({n, 1}, e.options().dtype(at::kLong));
    C10_CUDA_CHECK(cross_entropy_cuda::bf16_softmax_grad(
        e.data_ptr(), n, V, grad ? t.data_ptr<int64_t>() : nullptr, m->data_ptr<float>(), s->data_ptr<float>(),
        first_max->data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream(e.device().index()).stream()));
    return true;
  }
#endif
  (void)e, (void)t, (void)grad, (void)m, (void)s, (void)first_max, (void)picked;
  return false;
}

struct LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, bool grad_hidden,
                            bool grad_weight, int64_t* correct, at::ScalarType mm_dtype, double smoothing,
                            at::Tensor* unsmoothed, double softcap) {
    const bool bf16 = mm_dtype == at::kBFloat16;
    const bool smooth = smoothing > 0;
    const bool capped = softcap > 0;
    const double uniform = smooth ? smoothing / static_cast<double>(weight.size(0)) : 0.0;  // e / V
    at::Tensor rows = (targets != -100).nonzero().squeeze(1);  // trained rows only
    at::Tensor h_all = hidden.index_select(0, rows);
    at::Tensor t_all = targets.index_select(0, rows);
    at::Tensor w = weight.to(mm_dtype);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor plain = smooth && unsmoothed ? at::zeros({}, total.options()) : at::Tensor();
    at::Tensor n_correct = at::zeros({}, targets.options());  // read once, not a sync per chunk
    at::Tensor dh_rows = grad_hidden ? at::empty({rows.size(0), hidden.size(1)}, w.options()) : at::Tensor();
    at::Tensor dw = grad_weight ? at::zeros(weight.sizes(), w.options().dtype(at::kFloat)) : at::Tensor();
    const int64_t n = rows.size(0);
    // Smoothing's part of d hidden: -(e / V) times the head's column sums, one row for all.
    const at::Tensor w_uniform =
        smooth && grad_hidden && !bf16 && !capped ? w.sum(0, true).mul_(uniform) : at::Tensor();
    // The bf16 products of d loss / d logits p (bf16, (n,V)) for the chunk [i0, i1).
    auto bf16_products = [&](const at::Tensor& p, const at::Tensor& h, int64_t i0, int64_t i1, at::Tensor scratch) {
      if (grad_hidden) {
        at::Tensor out = dh_rows.slice(0, i0, i1);
        at::mm_out(out, p, w);
      }
      if (grad_weight) add_product_t_fp32(dw, p, h, scratch);  // dW summed in fp32, not rounded chunk by chunk
    };
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
      const int64_t i1 = std::min(n, i0 + chunk);
      at::Tensor h = h_all.slice(0, i0, i1).to(mm_dtype);   // (n,C)
      at::Tensor t = t_all.slice(0, i0, i1).unsqueeze(1);    // (n,1)
      at::Tensor e = at::matmul(h, w.t());                   // (n,V) logits
      // Soft-capping keeps tanh(logits / c), whose derivative the gradient takes.
      at::Tensor th;
      if (capped) {
        e.div_(softcap).tanh_();
        if (grad_hidden || grad_weight) th = e.clone();
        e.mul_(softcap);
      }
      at::Tensor m, s, first_max, picked;
      const bool fused =  // on CUDA one pass over the bf16 logits, which become d loss / d logits
          bf16 && !smooth && !capped &&
          bf16_softmax_grad_in_place(e, t, grad_hidden || grad_weight, &m, &s, &first_max, &picked);
      at::Tensor logit_sum;  // smoothing: each row's sum of logits, before e becomes exp
      if (!fused) {
        if (bf16) e = e.to(at::kFloat);                      // rounded to bf16, then fp32 as the loss takes them
        picked = e.gather(1, t);
        if (smooth) logit_sum = e.sum(1, true);
        row_softmax_parts(e, &m, &s, &first_max);            // e = exp(logits - max), in place
      }
      if (correct) n_correct.add_((first_max == t).sum());
      if (smooth) {  // logsumexp - (1 - e) logit[target] - e mean(logits)
        const at::Tensor lse = m + s.log();
        total.add_((lse - picked * (1.0 - smoothing) - logit_sum * uniform).sum());
        if (plain.defined()) plain.add_((lse - picked).sum());
      } else {
        total.add_((m + s.log() - picked).sum());            // logsumexp - logit[target]
      }
      if (!grad_hidden && !grad_weight) continue;
      if (fused) {
        bf16_products(e, h, i0, i1, {});
        continue;
      }
      at::Tensor inv = s.reciprocal_();
      if (bf16 || capped) {
        // d loss / d logits = softmax - onehot(t), formed in fp32 and rounded to bf16 for both
        // products, as autograd does for bf16 logits taken to fp32. Through the cap, in the
        // logits' dtype as autograd takes transformers' `/ c, tanh, * c`: times c, times
        // 1 - tanh^2 (tanh's backward), divided by c.
        e.mul_(inv).scatter_add_(1, t, at::full({i1 - i0, 1}, -(1.0 - smoothing), e.options()));
        if (smooth) e.sub_(uniform);
        at::Tensor g = bf16 ? e.to(at::kBFloat16) : e;
        if (capped) at::tanh_backward_out(g, g.mul_(softcap), th).div_(softcap);  // in place
        if (bf16) {
          bf16_products(g, h, i0, i1, e);
          continue;
        }
        if (grad_hidden) {
          at::Tensor out = dh_rows.slice(0, i0, i1);
          at::mm_out(out, g, w);
        }
        if (grad_weight) dw.addmm_(g.t(), h);
        continue;
      }
      // d loss / d logits = e / s - onehot(t). The 1/s goes on the narrow side of each
      // product (n x C, not n x V) and the one-hot part is a row gather / scatter.
      // Smoothing scales the one-hot part by (1 - e) and subtracts e / V everywhere: from d
      // hidden the head's column sums times e / V, from dW each column's sum of h times e / V.
      const at::Tensor t1 = t.squeeze(1);
      if (grad_hidden) {
        at::Tensor out = dh_rows.slice(0, i0, i1);
        at::mm_out(out, e, w);
        if (smooth)
          out.mul_(inv).sub_(w.index_select(0, t1), 1.0 - smoothing).sub_(w_uniform);
        else
          out.mul_(inv).sub_(w.index_select(0, t1));
      }
      if (grad_weight) {
        dw.addmm_(e.t(), h * inv);
        if (smooth) {
          dw.index_add_(0, t1, h, -(1.0 - smoothing));
          dw.sub_(h.sum(0, true).mul_(uniform));
        } else {
          dw.index_add_(0, t1, h.neg());
        }
      }
    }
    if (correct) *correct += n_correct.item<int64_t>();
    if (unsmoothed) *unsmoothed = smooth ? plain : total.clone();
    at::Tensor dh;
    if (grad_hidden) {
      dh = at::zeros(hidden.sizes(), dh_rows.options());
      dh.index_copy_(0, rows, dh_rows);
      dh = dh.to(hidden.scalar_type());
    }
    ctx->save_for_backward({dh, grad_weight ? dw.to(weight.scalar_type()) : dw});
    return total;
  }

  // Scales the gradients formed in the forward by the loss's. In place unless the graph is
  // kept for another backward: no second (V,C) dW beside the saved one (the same bits).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& go = grads[0];
    const bool in_place = !torch::autograd::get_current_graph_task_keep_graph();
    auto scaled = [&](at::Tensor& g) {
      if (!g.defined()) return g;
      const at::Tensor s = go.to(g.scalar_type());
      return in_place ? g.mul_(s) : g * s;
    };
    at::Tensor dh = scaled(saved[0]), dw = scaled(saved[1]);
    return {dh,          dw,          at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void detail::use_fused_bf16_softmax(bool fused) { fused_bf16_softmax = fused; }

at::ScalarType loss_matmul_dtype(at::ScalarType compute_dtype) {
  return compute_dtype == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t chunk_rows, int64_t* correct,
                                    at::ScalarType compute_dtype, double label_smoothing, at::Tensor* unsmoothed,
                                    double logit_softcap) {
  MEMTUNE_PROFILE_SCOPE("memtune::loss");
  MEMTUNE_INTERNAL_ASSERT(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "linear_cross_entropy_sum: hidden (N,C), weight (V,C)");
  MEMTUNE_INTERNAL_ASSERT(label_smoothing >= 0 && label_smoothing < 1, "label_smoothing ", label_smoothing,
                          " outside [0, 1)");
  const bool grad = at::GradMode::is_enabled();
  return LinearCrossEntropy::apply(hidden, weight, targets.to(at::kLong), chunk_rows,
                                   grad && hidden.requires_grad(), grad && weight.requires_grad(), correct,
                                   loss_matmul_dtype(compute_dtype), label_smoothing, unsmoothed, logit_softcap);
}

at::Tensor soft_cap_logits(at::Tensor logits, double c) {
  if (c > 0) logits.div_(c).tanh_().mul_(c);
  return logits;
}

}  // namespace memtune::models
