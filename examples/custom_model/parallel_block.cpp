// A custom architecture: "ParallelBlockForCausalLM", a decoder whose layers run attention
// and the MLP side by side on one normalised input (GPT-J / PaLM style):
//   x = x + attn(norm(x)) + mlp(norm(x))
// It reuses memtune's building blocks (Linear with NF4 and LoRA, the segment-aware causal
// attention with generation's key/value cache, RMSNorm, the checkpointed forward of CausalLM)
// and registers itself by name, so config.json files with "architectures":
// ["ParallelBlockForCausalLM"] load with it, and `memtune-custom init-model --arch ParallelBlockForCausalLM` makes one.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "data/batch.h"
#include "models/layers/attention.h"
#include "models/layers/norm_act.h"
#include "models/layers/projection_memory.h"
#include "models/registry.h"

namespace {

using namespace memtune::models;

class ParallelBlockModel : public CausalLM {
 public:
  explicit ParallelBlockModel(const ModelSpec& spec) : CausalLM(spec), layers_(spec.num_layers) {
    const int64_t C = spec.hidden_size, F = spec.intermediate_size, H = spec.num_heads * spec.head_dim;
    add_tensor("model.embed_tokens.weight", {spec.vocab_size, C}, TensorRole::kEmbedding, &embed_);
    add_tensor("model.pos_embed.weight", {spec.max_position_embeddings, C}, TensorRole::kPositionEmbedding, &pos_);
    for (int i = 0; i < spec.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer& L = layers_[i];
      add_tensor(p + "norm.weight", {C}, TensorRole::kNorm, &L.norm, i);
      L.qkv = &add_linear(std::make_unique<Linear>(p + "attn.qkv_proj", C, 3 * H, false), i);
      L.o = &add_linear(std::make_unique<Linear>(p + "attn.o_proj", H, C, false), i);
      L.up = &add_linear(std::make_unique<Linear>(p + "mlp.up_proj", C, F, false), i);
      L.down = &add_linear(std::make_unique<Linear>(p + "mlp.down_proj", F, C, false), i);
    }
    add_tensor("model.norm.weight", {C}, TensorRole::kNorm, &norm_);
    add_tensor("lm_head.weight", {spec.vocab_size, C}, TensorRole::kHead, &head_);
  }

  at::Tensor embed(const at::Tensor& ids, const at::Tensor& positions) override {
    return at::embedding(embed_, ids) + at::embedding(pos_, positions);
  }

  LayerContext layer_context(const memtune::data::Batch& b) override {
    LayerContext ctx;
    ctx.position_ids = b.position_ids;
    ctx.segment_ids = b.segment_ids;
    return ctx;
  }

  at::Tensor layer(int i, const at::Tensor& x, const LayerContext& ctx) override {
    const Layer& L = layers_[i];
    const int64_t B = x.size(0), T = x.size(1), Hn = spec_.num_heads, D = spec_.head_dim;
    at::Tensor h = rms_norm(x, L.norm, spec_.norm_eps);
    auto qkv = L.qkv->forward(h, ctx.training).split(Hn * D, -1);
    at::Tensor q = qkv[0].view({B, T, Hn, 1, D}).permute({0, 2, 3, 1, 4});
    at::Tensor k = qkv[1].view({B, T, Hn, D}).permute({0, 2, 1, 3});
    at::Tensor v = qkv[2].view({B, T, Hn, D}).permute({0, 2, 1, 3});
    // Through layer_attention, generation reads earlier positions' keys and values from its
    // cache instead of running the prefix again.
    at::Tensor a = layer_attention(ctx, i, q, k, v, 1.0 / std::sqrt(static_cast<double>(D)), 0, ctx.attention);
    a = a.permute({0, 3, 1, 2, 4}).reshape({B, T, Hn * D});
    at::Tensor m = L.down->forward(at::gelu(L.up->forward(h, ctx.training)), ctx.training);
    return x + L.o->forward(a, ctx.training) + m;
  }

