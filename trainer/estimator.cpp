#include "trainer/estimator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <unordered_map>

#include "models/causal_lm.h"
#include "models/layers/cross_entropy.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/int8.h"
#include "runtime/nf4.h"
#include "runtime/units.h"
#include "trainer/adamw8bit_kernels.h"
#include "trainer/optim_kernels.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {

namespace {

using models::TensorRole;
using models::TensorSlot;

constexpr int64_t kF32 = 4;
constexpr int64_t kBf16 = 2;
constexpr int64_t kI64 = 8;

int64_t numel(const TensorSlot& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return n;
}

class Planner {
 public:
  explicit Planner(const EstimateInput& in) : m_(in) {
    MEMTUNE_INTERNAL_ASSERT(m_.model != nullptr, "estimate: no model structure");
    const models::CausalLM& model = *m_.model;
    MEMTUNE_CHECK(m_.micro_batch > 0 && m_.seq_length > 0, "estimate: micro-batch ", m_.micro_batch,
                  " and sequence length ", m_.seq_length, " must be positive");
    MEMTUNE_CHECK(m_.world_size >= 1, "estimate: world size ", m_.world_size, " must be at least 1");
    MEMTUNE_CHECK(m_.sharding == "none" || m_.sharding == "optimizer" || m_.sharding == "gradients" ||
                      m_.sharding == "full",
                  "estimate: sharding '", m_.sharding, "' (none, optimizer, gradients or full)");
    full_ = m_.finetune == "full";
    L_ = static_cast<int>(model.num_layers());
    const int64_t T = (m_.seq_length + 7) / 8 * 8;  // data::collate pads to a multiple of 8
    shape_ = {m_.micro_batch, T, full_ ? kF32 : m_.dense_bytes, m_.compute_bytes, m_.fused_cpu_attention, m_.threads,
              m_.cuda_kernels, m_.adapter_bytes};
    E_ = shape_.rows();
    const int64_t samples =
        m_.samples_per_step > 0 ? m_.samples_per_step : m_.micro_batch * std::max<int64_t>(1, m_.accumulation_steps);
    accumulating_ = (samples + m_.micro_batch - 1) / m_.micro_batch > 1;
    act_ = shape_.act_bytes;  // the residual stream's dtype: the embedding's

    // How each projection is trained, and which tensors are trained whole.
    const auto& slots = model.tensors();
    auto flag = [&](const std::vector<bool>& v, size_t k, const char* what) {
      MEMTUNE_INTERNAL_ASSERT(v.empty() || v.size() == slots.size(), "estimate: ", v.size(), " ", what,
                              " flags for ", slots.size(), " tensors");
      return !v.empty() && v[k];
    };
    layer_trains_.assign(static_cast<size_t>(L_), false);
    for (size_t k = 0; k < slots.size(); ++k) {
      const TensorSlot& t = slots[k];
      const bool whole = full_ || flag(m_.trained, k, "trained");
      const bool adapted = !full_ && flag(m_.adapted, k, "adapter");
      if (t.role == TensorRole::kLinearWeight) {
        models::LinearTraining lt;
        lt.full = full_;
        MEMTUNE_INTERNAL_ASSERT(m_.lora_ranks.empty() || m_.lora_ranks.size() == slots.size(), "estimate: ",
                                m_.lora_ranks.size(), " LoRA ranks for ", slots.size(), " tensors");
        lt.lora_r = !adapted ? 0 : m_.lora_ranks.empty() ? m_.lora_r : m_.lora_ranks[k];
        lt.lora_dropout = adapted ? m_.lora_dropout : 0.0;
        lt.dora = adapted && m_.lora_dora;
        const bool dense = flag(m_.dense_projections, k, "dense projection");
        lt.nf4 = m_.load_in_4bit && !full_ && !dense;
        lt.int8 = m_.load_in_8bit && !full_ && !dense;
        // fp32 activations with 16-bit adapter products: the fp32 model under autocast.
        lt.lora_casts_input = adapted && m_.dense_bytes == kF32 && m_.adapter_bytes != kF32;
        training_[t.linear] = lt;
      }
      if (t.layer >= 0 && (whole || adapted)) layer_trains_[t.layer] = true;
      if (!whole) continue;
      trained_.push_back(&t);
      embedding_trained_ |= t.role == TensorRole::kEmbedding || t.role == TensorRole::kPositionEmbedding;
      head_trained_ |= t.role == TensorRole::kHead || (t.role == TensorRole::kEmbedding && tied());
      final_norm_trained_ |= t.role == TensorRole::kNorm && t.layer < 0;
    }
    // A layer's input needs a gradient when something below it (or the embedding) trains.
    input_grad_.assign(static_cast<size_t>(L_) + 1, embedding_trained_);
    for (int i = 1; i <= L_; ++i) input_grad_[i] = input_grad_[i - 1] || layer_trains_[i - 1];
    layers_.reserve(static_cast<size_t>(L_));
    for (int i = 0; i < L_; ++i) {
      models::LayerPlan plan;
      plan.input_grad = input_grad(i);
      plan.training = [this](const models::Linear& l) { return training_.at(&l); };
      layers_.push_back(model.layer_memory(i, shape_, plan));
    }
  }

