// memtune's blocked attention against the textbook one written with ATen ops (scores,
// explicit mask, softmax, weighted sum) under autograd: outputs and gradients for every
// query-block size, sliding windows, grouped-query heads and packed segments.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "models/layers/attention.h"
#include "test_util.h"

namespace {

using memtune::models::causal_segment_attention;
using memtune::testing::expect_close;

// q (B,Hkv,G,T,D), k/v (B,Hkv,T,D): every query against every key, then the mask.
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg,
                           double scale, int64_t window) {
  const int64_t T = q.size(3);
  at::Tensor s = at::matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale;  // (B,Hkv,G,T,T)
  at::Tensor pos = at::arange(T, at::kLong);
  at::Tensor qp = pos.view({T, 1}), kp = pos.view({1, T});
  at::Tensor allowed = (kp <= qp).unsqueeze(0) & (seg.unsqueeze(2) == seg.unsqueeze(1));  // (B,T,T)
  if (window > 0) allowed = allowed & (qp - kp < window).unsqueeze(0);
  s = s.masked_fill(allowed.logical_not().view({seg.size(0), 1, 1, T, T}), -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(s, -1), v.unsqueeze(2));
}

TEST(Attention, BlocksAndWindowsMatchTheTextbookAttention) {
  torch::manual_seed(9);
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  // Row 0: two documents (10 + 13 tokens); row 1: one document then padding (segment -1).
  at::Tensor seg = at::zeros({B, T}, at::kLong);
  seg[0].slice(0, 10) = 1;
  seg[1].slice(0, 19) = -1;
  for (int64_t window : {0, 1, 3, 10}) {
    for (int64_t block : {4, 7, 64}) {
      SCOPED_TRACE("window " + std::to_string(window) + ", block " + std::to_string(block));
      at::Tensor q = at::randn({B, Hkv, G, T, D}, at::kFloat).requires_grad_(true);
      at::Tensor k = at::randn({B, Hkv, T, D}, at::kFloat).requires_grad_(true);
      at::Tensor v = at::randn({B, Hkv, T, D}, at::kFloat).requires_grad_(true);
      for (int64_t keep_bytes : {int64_t{64} << 20, int64_t{0}}) {  // probabilities kept / recomputed
        at::Tensor out = causal_segment_attention(q, k, v, seg, 0.35, window, block, keep_bytes);
        at::Tensor qr = q.detach().clone().requires_grad_(true), kr = k.detach().clone().requires_grad_(true),
                   vr = v.detach().clone().requires_grad_(true);
        at::Tensor ref = naive_attention(qr, kr, vr, seg, 0.35, window);
        expect_close(out, ref, 2e-5, "output", 1.0);
        at::Tensor g = at::randn(out.sizes(), at::kFloat);
        auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
        ref.backward(g);
        expect_close(grads[0], qr.grad(), 2e-5, "grad q", 1.0);
        expect_close(grads[1], kr.grad(), 2e-5, "grad k", 1.0);
        expect_close(grads[2], vr.grad(), 2e-5, "grad v", 1.0);
      }
    }
  }
}

}  // namespace
