// GPT-2 family (GPT2LMHeadModel) with Hugging Face's semantics: LayerNorm, learned
// positions, GELU (tanh approximation), Conv1D projections whose weights are stored
// [in, out] (read as stored; adapters on them use fan_in_fan_out as PEFT does), the output
// head tied to the token embedding.
#include <cmath>

#include <ATen/ATen.h>

#include "data/batch.h"
#include "models/layers/attention.h"
#include "models/layers/norm_act.h"
#include "models/layers/projection_memory.h"
#include "models/registry.h"
#include "runtime/keyed_dropout.h"

namespace memtune::models {

namespace {

class Gpt2Model : public CausalLM {
 public:
  explicit Gpt2Model(const ModelSpec& spec)
      : CausalLM(spec), dropout_(dropout_rates(spec)), embedding_site_(dropout_site("transformer.drop")),
        layers_(spec.num_layers) {
    const int64_t C = spec.hidden_size, F = spec.intermediate_size;
    add_tensor("transformer.wte.weight", {spec.vocab_size, C}, TensorRole::kEmbedding, &wte_);
    add_tensor("transformer.wpe.weight", {spec.max_position_embeddings, C}, TensorRole::kPositionEmbedding, &wpe_);
    for (int i = 0; i < spec.num_layers; ++i) {
      const std::string p = "transformer.h." + std::to_string(i) + ".";
      Layer& L = layers_[i];
      L.attn_site = dropout_site(p + "attn.attn_dropout");
      L.attn_resid_site = dropout_site(p + "attn.resid_dropout");
      L.mlp_resid_site = dropout_site(p + "mlp.dropout");
      auto conv1d = [&](const std::string& name, int64_t in, int64_t out) {
        return &add_linear(std::make_unique<Linear>(p + name, in, out, true, /*fan_in_fan_out=*/true), i);
      };
      add_tensor(p + "ln_1.weight", {C}, TensorRole::kNorm, &L.ln1_w, i);
      add_tensor(p + "ln_1.bias", {C}, TensorRole::kNorm, &L.ln1_b, i);
      L.c_attn = conv1d("attn.c_attn", C, 3 * C);
      L.c_proj = conv1d("attn.c_proj", C, C);
      add_tensor(p + "ln_2.weight", {C}, TensorRole::kNorm, &L.ln2_w, i);
      add_tensor(p + "ln_2.bias", {C}, TensorRole::kNorm, &L.ln2_b, i);
      L.fc = conv1d("mlp.c_fc", C, F);
      L.proj = conv1d("mlp.c_proj", F, C);
    }
    add_tensor("transformer.ln_f.weight", {C}, TensorRole::kNorm, &ln_f_w_);
    add_tensor("transformer.ln_f.bias", {C}, TensorRole::kNorm, &ln_f_b_);
    if (!spec.tie_word_embeddings)
      add_tensor("lm_head.weight", {spec.vocab_size, C}, TensorRole::kHead, &lm_head_);
  }

  at::Tensor embed(const at::Tensor& ids, const at::Tensor& positions) override {
    return at::embedding(wte_, ids) + at::embedding(wpe_, positions);
  }

  LayerContext layer_context(const data::Batch& b) override {
    LayerContext ctx;
    ctx.position_ids = b.position_ids;
    ctx.segment_ids = b.segment_ids;
    return ctx;
  }

