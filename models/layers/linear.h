#pragma once
// A linear projection of a transformer block: a dense, NF4 or LLM.int8 base weight, an
// optional bias, and optional LoRA adapters. y = base(x) + B(A(dropout(x))) * scaling.
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

namespace memtune {
struct NF4Tensor;
enum class QuantType : uint8_t;  // runtime/nf4.h
}

namespace memtune::models {

struct LoraOptions {
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool use_rslora = false;            // scaling = alpha / sqrt(r) instead of alpha / r
  std::string init = "true";          // true: kaiming-uniform A (a = sqrt(5)), zero B; gaussian: N(0, 1/r) A
  // DoRA (PEFT's use_dora, models/layers/dora.h): a trained magnitude per output row rescales
  // W + s B A to it.
  bool use_dora = false;
  double scaling() const;
};

struct LoraAdapter {
  at::Tensor A;  // [r, in] fp32, trainable
  at::Tensor B;  // [out, r] fp32, trainable
  // DoRA's magnitude m [out] fp32, trainable (PEFT's lora_magnitude_vector); undefined for plain LoRA.
  at::Tensor magnitude;
  double scaling = 1.0;
  double dropout = 0.0;
  bool dora() const { return magnitude.defined(); }
  int64_t parameters() const { return A.numel() + B.numel() + (dora() ? magnitude.numel() : 0); }
};

class Linear {
 public:
  Linear(std::string name, int64_t in_features, int64_t out_features, bool has_bias,
         bool fan_in_fan_out = false);

  const std::string& name() const { return name_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  // The checkpoint stores the weight [in, out] (GPT-2's Conv1D) instead of [out, in].
  bool fan_in_fan_out() const { return fan_in_fan_out_; }
  bool quantized() const { return qweight_ != nullptr; }  // 4-bit (NF4 / FP4)
  // LLM.int8 (load_in_8bit): `weight` holds the int8 codes [out, in] (bitsandbytes' CB) and
  // weight_absmax their fp32 row absmax (SCB), runtime/int8.h.
  bool int8() const { return weight.defined() && weight.scalar_type() == at::kChar; }
  bool has_bias() const { return has_bias_; }
  // Whether the weight was read: false for a placeholder of shape and dtype alone (a meta
  // tensor, or 4-bit codes on the meta device), which distributed.sharding: full leaves for
  // the projections another rank owns (trainer/layer_shards.h).
  bool weight_loaded() const;

  // Tensors stay undefined until loaded or initialised (a model is built without memory).
  at::Tensor weight;  // dense weight as stored: [out, in], or [in, out] when fan_in_fan_out
  at::Tensor bias;    // [out] when has_bias()
  at::Tensor weight_absmax;    // [out] fp32 when int8()
  double int8_threshold = 6.0;  // llm_int8_threshold when int8()
  std::unique_ptr<LoraAdapter> lora;
  at::ScalarType compute_dtype = at::kFloat;  // dtype of the base matmul
  // The Trainer's fp16 / bf16 autocast (training.fp16 / bf16): an fp32 adapter's products run
  // in a 16-bit compute_dtype too, from 16-bit copies of A and B, as PEFT's adapters under
  // torch.autocast; the gradients reach A and B through the casts, in fp32. Off (a 16-bit
  // compute dtype from bnb_4bit_compute_dtype alone), they run in fp32, as PEFT's without it.
  bool autocast = false;

  // (..., in) -> (..., out), in x's dtype.
  at::Tensor forward(const at::Tensor& x, bool training) const;

  // Replaces the dense weight by its 4-bit form ([out, in] as bitsandbytes stores it).
  void quantize(int64_t blocksize, bool double_quant, QuantType quant_type);
  void set_quantized(std::shared_ptr<const NF4Tensor> q);
  // Replaces the dense weight by LLM.int8's 8-bit form (the weight cast to float16, then
  // quantized row by row), or sets one read from a checkpoint (codes [out, in], absmax [out]).
  void quantize_int8(double threshold);
  void set_int8(at::Tensor codes, at::Tensor absmax, double threshold);
  const std::shared_ptr<const NF4Tensor>& qweight() const { return qweight_; }

  // The base weight as fp32 [out, in], dequantized when needed (a new tensor).
  at::Tensor dense_weight() const;
  // Adds zero-initialised-B adapters (A drawn from the default generator); with use_dora, the
  // magnitude starts at ||W + s B A|| row by row, as PEFT's (so that the layer starts as the base).
  void add_lora(const LoraOptions& options);
  // Folds the adapter into the base; an NF4 or 8-bit base becomes dense fp32. The adapter is
  // removed. DoRA's: W' = m / ||W + s B A|| * (W + s B A), row by row (PEFT's merge).
  void merge_lora();
  // ||W + s B A|| row by row for this projection's adapter (DoRA's norm): fp32 [out], no gradient.
  at::Tensor dora_weight_norm() const;
  int64_t base_storage_bytes() const;

 private:
  // An fp32 adapter under autocast with a 16-bit compute dtype: its products run on 16-bit
  // copies of A and B (lora_linear's `autocast`), its gradients summed in fp32.
  bool adapter_autocasts() const;
  // DoRA's forward (models/layers/dora.h).
  at::Tensor forward_dora(const at::Tensor& x, bool training) const;
  // The base alone, x W^T + b, in compute_dtype (an 8-bit weight: its product's dtype).
  at::Tensor base_product(const at::Tensor& x, bool training) const;
  // The bias in the dtype PEFT's base layer holds it in: a trained bias (lora.bias) is an fp32
  // master copy of a parameter PEFT keeps in the weight's dtype; a frozen one is as loaded.
  at::Tensor module_bias() const;
  // Rows [r0, r0 + n) of W as [out, in] rows in fp32, as PEFT reads the weight for DoRA: a 4-bit
  // weight dequantized to the dtype it was quantized from, then widened.
  at::Tensor weight_rows_fp32(int64_t r0, int64_t n) const;

  std::string name_;
  int64_t in_, out_;
  bool fan_in_fan_out_;
  bool has_bias_;
  uint64_t dropout_site_;  // keyed dropout's salt for the adapter input, from the name
  std::string profile_scope_;  // forward's row in MEMTUNE_PROFILE's trace: "memtune::self_attn.q_proj"
  std::shared_ptr<const NF4Tensor> qweight_;
};

}  // namespace memtune::models
