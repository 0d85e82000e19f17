#pragma once
// What a layer's projections add to its memory (models/memory.h), for an architecture's
// CausalLM::layer_memory: each adapter's kept tensors, the widest adapter's rank (its x A^T
// sits beside a product) and the largest transient: a dequantized NF4 panel or 8-bit weight, a dense weight
// cast to the compute dtype, or an fp32 adapter's copies on a 16-bit model.
#include <algorithm>
#include <cstdint>

#include "models/layers/dora.h"
#include "models/layers/linear.h"
#include "models/layers/linear4bit.h"
#include "models/layers/linear8bit.h"
#include "models/layers/lora_linear.h"
#include "models/memory.h"

namespace memtune::models {

struct ProjectionTally {
  int64_t lora_rank = 0;
  int64_t panel = 0;
  // Notes `l`'s adapter rank and panel; returns what its adapter keeps for backward.
  int64_t add(const Linear& l, const LinearTraining& t, const StepShape& s) {
    lora_rank = std::max(lora_rank, t.lora_r);
    if (t.nf4) {
      // A GPU dequantizes all of W for each product (models/layers/linear4bit.cpp).
      panel = std::max(panel, s.cuda_kernels ? l.out_features() * l.in_features() * s.compute_bytes
                                             : nf4_panel_bytes(l.out_features(), l.in_features(), s.compute_bytes));
    } else if (t.int8) {
      // models/layers/linear8bit.h: on a CPU in training panels of the dequantized weight
      // (int8_panel_bytes); on a GPU the whole weight dequantized in backward, and the mixed
      // product's tensor ops: the input's copies, codes and masks, and its int32, fp32 (fp64
      // for a fused float16 bias) and 16-bit outputs. Their peak, measured with the CPU budget
      // allocator on the same ops (rows 8192; in x out 1024 x 4096 and 4096 x 512; every dtype,
      // bias or none; 2026-11-28): 456-648 MiB and 640 MiB, which 20 bytes an input element
      // plus 16 an output element bound (672 and 704 MiB).
      const int64_t out = l.out_features(), in = l.in_features();
      panel = std::max(panel, s.cuda_kernels ? std::max(out * in * s.act_bytes, s.rows() * (20 * in + 16 * out))
                                             : int8_panel_bytes(out, in, s.compute_bytes, s.act_bytes));
    } else if (s.compute_bytes != s.act_bytes) {
      // A dense weight computing in another dtype: its cast, made for each product and not
      // kept (models/layers/linear.cpp, CastLinear).
      panel = std::max(panel, l.out_features() * l.in_features() * s.compute_bytes);
    }
    // An fp32 adapter on a 16-bit model outside autocast: the node's fp32 copies while it runs.
    if (t.lora_r > 0 && !t.full && s.act_bytes != 4 && s.adapter_bytes == 4)
      panel = std::max(panel, lora_mixed_transient(s.rows(), l.in_features(), l.out_features()));
    // A 16-bit adapter (autocast): its output before it is added in, and in backward its
    // path's gradient for the input before the sum; with LoRA dropout, the input's fp32 copies.
    // On a GPU the node of a 16-bit model adds both where they are formed (lora_linear's
    // add_adapter_output), but LoRA dropout's input gets its gradient as a tensor of its own.
    if (t.lora_r > 0 && !t.full && s.adapter_bytes != 4) {
      const bool added_in_place = s.cuda_kernels && s.act_bytes == s.adapter_bytes;
      if (!added_in_place)
        panel = std::max(panel, s.rows() * std::max(l.in_features(), l.out_features()) * s.adapter_bytes);
      else if (t.lora_dropout > 0)
        panel = std::max(panel, s.rows() * l.in_features() * s.adapter_bytes);
      if (t.lora_dropout > 0)
        panel = std::max(panel, lora_autocast_dropout_transient(s.rows(), l.in_features(), s.act_bytes));
    }
    // LoRA dropout drops the adapter's fp32 input: keyed_dropout keeps a mask for it on a GPU only.
    int64_t kept = lora_kept(s.rows(), l.in_features(), l.out_features(), t.lora_r, t.lora_own_input(),
                             t.lora_dropout > 0 && s.cuda_kernels, s.adapter_bytes);
    if (t.lora_r > 0 && t.dora) {
      const int64_t out = l.out_features(), in = l.in_features();
      // Linear::forward_dora keeps x W^T without the bias and the adapter's output, in the
      // adapter's product dtype (adapter_bytes). x W^T is the base's output in x's dtype (a
      // 4-bit base, or outside autocast), or autocast's product, widened to fp32 by an fp32
      // bias; with LoRA dropout it is the dropped input's product with W in the adapter's
      // dtype, which keeps W's cast to that dtype when a dense W is in another.
      const bool dropped = t.lora_dropout > 0;
      const bool autocast_product = !t.nf4 && s.adapter_bytes != 4;
      // In fp32 without dropout: LoRA's node, then its output scaled, which keeps that output.
      const bool fused = !dropped && s.act_bytes == 4 && s.compute_bytes == 4 && s.adapter_bytes == 4;
      const int64_t base_bytes = dropped ? s.adapter_bytes
                                 : !autocast_product ? s.act_bytes
                                 : l.has_bias() ? std::max(s.act_bytes, s.compute_bytes) : s.compute_bytes;
      kept += fused ? s.rows() * out * 4 : dora_kept(s.rows(), out, base_bytes, s.adapter_bytes);
      if (dropped && !t.nf4 && s.act_bytes != s.adapter_bytes) kept += out * in * s.adapter_bytes;
      panel = std::max(panel, dora_transient(s.rows(), in, out));
      // A 4-bit weight on a GPU is dequantized whole for the norm, in its dtype and in fp32.
      if (t.nf4 && s.cuda_kernels) panel = std::max(panel, out * in * 8);
    }
    return kept;
  }
};

}  // namespace memtune::models