  // Dropout in training as transformers' GPT2Model places it: embd_pdrop on the embeddings
  // (applied here, at the first layer's input, which is the embeddings), attn_pdrop on the
  // attention probabilities, resid_pdrop on each sublayer's output before its residual sum.
  at::Tensor layer(int i, const at::Tensor& x_in, const LayerContext& ctx) override {
    const Layer& L = layers_[i];
    const ModelSpec& s = spec_;
    const int64_t B = x_in.size(0), T = x_in.size(1), C = s.hidden_size, H = s.num_heads, D = s.head_dim;
    auto drop = [&](const at::Tensor& t, double p, uint64_t site) {
      return ctx.training && p > 0 ? keyed_dropout(t, p, site) : t;
    };
    const at::Tensor x = i == 0 ? drop(x_in, dropout_.embedding, embedding_site_) : x_in;
    at::Tensor h = layer_norm(x, L.ln1_w, L.ln1_b);
    at::Tensor qkv = L.c_attn->forward(h, ctx.training);  // (B,T,3C)
    auto parts = qkv.split(C, -1);
    at::Tensor q = parts[0].view({B, T, H, 1, D}).permute({0, 2, 3, 1, 4});  // (B,H,1,T,D)
    at::Tensor k = parts[1].view({B, T, H, D}).permute({0, 2, 1, 3});
    at::Tensor v = parts[2].view({B, T, H, D}).permute({0, 2, 1, 3});
    at::Tensor a = layer_attention(
        ctx, i, q, k, v, 1.0 / std::sqrt(static_cast<double>(D)), 0,
        with_dropout(ctx.attention, ctx.training, dropout_.attention, L.attn_site, B, x.device()));
    a = a.permute({0, 3, 1, 2, 4}).reshape({B, T, C});
    at::Tensor y = x + drop(L.c_proj->forward(a, ctx.training), dropout_.residual, L.attn_resid_site);
    h = layer_norm(y, L.ln2_w, L.ln2_b);
    at::Tensor m = gelu_tanh(L.fc->forward(h, ctx.training), s.activation == "gelu_new");
    return y + drop(L.proj->forward(m, ctx.training), dropout_.residual, L.mlp_resid_site);
  }

  at::Tensor final_norm(const at::Tensor& x) override {
    return layer_norm(x, ln_f_w_, ln_f_b_);
  }

  // LayerNorm with its parameters in the input's dtype: a trained fp32 weight or bias of a
  // 16-bit model (lora.bias, lora.modules_to_save) computes as the module's own would.
  at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
    const auto in = [&](const at::Tensor& t) { return t.scalar_type() == x.scalar_type() ? t : t.to(x.scalar_type()); };
    return at::layer_norm(x, {spec_.hidden_size}, in(w), in(b), spec_.norm_eps);
  }

  const at::Tensor& head_weight() const override { return spec_.tie_word_embeddings ? wte_ : lm_head_; }

  bool applies_dropout() const override { return true; }

  std::vector<std::pair<std::string, int>> modules_without_tensors() const override {
    std::vector<std::pair<std::string, int>> m = {{"transformer.drop", -1}};
    for (int i = 0; i < spec_.num_layers; ++i)
      for (const char* name : {"attn.attn_dropout", "attn.resid_dropout", "mlp.act", "mlp.dropout"})
        m.emplace_back("transformer.h." + std::to_string(i) + "." + name, i);
    return m;
  }

