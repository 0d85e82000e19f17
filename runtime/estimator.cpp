#include "runtime/estimator.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "runtime/error.h"
#include "runtime/units.h"

namespace memtune {

namespace {

constexpr int64_t kF32 = 4;
constexpr int64_t kI64 = 8;
constexpr int64_t kQueryBlock = 64;           // models/layers/attention.h query_block
constexpr int64_t kKeepProbsBytes = 64 << 20;  // attention keeps probabilities below this
constexpr int64_t kNf4PanelBytes = 4 << 20;    // models/layers/linear4bit.cpp kPanelBytes

struct Projection {
  std::string name;  // short name, as lora_projections spells it
  int64_t in, out;
  bool bias;
};

std::vector<Projection> projections(const EstimateInput& m) {
  const int64_t C = m.hidden_size, F = m.intermediate_size, q = m.num_heads * m.head_dim,
                kv = m.num_kv_heads * m.head_dim;
  if (m.family == "gpt2")
    return {{"c_attn", C, 3 * C, true}, {"attn.c_proj", C, C, true}, {"c_fc", C, F, true}, {"mlp.c_proj", F, C, true}};
  return {{"q_proj", C, q, m.qkv_bias},      {"k_proj", C, kv, m.qkv_bias}, {"v_proj", C, kv, m.qkv_bias},
          {"o_proj", q, C, m.o_bias},        {"gate_proj", C, F, m.mlp_bias}, {"up_proj", C, F, m.mlp_bias},
          {"down_proj", F, C, m.mlp_bias}};
}

// Floats of scratch per thread of the fused CPU attention's backward, the larger pass
// (models/layers/attention_cpu.cpp Scratch::backward_floats).
int64_t fused_attention_scratch(int64_t T, int64_t D) {
  constexpr int64_t kRows = 32, kLanes = 16;
  const int64_t Tp = (T + kLanes - 1) / kLanes * kLanes, Dp = (D + kLanes - 1) / kLanes * kLanes;
  return (2 * D * Tp + T * Dp + 2 * kRows * (Tp + kLanes) + kRows * Dp) * kF32;
}

// Rows of key positions summed over query blocks: sum over blocks of bt * t1.
int64_t attention_block_area(int64_t T) {
  int64_t area = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kQueryBlock) area += (std::min(T, t0 + kQueryBlock) - t0) * std::min(T, t0 + kQueryBlock);
  return area;
}

}  // namespace

int64_t loss_chunk_rows(int64_t vocab_size) {
  const int64_t fit = (int64_t{8} << 20) / (std::max<int64_t>(vocab_size, 1) * kF32);
  return std::clamp<int64_t>(fit, 128, 1024);
}

namespace {

class Planner {
 public:
  explicit Planner(const EstimateInput& in) : m_(in), proj_(projections(in)) {
    MEMTUNE_CHECK(m_.family == "llama" || m_.family == "gpt2", "estimate: family '", m_.family,
                  "' (llama or gpt2)");
    MEMTUNE_CHECK(m_.num_layers > 0 && m_.hidden_size > 0 && m_.num_heads > 0 && m_.head_dim > 0 &&
                      m_.num_kv_heads > 0 && m_.vocab_size > 0,
                  "estimate: the model shape has a non-positive size");
    MEMTUNE_CHECK(m_.micro_batch > 0 && m_.seq_length > 0, "estimate: micro-batch ", m_.micro_batch,
                  " and sequence length ", m_.seq_length, " must be positive");
    MEMTUNE_CHECK(m_.world_size >= 1, "estimate: world size ", m_.world_size, " must be at least 1");
    MEMTUNE_CHECK(m_.sharding == "none" || m_.sharding == "optimizer" || m_.sharding == "gradients" ||
                      m_.sharding == "full",
                  "estimate: sharding '", m_.sharding, "' (none, optimizer, gradients or full)");
    full_ = m_.finetune == "full";
    T_ = (m_.seq_length + 7) / 8 * 8;  // data::collate pads to a multiple of 8
    E_ = m_.micro_batch * T_;
    act_ = full_ ? kF32 : m_.dense_bytes;  // the residual stream's dtype: the embedding's
  }

