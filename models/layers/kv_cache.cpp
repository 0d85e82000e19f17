#include "models/layers/kv_cache.h"

#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "runtime/error.h"
#include "runtime/step_profiler.h"

namespace memtune::models {

KVCache::KVCache(int num_layers, int64_t capacity)
    : keys_(num_layers), values_(num_layers), length_(num_layers, 0), capacity_(std::max<int64_t>(capacity, 1)) {}

bool KVCache::holds(int64_t positions) const {
  return std::all_of(length_.begin(), length_.end(), [&](int64_t n) { return n == positions; });
}

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < keys_.size(); ++i)
    if (keys_[i].defined()) n += keys_[i].nbytes() + values_[i].nbytes();
  return n;
}

at::Tensor KVCache::attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& segment_ids, double scale, int64_t sliding_window,
                           const AttentionOptions& options) {
  MEMTUNE_INTERNAL_ASSERT(!at::GradMode::is_enabled(), "KVCache: a forward that records gradients");
  MEMTUNE_INTERNAL_ASSERT(layer >= 0 && layer < static_cast<int>(length_.size()), "KVCache: layer ", layer, " of ",
                          length_.size());
  MEMTUNE_INTERNAL_ASSERT(q.dim() == 5 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(3) == k.size(2),
                          "KVCache: q (B,Hkv,G,T,D), k/v (B,Hkv,T,D)");
  at::Tensor& keys = keys_[layer];
  at::Tensor& values = values_[layer];
  const int64_t past = length_[layer], T = k.size(2), held = past + T;
  if (keys.defined())
    MEMTUNE_INTERNAL_ASSERT(keys.size(0) == k.size(0) && keys.size(1) == k.size(1) && keys.size(3) == k.size(3) &&
                                keys.scalar_type() == k.scalar_type() && keys.device() == k.device(),
                            "KVCache: layer ", layer, " holds keys ", keys.sizes(), " ", keys.scalar_type(), " on ",
                            keys.device(), ", the forward brings ", k.sizes(), " ", k.scalar_type(), " on ",
                            k.device());
  if (!keys.defined() || held > keys.size(2)) {
    int64_t room = keys.defined() ? keys.size(2) : capacity_;
    while (room < held) room *= 2;
    at::Tensor grown_k = at::empty({k.size(0), k.size(1), room, k.size(3)}, k.options());
    at::Tensor grown_v = at::empty({v.size(0), v.size(1), room, v.size(3)}, v.options());
    if (past > 0) {
      grown_k.narrow(2, 0, past).copy_(keys.narrow(2, 0, past));
      grown_v.narrow(2, 0, past).copy_(values.narrow(2, 0, past));
    }
    keys = grown_k;
    values = grown_v;
  }
  keys.narrow(2, past, T).copy_(k);
  values.narrow(2, past, T).copy_(v);
  length_[layer] = held;
  if (past == 0) return causal_segment_attention(q, k, v, segment_ids, scale, sliding_window, options);
  return attention_after_prefix(q, keys.narrow(2, 0, held), values.narrow(2, 0, held), scale, sliding_window,
                                options.softcap);
}

namespace {

// a @ b in a's dtype. On a CPU in 16 bits, from fp32 copies rounded once, as a GEMM that adds
// in fp32 gives it: LibTorch 1.13's CPU batched product adds small 16-bit problems in 16 bits
// (measured in bf16, (2x16) @ (16x20): max error 0.14 against 0.03 for the rounded exact
// product), and a new token's scores and weighted values are that small on small models.
at::Tensor matmul_rounded_once(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cpu() || (a.scalar_type() != at::kBFloat16 && a.scalar_type() != at::kHalf)) return at::matmul(a, b);
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

}  // namespace

at::Tensor attention_after_prefix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  int64_t sliding_window, double softcap) {
  MEMTUNE_PROFILE_SCOPE("memtune::attention");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4), L = k.size(2);
  MEMTUNE_INTERNAL_ASSERT(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == Hkv &&
                              k.size(3) == D && T <= L,
                          "attention_after_prefix: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  // Keys before the first query's window take no part.
  const int64_t k0 = sliding_window > 0 ? std::max<int64_t>(0, L - T - sliding_window + 1) : 0;
  at::Tensor kb = k.narrow(2, k0, L - k0), vb = v.narrow(2, k0, L - k0);
  at::Tensor s = matmul_rounded_once(q.reshape({B, Hkv, G * T, D}), kb.transpose(-1, -2));
  s = s.view({B, Hkv, G, T, L - k0}).mul_(scale);
  if (softcap > 0) s.div_(softcap).tanh_().mul_(softcap);
  s = s.to(at::kFloat);
  if (T > 1 || sliding_window > 0) {
    const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
    at::Tensor qpos = at::arange(L - T, L, positions).unsqueeze(1), kpos = at::arange(k0, L, positions).unsqueeze(0);
    at::Tensor allowed = kpos <= qpos;
    if (sliding_window > 0) allowed = allowed.logical_and(qpos - kpos < sliding_window);
    s.masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  }
  at::Tensor p = at::softmax(s, -1);
  return matmul_rounded_once(p.to(q.scalar_type()).view({B, Hkv, G * T, L - k0}), vb).view({B, Hkv, G, T, D});
}

}  // namespace memtune::models
