#pragma once
// Memory plan of a training step, computed before anything is allocated: the bytes of the
// weights (NF4 or dense), LoRA adapters, gradients, optimizer states, the activations each
// layer keeps for backward under the checkpointing policy, the chunked loss, the optimizer
// workspace and the recompute of a checkpointed layer, and from them the peak of a step.
//
// The formulas count the tensors memtune's own forward keeps (models/causal_lm.cpp,
// models/arch/{llama,gpt2}.cpp, models/layers/{attention,linear,linear4bit,cross_entropy}.cpp,
// trainer/optimizer.cpp); bench/estimator_accuracy.cpp measures them with the CPU budget
// allocator. The input is plain data: runtime knows nothing of configs or models.
#include <cstdint>
#include <string>
#include <vector>

namespace memtune {

struct EstimateInput {
  // Model shape (config.json).
  std::string family = "llama";     // llama (Llama/Mistral/Qwen2) | gpt2
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;         // C
  int64_t intermediate_size = 172;  // F
  int64_t num_layers = 2;
  int64_t num_heads = 4;            // H
  int64_t num_kv_heads = 4;         // Hkv (llama; gpt2: = H)
  int64_t head_dim = 16;            // D
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;            // llama attention_bias on q, k, v
  bool o_bias = false;              // llama attention_bias on o_proj (not qwen2)
  bool mlp_bias = false;            // llama mlp_bias on gate, up, down

  // Storage of the base weights.
  bool load_in_4bit = false;        // NF4 projections (embeddings, norms, head stay dense)
  bool double_quant = true;         // absmax as uint8 codes + fp32 per 256 blocks
  int64_t blocksize = 64;           // NF4 elements per absmax block
  int64_t dense_bytes = 4;          // bytes per element of dense base tensors

  // Fine-tuning.
  std::string finetune = "lora";    // lora | full (every base tensor trainable, fp32)
  int64_t lora_r = 8;
  // Projections with adapters, by short name: llama q_proj k_proj v_proj o_proj gate_proj
  // up_proj down_proj; gpt2 c_attn attn.c_proj c_fc mlp.c_proj.
  std::vector<std::string> lora_projections;
  std::vector<bool> lora_layers;    // per layer: adapters there (empty: every layer)
  double lora_dropout = 0.0;        // > 0: each adapter keeps its dropped input and mask
  // lora.modules_to_save: tensors outside the layers trained in full (fp32) beside the adapters.
  bool train_embedding = false;           // the input embedding [V,C] (untied models only)
  bool train_position_embedding = false;  // GPT-2's wpe
  bool train_final_norm = false;          // the final norm's weight (and GPT-2's bias)
  bool train_head = false;                // lm_head [V,C] (untied models only)

  // Training shape.
  int64_t micro_batch = 1;          // B
  int64_t seq_length = 512;         // T (rows are padded to a multiple of 8)
  std::vector<bool> checkpoint_layers;  // per layer: recomputed in backward (empty: none)
  bool offload_activations = false;     // a checkpointed layer's input waits in host memory
  // adamw (2 fp32 states + a workspace) | adamw_8bit (bitsandbytes: 2 uint8 codes + 2 fp32
  // absmax per 256 elements for tensors of >= 4096 elements, else 2 fp32) | adamw_32bit
  // (bitsandbytes: 2 fp32, no workspace) | sgd (1: momentum buffer)
  std::string optimizer = "adamw";
  bool optimizer_paged = false;     // states in host memory: nothing on the device
  int64_t compute_bytes = 4;        // bytes per element of the base matmuls
  // Attention runs the fused CPU kernel (models/layers/attention_cpu.h: CPU, fp32), whose
  // scratch is per intra-op thread; otherwise the blocked ATen one.
  bool fused_cpu_attention = false;
  // The update runs on the CPU: the gradient norm sums fp32 gradients in place (elsewhere it
  // converts the largest gradient to fp64 and squares it).
  bool cpu_update = false;
  int64_t threads = 1;
  int64_t loss_chunk_rows = 0;      // rows of logits formed at a time; 0: loss_chunk_rows(vocab)

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

// Rows of fp32 logits the loss forms at a time (models/layers/cross_entropy.h): as many as
// fit 8 MiB, at least 128 (smaller GEMMs would re-read the head's weight for little gain)
// and at most 1024.
int64_t loss_chunk_rows(int64_t vocab_size);

struct EstimateComponent {
  std::string name;  // e.g. "weights: NF4 (double quant, blocksize 64)"
  int64_t bytes = 0;
  std::string note;  // how it was counted
};

struct Estimate {
  std::vector<EstimateComponent> components;  // the breakdown, in order
  // Persistent across the step.
  int64_t weights_nf4 = 0;        // packed codes + absmax (+ nested absmax and map)
  int64_t weights_dense = 0;      // embeddings, norms, head, biases, dense projections
  int64_t layers_sharded_from = 0; // sharding full: every layer's weights, of which this rank keeps 1/W
  int64_t gathered_layer = 0;     // sharding full: one layer gathered whole around its forward
  int64_t lora_parameters = 0;    // A and B, fp32
  int64_t trainable_parameters = 0;  // count
  int64_t gradients = 0;          // one fp32 gradient per trainable tensor
  int64_t optimizer_states = 0;
  int64_t optimizer_workspace = 0;  // the largest trainable tensor, fp32
  int64_t gradients_after_reduce = 0;  // held in the update: gradients, or 1/W of them when sharded
  int64_t sharding_buffer = 0;      // the sharded collectives' bucket buffer
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
};

Estimate estimate_memory(const EstimateInput& in);
inline int64_t estimate_peak(const EstimateInput& in) { return estimate_memory(in).peak_bytes; }

// Bytes of one NF4 tensor of n elements: n/2 codes, fp32 absmax per block, or uint8 codes
// + fp32 per 256 blocks + the 256-entry fp32 map with double quantization.
int64_t nf4_storage_bytes(int64_t numel, int64_t blocksize, bool double_quant);

// Device bytes of the optimizer's states for one trainable tensor of n elements (see
// EstimateInput::optimizer; 0 when paged).
int64_t optimizer_state_bytes(const std::string& optimizer, bool paged, int64_t numel);

// The largest micro-batch (sequence length) whose estimated peak fits `budget`, the other
// fields as given; 0 when even 1 (8 tokens) does not fit. Sequence lengths are multiples of
// 8 up to max_position_embeddings.
int64_t max_micro_batch(const EstimateInput& in, int64_t budget, int64_t limit = 1 << 20);
int64_t max_seq_length(const EstimateInput& in, int64_t budget);

}  // namespace memtune