  bool lora_on(int layer, const std::string& name) const {
    if (full_) return false;
    if (!m_.lora_layers.empty() && !(layer < static_cast<int>(m_.lora_layers.size()) && m_.lora_layers[layer]))
      return false;
    return std::find(m_.lora_projections.begin(), m_.lora_projections.end(), name) != m_.lora_projections.end();
  }
  bool layer_has_lora(int layer) const {
    for (const auto& p : proj_)
      if (lora_on(layer, p.name)) return true;
    return false;
  }
  bool checkpointed(int layer) const {
    return shard_layers() ||
           (layer < static_cast<int>(m_.checkpoint_layers.size()) && m_.checkpoint_layers[layer]);
  }
  // distributed.sharding: full over several ranks (trainer/layer_shards.h): each rank keeps
  // 1/W of every layer's frozen weights, gathers a layer around its forward, checkpoints all.
  bool shard_layers() const { return m_.world_size > 1 && m_.sharding == "full" && !full_; }
  // The layer's input requires grad: something below it (or the embedding) is trained.
  bool input_grad(int layer) const {
    if (full_ || m_.train_embedding || m_.train_position_embedding) return true;
    for (int j = 0; j < layer; ++j)
      if (layer_has_lora(j)) return true;
    return false;
  }

  // What a layer keeps for backward, in two parts freed at different times in backward:
  // `attn` lives until the attention's backward (norm 1, its output, q, k, v, the
  // attention's own saved tensors), `mlp` is freed before it (the merged heads, norm 2, the
  // MLP). Follows the autograd graph of models/arch/*.cpp: a tensor is kept only by an op
  // that needs it for a wanted gradient (LoRA A needs its input, B A's output; a frozen
  // weight needs nothing of the input; full fine-tuning keeps every matmul input). RMSNorm
  // (the node of models/layers/norm_act.h) keeps x and one fp32 rstd per row.
  struct LayerKept {
    int64_t attn = 0, mlp = 0;
    int64_t total() const { return attn + mlp; }
  };

  LayerKept layer_kept(int i) const {
    const int64_t E = E_, C = m_.hidden_size, F = m_.intermediate_size, H = m_.num_heads, r = m_.lora_r;
    const int64_t q = m_.num_heads * m_.head_dim, kv = m_.num_kv_heads * m_.head_dim;
    const int64_t a = act_;
    const bool gpt2 = m_.family == "gpt2";
    auto lora = [&](const std::string& n) { return lora_on(i, n); };
    auto keeps_input = [&](const std::string& n) { return full_ || lora(n); };
    auto norm = [&]() {
      return gpt2 ? E * C * a + 2 * E * kF32 : E * C * a + E * kF32;
    };
    LayerKept k;
    // LoRA: A's output (E, r) fp32 for B's gradient; with dropout, the mask and the dropped input.
    for (const auto& p : proj_)
      if (lora(p.name)) {
        int64_t b = E * r * kF32 + (m_.lora_dropout > 0 ? 2 * E * p.in * kF32 : 0);
        const bool first = p.name == "q_proj" || p.name == "k_proj" || p.name == "v_proj" || p.name == "c_attn";
        (first ? k.attn : k.mlp) += b;
      }
    const bool g_in = input_grad(i);
    if (g_in) k.attn += norm();
    const bool g_h1 = g_in || full_;
    bool g_attn_in;
    if (gpt2) {
      if (keeps_input("c_attn")) k.attn += E * C * a;  // h1
      g_attn_in = g_h1 || keeps_input("c_attn");
    } else {
      const bool any = keeps_input("q_proj") || keeps_input("k_proj") || keeps_input("v_proj");
      if (any) k.attn += E * C * a;
      g_attn_in = g_h1 || any;
    }
    // Attention (models/layers/attention.cpp): q, k, v, the output, one fp32 log-sum-exp per
    // query row; the blocked kernel also the probabilities when they fit 64 MiB, the fused
    // one each query's first key (int64).
    if (g_attn_in) {
      const int64_t kvd = gpt2 ? q : kv;
      k.attn += E * (2 * q + 2 * kvd) * a + E * H * kF32;
      if (m_.fused_cpu_attention) k.attn += E * kI64;
      else if (keep_probs()) k.attn += m_.micro_batch * H * attention_block_area(T_) * a;
    }
    const std::string o = gpt2 ? "attn.c_proj" : "o_proj";
    if (keeps_input(o)) k.mlp += E * q * a;  // the merged heads, (B,T,q)
    const bool g_y = g_in || g_attn_in || keeps_input(o);
    if (g_y) k.mlp += norm();
    if (gpt2) {
      if (keeps_input("c_fc")) k.mlp += E * C * a;  // h2
      if (g_y || keeps_input("c_fc")) k.mlp += E * F * a;  // gelu keeps its input
      if (keeps_input("mlp.c_proj")) k.mlp += E * F * a;   // gelu's output
    } else {
      if (keeps_input("gate_proj") || keeps_input("up_proj")) k.mlp += E * C * a;  // h2
      const bool g_gate = g_y || keeps_input("gate_proj");
      const bool g_up = g_y || keeps_input("up_proj");
      // The SwiGLU node (models/layers/norm_act.h) keeps gate's and up's outputs.
      if (g_gate || g_up) k.mlp += 2 * E * F * a;
      if (keeps_input("down_proj")) k.mlp += E * F * a;  // silu(gate) * up
    }
    return k;
  }
  int64_t layer_saved(int i) const { return layer_kept(i).total(); }