  bool tied() const { return m_.model->spec().tie_word_embeddings; }
  bool checkpointed(int layer) const {
    return shard_layers() || offloaded(layer) ||
           (layer < static_cast<int>(m_.checkpoint_layers.size()) && m_.checkpoint_layers[layer]);
  }
  bool offloaded(int layer) const {
    return layer >= 0 && layer < static_cast<int>(m_.offloaded_layers.size()) && m_.offloaded_layers[layer];
  }
  // distributed.sharding: full over several ranks (trainer/layer_shards.h): each rank keeps
  // 1/W of the layers' weights (frozen and trainable), gathers a layer around its forward,
  // checkpoints all.
  bool shard_layers() const { return m_.world_size > 1 && m_.sharding == "full"; }
  // Layers gathered at once: the one running, and with prefetch the next one's gather.
  int64_t gathered_copies() const { return m_.prefetch && L_ > 1 ? 2 : 1; }
  // Layer `layer`'s input (the final norm's at num_layers) requires grad.
  bool input_grad(int layer) const { return input_grad_[layer]; }
  // What a checkpointed layer keeps: its input, when a gradient is wanted through it and it
  // is not in host memory.
  int64_t checkpoint_input(int i) const {
    return (input_grad(i) || layer_trains_[i]) ? E_ * m_.model->spec().hidden_size * act_ : 0;
  }

