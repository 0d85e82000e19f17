#pragma once
// A decoder-only language model: embeddings, a stack of layers, a final norm and an
// output head. Architectures (models/arch/) fill in the pieces; this class owns the one
// list of tensors and the forward pass shared by all of them (checkpointing, device
// placement, the chunked loss).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/layers/attention.h"
#include "models/layers/kv_cache.h"
#include "models/layers/linear.h"
#include "models/memory.h"
#include "models/model_spec.h"
#include "models/placement.h"

namespace memtune::data {
struct Batch;
}

namespace memtune::models {

enum class TensorRole { kEmbedding, kPositionEmbedding, kNorm, kLinearWeight, kLinearBias, kHead };

// One tensor of the model under its Hugging Face name. Loading, saving, quantizing,
// device placement and memory accounting all walk the model's list of these.
struct TensorSlot {
  std::string name;             // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;   // as stored in HF checkpoints
  TensorRole role;
  at::Tensor* tensor;           // the dense tensor (undefined for an NF4 linear weight)
  Linear* linear = nullptr;     // owner, for linear weights and biases
  int layer = -1;               // decoder layer, -1 outside the stack
};

// Tensors a layer's forward needs from outside: rotary tables and document segments.
struct LayerContext {
  at::Tensor cos, sin;          // (B,T,head_dim) for rotary models, undefined otherwise
  at::Tensor local_cos, local_sin;  // Gemma 3's sliding layers' (their own rotary base), else undefined
  at::Tensor position_ids;      // (B,T) int64
  at::Tensor segment_ids;       // (B,T) int64
  bool training = false;
  AttentionOptions attention;   // the model's attention kernel, and whether rows are one document
  KVCache* kv_cache = nullptr;  // generation: the positions read before this forward (ForwardOptions)
};

// Layer `layer`'s causal self-attention over q (B,Hkv,G,T,D), k, v (B,Hkv,T,D):
// causal_segment_attention over the batch's documents, or, when the forward reads a key/value
// cache (generation), over the positions the cache holds and these (KVCache::attend). An
// architecture whose layers attend through this gets the cache; one that calls
// causal_segment_attention itself still generates, running the whole prefix at every token.
at::Tensor layer_attention(const LayerContext& ctx, int layer, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, double scale, int64_t sliding_window, const AttentionOptions& options);

// Layers whose frozen weights are not all on this process (distributed.sharding: full,
// trainer/layer_shards.h): gather() makes layer `i`'s tensors whole until release(). The
// forward gathers a covered layer just before it runs and releases it after, and such a
// layer is always checkpointed, so its rerun in backward gathers again. gather() is all or
// nothing: when it throws, the layer is as it was.
class LayerSource {
 public:
  virtual ~LayerSource() = default;
  virtual bool covers(int layer) const = 0;
  virtual void gather(int layer) = 0;
  virtual void release(int layer) = 0;
};

struct ForwardOptions {
  bool training = false;
  std::vector<bool> checkpoint_layers;  // per layer: recompute in backward
  bool offload_activations = false;     // checkpointed layers' inputs wait in host memory (activation offload)
  bool return_logits = false;           // also the full (B,T,V) logits (tests, generation)
  // Generation. `kv_cache`: the batch's tokens follow the positions the cache holds (its
  // position_ids say where) and their keys and values join it; without grad, one document per
  // row. `last_logits_only`: no loss (loss_sum 0, nothing counted), and the logits of each
  // row's last position only, (B,1,V).
  KVCache* kv_cache = nullptr;
  bool last_logits_only = false;
  int64_t loss_chunk_rows = 0;  // 0: by vocabulary size, models/layers/cross_entropy.h loss_chunk_rows()
  double label_smoothing = 0;   // the loss's (models/layers/cross_entropy.h): transformers' label_smoothing_factor
  // NEFTune (transformers' neftune_noise_alpha): in training, the embeddings plus uniform
  // noise in +-alpha / sqrt(T C), T the row's batch.noise_lengths (else the batch's length).
  double neftune_noise_alpha = 0;
  // Applied to the head's (V,C) weight before the loss (and the logits) use it; it returns the
  // same values. The caller's hold on the head's gradient as the loss's backward produces it,
  // before autograd sums it with the embedding's when the two are tied. Unset: the weight.
  std::function<at::Tensor(const at::Tensor&)> head_weight_tap;
};

struct ForwardOutput {
  at::Tensor loss_sum;       // fp32 scalar: sum of next-token cross-entropy over targets (label-smoothed when asked)
  at::Tensor cross_entropy_sum;  // without label smoothing (with none: loss_sum's value); not for backward
  int64_t target_tokens = 0; // targets counted in loss_sum
  int64_t correct_tokens = 0; // targets that are the model's most likely next token
  at::Tensor logits;         // (B,T,V) fp32 when asked for
};

class CausalLM {
 public:
  explicit CausalLM(ModelSpec spec) : spec_(std::move(spec)) {}
  virtual ~CausalLM() = default;
  CausalLM(const CausalLM&) = delete;
  CausalLM& operator=(const CausalLM&) = delete;

  const ModelSpec& spec() const { return spec_; }
  int64_t num_layers() const { return spec_.num_layers; }

  const std::vector<TensorSlot>& tensors() const { return slots_; }
  std::vector<TensorSlot>& tensors() { return slots_; }
  const TensorSlot* find_tensor(const std::string& name) const;
  std::vector<Linear*> linears() const;    // every projection, in tensor-list order
  Linear* find_linear(const std::string& module_name) const;  // "model.layers.0.self_attn.q_proj"
  std::vector<Linear*> layer_linears(int layer) const;

