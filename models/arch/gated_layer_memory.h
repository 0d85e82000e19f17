#pragma once
// The memory of a Llama-shaped decoder layer (a pre-norm attention over q, k, v and o, then a
// pre-norm gated MLP over gate, up and down), op by op, for the families built on it: Llama,
// Mistral, Qwen2, Qwen3 (models/arch/llama.cpp), Gemma, Gemma 2 and Gemma 3
// (models/arch/gemma.cpp). The spec's attention soft-capping counts.
#include <cstdint>

#include "models/layers/linear.h"
#include "models/memory.h"
#include "models/model_spec.h"

namespace memtune::models {

struct GatedLayerProjections {
  const Linear *q, *k, *v, *o, *gate, *up, *down;
};

// Where a family's layer differs from Llama's.
struct GatedLayerForm {
  bool qk_norm = false;         // per-head q and k norms (Qwen3, Gemma 3)
  bool sandwich_norms = false;  // Gemma 2's and 3's norms on the attention's and the MLP's outputs
  bool geglu = false;           // GeGLU (Gemma) rather than SwiGLU: its backward's transients
  double attention_dropout = 0;
};

// A tensor is kept only by an op that needs it for a wanted gradient: a trained weight or an
// adapter without dropout keeps its projection's input (h is shared by q, k and v, and by
// gate and up), a frozen weight keeps nothing of it. The attention's part of what is kept
// lives until its backward; the MLP's is freed before.
LayerMemory gated_layer_memory(const GatedLayerProjections& layer, const GatedLayerForm& form, const ModelSpec& spec,
                               const StepShape& s, const LayerPlan& plan);

}  // namespace memtune::models
