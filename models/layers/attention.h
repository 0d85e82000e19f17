#pragma once
// Causal self-attention restricted to documents (segment ids), with grouped-query heads.
#include <ATen/core/Tensor.h>

namespace memtune::models {

// q (B,Hkv,G,T,D) — G query heads share each of the Hkv key/value heads —, k and v
// (B,Hkv,T,D), segment_ids (B,T) int64. Query t attends to key s when s <= t and both lie in
// the same segment (padding is segment -1 and so only attends to padding), and with a
// sliding window W > 0 (Mistral) when t - s < W: the query's W latest keys, itself
// included; keys outside every window of a query block are not computed. Softmax in fp32.
// Memory: the forward keeps q, k, v, the output and one log-sum-exp per query row; the
// attention probabilities are kept only when they fit `keep_probs_bytes`, else recomputed
// block by block in backward, so memory grows linearly with sequence length.
// Returns (B,Hkv,G,T,D).
//
// Two implementations compute it. On the CPU in fp32 (the CPU's compute dtype) with
// segments that are runs of positions, the fused kernel of attention_cpu.h: register-tiled
// per-head GEMMs on the intra-op threads, probabilities never kept. Elsewhere (GPUs, fp16
// and bf16, arbitrary segment ids) the blocked one below written with ATen ops.
struct AttentionOptions {
  enum class Kernel { kAuto, kBlocked };
  Kernel kernel = Kernel::kAuto;
  // The blocked implementation's query rows per block and its limit for keeping the
  // probabilities instead of recomputing them in backward.
  int64_t query_block = 64;
  int64_t keep_probs_bytes = 64LL << 20;
};

at::Tensor causal_segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& segment_ids, double scale, int64_t sliding_window = 0,
                                    const AttentionOptions& options = {});

// Whether causal_segment_attention runs the fused CPU kernel for these inputs.
bool uses_fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& segment_ids);

}  // namespace memtune::models