  // Elements trained in layer i: its adapters, or every tensor of it when full.
  int64_t layer_trainable(int i) const {
    int64_t n = 0;
    for (const auto& p : proj_) {
      if (full_) n += p.in * p.out + (p.bias ? p.out : 0);
      else if (lora_on(i, p.name)) n += m_.lora_r * (p.in + p.out);
    }
    if (full_) n += (m_.family == "gpt2" ? 4 : 2) * m_.hidden_size;  // norms
    return n;
  }

  bool keep_probs() const {
    return m_.micro_batch * m_.num_heads * T_ * T_ * 4 / 2 <= kKeepProbsBytes;
  }
  // The fused kernel's scratch, all threads.
  int64_t fused_scratch() const { return std::max<int64_t>(m_.threads, 1) * fused_attention_scratch(T_, m_.head_dim); }
  // What the attention's forward holds beyond its inputs and output while it runs.
  int64_t attention_forward_transient() const {
    if (m_.fused_cpu_attention) return fused_scratch();
    return score_block() + (keep_probs() ? 0 : score_block()) + mask_block();
  }

  // One query block of fp32 scores (B,H,bt,T).
  int64_t score_block() const { return m_.micro_batch * m_.num_heads * std::min(T_, kQueryBlock) * T_ * kF32; }
  // The block's additive mask (B,1,1,bt,T) fp32 and the boolean tensors that build it.
  int64_t mask_block() const { return m_.micro_batch * std::min(T_, kQueryBlock) * T_ * (kF32 + 3); }
  // q, k (after rotary) and v as the layer's locals hold them until it returns; GPT-2 holds
  // the fused (B,T,3C) projection.
  int64_t qkv_locals() const {
    const int64_t q = m_.num_heads * m_.head_dim, kv = m_.num_kv_heads * m_.head_dim;
    return E_ * (m_.family == "gpt2" ? 3 * m_.hidden_size : q + 2 * kv) * act_;
  }

