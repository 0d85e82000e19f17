#pragma once
// Memory plan of a training step, computed before anything is allocated: the bytes of the
// weights (NF4 or dense), LoRA adapters, gradients, optimizer states, the activations each
// layer keeps for backward under the checkpointing policy, the chunked loss, the optimizer
// workspace and the recompute of a checkpointed layer, and from them the peak of a step.
//
// What a layer keeps and holds comes from the model itself (CausalLM::layer_memory, built
// from its kernels' accounting, models/memory.h); this file sums it over the real tensor
// list under the run's storage, fine-tuning mode, checkpoint policy, offload, optimizer and
// sharding. It names no architecture. bench/estimator_accuracy.py measures it against the
// real training binary.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/nf4.h"

namespace memtune::models {
class CausalLM;
}

namespace memtune::trainer {

struct EstimateInput {
  // The model's structure (models::build_model: shapes and tensors, no weights), whose own
  // list of tensors and layer accounting the estimate walks.
  std::shared_ptr<const models::CausalLM> model;
  int64_t num_layers = 0;           // model->num_layers()

  // Storage of the base weights.
  bool load_in_4bit = false;        // 4-bit projections (embeddings, norms, head stay dense)
  bool load_in_8bit = false;        // LLM.int8 projections: int8 codes and an fp32 absmax per row
  QuantType quant_type = QuantType::kNF4;  // names the component; NF4 and FP4 take the same bytes
  bool double_quant = true;         // absmax as uint8 codes + fp32 per 256 blocks
  int64_t blocksize = 64;           // 4-bit elements per absmax block
  int64_t dense_bytes = 4;          // bytes per element of dense base tensors
  // Per model->tensors() (empty: none): a projection weight llm_int8_skip_modules keeps dense
  // under load_in_4bit / load_in_8bit.
  std::vector<bool> dense_projections;

  // Fine-tuning.
  std::string finetune = "lora";    // lora | full (every base tensor trainable, fp32)
  int64_t lora_r = 8;
  double lora_dropout = 0.0;        // > 0: each adapter keeps its dropped input and mask
  bool lora_dora = false;           // lora.use_dora: a magnitude per output row (models/layers/dora.h)
  // Per model->tensors() (empty: none): an adapter on that projection weight (lora), and the
  // tensors trained whole beside the adapters (lora.modules_to_save).
  std::vector<bool> adapted;
  std::vector<bool> trained;
  // Per model->tensors() (empty: lora_r for every adapter): an adapter's rank (lora.rank_pattern).
  std::vector<int64_t> lora_ranks;

  // Training shape.
  int64_t micro_batch = 1;          // B
  // Samples of one optimizer step (per rank); 0: micro_batch x accumulation_steps. With more
  // than one micro-batch per step, every gradient is held through the later ones' forward
  // and backward.
  int64_t samples_per_step = 0;
  int64_t accumulation_steps = 1;   // training.gradient_accumulation_steps
  int64_t seq_length = 512;         // T (rows are padded to a multiple of 8)
  // The most trained positions (targets not ignored) in one sample; 0: every position. Only
  // trained positions form logits in the loss, so a micro-batch's loss holds at most
  // micro_batch x this many rows (fit_to_data in trainer/estimate.h sets it from the data).
  int64_t max_sample_targets = 0;
  std::vector<bool> checkpoint_layers;  // per layer: recomputed in backward (empty: none)
  // Per layer (empty: none): offloaded by model.device_map, its frozen weights in host memory
  // outside the budget and fetched for each run of the layer, which is always checkpointed
  // (models::CausalLM::forward).
  std::vector<bool> offloaded_layers;
  bool offload_activations = false;     // a checkpointed layer's input waits in host memory
  // ... and comes back one checkpointed layer ahead in backward (offload_prefetches: CUDA)
  bool prefetch_activations = false;
  // adamw (2 fp32 states + a workspace) | adamw_8bit (bitsandbytes: 2 uint8 codes + 2 fp32
  // absmax per 256 elements for tensors of >= 4096 elements, else 2 fp32) | adamw_32bit
  // (bitsandbytes: 2 fp32, no workspace) | adafactor (fp32 per row and per column of a matrix,
  // per element of a vector, and a workspace) | sgd (1: momentum buffer, when sgd_momentum)
  std::string optimizer = "adamw";
  bool prefetch = true;             // sharding full: the next layer's gather held beside the one running
  bool sgd_momentum = false;        // training.momentum > 0 (torch.optim.SGD keeps no buffer at 0)
  bool optimizer_paged = false;     // states in host memory: nothing on the device
  // Paged states pass through the device per tensor (paged_* on CUDA: trainer::PagedStates),
  // in two slots of the largest tensor's states.
  bool optimizer_streamed = false;
  // Gradients in host memory as backward produces them (memory.optimizer_offload: cpu,
  // trainer/gradient_offload.h): none held on the device across micro-batches or in the
  // update. Asked for; the estimate applies it where gradient offload runs
  // (gradients_can_leave: one rank, or a CPU group).
  bool gradients_offloaded = false;
  int64_t compute_bytes = 4;        // bytes per element of the base matmuls
  int64_t adapter_bytes = 4;        // ... of LoRA adapters' products (models::StepShape::adapter_bytes)
  bool loss_bf16 = false;           // the head's products in bf16 (models::loss_matmul_dtype)
  bool label_smoothing = false;     // training.label_smoothing_factor > 0: no one-pass bf16 CUDA kernel
  bool logit_softcap = false;       // the model soft-caps its logits (final_logit_softcapping)
  // Attention runs the fused CPU kernel (models/layers/attention_cpu.h: CPU, fp32), whose
  // scratch is per intra-op thread; otherwise the blocked ATen one.
  bool fused_cpu_attention = false;
  bool cuda_kernels = false;  // a CUDA device: models::StepShape::cuda_kernels
  // The update runs on the CPU: the gradient norm sums fp32 gradients in place (elsewhere it
  // converts the largest gradient to fp64 and squares it).
  bool cpu_update = false;
  int64_t threads = 1;
  int64_t loss_chunk_rows = 0;      // rows of logits formed at a time; 0: models::loss_chunk_rows(vocab)

