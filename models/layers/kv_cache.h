#pragma once
// Keys and values of the positions a model has already read, per layer, for generation: each
// new token's forward attends to them instead of running the whole prefix again
// (transformers' DynamicCache under generate's use_cache=True). Forwards without grad only.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/layers/attention.h"

namespace memtune::models {

class KVCache {
 public:
  // Room for `capacity` positions per layer, allocated at a layer's first append in its keys'
  // dtype and device, and doubled when a forward goes past it.
  KVCache(int num_layers, int64_t capacity);

  // Positions layer `layer` holds.
  int64_t length(int layer) const { return length_.at(layer); }
  // Whether every layer holds `positions`: a forward of an architecture whose layers attend
  // through layer_attention (models/causal_lm.h) fills every layer; one that calls
  // causal_segment_attention itself leaves them empty, and generation then runs the prefix.
  bool holds(int64_t positions) const;
  // Bytes allocated for keys and values.
  int64_t bytes() const;

  // Layer `layer`'s attention for queries q (B,Hkv,G,T,D) at the T positions after the ones
  // it holds, with their keys and values k, v (B,Hkv,T,D): appends k and v, then every query
  // attends to the positions up to its own (within `sliding_window` when > 0). On an empty
  // layer this is causal_segment_attention of the T positions (`segment_ids`, `options`: the
  // prompt's one document); after, the prompt's keys count as one document with the new ones.
  at::Tensor attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& segment_ids, double scale, int64_t sliding_window,
                    const AttentionOptions& options);

 private:
  std::vector<at::Tensor> keys_, values_;  // (B,Hkv,capacity,D), the first length_ positions held
  std::vector<int64_t> length_;
  int64_t capacity_;
};

// Causal attention of queries q (B,Hkv,G,T,D) at the last T of the L positions of k and v
// (B,Hkv,L,D): query t (position L-T+t) attends to keys s <= L-T+t, and with a window W > 0
// to those with L-T+t - s < W. Scores in q's dtype, scaled (and soft-capped: `softcap` > 0,
// AttentionOptions::softcap), then softmax in fp32, as the blocked kernel of
// causal_segment_attention computes them. Returns (B,Hkv,G,T,D).
at::Tensor attention_after_prefix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  int64_t sliding_window, double softcap = 0);

}  // namespace memtune::models