  at::Tensor final_norm(const at::Tensor& x) override { return rms_norm(x, norm_, spec_.norm_eps); }
  const at::Tensor& head_weight() const override { return head_; }

  // What layer() keeps and holds, op by op, from the building blocks' own accounting
  // (models/memory.h): `memtune estimate`, the auto micro-batch, the pre-load check and the
  // supervisor's ladder all plan with it. Left out, CausalLM's default bound is used.
  LayerMemory layer_memory(int i, const StepShape& s, const LayerPlan& plan) const override {
    const Layer& L = layers_[i];
    const int64_t E = s.rows(), C = spec_.hidden_size, F = spec_.intermediate_size, H = spec_.num_heads * spec_.head_dim;
    const int64_t a = s.act_bytes;
    const LinearTraining tqkv = plan.training(*L.qkv), to = plan.training(*L.o), tu = plan.training(*L.up),
                         td = plan.training(*L.down);
    // `attn`: what lives until the attention's backward, the last of the layer's to run;
    // `rest`: the output projection's and the MLP's, freed before it.
    ProjectionTally p;
    int64_t attn = p.add(*L.qkv, tqkv, s);
    int64_t rest = p.add(*L.o, to, s) + p.add(*L.up, tu, s) + p.add(*L.down, td, s);
    const int64_t r = p.lora_rank, panel = p.panel;
    if (plan.input_grad) attn += rms_norm_kept(E, C, a);
    if (tqkv.keeps_input() || tu.keeps_input()) attn += E * C * a;  // h, shared by qkv and up
    const AttentionMemory at = attention_memory(s.batch, spec_.num_heads, spec_.num_heads, s.tokens, spec_.head_dim,
                                                a, s.fused_cpu_attention, s.threads);
    if (plan.input_grad || tqkv.trains()) attn += at.kept;
    // The merged heads: a view of the fused kernel's output, which it keeps itself.
    if (to.keeps_input() && !(s.fused_cpu_attention && (plan.input_grad || tqkv.trains()))) rest += E * H * a;
    if (plan.input_grad || tu.trains()) rest += E * F * a;       // GELU's input
    if (td.keeps_input()) rest += E * F * a;                   // GELU's output
    const int64_t qkv = E * 3 * H * a;  // the projection q, k and v are views of (the fused kernel keeps them)
    LayerMemory m;
    m.kept = attn + rest;
    // At the MLP's end: GELU's output (a transient unless down keeps it), down's output.
    const int64_t mlp_end = (td.keeps_input() ? 0 : E * F * a) + E * C * a + E * r * 4 + panel;
    m.forward = std::max(attn + (s.fused_cpu_attention ? 0 : qkv) + at.forward_transient,
                         m.kept + (s.fused_cpu_attention ? 0 : qkv) + mlp_end);
    m.forward_no_grad = E * C * a + qkv + std::max(at.no_grad_own + at.forward_transient, E * H * a + 2 * E * F * a + panel);
    const int64_t at_mlp = gelu_backward_transient(E, F) + E * C * 4 + panel;
    m.backward = std::max(m.kept + at_mlp, attn + at.backward_transient);
    m.workspace = std::max(at_mlp, at.backward_transient);
    return m;
  }

  StackMemory stack_memory(const StepShape& s) const override {
    return {0, rms_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};  // no rotary tables; the final RMSNorm
  }

 private:
  struct Layer {
    at::Tensor norm;
    Linear *qkv = nullptr, *o = nullptr, *up = nullptr, *down = nullptr;
  };
  at::Tensor embed_, pos_, norm_, head_;
  std::vector<Layer> layers_;
};

// Registration: the name config.json's "architectures" (or --arch) uses.
const ArchitectureRegistrar kRegistrar("ParallelBlockForCausalLM", [](const ModelSpec& spec) {
  return std::make_unique<ParallelBlockModel>(spec);
});

}  // namespace