  // Tensors that need gradients: LoRA adapters and/or base tensors set trainable.
  std::vector<std::pair<std::string, at::Tensor>> trainable_parameters() const;
  std::vector<at::Tensor> layer_trainable(int layer) const;
  int64_t base_parameter_count() const;
  int64_t base_storage_bytes() const;

  // Random initialisation (deterministic for a given generator state), HF-like: normal
  // with std 0.02 for matrices, ones for norm weights, zeros for biases.
  void init_random(uint64_t seed);

  // Casts every dense base tensor (embeddings, norms, dense projections and their biases, the
  // head; not 4-bit weights, not adapters) to `dtype`, as from_pretrained's torch_dtype keeps
  // them. The residual stream then runs in it: the embedding's dtype.
  void set_dense_dtype(at::ScalarType dtype);

  // The dtype of the base matmuls; `autocast`: the Trainer's fp16 / bf16 autocast
  // (training.fp16 / bf16), under which fp32 adapters' products run in it too (Linear::autocast).
  void set_compute_dtype(at::ScalarType dtype, bool autocast = false);
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  bool autocast() const { return autocast_; }

  ForwardOutput forward(const data::Batch& batch, const ForwardOptions& options);

  // Which attention implementation layers use (models/layers/attention.h; config
  // model.attn_implementation). Throws UserError for sdpa on a model whose attention scores
  // are soft-capped (Gemma 2's attn_logit_softcapping), which SDPA cannot compute.
  void set_attention_kernel(AttentionOptions::Kernel kernel);

  // Moves every tensor (base, adapters, trainable weights) to its part's device; trainable
  // tensors stay leaves, so place before building an optimizer. Offloaded layers stay in
  // host memory and are fetched to their new device. Unplaced, a model is on the CPU.
  void place(const Placement& placement);
  const Placement& placement() const { return placement_; }
  c10::Device layer_device(int layer) const {
    return layer < static_cast<int>(placement_.layers.size()) ? placement_.layers[layer] : placement_.embeddings;
  }

  // Offloading: the layer's base weights move to host memory outside the device budget and
  // are fetched just before the layer runs (and again when it reruns in backward: an
  // offloaded layer is always checkpointed). Adapters stay where they are.
  void set_offloaded(int layer, bool offloaded);
  bool offloaded(int layer) const {
    return layer >= 0 && layer < static_cast<int>(offloaded_.size()) && offloaded_[layer];
  }
  int64_t layer_weight_bytes(int layer) const;

  // Sharded layers: `source` (owned by the caller, outlives the model's use; nullptr: none)
  // gathers the layers it covers around their forward. place() leaves their frozen tensors
  // where the source keeps them, and they cannot be offloaded.
  void set_layer_source(LayerSource* source) { layer_source_ = source; }
  bool sharded(int layer) const { return layer_source_ && layer_source_->covers(layer); }

  // Pieces an architecture provides.
  virtual at::Tensor embed(const at::Tensor& input_ids, const at::Tensor& position_ids) = 0;  // (B,T,C)
  virtual LayerContext layer_context(const data::Batch& batch) = 0;
  virtual at::Tensor layer(int index, const at::Tensor& x, const LayerContext& ctx) = 0;
  virtual at::Tensor final_norm(const at::Tensor& x) = 0;
  virtual const at::Tensor& head_weight() const = 0;  // (V,C); the embedding when tied
  // Whether layer() applies config.json's dropout in training (models::dropout_rates) as
  // transformers does; training refuses a nonzero rate for an architecture that does not,
  // rather than train without it.
  virtual bool applies_dropout() const { return false; }
  // The value init_random gives norm weights (Gemma's norms scale by 1 + weight: 0).
  virtual double initial_norm_weight() const { return 1.0; }
  // The modules transformers' model of this architecture has that hold no tensor (its
  // activations, dropouts, rotary embedding), each with its decoder layer (-1 outside the
  // stack): a LoRA target that selects one is refused, as PEFT refuses it.
  virtual std::vector<std::pair<std::string, int>> modules_without_tensors() const { return {}; }

  // Memory accounting (models/memory.h): what layer `index` keeps and holds in a step of
  // these shapes under `plan`, and what the forward holds beside the layers. An
  // architecture states them next to its forward, from its kernels' own accounting (see
  // models/arch/llama.cpp). The defaults are a bound for architectures that state nothing:
  // every projection's input and output kept, one attention of the spec's heads, a
  // LayerNorm's statistics; the estimate says when it used them.
  virtual LayerMemory layer_memory(int index, const StepShape& shape, const LayerPlan& plan) const;
  virtual StackMemory stack_memory(const StepShape& shape) const;

 protected:
  void add_tensor(std::string name, std::vector<int64_t> shape, TensorRole role, at::Tensor* tensor,
                  int layer = -1);
  Linear& add_linear(std::unique_ptr<Linear> linear, int layer);

  ModelSpec spec_;
  Placement placement_;
  std::vector<bool> offloaded_;
  LayerSource* layer_source_ = nullptr;
  std::vector<TensorSlot> slots_;
  std::vector<std::unique_ptr<Linear>> linears_;
  at::ScalarType compute_dtype_ = at::kFloat;
  bool autocast_ = false;
  AttentionOptions::Kernel attention_kernel_ = AttentionOptions::Kernel::kAuto;
};

}  // namespace memtune::models
