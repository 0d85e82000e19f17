#pragma once
// Attention for CPUs in fp32 (models/layers/attention.h chooses it): one task per (batch
// row, key/value head), spread over the intra-op threads; within a task, query blocks of 32
// rows go through register-tiled GEMMs and an in-place softmax, and backward recomputes
// the scores. No probabilities are kept and no per-head BLAS call is made: at head
// sizes of 64 the batched BLAS calls cost more in per-matrix overhead than in arithmetic.
#include <ATen/core/Tensor.h>

#include "runtime/keyed_dropout.h"

namespace memtune::models::detail {

// Whether fused_cpu_attention takes these inputs: CPU float32 q, k, v (any strides), and
// segment ids in which each segment is one run of positions (packing and padding produce
// them so, with any number of documents per row), so that every query sees one contiguous
// range of keys.
bool fused_cpu_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& segment_ids);

// As causal_segment_attention (attention.h), or an undefined tensor when the inputs are not
// ones fused_cpu_attention_applies to (checked in the same pass that prepares them). The
// output is laid out (B,T,Hkv,G,D) in memory, so merging the heads back into (B,T,H*D)
// needs no copy. With `dropout` active, the probabilities are dropped as
// attention_keep_mask draws them (after the softmax, before the values), the mask drawn
// again in backward instead of kept. `softcap` > 0 soft-caps the scaled scores (Gemma 2's
// attn_logit_softcapping, AttentionOptions::softcap).
at::Tensor fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& segment_ids, double scale, int64_t sliding_window,
                               const AttentionDropout& dropout = {}, double softcap = 0);

// Bytes of one thread's scratch in the backward pass (the larger pass) at T tokens of D
// dimensions (`softcap`: with a block of the scores' tanh as well).
int64_t fused_cpu_attention_scratch_bytes(int64_t T, int64_t D, bool softcap = false);

}  // namespace memtune::models::detail
