#include "models/arch/gated_layer_memory.h"

#include <algorithm>

#include "models/layers/attention.h"
#include "models/layers/norm_act.h"
#include "models/layers/projection_memory.h"

namespace memtune::models {

LayerMemory gated_layer_memory(const GatedLayerProjections& L, const GatedLayerForm& form, const ModelSpec& sp,
                               const StepShape& s, const LayerPlan& plan) {
  const int64_t E = s.rows(), C = sp.hidden_size, F = sp.intermediate_size, q = sp.q_dim(), kv = sp.kv_dim();
  const int64_t a = s.act_bytes;
  const LinearTraining tq = plan.training(*L.q), tk = plan.training(*L.k), tv = plan.training(*L.v),
                       to = plan.training(*L.o), tg = plan.training(*L.gate), tu = plan.training(*L.up),
                       td = plan.training(*L.down);
  ProjectionTally p;
  int64_t attn = p.add(*L.q, tq, s) + p.add(*L.k, tk, s) + p.add(*L.v, tv, s);
  const int64_t down_adapter = p.add(*L.down, td, s);
  int64_t mlp = p.add(*L.o, to, s) + p.add(*L.gate, tg, s) + p.add(*L.up, tu, s) + down_adapter;
  const int64_t r = p.lora_rank, panel = p.panel;
  const bool g_in = plan.input_grad;
  if (g_in) attn += rms_norm_kept(E, C, a);
  const bool qkv_trained = tq.trains() || tk.trains() || tv.trains();
  if (tq.keeps_input() || tk.keeps_input() || tv.keeps_input()) attn += E * C * a;  // h
  // The q and k norms keep the projections' outputs (the rotary embedding after them keeps nothing).
  if (form.qk_norm && (g_in || tq.trains())) attn += rms_norm_kept(E * sp.num_heads, sp.head_dim, a);
  if (form.qk_norm && (g_in || tk.trains())) attn += rms_norm_kept(E * sp.num_kv_heads, sp.head_dim, a);
  AttentionOptions dropped;  // the blocked kernel draws dropout's masks per block
  dropped.dropout.p = form.attention_dropout;
  dropped.softcap = sp.attn_logit_softcapping.value_or(0);
  const AttentionMemory at = attention_memory(s.batch, sp.num_heads, sp.num_kv_heads, s.tokens, sp.head_dim, a,
                                              s.fused_cpu_attention, s.threads, dropped);
  const bool g_attention = g_in || qkv_trained;
  if (g_attention) attn += at.kept;
  // The merged heads: a view of the fused kernel's output, which it keeps itself.
  if (to.keeps_input() && !(s.fused_cpu_attention && g_attention)) mlp += E * q * a;
  const bool g_y = g_attention || to.trains();
  if (form.sandwich_norms && g_y) mlp += rms_norm_kept(E, C, a);  // o_proj's output
  if (g_y) mlp += rms_norm_kept(E, C, a);                           // y, under the MLP's norm
  if (tg.keeps_input() || tu.keeps_input()) mlp += E * C * a;      // h
  if (g_y || tg.trains() || tu.trains()) mlp += swiglu_kept(E, F, a);  // gate and up (GeGLU's alike)
  if (td.keeps_input()) mlp += E * F * a;                               // act(gate) * up
  const bool g_mlp_out = g_y || tg.trains() || tu.trains() || td.trains();
  if (form.sandwich_norms && g_mlp_out) mlp += rms_norm_kept(E, C, a);  // down_proj's output

  const int64_t qkv = E * (q + 2 * kv) * a;                    // q, k (after rotary), v: the layer's locals
  const int64_t sandwich = form.sandwich_norms ? E * C * a : 0;  // a norm's output beside its input
  LayerMemory m;
  m.kept = attn + mlp;
  // The fused kernel keeps the locals q, k, v themselves (the blocked one contiguous copies).
  // At the MLP's end: act(gate) * up (a transient unless down keeps it), down's output before
  // the residual sum, an adapter's x A^T (the fused LoRA node adds the adapter inside the
  // base's GEMM, no full-size delta).
  const int64_t mlp_end = (td.keeps_input() ? 0 : E * F * a) + E * C * a + sandwich + E * r * s.adapter_bytes + panel;
  m.forward = std::max(attn + (s.fused_cpu_attention ? 0 : qkv) + at.forward_transient,
                       m.kept + (s.fused_cpu_attention ? 0 : qkv) + mlp_end);
  // Unrecorded: x, h, the locals, the merged heads, y, and the MLP's gate, up and the product
  // (act(gate), multiplied by up in place).
  m.forward_no_grad = std::max(E * C * a + qkv + at.no_grad_own + at.forward_transient,
                               3 * E * C * a + sandwich + qkv + E * q * a + 3 * E * F * a + panel);
  // The MLP's backward, beside the gradient flowing in (the caller's): the product's gradient
  // from down and the activation's transients, once down's node has run and released what it
  // kept.
  const int64_t down_kept = (td.keeps_input() ? E * F * a : 0) + down_adapter;
  const int64_t act_backward =
      form.geglu ? geglu_backward_transient(E, F, a) : swiglu_backward_transient(E, F, a, s.cuda_kernels);
  const int64_t at_mlp = E * F * 4 + act_backward + sandwich + panel;
  m.backward = std::max(m.kept - down_kept + at_mlp, attn + at.backward_transient);
  m.workspace = std::max(at_mlp, at.backward_transient);
  return m;
}

}  // namespace memtune::models