  // Peak of a layer's forward above what is alive before it, with autograd recording.
  int64_t forward_with_grad(int i) const {
    const LayerKept k = layer_kept(i);
    // The fused kernel keeps q, k and v themselves (the layer's locals), not copies.
    const int64_t at_attention =
        k.attn + (m_.fused_cpu_attention ? 0 : qkv_locals()) + attention_forward_transient();
    // Up's output (kept) and its adapter's x A^T: the fused LoRA node adds the adapter's
    // product inside the base's GEMM (models/layers/lora_linear.h), no full-size delta.
    const int64_t at_mlp = k.total() + qkv_locals() + E_ * m_.lora_r * kF32 + nf4_panel();
    return std::max(at_attention, at_mlp);
  }

  // Peak of a checkpointed layer's forward (no autograd): only the layer's locals and the
  // tensors of the op running stay alive.
  int64_t forward_without_grad() const {
    const int64_t E = E_, C = m_.hidden_size, F = m_.intermediate_size, H = m_.num_heads, a = act_;
    const int64_t q = m_.num_heads * m_.head_dim, kv = m_.num_kv_heads * m_.head_dim;
    const int64_t kvd = m_.family == "gpt2" ? q : kv;
    // The blocked kernel makes q, k, v contiguous and keeps or forms the probabilities; the
    // fused one reads q, k, v in place and adds each query's first key.
    const int64_t own = m_.fused_cpu_attention
                            ? E * q * a + E * H * kF32 + E * kI64
                            : E * (2 * q + 2 * kvd) * a + E * H * kF32 +
                                  (keep_probs() ? m_.micro_batch * H * attention_block_area(T_) * a : 0);
    const int64_t at_attention = E * C * a + qkv_locals() + own + attention_forward_transient();
    // x, h, q/k/v locals, merged heads, y, and the MLP: gate, up's parts, silu, the product.
    const int64_t at_mlp = 3 * E * C * a + qkv_locals() + E * q * a + 5 * E * F * a + nf4_panel();
    return std::max(at_attention, at_mlp);
  }

  // Backward of a layer above its kept tensors: at the MLP, the product's gradient (base
  // and adapter summed in one buffer by the fused LoRA node) and the one flowing in;
  // at the attention (the MLP's tensors freed), the incoming gradient and its contiguous
  // copy, dq, dk, dv, the product with the output, and per query block the probabilities'
  // gradient and the scores' gradient (plus the recomputed probabilities and their mask
  // when they were not kept).
  int64_t backward_at_mlp() const {
    // Llama: SwiGLU's backward rebuilds sigmoid(gate) and forms both gradients next to the
    // incoming one.
    const int64_t f = m_.family == "gpt2" ? 1 : 3;
    return f * E_ * m_.intermediate_size * kF32 + E_ * m_.hidden_size * kF32 + nf4_panel();
  }
  int64_t backward_at_attention() const {
    const int64_t q = m_.num_heads * m_.head_dim, kv = m_.num_kv_heads * m_.head_dim;
    const int64_t kvd = m_.family == "gpt2" ? q : kv;
    // The fused kernel: the incoming gradient (no copy), dq, dk, dv and its scratch.
    if (m_.fused_cpu_attention) return E_ * (2 * q + 2 * kvd) * kF32 + fused_scratch();
    const int64_t blocks = keep_probs() ? 2 * score_block() : 3 * score_block() + mask_block();
    return E_ * (4 * q + 2 * kvd) * kF32 + E_ * m_.num_heads * kF32 + blocks;
  }

  int64_t nf4_panel() const {
    if (!m_.load_in_4bit) return 0;
    int64_t worst = 0;
    for (const auto& p : proj_) worst = std::max(worst, std::min(p.out * p.in * m_.compute_bytes, kNf4PanelBytes + p.in * m_.compute_bytes));
    return worst;
  }