  Estimate run() const {
    Estimate e;
    const models::CausalLM& model = *m_.model;
    const int64_t C = model.spec().hidden_size, V = model.spec().vocab_size, E = E_;
    const int64_t wb = full_ ? kF32 : m_.dense_bytes;
    const bool nf4 = m_.load_in_4bit && !full_;

    // Weights, tensor by tensor.
    int64_t layers_nf4 = 0, layers_dense = 0, largest = 0;
    std::vector<int64_t> offloaded_bytes(static_cast<size_t>(L_), 0);
    for (const TensorSlot& t : model.tensors()) {
      const int64_t n = numel(t);
      largest = std::max(largest, n);
      const bool quantized =
          t.role == TensorRole::kLinearWeight && (training_.at(t.linear).nf4 || training_.at(t.linear).int8);
      const int64_t bytes = !quantized ? n * wb
                            : nf4      ? nf4_storage_bytes(n, m_.blocksize, m_.double_quant)
                                       : int8_storage_bytes(t.linear->out_features(), t.linear->in_features());
      if (offloaded(t.layer)) {
        offloaded_bytes[t.layer] += bytes;
        continue;
      }
      (quantized ? e.weights_quantized : e.weights_dense) += bytes;
      if (t.layer >= 0) (quantized ? layers_nf4 : layers_dense) += bytes;
    }
    e.weights_layers = layers_nf4 + layers_dense;
    for (int64_t b : offloaded_bytes) {
      e.weights_offloaded += b;
      e.fetched_layer = std::max(e.fetched_layer, b);
    }
    // Sharded layers: this rank's 1/W (the whole-tensor partition is within a tensor of it),
    // and one whole layer while it is gathered (forward, and its rerun in backward).
    int64_t gathered = 0;
    if (shard_layers()) {
      const int64_t W = m_.world_size;
      e.layers_sharded_from = e.weights_layers;
      e.weights_quantized = (layers_nf4 + W - 1) / W + (e.weights_quantized - layers_nf4);
      e.weights_dense = (layers_dense + W - 1) / W + (e.weights_dense - layers_dense);
      e.gathered_layer = (e.weights_layers + L_ - 1) / L_;
      gathered = e.gathered_layer * gathered_copies();
    }
    // An offloaded layer's weights come to the device for its forward and again for its
    // rerun and backward (a sharded layer is never offloaded).
    gathered = std::max(gathered, e.fetched_layer);

    // Trainable tensors, their gradients and the optimizer's states, tensor by tensor (8-bit
    // states depend on each tensor's size).
    int64_t trainable = 0, largest_trainable = 0, largest_states = 0, square_sum_scratch = 0;
    std::vector<int64_t> layer_trainable(static_cast<size_t>(L_), 0), layer_largest(static_cast<size_t>(L_), 0);
    int64_t outside_trainable = 0;  // trained outside the layers, but the embeddings: final norm, head
    int64_t embedding_trainable = 0;
    auto train = [&](const std::vector<int64_t>& shape, int layer, bool embedding) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      trainable += n;
      largest_trainable = std::max(largest_trainable, n);
      square_sum_scratch += square_sum_cuda_scratch(n);
      e.optimizer_states += optimizer_state_bytes(m_.optimizer, m_.optimizer_paged, shape, m_.sgd_momentum);
      largest_states = std::max(largest_states, optimizer_state_bytes(m_.optimizer, false, shape, m_.sgd_momentum));
      if (layer >= 0) {
        layer_trainable[layer] += n;
        layer_largest[layer] = std::max(layer_largest[layer], n);
      } else if (!embedding) {
        outside_trainable += n;
      } else {
        embedding_trainable += n;
      }
    };
    for (const TensorSlot& s : model.tensors()) {
      if (s.role != TensorRole::kLinearWeight) continue;
      const models::LinearTraining& t = training_.at(s.linear);
      if (t.lora_r == 0) continue;
      train({t.lora_r, s.linear->in_features()}, s.layer, false);   // A
      train({s.linear->out_features(), t.lora_r}, s.layer, false);  // B
      if (t.dora) train({s.linear->out_features()}, s.layer, false);  // DoRA's magnitude
    }
    e.lora_parameters = trainable * kF32;
    if (shard_layers()) {  // the layers' adapters sharded with their layers, gathered with them
      e.lora_parameters = (e.lora_parameters + m_.world_size - 1) / m_.world_size;
      e.gathered_layer += (trainable * kF32 + L_ - 1) / L_;
      gathered = e.gathered_layer * gathered_copies();
    }
    for (const TensorSlot* t : trained_)
      train(t->shape, t->layer, t->role == TensorRole::kEmbedding || t->role == TensorRole::kPositionEmbedding);
    e.trainable_parameters = trainable;
    e.gradients = trainable * kF32;
    // Adafactor keeps a workspace on every device (in host memory with offloaded states); torch's
    // AdamW none: its fused kernels, the CPU's and a GPU's multi-tensor one, update in place
    // (trainer/optimizer.cpp).
    const bool has_workspace = m_.optimizer == "adafactor";
    e.optimizer_workspace = has_workspace && !m_.optimizer_paged ? largest_trainable * kF32 : 0;
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
    // Gradients in host memory as backward produces them (trainer/gradient_offload.h).
    const bool grads_off = m_.gradients_offloaded && gradients_can_leave(m_.world_size, m_.cpu_update);
    // Paged states stream through two device slots where the gradients stay on the device,
    // each the largest tensor's states at 256-byte boundaries (four arrays at most), or
    // kPagedSlotBytes when those are larger (a tensor then passes in runs).
    const bool streamed = m_.optimizer_streamed && !grads_off;
    if (streamed)
      e.optimizer_workspace = 2 * std::min(largest_states + 4 * 256, kPagedSlotBytes);
    // Unsharded gradients are all-reduced through flat buffers as large as they are, kept from
    // the first step on (ProcessGroup::allreduce_sum); in host memory when they are.
    e.allreduce_buffers = W > 1 && !shard_grads && !grads_off ? e.gradients : 0;
    const int64_t persistent = e.weights_quantized + e.weights_dense + e.lora_parameters + e.optimizer_states +
                               e.optimizer_workspace + e.sharding_buffer + e.allreduce_buffers;

