#pragma once
// The output head and the loss together, chunk by chunk, so the (tokens x vocab) logits
// are never held whole.
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace memtune::models {

// Sum over rows with target != -100 of cross_entropy(hidden @ weight^T, target), in fp32.
// hidden (N,C), weight (V,C), targets (N) int64. Rows whose target is ignored cost nothing.
// The gradients w.r.t. hidden and weight are computed during the forward, chunk by chunk
// (the loss is a sum, so d loss / d logits is known then), and only scaled in backward:
// peak extra memory is one chunk of logits, and no logits are recomputed.
// `correct` (optional) receives how many trained rows have their target as the argmax.
// Rows of fp32 logits formed at a time by default: as many as fit 8 MiB, at least 256 and at
// most 1024. Each chunk's two GEMMs read the whole head weight, so narrower chunks re-read it
// more often: at 128 rows the loss of 512 tokens took 11 % longer than at 256, with a vocab of
// 32000 (hidden 768) and of 128256 (hidden 2048), fp32 on a 2-vCPU Zen 4 (2026-11-25), for
// one more chunk of logits in memory (32 MB and 131 MB at 256 rows).
int64_t loss_chunk_rows(int64_t vocab_size);

// The dtype the head's products run in for a run computing in `compute_dtype`: bf16 for bf16,
// as Hugging Face's lm_head under bf16 autocast or in a bf16 model (the logits rounded to
// bf16, then taken to fp32 for the softmax; d loss / d logits formed in fp32 and rounded to
// bf16 for the products that give d hidden and dW; dW summed in fp32). Otherwise fp32: an fp16
// d loss / d logits, formed before any loss scale applies, would flush every probability
// under 2^-24 to zero.
at::ScalarType loss_matmul_dtype(at::ScalarType compute_dtype);

// `label_smoothing` e in [0, 1): each trained row's loss is (1 - e) of its cross-entropy plus
// e of the mean over the vocabulary of -log softmax (torch's cross_entropy(label_smoothing),
// transformers' LabelSmoother per token): logsumexp - (1 - e) logit[target] - e mean(logits),
// with d loss / d logits = softmax - (1 - e) onehot - e / V. `unsmoothed` (optional) receives
// the plain cross-entropy sum as well (what a perplexity is of).
// `logit_softcap` c > 0 (Gemma 2's final_logit_softcapping): the loss takes the logits
// soft-capped, c tanh(logits / c) (soft_cap_logits), and its gradient through the cap.
at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t chunk_rows = 1024,
                                    int64_t* correct = nullptr, at::ScalarType compute_dtype = at::kFloat,
                                    double label_smoothing = 0, at::Tensor* unsmoothed = nullptr,
                                    double logit_softcap = 0);

// Logits soft-capped in place as transformers' Gemma 2 head: logits / c, tanh, * c, each in
// the logits' dtype (c > 0; c <= 0 leaves them). Returns `logits`.
at::Tensor soft_cap_logits(at::Tensor logits, double c);

namespace detail {
// Tests: false sends a bf16 loss on CUDA through an fp32 copy of each chunk's logits and the
// fp32 softmax pass, the route whose bits the one-pass bf16 kernel must give.
void use_fused_bf16_softmax(bool fused);
}  // namespace detail

}  // namespace memtune::models