  Estimate run() const {
    Estimate e;
    const int64_t C = m_.hidden_size, V = m_.vocab_size, L = m_.num_layers, E = E_;
    const bool gpt2 = m_.family == "gpt2";
    const int64_t wb = full_ ? kF32 : m_.dense_bytes;

    // Weights.
    int64_t dense_numel = V * C + (m_.tie_word_embeddings ? 0 : V * C);
    dense_numel += gpt2 ? m_.max_position_embeddings * C + L * 4 * C + 2 * C : L * 2 * C + C;
    int64_t proj_numel = 0, largest = std::max<int64_t>(V * C, gpt2 ? m_.max_position_embeddings * C : 0);
    for (const auto& p : proj_) {
      proj_numel += p.in * p.out;
      largest = std::max(largest, p.in * p.out);
      if (p.bias) dense_numel += L * p.out;
    }
    // The layers' own dense tensors: norms, biases, dense projections.
    int64_t layer_dense = L * (gpt2 ? 4 * C : 2 * C);
    for (const auto& p : proj_)
      if (p.bias) layer_dense += L * p.out;
    if (m_.load_in_4bit && !full_) {
      for (const auto& p : proj_) e.weights_nf4 += L * nf4_storage_bytes(p.in * p.out, m_.blocksize, m_.double_quant);
    } else {
      dense_numel += L * proj_numel;
      layer_dense += L * proj_numel;
    }
    e.weights_dense = dense_numel * wb;
    // Sharded layers: this rank's 1/W (the whole-tensor partition is within a tensor of it),
    // and one whole layer while it is gathered (forward, and its rerun in backward).
    int64_t gathered = 0;
    if (shard_layers()) {
      const int64_t W = m_.world_size, layers = e.weights_nf4 + layer_dense * wb;
      e.layers_sharded_from = layers;
      e.weights_nf4 = (e.weights_nf4 + W - 1) / W;
      e.weights_dense = (dense_numel - layer_dense) * wb + (layer_dense * wb + W - 1) / W;
      gathered = (layers + L - 1) / L;
      e.gathered_layer = gathered;
    }

    // Trainable tensors, their gradients and the optimizer's states.
    int64_t trainable = 0, largest_trainable = 0;
    if (full_) {
      trainable = dense_numel;
      largest_trainable = largest;
    } else {
      for (int i = 0; i < L; ++i)
        for (const auto& p : proj_)
          if (lora_on(i, p.name)) {
            trainable += m_.lora_r * (p.in + p.out);
            largest_trainable = std::max({largest_trainable, m_.lora_r * p.in, m_.lora_r * p.out});
          }
      e.lora_parameters = trainable * kF32;
      // modules_to_save: whole tensors beside the adapters (their weights are in weights_dense).
      for (auto [on, numel] : {std::pair{m_.train_embedding, V * C}, std::pair{m_.train_head, V * C},
                               std::pair{m_.train_position_embedding, m_.max_position_embeddings * C},
                               std::pair{m_.train_final_norm, (gpt2 ? 2 : 1) * C}})
        if (on) {
          trainable += numel;
          largest_trainable = std::max(largest_trainable, numel);
        }
    }
    e.trainable_parameters = trainable;
    e.gradients = trainable * kF32;
    // The states, tensor by tensor (8-bit ones depend on each tensor's size).
    auto states = [&](int64_t numel, int64_t count) {
      e.optimizer_states += count * optimizer_state_bytes(m_.optimizer, m_.optimizer_paged, numel);
    };
    if (full_) {
      states(V * C, m_.tie_word_embeddings ? 1 : 2);
      if (gpt2) states(m_.max_position_embeddings * C, 1);
      states(C, gpt2 ? L * 4 + 2 : L * 2 + 1);  // norm weights (and GPT-2's norm biases)
      for (const auto& p : proj_) {
        states(p.in * p.out, L);
        if (p.bias) states(p.out, L);
      }
    } else {
      for (int i = 0; i < L; ++i)
        for (const auto& p : proj_)
          if (lora_on(i, p.name)) {
            states(m_.lora_r * p.in, 1);
            states(m_.lora_r * p.out, 1);
          }
      if (m_.train_embedding) states(V * C, 1);
      if (m_.train_head) states(V * C, 1);
      if (m_.train_position_embedding) states(m_.max_position_embeddings * C, 1);
      if (m_.train_final_norm) states(C, gpt2 ? 2 : 1);
    }
    // Only torch's AdamW off the fused CPU kernel keeps a workspace (trainer/optimizer.cpp).
    e.optimizer_workspace = m_.optimizer == "adamw" ? largest_trainable * kF32 : 0;
    // Sharding (trainer/sharding.h): the ideal 1/W share; its whole-tensor partition is within
    // one tensor of it.
    const int64_t W = m_.world_size;
    const bool shard_states = W > 1 && m_.sharding != "none",
               shard_grads = W > 1 && (m_.sharding == "gradients" || m_.sharding == "full");
    const int64_t states_whole = e.optimizer_states;
    if (shard_states) {
      e.optimizer_states = (e.optimizer_states + W - 1) / W;
      e.sharding_buffer = std::min((e.gradients + W - 1) / W, m_.bucket_bytes) / kF32 * kF32;
    }
    e.gradients_after_reduce = shard_grads ? (e.gradients + W - 1) / W : e.gradients;
    const int64_t persistent = e.weights_nf4 + e.weights_dense + e.lora_parameters + e.optimizer_states +
                               e.optimizer_workspace + e.sharding_buffer;

    // Activations kept for backward.
    const int64_t batch = 4 * E * kI64;                            // input_ids, targets, positions, segments
    const int64_t rotary = gpt2 ? 0 : 2 * E * m_.head_dim * kF32;  // cos, sin (B,T,1,D)
    int64_t kept = 0;
    for (int i = 0; i < L; ++i) {
      const int64_t s = checkpointed(i) ? (!m_.offload_activations && (input_grad(i) || layer_has_lora(i)) ? E * C * act_ : 0)
                                        : layer_saved(i);
      e.activations_per_layer.push_back(s);
      kept += s;
    }
    // Final norm keeps the last layer's output and its statistics (LayerNorm: mean and
    // rstd; the RMSNorm node: rstd).
    const bool g_last = full_ || m_.train_final_norm || input_grad(static_cast<int>(L));
    const int64_t final_norm = !g_last ? 0 : E * C * act_ + (gpt2 ? 2 : 1) * E * kF32;
    e.activations = kept + final_norm + batch + rotary;

    // Loss (models/layers/cross_entropy.cpp): gradients are formed in the forward. Alive at
    // once: the normed hidden (E,C), its trained rows, their fp32 gradient, a chunk of fp32
    // logits (softmaxed in place) and a chunk of gathered head rows; at the end the full (E,C)
    // gradient, kept for backward (and dW (V,C) fp32 when the head is trained).
    const int64_t chunk = std::min(E, m_.loss_chunk_rows > 0 ? m_.loss_chunk_rows : loss_chunk_rows(V));
    const int64_t hidden = E * C * act_;
    const int64_t dh = E * C * kF32;
    const int64_t head_grad = full_ || m_.train_head ? V * C * kF32 : 0;
    const int64_t loss_chunk = hidden + hidden + dh + chunk * V * kF32 + chunk * C * kF32 + head_grad;
    const int64_t loss_end = hidden + hidden + 2 * dh + head_grad;
    e.loss = std::max(loss_chunk, loss_end);
    e.after_forward = e.activations + dh + head_grad;

    // Forward: each layer on top of what the layers below keep, then the loss.
    int64_t below = batch + rotary, fwd = 0;
    for (int i = 0; i < L; ++i) {
      const int64_t input = input_grad(i) ? 0 : E * C * act_;  // the embedding's output, not kept
      fwd = std::max(fwd, below + (checkpointed(i) ? forward_without_grad() : forward_with_grad(i) + input));
      below += e.activations_per_layer[i];
    }
    fwd = std::max(fwd, e.activations + e.loss);
    e.forward_peak = persistent + fwd + gathered;  // gradients were dropped before the step (zero_grad)

    // Backward: the loss node (its saved gradients and their product with the loss's
    // gradient), then from the top layer down: a checkpointed layer is first rebuilt with
    // autograd, then each layer's MLP and attention backward run with the layers below kept
    // and the gradient flowing in. Gradients appear as their layer finishes: at layer i those
    // of the head (full) and of layers >= i. The embedding's gradient comes last.
    int64_t bwd = e.activations + 2 * (dh + head_grad);
    int64_t recompute = 0, workspace = 0;
    int64_t grads = (full_ || m_.train_final_norm ? (gpt2 ? 2 * C : C) * kF32 : 0) + head_grad;  // final norm, head
    below = batch + rotary + kept;
    const int64_t grad_in = E * C * kF32;
    for (int i = static_cast<int>(L) - 1; i >= 0; --i) {
      below -= e.activations_per_layer[i];
      const LayerKept k = layer_kept(i);
      int64_t worst = std::max(k.total() + backward_at_mlp(), k.attn + backward_at_attention());
      if (checkpointed(i)) {
        // Offloaded, the input comes back to the device for the recomputation.
        const int64_t fetched = m_.offload_activations && (input_grad(i) || layer_has_lora(i)) ? E * C * act_ : 0;
        recompute = std::max(recompute, k.total() + fetched);
        worst = std::max(worst + fetched, forward_with_grad(i) + fetched + (input_grad(i) ? 0 : E * C * act_));
      }
      workspace = std::max({workspace, backward_at_mlp(), backward_at_attention()});
      bwd = std::max(bwd, grads + below + grad_in + worst);
      grads += layer_trainable(i) * kF32;
    }
    // The embedding's backward: a dense (V,C) gradient, added in place when tied to a head
    // that already has one.
    if (full_) bwd = std::max(bwd, e.gradients + batch + grad_in + (m_.tie_word_embeddings ? V * C * kF32 : 0));
    if (!full_ && (m_.train_embedding || m_.train_position_embedding)) bwd = std::max(bwd, e.gradients + batch + grad_in);
    e.recompute = recompute;
    e.workspace = workspace;
    e.backward_peak = persistent + bwd + gathered;

    // Optimizer: off the CPU the gradient norm converts the largest gradient to fp64 and
    // squares it (trainer/optimizer.cpp grad_square_sum); on the CPU it sums in place.
    e.optimizer_peak = persistent + e.gradients_after_reduce + (m_.cpu_update ? 0 : 2 * largest_trainable * 8);
    e.peak_bytes = std::max({e.forward_peak, e.backward_peak, e.optimizer_peak});

    auto add = [&](std::string name, int64_t bytes, std::string note) {
      e.components.push_back({std::move(name), bytes, std::move(note)});
    };
    if (e.weights_nf4)
      add("weights: NF4", e.weights_nf4,
          str_cat("projections, blocksize ", m_.blocksize, m_.double_quant ? ", double quant" : ""));
    add("weights: dense", e.weights_dense, str_cat(wb, " bytes per element"));
    if (gathered)
      add("weights: gathered layer", gathered,
          str_cat("one whole layer while it runs, in forward and in backward; the layers' weights above are 1/",
                  m_.world_size, " of ", format_bytes(e.layers_sharded_from), " (distributed.sharding: full)"));
    if (e.lora_parameters) add("LoRA parameters", e.lora_parameters, str_cat("r=", m_.lora_r, ", fp32"));
    add("gradients", e.gradients, str_cat(trainable, " trainable parameters, fp32"));
    std::string states_how = m_.optimizer == "sgd"           ? "sgd: momentum buffer"
                      : m_.optimizer == "adamw_8bit"  ? "adamw 8-bit: uint8 codes + absmax per 256 (fp32 under 4096 elements)"
                      : m_.optimizer == "adamw_32bit" ? "adamw (bitsandbytes 32-bit): exp_avg, exp_avg_sq"
                                                      : "adamw: exp_avg, exp_avg_sq";
    if (m_.optimizer_paged) states_how = "paged: in host memory, none on the device";
    if (trainable > 0) {
      char per[64];
      std::snprintf(per, sizeof per, " (%.3f B per trainable parameter)",
                    static_cast<double>(e.optimizer_states) / static_cast<double>(trainable));
      states_how += per;
    }
    if (shard_states)
      states_how = str_cat("per rank, 1/", W, " of ", format_bytes(states_whole), " (distributed.sharding: ",
                           m_.sharding, "); ", states_how);
    add("optimizer states", e.optimizer_states, states_how);
    if (shard_grads)
      add("gradients after reduction", e.gradients_after_reduce,
          str_cat("per rank in the update, 1/", W, " (distributed.sharding: ", m_.sharding, ")"));
    if (e.sharding_buffer) add("sharding buffer", e.sharding_buffer, "one bucket of the sharded collectives");
    if (e.optimizer_workspace) add("optimizer workspace", e.optimizer_workspace, "the largest trainable tensor, fp32");
    // Runs of layers that keep the same bytes the same way are one line.
    for (int i = 0; i < L;) {
      int j = i;
      while (j + 1 < L && e.activations_per_layer[j + 1] == e.activations_per_layer[i] &&
             checkpointed(j + 1) == checkpointed(i))
        ++j;
      const std::string how = !checkpointed(i)            ? "kept for backward"
                              : m_.offload_activations ? "checkpointed, its input in host memory"
                                                       : "checkpointed: its input";
      if (j == i)
        add(str_cat("activations: layer ", i), e.activations_per_layer[i], how);
      else
        add(str_cat("activations: layers ", i, "-", j), e.activations_per_layer[i] * (j - i + 1),
            str_cat(format_bytes(e.activations_per_layer[i]), " each, ", how));
      i = j + 1;
    }
    add("activations: final norm, rotary, batch", final_norm + rotary + batch, "");
    add("logits and loss", e.loss, str_cat("chunks of ", chunk, " rows x ", V, " fp32 logits"));
    add("recompute (checkpointed layer)", e.recompute, "one layer rebuilt in backward");
    add("workspace (layer backward)", e.workspace, "temporaries of one layer's backward");
    return e;
  }

