#pragma once
// Causal self-attention restricted to documents (segment ids), with grouped-query heads.
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/keyed_dropout.h"

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
// Three implementations compute it (`model.attn_implementation` picks; auto by default):
// - the fused CPU kernel (attention_cpu.h): CPU, fp32, segments that are runs of positions;
//   register-tiled per-head GEMMs on the intra-op threads, probabilities never kept;
// - at::scaled_dot_product_attention (LibTorch >= 2.0): auto takes it on GPUs without a
//   window when every row is one document without padding (causal masking alone), and when
//   the rows' documents are known runs of positions (segment_lengths): the documents, padding
//   included, gathered into rows of a power-of-two width padded at their ends, one causal
//   call per width (flash/memory-efficient kernels, no mask, linear memory; the padding after
//   a document cannot change it under causal masking); `sdpa` forces it, by documents where
//   the runs are known, else with an explicit (B,1,T,T)
//   boolean mask (quadratic memory); grouped key/value heads repeated to the query heads,
//   except under causal masking alone on LibTorch >= 2.5 where SDPA's flash kernel takes them
//   as they are (enable_gqa, as transformers; CUDA, 16-bit: elsewhere SDPA would take grouped
//   heads to its quadratic math kernel);
// - the blocked one written with ATen ops ("eager"): anything else (packed documents on a
//   GPU, fp16/bf16, arbitrary segment ids), linear memory.
struct DocumentBuckets;  // below

struct AttentionOptions {
  enum class Kernel { kAuto, kEager, kSdpa };
  Kernel kernel = Kernel::kAuto;
  // Every row of segment_ids is one segment without padding (the caller knows it from the
  // batch; causal_segment_attention does not look, to spare a device sync per layer).
  bool one_segment_per_row = false;
  // Per row, the lengths of its runs of equal segment ids in order (summing to T), from the
  // batch on the host (segment_run_lengths); null when unknown, or when a row's segment id
  // comes back after another one (its runs are then not its documents).
  std::shared_ptr<const std::vector<std::vector<int64_t>>> segment_lengths;
  // Those documents' gathers for SDPA on the device that computes (document_buckets), made
  // once per forward by the caller; made at each call when absent.
  std::shared_ptr<const DocumentBuckets> document_buckets;
  // The blocked implementation's query rows per block and its limit for keeping the
  // probabilities instead of recomputing them in backward.
  int64_t query_block = 64;
  int64_t keep_probs_bytes = 64LL << 20;
  // Dropout on the probabilities (training only; the model sets it per layer): the fused
  // CPU kernel and the blocked one draw attention_keep_mask's bits (runtime/keyed_dropout.h),
  // so the same sample gets the same mask in any batch, and neither keeps it; SDPA draws
  // its own, so auto does not take SDPA with dropout, and `sdpa` refuses it.
  AttentionDropout dropout;
  // Gemma 2's attn_logit_softcapping c > 0: the scaled scores s become c tanh(s / c) before
  // the mask and the softmax, as transformers' eager attention computes them (in q's dtype).
  // The fused CPU kernel and the blocked one cap; SDPA cannot, so auto does not take it and
  // `sdpa` refuses it. 0: none.
  double softcap = 0;
};

// Packed rows' documents grouped by width (the smallest power of two >= the length, at
// least 32) for SDPA: per bucket the flat (b*T + t) positions its rows gather (B*T: the zero
// row, padding past a document's end) and which of its n x width outputs are real; `order`
// takes the buckets' real outputs, concatenated, back to (b, t) order. Index tensors on `device`.
struct DocumentBuckets {
  struct Bucket {
    int64_t width = 0, documents = 0;
    at::Tensor gather;  // int64 [documents * width]
    at::Tensor real;    // int64: indices into the bucket's documents * width outputs
  };
  std::vector<Bucket> buckets;
  at::Tensor order;  // int64 [B*T]
  c10::Device device = c10::kCPU;
};
std::shared_ptr<const DocumentBuckets> document_buckets(const std::vector<std::vector<int64_t>>& lengths, int64_t T,
                                                        const c10::Device& device);

// AttentionOptions::segment_lengths of segment_ids (B,T) (copied to the host if elsewhere):
// null when a row's segment id comes back after another one.
std::shared_ptr<const std::vector<std::vector<int64_t>>> segment_run_lengths(const at::Tensor& segment_ids);

// The option's spelling in configs (auto, eager, sdpa); throws on anything else, and on
// sdpa when the LibTorch memtune was built against predates it.
AttentionOptions::Kernel parse_attention_kernel(const std::string& name);

// `options` with attention dropout `p` for dropout site `site` when training and p > 0 (the
// rows' seeds from their keys: attention_dropout_seeds), else `options` as they are.
AttentionOptions with_dropout(const AttentionOptions& options, bool training, double p, uint64_t site, int64_t rows,
                              const c10::Device& device);

// Whether this build has at::scaled_dot_product_attention (LibTorch >= 2.0).
bool sdpa_available();

at::Tensor causal_segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& segment_ids, double scale, int64_t sliding_window = 0,
                                    const AttentionOptions& options = {});

// Memory of one causal_segment_attention at B rows of T tokens, Hq query and Hkv key/value
// heads of D dimensions, elements of `elem_bytes` (the accounting of the memory model,
// models/memory.h; `fused_cpu`: the fused CPU kernel runs it on `threads` threads; the
// options' dropout and softcap count).
struct AttentionMemory {
  int64_t kept = 0;                // saved for backward: q, k, v, the output, the log-sum-exp, and
                                   // the probabilities (blocked, when they fit) or each query's first key (fused)
  int64_t forward_transient = 0;   // beyond inputs and output while the forward runs
  int64_t no_grad_own = 0;         // what the op itself holds when nothing records (a checkpointed forward)
  int64_t backward_transient = 0;  // dq, dk, dv, the incoming gradient's copy, the per-block gradients
};
AttentionMemory attention_memory(int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D, int64_t elem_bytes,
                                 bool fused_cpu, int64_t threads, const AttentionOptions& options = {});

// Whether causal_segment_attention runs the fused CPU kernel for these inputs.
bool uses_fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& segment_ids);

}  // namespace memtune::models
