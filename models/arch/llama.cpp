// Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) with
// Hugging Face's semantics: RMSNorm in fp32, rotary embeddings in the rotate_half layout (with
// linear, llama3, yarn and, within max_position_embeddings, dynamic frequency scaling),
// grouped-query attention, SwiGLU MLP, optional attention and MLP biases, optionally tied
// embeddings, and Qwen3's RMSNorm over each head's query and key before the rotary embedding.
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

class LlamaModel : public GatedDecoder {
 public:
  explicit LlamaModel(const ModelSpec& spec) : GatedDecoder(spec) {}

  // transformers builds the embedding with padding_idx = pad_token_id: that row gets no gradient.
  at::Tensor embed(const at::Tensor& ids, const at::Tensor&) override {
    return at::embedding(embed_tokens_, ids, spec().padding_index());
  }

  LayerContext layer_context(const data::Batch& b) override {
    LayerContext ctx;
    std::tie(ctx.cos, ctx.sin) = rotary_tables(b.position_ids, inv_freq_, rope_scale_);
    if (spec_.rope_scaling.type == "dynamic") {
      const int64_t longest = b.position_ids.numel() ? b.position_ids.max().item<int64_t>() + 1 : 0;
      MEMTUNE_CHECK(longest <= spec_.max_position_embeddings, "rope_scaling dynamic: a sequence reaches ", longest,
                    " positions, past max_position_embeddings ", spec_.max_position_embeddings,
                    "; there transformers rescales the rotary base from the longest sequence of each forward and "
                    "keeps it for the forwards that follow, a state memtune does not reproduce. memtune supports "
                    "dynamic within max_position_embeddings (where it is the plain rotary embedding): keep "
                    "sequences (data.max_seq_length, prompt and new tokens) within ", spec_.max_position_embeddings);
    }
    ctx.position_ids = b.position_ids;
    ctx.segment_ids = b.segment_ids;
    return ctx;
  }

  at::Tensor layer(int i, const at::Tensor& x, const LayerContext& ctx) override {
    const Layer& L = layers_[i];
    const ModelSpec& s = spec_;
    const int64_t B = x.size(0), T = x.size(1), D = s.head_dim, Hkv = s.num_kv_heads,
                  G = s.num_heads / s.num_kv_heads;
    at::Tensor h = rms_norm(x, L.input_norm, s.norm_eps);
    at::Tensor q = L.q->forward(h, ctx.training).view({B, T, s.num_heads, D});
    at::Tensor k = L.k->forward(h, ctx.training).view({B, T, Hkv, D});
    at::Tensor v = L.v->forward(h, ctx.training).view({B, T, Hkv, D});
    if (s.qk_norm) {  // over each head's D values, as Qwen3Attention's q_norm and k_norm
      q = rms_norm(q, L.q_norm, s.norm_eps);
      k = rms_norm(k, L.k_norm, s.norm_eps);
    }
    q = apply_rotary(q, ctx.cos, ctx.sin);
    k = apply_rotary(k, ctx.cos, ctx.sin);
    // Query head j uses key/value head j / G (HF's repeat_kv).
    at::Tensor q5 = q.view({B, T, Hkv, G, D}).permute({0, 2, 3, 1, 4});  // (B,Hkv,G,T,D)
    // attention_dropout on the probabilities in training, as transformers' eager attention.
    at::Tensor a = layer_attention(
        ctx, i, q5, k.permute({0, 2, 1, 3}), v.permute({0, 2, 1, 3}), 1.0 / std::sqrt(static_cast<double>(D)),
        s.sliding_window.value_or(0),
        with_dropout(ctx.attention, ctx.training, dropout_.attention, L.attention_dropout_site, B, x.device()));
    a = a.permute({0, 3, 1, 2, 4}).reshape({B, T, s.q_dim()});
    at::Tensor y = x + L.o->forward(a, ctx.training);
    h = rms_norm(y, L.post_attention_norm, s.norm_eps);
    at::Tensor m = swiglu(L.gate->forward(h, ctx.training), L.up->forward(h, ctx.training));
    return y + L.down->forward(m, ctx.training);
  }

  at::Tensor final_norm(const at::Tensor& x) override { return rms_norm(x, norm_, spec_.norm_eps); }

  StackMemory stack_memory(const StepShape& s) const override {
    // cos and sin (B,T,1,D) fp32; the final RMSNorm.
    return {2 * s.rows() * spec_.head_dim * 4, rms_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};
  }
};

}  // namespace

std::unique_ptr<CausalLM> make_llama(const ModelSpec& spec) { return std::make_unique<LlamaModel>(spec); }

}  // namespace memtune::models