 private:
  const EstimateInput& m_;
  std::vector<Projection> proj_;
  bool full_ = false;
  int64_t T_ = 0, E_ = 0, act_ = 4;
};

}  // namespace

int64_t optimizer_state_bytes(const std::string& optimizer, bool paged, int64_t numel) {
  if (paged) return 0;
  if (optimizer == "sgd") return numel * 4;
  if (optimizer == "adamw_8bit" && numel >= 4096) return 2 * numel + 2 * ((numel + 255) / 256) * 4;
  return 2 * numel * 4;
}

int64_t nf4_storage_bytes(int64_t numel, int64_t blocksize, bool double_quant) {
  const int64_t nblocks = (numel + blocksize - 1) / blocksize;
  const int64_t packed = (numel + 1) / 2;
  if (!double_quant) return packed + nblocks * kF32;
  const int64_t nested = (nblocks + 255) / 256;
  return packed + nblocks + nested * kF32 + 256 * kF32;
}

Estimate estimate_memory(const EstimateInput& in) { return Planner(in).run(); }

int64_t max_micro_batch(const EstimateInput& in, int64_t budget, int64_t limit) {
  EstimateInput x = in;
  auto fits = [&](int64_t b) {
    x.micro_batch = b;
    return estimate_peak(x) <= budget;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= limit && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  hi = std::min(hi, limit + 1);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

int64_t max_seq_length(const EstimateInput& in, int64_t budget) {
  EstimateInput x = in;
  auto fits = [&](int64_t t) {
    x.seq_length = t;
    return estimate_peak(x) <= budget;
  };
  const int64_t top = std::max<int64_t>(8, in.max_position_embeddings / 8 * 8);
  if (!fits(8)) return 0;
  int64_t lo = 1, hi = top / 8 + 1;  // in units of 8 tokens; lo fits, hi does not
  if (fits(top)) return top;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid * 8) ? lo : hi) = mid;
  }
  return lo * 8;
}

}  // namespace memtune
