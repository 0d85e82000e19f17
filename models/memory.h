#pragma once
// The vocabulary of memory accounting. Each kernel states, beside its code, what it keeps
// for backward and what it holds while it runs, as a function of the shapes it is given
// (attention_memory, rms_norm_kept, lora_kept, nf4_panel_bytes, loss_chunk_rows in
// models/layers/); each architecture composes them into what one of its layers costs
// (CausalLM::layer_memory), next to the forward it describes; trainer/estimate.cpp sums the
// layers over the real tensor list under the run's placement and checkpoint policy. Nothing
// outside models/ names an architecture.
#include <cstdint>
#include <functional>

namespace memtune::models {

class Linear;

// The shapes of one micro-batch's step.
struct StepShape {
  int64_t batch = 1;                 // B
  int64_t tokens = 8;                // T, as collated (padded to a multiple of 8)
  int64_t act_bytes = 4;             // bytes per element of the residual stream and what is kept
  int64_t compute_bytes = 4;         // bytes per element of the base matmuls
  bool fused_cpu_attention = false;  // attention runs the fused CPU kernel (models/layers/attention_cpu.h)
  int64_t threads = 1;               // intra-op threads (the fused kernel's scratch is per thread)
  // A CUDA device: RMSNorm, SwiGLU, rotary and the loss's softmax run memtune's kernels
  // (models/layers/cuda/), whose backward forms no fp32 intermediates.
  bool cuda_kernels = false;
  // Bytes per element of LoRA adapters' products: 4 (their fp32), or compute_bytes under the
  // Trainer's autocast (training.bf16 / fp16: models::Linear::autocast).
  int64_t adapter_bytes = 4;
  int64_t rows() const { return batch * tokens; }
  // keyed_dropout keeps a boolean mask (runtime/keyed_dropout.h): on a GPU, and for fp16/bf16
  // inputs on the CPU (taken where the matmuls are not fp32). LoRA dropout's input is the
  // adapter's fp32 whatever the model: a mask on a GPU only (projection_memory.h).
  bool dropout_keeps_mask() const { return cuda_kernels || compute_bytes != 4; }
};

// How one projection is trained in the planned run.
struct LinearTraining {
  bool full = false;     // its weight (and bias) trained
  int64_t lora_r = 0;    // > 0: an adapter of this rank
  double lora_dropout = 0;
  bool dora = false;     // the adapter is DoRA's (models/layers/dora.h)
  bool nf4 = false;      // a frozen NF4 base: its products hold a dequantized panel
  bool int8 = false;     // a frozen LLM.int8 base (models/layers/linear8bit.h)
  // Under autocast in an fp32 model the adapter's products take a 16-bit copy of the input.
  bool lora_casts_input = false;
  // Its output needs a gradient (a trained weight or an adapter).
  bool trains() const { return full || lora_r > 0; }
  // The adapter keeps a copy of the input of its own: dropped (LoRA dropout) or cast.
  bool lora_own_input() const { return lora_r > 0 && (lora_dropout > 0 || lora_casts_input); }
  // The projection keeps its input for backward: a trained weight's gradient needs it, and
  // so does an adapter's A, unless the adapter keeps its own copy (lora_kept): then the
  // input is freed unless another op keeps it.
  bool keeps_input() const { return full || (lora_r > 0 && !lora_own_input()); }
};

// What the accounting of a layer is told about the run.
struct LayerPlan {
  bool input_grad = false;  // the layer's input needs a gradient (something below it trains)
  std::function<LinearTraining(const Linear&)> training;
};

// What one decoder layer costs in a step, above what is alive before it runs (the layers
// below, the batch, the layer context, and the layer's input, which belongs to the caller).
struct LayerMemory {
  int64_t kept = 0;             // kept for backward when autograd records
  int64_t forward = 0;          // the forward's peak with autograd recording, `kept` included
  int64_t forward_no_grad = 0;  // the forward's peak when nothing records (a checkpointed layer's first run)
  int64_t backward = 0;         // the backward's peak above the incoming gradient: what is still kept plus transients
  int64_t workspace = 0;        // the backward's transients alone
  // false: the architecture does not state its accounting and CausalLM's default bound
  // counted it (every projection's input and output kept).
  bool stated = true;
};

// What the model's forward holds beside its layers.
struct StackMemory {
  int64_t context = 0;     // the layer context (rotary cos and sin tables)
  int64_t final_norm = 0;  // what the final norm keeps when its input needs a gradient
};

}  // namespace memtune::models