  // layer()'s memory, op by op (see LlamaModel::layer_memory): LayerNorms keep x and fp32
  // mean and rstd, GELU keeps its input, q, k and v are views of one (B,T,3C) projection.
  LayerMemory layer_memory(int i, const StepShape& s, const LayerPlan& plan) const override {
    const Layer& L = layers_[i];
    const int64_t E = s.rows(), C = spec_.hidden_size, F = spec_.intermediate_size, H = spec_.num_heads;
    const int64_t a = s.act_bytes;
    const LinearTraining tqkv = plan.training(*L.c_attn), to = plan.training(*L.c_proj), tfc = plan.training(*L.fc),
                         tp = plan.training(*L.proj);
    ProjectionTally p;
    int64_t attn = p.add(*L.c_attn, tqkv, s);
    int64_t mlp = p.add(*L.c_proj, to, s) + p.add(*L.fc, tfc, s) + p.add(*L.proj, tp, s);
    const int64_t r = p.lora_rank, panel = p.panel;
    const bool g_in = plan.input_grad;
    if (g_in) attn += layer_norm_kept(E, C, a);
    if (tqkv.keeps_input()) attn += E * C * a;  // h
    AttentionOptions dropped;  // the blocked kernel draws dropout's masks per block
    dropped.dropout.p = dropout_.attention;
    const AttentionMemory at =
        attention_memory(s.batch, H, H, s.tokens, spec_.head_dim, a, s.fused_cpu_attention, s.threads, dropped);
    const bool g_attention = g_in || tqkv.trains();
    if (g_attention) attn += at.kept;
    // The merged heads: a view of the fused kernel's output, which it keeps itself.
    if (to.keeps_input() && !(s.fused_cpu_attention && g_attention)) mlp += E * C * a;
    const bool g_y = g_attention || to.trains();
    if (g_y) mlp += layer_norm_kept(E, C, a);
    if (tfc.keeps_input()) mlp += E * C * a;           // h
    // GELU's input; in a 16-bit model gelu_new runs as transformers' ops, whose autograd keeps
    // three more tensors of its size (tanh's output, 1 + it, x / 2).
    const bool gelu_ops = a != 4 && spec_.activation == "gelu_new";
    if (g_y || tfc.trains()) mlp += E * F * a * (gelu_ops ? 4 : 1);
    if (tp.keeps_input()) mlp += E * F * a;           // GELU's output

    // keyed_dropout keeps a boolean mask where a gradient flows through it, where it keeps
    // one (s.dropout_keeps_mask()); while it runs: its output, and where it keeps a mask, a
    // row's uniform draws and the masks.
    const bool resid = dropout_.residual > 0, embd = i == 0 && dropout_.embedding > 0;
    const bool masks = s.dropout_keeps_mask();
    if (masks && resid && g_y) mlp += E * C;
    if (masks && resid && (g_y || tfc.trains() || tp.trains())) mlp += E * C;
    if (masks && embd && g_in) attn += E * C;
    // The first layer's dropped input lives beside its input through the layer; LayerNorm
    // keeps it where a gradient flows.
    const int64_t embd_x = embd ? E * C * a : 0;
    if (embd && g_in) attn += embd_x;
    const int64_t drop = resid || embd ? E * C * a + (masks ? 2 * E * C + s.tokens * C * 5 : 0) : 0;

    const int64_t qkv = E * 3 * C * a;
    LayerMemory m;
    m.kept = attn + mlp;
    // At the MLP's end: GELU's output (a transient unless the projection keeps it), the
    // projection's output before the residual sum.
    const int64_t gelu_run = gelu_ops ? 2 * E * F * a : 0;  // the formula's two intermediates while it runs
    const int64_t mlp_end = (tp.keeps_input() ? 0 : E * F * a) + E * C * a + E * r * s.adapter_bytes + std::max(panel, gelu_run) + drop;
    m.forward = std::max(attn + (embd && !g_in ? embd_x : 0) + (s.fused_cpu_attention ? 0 : qkv) + at.forward_transient,
                         m.kept + (s.fused_cpu_attention ? 0 : qkv) + mlp_end);
    // Unrecorded: x, h, the projection, the merged heads, y, and the MLP's fc output and GELU's.
    m.forward_no_grad = std::max(E * C * a + qkv + at.no_grad_own + at.forward_transient,
                                 3 * E * C * a + qkv + E * C * a + 2 * E * F * a + std::max(panel, gelu_run));
    // The MLP's backward, beside the gradient flowing in (the caller's).
    const int64_t at_mlp = (gelu_ops ? 4 * E * F * a : gelu_backward_transient(E, F)) + panel;
    m.backward = std::max(m.kept + at_mlp, attn + at.backward_transient);
    m.workspace = std::max(at_mlp, at.backward_transient);
    return m;
  }

  StackMemory stack_memory(const StepShape& s) const override {
    return {0, layer_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};
  }

 private:
  struct Layer {
    at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
    Linear *c_attn = nullptr, *c_proj = nullptr, *fc = nullptr, *proj = nullptr;
    uint64_t attn_site = 0, attn_resid_site = 0, mlp_resid_site = 0;  // keyed dropout's sites
  };
  DropoutRates dropout_;
  uint64_t embedding_site_;
  at::Tensor wte_, wpe_, ln_f_w_, ln_f_b_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<CausalLM> make_gpt2(const ModelSpec& spec) { return std::make_unique<Gpt2Model>(spec); }

}  // namespace memtune::models