  // Data parallel over world_size ranks; the figures are per rank. sharding
  // (distributed.sharding): none | optimizer (each rank keeps 1/W of the optimizer state) |
  // gradients (also 1/W of the gradients once reduced, for the update; backward still holds
  // them all) | full (also 1/W of the layers' frozen weights, one layer gathered at a time,
  // every layer checkpointed; LoRA only). A sharded level keeps one buffer of bucket_bytes
  // (at most its share).
  int64_t world_size = 1;
  std::string sharding = "none";
  int64_t bucket_bytes = int64_t{25} << 20;
};

struct EstimateComponent {
  std::string name;  // e.g. "weights: NF4 (double quant, blocksize 64)"
  int64_t bytes = 0;
  std::string note;  // how it was counted
};

struct Estimate {
  std::vector<EstimateComponent> components;  // the breakdown, in order
  // Persistent across the step.
  int64_t weights_quantized = 0;  // 4-bit: packed codes + absmax (+ nested absmax and map); 8-bit: codes + row absmax
  int64_t weights_dense = 0;      // embeddings, norms, head, biases, dense projections
  int64_t weights_layers = 0;     // of the two above, the decoder layers' (what layer offload can move)
  int64_t layers_sharded_from = 0; // sharding full: every layer's weights, of which this rank keeps 1/W
  int64_t gathered_layer = 0;     // sharding full: one layer gathered whole around its forward
  int64_t weights_offloaded = 0;  // offloaded layers' weights, in host memory (not in the peaks)
  int64_t fetched_layer = 0;      // the largest offloaded layer, on the device while it runs
  int64_t lora_parameters = 0;    // A and B, fp32
  int64_t trainable_parameters = 0;  // count
  int64_t gradients = 0;          // one fp32 gradient per trainable tensor
  int64_t optimizer_states = 0;
  int64_t optimizer_workspace = 0;  // the largest trainable tensor, fp32
  int64_t gradients_after_reduce = 0;  // held in the update: gradients, or 1/W of them when sharded
  int64_t sharding_buffer = 0;      // the sharded collectives' bucket buffer
  int64_t allreduce_buffers = 0;    // several ranks, gradients unsharded: their all-reduce's flat copies
  // Per step.
  std::vector<int64_t> activations_per_layer;  // kept for backward (only the input when checkpointed)
  int64_t activations = 0;        // sum of the above + final norm + rotary tables + batch
  int64_t loss = 0;               // chunked loss: logits chunk, its softmax, the hidden gradient
  int64_t recompute = 0;          // the largest checkpointed layer rebuilt in backward (0 if none)
  int64_t workspace = 0;          // transients of the largest layer backward
  int64_t after_forward = 0;      // kept when the forward returns: activations + the loss's gradients
  int64_t forward_peak = 0;
  int64_t backward_peak = 0;
  int64_t optimizer_peak = 0;
  int64_t peak_bytes = 0;         // max of the three phases
  // false: the architecture states no layer accounting and its layers were counted by
  // CausalLM's default bound (models/causal_lm.h).
  bool layers_stated = true;
};

Estimate estimate_memory(const EstimateInput& in);

// Whether optimizer offload takes the gradients off the device too: everywhere but on several
// ranks of a GPU, whose collectives (NCCL) reduce device memory only.
inline bool gradients_can_leave(int64_t world_size, bool on_cpu) { return world_size <= 1 || on_cpu; }
inline int64_t estimate_peak(const EstimateInput& in) { return estimate_memory(in).peak_bytes; }

// The largest micro-batch (sequence length) whose estimated peak fits `budget`, the other
// fields as given; 0 when even 1 (8 tokens) does not fit. Sequence lengths are multiples of
// 8 up to max_position_embeddings.
int64_t max_micro_batch(const EstimateInput& in, int64_t budget, int64_t limit = 1 << 20);
int64_t max_seq_length(const EstimateInput& in, int64_t budget);

}  // namespace memtune::trainer