    // Activations kept for backward.
    const models::StackMemory stack = model.stack_memory(shape_);
    const int64_t batch = 4 * E * kI64;  // input_ids, targets, positions, segments
    int64_t kept = 0;
    for (int i = 0; i < L_; ++i) {
      const int64_t s = checkpointed(i) ? (m_.offload_activations ? 0 : checkpoint_input(i)) : layers_[i].kept;
      e.activations_per_layer.push_back(s);
      kept += s;
      e.layers_stated = e.layers_stated && layers_[i].stated;
    }
    // The final norm keeps the last layer's output and its statistics when a gradient is wanted through it.
    const bool g_last = final_norm_trained_ || input_grad(L_);
    const int64_t final_norm = g_last ? stack.final_norm : 0;
    e.activations = kept + final_norm + batch + stack.context;

    // Loss (models/layers/cross_entropy.cpp): gradients are formed in the forward. Alive at
    // once: the normed hidden (E,C), its N trained rows, their gradient in the products' dtype,
    // the head in that dtype (a copy where it is stored in another), a chunk of logits and the
    // chunk's hidden rows in that dtype; at the end the full (E,C) gradient in the hidden's
    // dtype, kept for backward (and dW (V,C) fp32 when the head is trained).
    // In fp32 products: the chunk's fp32 logits (softmaxed in place) and a chunk of gathered
    // head rows. In bf16 products on CUDA: the bf16 logits alone, overwritten by d logits (one
    // kernel, models/layers/cuda/cross_entropy_cuda_kernels.h, which label smoothing does not
    // take); elsewhere beside their fp32 copy, then that beside the bf16 d logits (6 bytes per
    // logit at the peak), and the chunk's hidden also in fp32 where dW is summed on the CPU.
    const int64_t N = m_.max_sample_targets > 0 ? std::min(E, m_.micro_batch * m_.max_sample_targets) : E;
    const int64_t chunk = std::min(N, m_.loss_chunk_rows > 0 ? m_.loss_chunk_rows : models::loss_chunk_rows(V));
    const int64_t mm = m_.loss_bf16 ? kBf16 : kF32;  // the products' dtype
    const bool cast = act_ != mm;                    // the head and hidden are stored in another dtype
    const int64_t hidden = E * C * act_;
    const int64_t head_grad = head_trained_ ? V * C * kF32 : 0;
    const int64_t rows = N * C * act_, d_rows = N * C * mm, head_copy = cast ? V * C * mm : 0;
    const int64_t h_chunk = (cast ? chunk * C * mm : 0) + (m_.loss_bf16 && head_trained_ && !m_.cuda_kernels ? chunk * C * kF32 : 0);
    // Soft-capped logits (final_logit_softcapping) keep their tanh beside them, and form the
    // whole d logits before the products, taken through the cap in place: in fp32 that and
    // the tanh; in bf16 the fp32 d logits, the bf16 tanh and their bf16 rounding.
    const int64_t logits = m_.logit_softcap ? (m_.loss_bf16 ? chunk * V * (kF32 + 2 * kBf16) : chunk * V * kF32 * 2)
                           : !m_.loss_bf16 ? chunk * V * kF32 + chunk * C * kF32
                           : m_.cuda_kernels && !m_.label_smoothing ? chunk * V * kBf16
                                                                    : chunk * V * (kBf16 + kF32);
    const int64_t dh = E * C * act_;
    const int64_t loss_chunk = hidden + rows + d_rows + head_copy + logits + h_chunk + head_grad;
    const int64_t loss_end = hidden + rows + d_rows + head_copy + (cast ? E * C * mm : 0) + dh + head_grad;
    e.loss = std::max(loss_chunk, loss_end);
    e.after_forward = e.activations + dh + head_grad;

