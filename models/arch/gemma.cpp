// Gemma (GemmaForCausalLM), Gemma 2 (Gemma2ForCausalLM) and Gemma 3's language model
// (Gemma3ForCausalLM, model_type gemma3_text) with Hugging Face's semantics. All are Llama's
// decoder with Gemma's pieces: RMSNorm scaling by (1 + weight) in fp32 with one rounding,
// embeddings multiplied by sqrt(hidden_size), a GeGLU MLP (gelu_pytorch_tanh or exact gelu),
// heads of head_dim independent of hidden_size, a tied head. Gemma 2 adds an attention scale
// of query_pre_attn_scalar^-0.5, norms after the attention and around the MLP (four a layer),
// two kinds of layer (layer_types: sliding ones attend within sliding_window, full ones to
// every earlier position) and tanh soft-capping of the attention scores and the logits (the
// attention kernels' and the loss's, from the spec). Gemma 3 takes Gemma 2's layer with
// per-head q and k norms, and rotates its sliding layers by rope_local_base_freq, its full
// ones by rope_theta with rope_scaling.
#include <algorithm>
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>

#include "data/batch.h"
#include "models/arch/gated_decoder.h"
#include "models/layers/attention.h"
#include "models/layers/norm_act.h"
#include "models/layers/rotary.h"
#include "models/registry.h"
#include "runtime/error.h"

namespace memtune::models {

namespace {

class GemmaModel : public GatedDecoder {
 public:
  explicit GemmaModel(const ModelSpec& spec) : GatedDecoder(spec) {
    MEMTUNE_CHECK(spec.rope_scaling.type != "dynamic", spec.architecture,
                  ": dynamic rope scaling is not supported on Gemma models (linear, llama3, yarn are)");
    if (spec.model_type == "gemma3_text" && !spec.sliding_layers.empty())
      local_inv_freq_ = rope_inv_freq(spec.head_dim, spec.local_rope_theta, {});
    scale_ = 1.0 / std::sqrt(static_cast<double>(spec.query_pre_attn_scalar.value_or(spec.head_dim)));
  }

  // The embedding times sqrt(hidden_size) rounded to the embedding's dtype, as Gemma's
  // scaled embedding; padding_idx = pad_token_id, whose row gets no gradient.
  at::Tensor embed(const at::Tensor& ids, const at::Tensor&) override {
    at::Tensor e = at::embedding(embed_tokens_, ids, spec().padding_index());
    const at::Tensor scale = at::scalar_tensor(std::sqrt(static_cast<double>(spec().hidden_size)), at::kFloat)
                                 .to(e.scalar_type())
                                 .to(e.device());
    return e * scale;
  }

  LayerContext layer_context(const data::Batch& b) override {
    LayerContext ctx;
    std::tie(ctx.cos, ctx.sin) = rotary_tables(b.position_ids, inv_freq_, rope_scale_);
    if (local_inv_freq_.defined()) std::tie(ctx.local_cos, ctx.local_sin) = rotary_tables(b.position_ids, local_inv_freq_, 1.0);
    ctx.position_ids = b.position_ids;
    ctx.segment_ids = b.segment_ids;
    return ctx;
  }

  at::Tensor layer(int i, const at::Tensor& x, const LayerContext& ctx) override {
    const Layer& L = layers_[i];
    const ModelSpec& s = spec_;
    const int64_t B = x.size(0), T = x.size(1), D = s.head_dim, Hkv = s.num_kv_heads,
                  G = s.num_heads / s.num_kv_heads;
    // Gemma 3's sliding layers rotate by their own table; Gemma 2's by the one of all layers.
    const bool local = ctx.local_cos.defined() && !s.sliding_layers.empty() && s.sliding_layers[static_cast<size_t>(i)];
    const at::Tensor& cos = local ? ctx.local_cos : ctx.cos;
    const at::Tensor& sin = local ? ctx.local_sin : ctx.sin;
    at::Tensor h = gemma_rms_norm(x, L.input_norm, s.norm_eps);
    at::Tensor q = L.q->forward(h, ctx.training).view({B, T, s.num_heads, D});
    at::Tensor k = L.k->forward(h, ctx.training).view({B, T, Hkv, D});
    at::Tensor v = L.v->forward(h, ctx.training).view({B, T, Hkv, D});
    if (s.qk_norm) {
      q = gemma_rms_norm(q, L.q_norm, s.norm_eps);
      k = gemma_rms_norm(k, L.k_norm, s.norm_eps);
    }
    q = apply_rotary(q, cos, sin);
    k = apply_rotary(k, cos, sin);
    at::Tensor q5 = q.view({B, T, Hkv, G, D}).permute({0, 2, 3, 1, 4});  // (B,Hkv,G,T,D)
    at::Tensor a = layer_attention(
        ctx, i, q5, k.permute({0, 2, 1, 3}), v.permute({0, 2, 1, 3}), scale_, s.layer_window(i),
        with_dropout(ctx.attention, ctx.training, dropout_.attention, L.attention_dropout_site, B, x.device()));
    a = L.o->forward(a.permute({0, 3, 1, 2, 4}).reshape({B, T, s.q_dim()}), ctx.training);
    if (s.sandwich_norms) {
      const at::Tensor y = x + gemma_rms_norm(a, L.post_attention_norm, s.norm_eps);
      h = gemma_rms_norm(y, L.pre_mlp_norm, s.norm_eps);
      return y + gemma_rms_norm(mlp(L, h, ctx.training), L.post_mlp_norm, s.norm_eps);
    }
    const at::Tensor y = x + a;
    h = gemma_rms_norm(y, L.post_attention_norm, s.norm_eps);
    return y + mlp(L, h, ctx.training);
  }

  at::Tensor final_norm(const at::Tensor& x) override { return gemma_rms_norm(x, norm_, spec_.norm_eps); }

  // Gemma's norms scale by (1 + weight): transformers initialises their weights to 0.
  double initial_norm_weight() const override { return 0.0; }

  StackMemory stack_memory(const StepShape& s) const override {
    // cos and sin (B,T,1,D) fp32, twice with Gemma 3's sliding layers; the final RMSNorm.
    const int64_t tables = local_inv_freq_.defined() ? 2 : 1;
    return {tables * 2 * s.rows() * spec_.head_dim * 4, rms_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};
  }

 private:
  at::Tensor mlp(const Layer& L, const at::Tensor& h, bool training) const {
    at::Tensor m = geglu(L.gate->forward(h, training), L.up->forward(h, training),
                         spec_.hidden_act == "gelu_pytorch_tanh");
    return L.down->forward(m, training);
  }

  at::Tensor local_inv_freq_;  // Gemma 3's sliding layers' rotary frequencies
  double scale_ = 1.0;         // the attention's score scale
};

}  // namespace

std::unique_ptr<CausalLM> make_gemma(const ModelSpec& spec) { return std::make_unique<GemmaModel>(spec); }

}  // namespace memtune::models