    // Forward: each layer on top of what the layers below keep, then the loss.
    int64_t below = batch + stack.context, fwd = 0;
    for (int i = 0; i < L_; ++i) {
      const int64_t input = input_grad(i) ? 0 : E * C * act_;  // the embedding's output, not kept
      fwd = std::max(fwd, below + (checkpointed(i) ? layers_[i].forward_no_grad : layers_[i].forward + input));
      below += e.activations_per_layer[i];
    }
    fwd = std::max(fwd, e.activations + e.loss);
    // Gradients were dropped before the step (zero_grad); after the step's first
    // micro-batch every one of them is held while the next ones run.
    // ZeRO-2 (trainer/sharding.h Sharding::backward): each bucket is reduced to its owner as
    // backward completes it, so a rank holds the sums of its own tensors and the gradients
    // not reduced yet (a bucket's worth, and the tensor that completes it), never all.
    const bool reduced_in_backward = shard_grads && !grads_off;
    const int64_t in_flight_cap = std::min(e.gradients, m_.bucket_bytes + largest_trainable * kF32);
    auto holding = [&](int64_t produced) {  // gradients alive once backward produced `produced` bytes of them
      return reduced_in_backward ? e.gradients_after_reduce + std::min(produced, in_flight_cap) : produced;
    };
    const int64_t held = accumulating_ && !grads_off ? (reduced_in_backward ? e.gradients_after_reduce : e.gradients) : 0;
    e.forward_peak = persistent + fwd + gathered + held;

    // Backward: the loss node (its saved gradients, scaled by the loss's gradient in place),
    // then from the top layer down: a checkpointed layer is first rebuilt with
    // autograd, then its backward runs with the layers below kept and the gradient flowing
    // in. Gradients appear as their layer finishes: at layer i those of the final norm and
    // head and of layers >= i. The embedding's gradient comes last.
    int64_t bwd = held + e.activations + dh + head_grad;  // scaled in place (models/layers/cross_entropy.cpp)
    int64_t recompute = 0, workspace = 0;
    // The final norm's and the head's; tied, the head's waits in autograd's input buffer for
    // the embedding's, unless offload hands it to the host at once (GradientOffload::tap).
    int64_t grads = (grads_off ? 0 : outside_trainable * kF32) + (tied() && !grads_off ? head_grad : 0);
    below = batch + stack.context + kept;
    const int64_t grad_in = E * C * kF32;
    // Offloaded on a device that copies asynchronously, the next checkpointed layer's input
    // (the highest below) comes back while the checkpointed layer above it runs its backward,
    // and waits on the device until its own (runtime/offload.h, OffloadedTensor::prefetch).
    auto prefetched_below = [&](int i) -> int64_t {
      if (!m_.offload_activations || !m_.prefetch_activations) return 0;
      for (int j = i - 1; j >= 0; --j)
        if (checkpointed(j)) return checkpoint_input(j);
      return 0;
    };
    bool checkpointed_above = false;  // a checkpointed layer at or above the current one
    for (int i = L_ - 1; i >= 0; --i) {
      below -= e.activations_per_layer[i];
      const models::LayerMemory& l = layers_[i];
      int64_t worst = l.backward;
      checkpointed_above = checkpointed_above || checkpointed(i);
      const int64_t prefetched = checkpointed_above ? prefetched_below(i) : 0;
      if (checkpointed(i)) {
        // Offloaded, the input comes back to the device for the recomputation; the rebuilt
        // layer's output stays alive through the layer's backward
        // (runtime/activation_checkpoint.cpp).
        const int64_t fetched = m_.offload_activations ? checkpoint_input(i) : 0;
        const int64_t output = E * C * act_;
        recompute = std::max(recompute, l.kept + fetched + prefetched + output);
        worst = std::max(worst + fetched + output, l.forward + fetched + (input_grad(i) ? 0 : E * C * act_));
      }
      worst += prefetched;
      workspace = std::max(workspace, l.workspace);
      // The layer's gradients form as its backward runs: the first micro-batch's become the
      // gradients (its own counted whole); a later one's each wait, one tensor at a time, to be
      // added to the held sums. Offloaded, they stay only until their accumulators take them.
      const int64_t own = layer_trainable[i] * kF32;
      const int64_t forming = grads_off ? own : std::max(holding(grads + own), held + layer_largest[i] * kF32);
      bwd = std::max(bwd, forming + below + grad_in + worst);
      if (!grads_off) grads += layer_trainable[i] * kF32;
    }
    // The embedding's backward: a dense (V,C) gradient. Tied to a trained head, the tensor's
    // two gradients meet in autograd's input buffer before its accumulator runs: the head's,
    // waiting since the loss's backward, the embedding's and, under LibTorch 1.13, their sum
    // in a third tensor, all (V,C) fp32 (measured: GPT-2 124M's backward with gradient
    // offload before the tap, 475 MiB of weights + 3 x 147). LibTorch 2.x adds the late one
    // into the waiting one in place: one (V,C) less (tests/trainer/gradient_offload_test.cpp
    // measures both). Offloaded, the head's went to the host and the sum is formed there.
    constexpr int64_t kTiedSumTensors = MEMTUNE_TORCH_AT_LEAST(2, 0) ? 1 : 2;
    const int64_t embedding_grads = grads_off ? embedding_trainable * kF32  // offloaded: its own only
                                    : reduced_in_backward ? holding(embedding_trainable * kF32 + m_.bucket_bytes)
                                                          : e.gradients;
    if (embedding_trained_)
      bwd = std::max(bwd, embedding_grads + batch + grad_in +
                              (tied() && head_trained_ && !grads_off ? kTiedSumTensors * V * C * kF32 : 0));
    e.recompute = recompute;
    e.workspace = workspace;
    e.backward_peak = persistent + bwd + gathered;

    // Optimizer: the gradient norm sums in place on the CPU; on a GPU it keeps one double per
    // 4096 elements of each gradient it holds until it adds them (trainer/optimizer.cpp
    // grad_square_sum; a rank of sharded gradients holds 1/W of them).
    const int64_t norm_scratch = m_.cpu_update ? 0 : shard_grads ? (square_sum_scratch + W - 1) / W : square_sum_scratch;
    e.optimizer_peak = persistent + (grads_off ? 0 : e.gradients_after_reduce + norm_scratch);
    e.peak_bytes = std::max({e.forward_peak, e.backward_peak, e.optimizer_peak});

    auto add = [&](std::string name, int64_t bytes, std::string note) {
      e.components.push_back({std::move(name), bytes, std::move(note)});
    };
    if (e.weights_quantized && m_.load_in_8bit)
      add("weights: LLM.int8", e.weights_quantized, "projections: int8 codes and an fp32 absmax per row");
    else if (e.weights_quantized)
      add(str_cat("weights: ", quant_type_label(m_.quant_type)), e.weights_quantized,
          str_cat("projections, blocksize ", m_.blocksize, m_.double_quant ? ", double quant" : ""));
    add("weights: dense", e.weights_dense, str_cat(wb, " bytes per element"));
    if (e.fetched_layer)
      add("weights: offloaded layer", e.fetched_layer,
          str_cat("the largest offloaded layer, fetched while it runs; the offloaded layers' ",
                  format_bytes(e.weights_offloaded), " wait in host memory (model.device_map)"));
    if (e.gathered_layer)
      add("weights: gathered layer", e.gathered_layer,
          str_cat("one whole layer while it runs, in forward and in backward; the layers' weights above are 1/",
                  m_.world_size, " of ", format_bytes(e.layers_sharded_from), " (distributed.sharding: full)"));
    if (e.lora_parameters) {
      // The ranks rank_pattern gives, as a range.
      int64_t lo = m_.lora_ranks.empty() ? m_.lora_r : INT64_MAX, hi = m_.lora_ranks.empty() ? m_.lora_r : 0;
      for (int64_t r : m_.lora_ranks)
        if (r > 0) lo = std::min(lo, r), hi = std::max(hi, r);
      add("LoRA parameters", e.lora_parameters,
          str_cat("r=", lo == hi ? std::to_string(lo) : str_cat(lo, "..", hi), ", fp32"));
    }
    add("gradients", e.gradients,
        str_cat(trainable, " trainable parameters, fp32",
                grads_off ? "; in host memory as backward produces them (memory.optimizer_offload: cpu)" : ""));
    std::string states_how = m_.optimizer == "sgd"           ? (m_.sgd_momentum ? "sgd: momentum buffer" : "sgd without momentum: none")
                      : m_.optimizer == "adamw_8bit"  ? "adamw 8-bit: uint8 codes + absmax per 256 (fp32 under 4096 elements)"
                      : m_.optimizer == "adamw_32bit" ? "adamw (bitsandbytes 32-bit): exp_avg, exp_avg_sq"
                      : m_.optimizer == "adafactor"   ? "adafactor: a matrix's second moment per row and per column"
                                                      : "adamw: exp_avg, exp_avg_sq";
    if (m_.optimizer_paged)
      states_how = streamed ? "paged: in host memory, passing through the optimizer workspace"
                                         : "paged: in host memory, none on the device";
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
    if (e.allreduce_buffers)
      add("all-reduce buffers", e.allreduce_buffers, "the gradients' flat copies, kept between steps");
    if (e.optimizer_workspace)
      add("optimizer workspace", e.optimizer_workspace,
          streamed ? "two slots of the largest tensor's paged states, double-buffered"
                                : "the largest trainable tensor, fp32");
    // Runs of layers that keep the same bytes the same way are one line.
    const std::string bound =
        e.layers_stated ? "" : str_cat(" (a bound: ", model.spec().architecture, " states no layer accounting)");
    for (int i = 0; i < L_;) {
      int j = i;
      while (j + 1 < L_ && e.activations_per_layer[j + 1] == e.activations_per_layer[i] &&
             checkpointed(j + 1) == checkpointed(i) && offloaded(j + 1) == offloaded(i))
        ++j;
      const std::string how = (offloaded(i) ? "offloaded (model.device_map), " : "") +
                              std::string(!checkpointed(i)            ? "kept for backward"
                                          : m_.offload_activations ? "checkpointed, its input in host memory"
                                                                   : "checkpointed: its input") +
                              bound;
      if (j == i)
        add(str_cat("activations: layer ", i), e.activations_per_layer[i], how);
      else
        add(str_cat("activations: layers ", i, "-", j), e.activations_per_layer[i] * (j - i + 1),
            str_cat(format_bytes(e.activations_per_layer[i]), " each, ", how));
      i = j + 1;
    }
    add("activations: outside the layers", final_norm + stack.context + batch,
        "the final norm, the layer context (rotary tables), the batch");
    add("logits and loss", e.loss,
        str_cat("chunks of ", chunk, " rows x ", V, " fp32 logits",
                m_.logit_softcap ? " and their tanh (soft-capped)" : "",
                N < E ? str_cat(", ", N, " trained rows (at most ", m_.max_sample_targets, " per sample)") : ""));
    add("recompute (checkpointed layer)", e.recompute, "one layer rebuilt in backward");
    add("workspace (layer backward)", e.workspace, "temporaries of one layer's backward");
    return e;
  }

 private:
  const EstimateInput& m_;
  bool full_ = false;
  int L_ = 0;
  models::StepShape shape_;
  int64_t E_ = 0, act_ = 4;
  bool accumulating_ = false;  // several micro-batches per step: the gradients outlive each
  std::unordered_map<const models::Linear*, models::LinearTraining> training_;
  std::vector<const TensorSlot*> trained_;  // tensors trained whole
  std::vector<bool> layer_trains_;          // per layer: something in it is trained
  std::vector<bool> input_grad_;            // per layer and the final norm: its input needs a gradient
  bool embedding_trained_ = false;          // the token or position embedding
  bool head_trained_ = false;
  bool final_norm_trained_ = false;
  std::vector<models::LayerMemory> layers_;
};

}  // namespace

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
  const int64_t top = std::max<int64_t>(8, in.model->spec().max_position_embeddings / 8 * 8);
  if (!fits(8)) return 0;
  int64_t lo = 1, hi = top / 8 + 1;  // in units of 8 tokens; lo fits, hi does not
  if (fits(top)) return top;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid * 8) ? lo : hi) = mid;
  }
  return lo * 8;
}

}  // namespace memtune::trainer
