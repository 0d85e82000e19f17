#include "models/causal_lm.h"

#include <cmath>
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "data/batch.h"
#include "models/layers/attention.h"
#include "models/layers/cross_entropy.h"
#include "models/layers/linear4bit.h"
#include "models/layers/lora_linear.h"
#include "models/layers/norm_act.h"
#include "models/layers/projection_memory.h"
#include "runtime/activation_checkpoint.h"
#include "runtime/error.h"
#include "runtime/keyed_dropout.h"
#include "runtime/nf4.h"
#include "runtime/offload.h"
#include "runtime/step_profiler.h"

namespace memtune::models {

void CausalLM::add_tensor(std::string name, std::vector<int64_t> shape, TensorRole role,
                          at::Tensor* tensor, int layer) {
  slots_.push_back({std::move(name), std::move(shape), role, tensor, nullptr, layer});
}

Linear& CausalLM::add_linear(std::unique_ptr<Linear> linear, int layer) {
  Linear& l = *linear;
  std::vector<int64_t> shape = l.fan_in_fan_out() ? std::vector<int64_t>{l.in_features(), l.out_features()}
                                                  : std::vector<int64_t>{l.out_features(), l.in_features()};
  slots_.push_back({l.name() + ".weight", shape, TensorRole::kLinearWeight, &l.weight, &l, layer});
  if (l.has_bias())
    slots_.push_back({l.name() + ".bias", {l.out_features()}, TensorRole::kLinearBias, &l.bias, &l, layer});
  linears_.push_back(std::move(linear));
  return l;
}

const TensorSlot* CausalLM::find_tensor(const std::string& name) const {
  for (const auto& s : slots_)
    if (s.name == name) return &s;
  return nullptr;
}

std::vector<Linear*> CausalLM::linears() const {
  std::vector<Linear*> out;
  for (const auto& l : linears_) out.push_back(l.get());
  return out;
}

Linear* CausalLM::find_linear(const std::string& module_name) const {
  for (const auto& l : linears_)
    if (l->name() == module_name) return l.get();
  return nullptr;
}

std::vector<Linear*> CausalLM::layer_linears(int layer) const {
  std::vector<Linear*> out;
  for (const auto& s : slots_)
    if (s.layer == layer && s.role == TensorRole::kLinearWeight) out.push_back(s.linear);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> CausalLM::trainable_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& s : slots_)
    if (s.tensor->defined() && s.tensor->requires_grad()) out.emplace_back(s.name, *s.tensor);
  for (const auto& l : linears_)
    if (l->lora) {
      out.emplace_back(l->name() + ".lora_A.weight", l->lora->A);
      out.emplace_back(l->name() + ".lora_B.weight", l->lora->B);
      if (l->lora->dora()) out.emplace_back(l->name() + ".lora_magnitude_vector", l->lora->magnitude);
    }
  return out;
}

std::vector<at::Tensor> CausalLM::layer_trainable(int layer) const {
  std::vector<at::Tensor> out;
  for (const auto& s : slots_) {
    if (s.layer != layer) continue;
    if (s.tensor->defined() && s.tensor->requires_grad()) out.push_back(*s.tensor);
    if (s.role == TensorRole::kLinearWeight && s.linear->lora) {
      out.push_back(s.linear->lora->A);
      out.push_back(s.linear->lora->B);
      if (s.linear->lora->dora()) out.push_back(s.linear->lora->magnitude);
    }
  }
  return out;
}

int64_t CausalLM::base_parameter_count() const {
  int64_t n = 0;
  for (const auto& s : slots_) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  return n;
}

int64_t CausalLM::base_storage_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : slots_) {
    if (s.role == TensorRole::kLinearWeight || s.role == TensorRole::kLinearBias) continue;
    if (s.tensor->defined()) bytes += s.tensor->numel() * static_cast<int64_t>(s.tensor->element_size());
  }
  for (const auto& l : linears_) bytes += l->base_storage_bytes();
  return bytes;
}

void CausalLM::init_random(uint64_t seed) {
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (auto& s : slots_) {
    MEMTUNE_CHECK(!(s.linear && s.linear->quantized()), "init_random: ", s.name,
                  " is quantized; initialise before quantizing");
    at::Tensor& t = *s.tensor;
    t = at::empty(s.shape, at::kFloat);
    const bool is_bias = s.name.size() > 5 && s.name.compare(s.name.size() - 5, 5, ".bias") == 0;
    if (s.role == TensorRole::kNorm)
      t.fill_(is_bias ? 0.0 : initial_norm_weight());
    else if (s.role == TensorRole::kLinearBias)
      t.zero_();
    else
      t.normal_(0.0, 0.02, gen);
  }
}

void CausalLM::set_dense_dtype(at::ScalarType dtype) {
  MEMTUNE_CHECK(layer_source_ == nullptr && std::find(offloaded_.begin(), offloaded_.end(), true) == offloaded_.end(),
                "set_dense_dtype: cast before layers are offloaded or sharded (their tensors live in their buffers)");
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    at::Tensor& t = *s.tensor;
    if (!t.defined() || t.scalar_type() == dtype || !t.is_floating_point()) continue;  // not 8-bit codes
    MEMTUNE_CHECK(!t.requires_grad(), "set_dense_dtype: ", s.name, " is trainable; cast before training is set up");
    t = t.to(dtype);
  }
}

void CausalLM::set_compute_dtype(at::ScalarType dtype, bool autocast) {
  compute_dtype_ = dtype;
  autocast_ = autocast;
  for (auto& l : linears_) {
    l->compute_dtype = dtype;
    l->autocast = autocast;
  }
}

namespace {

NF4Tensor map_nf4(const NF4Tensor& q, const std::function<at::Tensor(const at::Tensor&)>& f) {
  NF4Tensor out = q;
  out.packed = f(q.packed);
  out.absmax = f(q.absmax);
  out.nested_absmax = f(q.nested_absmax);
  out.nested_quant_map = f(q.nested_quant_map);
  return out;
}

// Fetches an offloaded layer's weights for the duration of its forward.
class LayerFetch {
 public:
  LayerFetch(std::vector<TensorSlot>& slots, int layer, const c10::Device& device) {
    auto fetch = [&](const at::Tensor& t) { return fetch_from_offload(t, device); };
    for (auto& s : slots) {
      if (s.layer != layer) continue;
      if (s.role == TensorRole::kLinearWeight && s.linear->quantized()) {
        quantized_.emplace_back(s.linear, s.linear->qweight());
        s.linear->set_quantized(std::make_shared<NF4Tensor>(map_nf4(*s.linear->qweight(), fetch)));
      } else if (s.tensor->defined()) {
        dense_.emplace_back(s.tensor, *s.tensor);
        *s.tensor = fetch(*s.tensor);
      }
    }
  }
  ~LayerFetch() {
    for (auto& [linear, q] : quantized_) linear->set_quantized(q);
    for (auto& [slot, t] : dense_) *slot = t;
  }

 private:
  std::vector<std::pair<Linear*, std::shared_ptr<const NF4Tensor>>> quantized_;
  std::vector<std::pair<at::Tensor*, at::Tensor>> dense_;
};

// A sharded layer's weights gathered for the duration of its forward.
class LayerGathered {
 public:
  LayerGathered(LayerSource& source, int layer) : source_(source), layer_(layer) { source_.gather(layer_); }
  ~LayerGathered() { source_.release(layer_); }
  LayerGathered(const LayerGathered&) = delete;
  LayerGathered& operator=(const LayerGathered&) = delete;

 private:
  LayerSource& source_;
  int layer_;
};

}  // namespace

void CausalLM::set_offloaded(int layer, bool off) {
  if (offloaded_.size() < static_cast<size_t>(spec_.num_layers)) offloaded_.resize(spec_.num_layers, false);
  if (offloaded_[layer] == off) return;
  MEMTUNE_CHECK(!off || !sharded(layer), "offload: layer ", layer,
                " is sharded over the ranks (distributed.sharding: full), each keeping 1/W of it; it is not "
                "offloaded. Hint: drop the offload from model.device_map");
  const c10::Device device = layer_device(layer);
  auto move = [&](const at::Tensor& t) { return off ? to_offload_storage(t) : fetch_from_offload(t, device); };
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    if (s.layer != layer) continue;
    if (s.role == TensorRole::kLinearWeight && s.linear->quantized())
      s.linear->set_quantized(std::make_shared<NF4Tensor>(map_nf4(*s.linear->qweight(), move)));
    else if (s.tensor->defined()) {
      const bool trainable = s.tensor->requires_grad();
      MEMTUNE_CHECK(!trainable, "offload: ", s.name, " is trainable; only frozen base weights can be offloaded");
      *s.tensor = move(*s.tensor);
    }
  }
  offloaded_[layer] = off;
}

void CausalLM::place(const Placement& placement) {
  MEMTUNE_CHECK(static_cast<int64_t>(placement.layers.size()) == spec_.num_layers, "place: ",
                placement.layers.size(), " layer devices for ", spec_.num_layers, " layers");
  MEMTUNE_CHECK(!spec_.tie_word_embeddings || placement.head == placement.embeddings,
                "place: the head is tied to the embeddings and must share their device");
  at::NoGradGuard no_grad;
  // A new tensor on the device; a trainable one stays a leaf that requires grad.
  auto move = [](at::Tensor& t, const c10::Device& d) {
    if (!t.defined() || t.device() == d) return;
    const bool trainable = t.requires_grad();
    t = t.detach().to(d);
    if (trainable) t.requires_grad_(true);
  };
  for (auto& s : slots_) {
    const c10::Device d = s.layer >= 0 ? placement.layers[s.layer]
                          : (s.role == TensorRole::kHead || s.role == TensorRole::kNorm) ? placement.head
                                                                                         : placement.embeddings;
    // A sharded layer's tensors, trainable ones included, live in its source's buffers on the
    // group's device (trainer/layer_shards.h).
    if (s.layer >= 0 && sharded(s.layer)) continue;
    if (s.role == TensorRole::kLinearWeight && s.linear->lora) {
      move(s.linear->lora->A, d);
      move(s.linear->lora->B, d);
      if (s.linear->lora->dora()) move(s.linear->lora->magnitude, d);
    }
    // An 8-bit weight's row absmax (4 bytes a row) stays on its layer's device, offloaded or not.
    if (s.role == TensorRole::kLinearWeight && s.linear->int8()) move(s.linear->weight_absmax, d);
    if (s.layer >= 0 && offloaded(s.layer)) continue;  // fetched to its layer's device when it runs
    if (s.role == TensorRole::kLinearWeight && s.linear->quantized()) {
      if (s.linear->qweight()->packed.device() != d)
        s.linear->set_quantized(std::make_shared<NF4Tensor>(
            map_nf4(*s.linear->qweight(), [&](const at::Tensor& t) { return t.defined() ? t.to(d) : t; })));
    } else {
      move(*s.tensor, d);
    }
  }
  placement_ = placement;
}

LayerMemory CausalLM::layer_memory(int index, const StepShape& s, const LayerPlan& plan) const {
  const int64_t E = s.rows(), C = spec_.hidden_size, a = s.act_bytes;
  LayerMemory m;
  m.stated = false;
  int64_t widest = C;
  ProjectionTally tally;  // adapters' kept tensors and the largest transient weight
  for (const Linear* l : layer_linears(index)) {
    m.kept += E * (l->in_features() + l->out_features()) * a + tally.add(*l, plan.training(*l), s);
    widest = std::max({widest, l->in_features(), l->out_features()});
  }
  const int64_t panel = tally.panel;
  const AttentionMemory at = attention_memory(s.batch, spec_.num_heads, spec_.num_kv_heads, s.tokens, spec_.head_dim, a,
                                              s.fused_cpu_attention, s.threads);
  m.kept += at.kept + 2 * layer_norm_kept(E, C, a);
  m.forward = m.kept + at.forward_transient + 2 * E * widest * a + panel;
  m.forward_no_grad = m.forward;
  m.workspace = std::max(at.backward_transient, 4 * E * widest * 4) + panel;
  m.backward = m.kept + m.workspace;
  return m;
}

StackMemory CausalLM::stack_memory(const StepShape& s) const {
  return {0, layer_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};
}

int64_t CausalLM::layer_weight_bytes(int layer) const {
  int64_t bytes = 0;
  for (const auto& s : slots_) {
    if (s.layer != layer) continue;
    if (s.role == TensorRole::kLinearWeight && s.linear->quantized()) bytes += s.linear->qweight()->storage_bytes();
    else if (s.tensor->defined()) bytes += s.tensor->numel() * static_cast<int64_t>(s.tensor->element_size());
    if (s.role == TensorRole::kLinearWeight && s.linear->int8()) bytes += 4 * s.linear->out_features();  // absmax
  }
  return bytes;
}

at::Tensor layer_attention(const LayerContext& ctx, int layer, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, double scale, int64_t sliding_window, const AttentionOptions& options) {
  if (ctx.kv_cache) return ctx.kv_cache->attend(layer, q, k, v, ctx.segment_ids, scale, sliding_window, options);
  return causal_segment_attention(q, k, v, ctx.segment_ids, scale, sliding_window, options);
}

void CausalLM::set_attention_kernel(AttentionOptions::Kernel kernel) {
  MEMTUNE_CHECK(kernel != AttentionOptions::Kernel::kSdpa || !spec_.attn_logit_softcapping,
                "model.attn_implementation: sdpa cannot soft-cap attention scores, and ", spec_.architecture,
                "'s are capped (attn_logit_softcapping ", spec_.attn_logit_softcapping.value_or(0),
                "); transformers' own sdpa path drops the cap without a word and so computes another model. Hint: "
                "attn_implementation auto or eager (memtune's kernels cap, as transformers' eager attention)");
  attention_kernel_ = kernel;
}

ForwardOutput CausalLM::forward(const data::Batch& batch, const ForwardOptions& options) {
  // Keyed dropout: each row's masks follow the sample, whatever batch it is in.
  std::optional<DropoutKeysScope> dropout_keys;
  if (options.training && !batch.row_keys.empty()) {
    MEMTUNE_CHECK(batch.row_keys.size() == static_cast<size_t>(batch.rows()) &&
                      batch.row_lengths.size() == batch.row_keys.size(),
                  "forward: the batch has ", batch.rows(), " rows but ", batch.row_keys.size(), " dropout keys and ",
                  batch.row_lengths.size(), " row lengths");
    dropout_keys.emplace(DropoutKeys{batch.row_keys, batch.row_lengths});
  }
  // From the batch as given (the collator's host tensors: no device sync).
  const at::Tensor& seg = batch.segment_ids;
  const bool one_segment_per_row = seg.numel() > 0 &&
                                   (seg == seg.select(1, 0).unsqueeze(1)).all().item<bool>() &&
                                   (seg.select(1, 0) >= 0).all().item<bool>();
  // Packed rows' documents as runs, for attention by documents on GPUs: found once per
  // forward, the first time a device needs them (null: not runs).
  std::optional<std::shared_ptr<const std::vector<std::vector<int64_t>>>> runs;
  auto segment_runs = [&] {
    if (!runs) runs = segment_run_lengths(seg);
    return *runs;
  };
  // The batch and the layers' context on each device the model computes on.
  std::unordered_map<c10::Device, data::Batch> batches;
  std::unordered_map<c10::Device, LayerContext> contexts;
  auto batch_on = [&](const c10::Device& d) -> const data::Batch& {
    auto it = batches.find(d);
    if (it != batches.end()) return it->second;
    data::Batch b = batch;
    b.input_ids = batch.input_ids.to(d);
    b.targets = batch.targets.to(d);
    b.position_ids = batch.position_ids.to(d);
    b.segment_ids = batch.segment_ids.to(d);
    return batches.emplace(d, std::move(b)).first->second;
  };
  auto context_on = [&](const c10::Device& d) -> const LayerContext& {
    auto it = contexts.find(d);
    if (it != contexts.end()) return it->second;
    LayerContext ctx = layer_context(batch_on(d));
    ctx.training = options.training;
    ctx.kv_cache = options.kv_cache;
    ctx.attention.kernel = attention_kernel_;
    ctx.attention.one_segment_per_row = one_segment_per_row;
    ctx.attention.softcap = spec_.attn_logit_softcapping.value_or(0);
    if (!d.is_cpu() && !one_segment_per_row && seg.numel() > 0) {
      ctx.attention.segment_lengths = segment_runs();
      if (ctx.attention.segment_lengths)  // the gathers, on this device once for every layer
        ctx.attention.document_buckets = document_buckets(*ctx.attention.segment_lengths, seg.size(1), d);
    }
    return contexts.emplace(d, std::move(ctx)).first->second;
  };

  if (options.kv_cache)
    MEMTUNE_CHECK(!at::GradMode::is_enabled() && !options.training && one_segment_per_row,
                  "forward: a key/value cache serves generation: without grad, not training, one document per row");
  const data::Batch& first = batch_on(placement_.embeddings);
  at::Tensor x = [&] {
    MEMTUNE_PROFILE_SCOPE("memtune::embed");
    at::Tensor e = embed(first.input_ids, first.position_ids);  // (B,T,C)
    if (options.training && options.neftune_noise_alpha > 0) {
      // transformers' neftune_post_forward_hook: alpha / sqrt(T C) in float32 (torch may
      // divide as a reciprocal times alpha: a last-bit difference in the bound), on the input
      // embeddings (GPT-2's position embeddings are added to them first here: the same sum,
      // its rounding aside).
      const int64_t C = e.size(2);
      std::vector<double> bounds(static_cast<size_t>(e.size(0)));
      for (int64_t b = 0; b < e.size(0); ++b) {
        const int64_t T = batch.noise_lengths.empty() ? e.size(1) : batch.noise_lengths[static_cast<size_t>(b)];
        bounds[static_cast<size_t>(b)] =
            static_cast<float>(options.neftune_noise_alpha) / std::sqrt(static_cast<float>(T * C));
      }
      e = e + keyed_uniform_noise(e, bounds, dropout_site("neftune"));
    }
    return e;
  }();
  for (int i = 0; i < spec_.num_layers; ++i) {
    const c10::Device device = layer_device(i);
    if (x.device() != device) x = x.to(device);  // its gradient goes back the same way
    const bool off = offloaded(i), shard = sharded(i);
    const bool ckpt = off || shard ||
                      (i < static_cast<int>(options.checkpoint_layers.size()) && options.checkpoint_layers[i]);
    // The context is captured by value: a checkpointed layer reruns during backward.
    BlockFn fn = [this, i, ctx = context_on(device), off, shard, device](const at::Tensor& h) {
      MEMTUNE_PROFILE_SCOPE("memtune::layer");
      if (shard) {
        LayerGathered gathered(*layer_source_, i);
        return layer(i, h, ctx);
      }
      if (!off) return layer(i, h, ctx);
      LayerFetch fetched(slots_, i, device);
      return layer(i, h, ctx);
    };
    x = ckpt ? checkpoint(fn, x, layer_trainable(i), options.offload_activations) : fn(x);
  }
  if (x.device() != placement_.head) x = x.to(placement_.head);
  x = final_norm(x);

  const data::Batch& last = batch_on(placement_.head);
  ForwardOutput out;
  const int64_t C = x.size(-1);
  const at::Tensor head = options.head_weight_tap ? options.head_weight_tap(head_weight()) : head_weight();
  // The logits as the loss forms them: in bf16 products in a bf16 run, as transformers' lm_head.
  const at::ScalarType mm = loss_matmul_dtype(compute_dtype_);
  const double cap = spec_.final_logit_softcapping.value_or(0);
  if (options.last_logits_only) {
    out.loss_sum = at::zeros({}, x.options().dtype(at::kFloat));
    out.logits = soft_cap_logits(at::matmul(x.narrow(1, x.size(1) - 1, 1).to(mm), head.to(mm).t()), cap).to(at::kFloat);
    return out;
  }
  out.loss_sum = linear_cross_entropy_sum(x.reshape({-1, C}), head, last.targets.reshape({-1}),
                                          options.loss_chunk_rows > 0 ? options.loss_chunk_rows
                                                                      : loss_chunk_rows(spec().vocab_size),
                                          &out.correct_tokens, compute_dtype_, options.label_smoothing,
                                          options.label_smoothing > 0 ? &out.cross_entropy_sum : nullptr, cap);
  if (!out.cross_entropy_sum.defined()) out.cross_entropy_sum = out.loss_sum.detach();  // unsmoothed: the same
  out.target_tokens = (batch.targets != data::kIgnoreIndex).sum().item<int64_t>();
  if (options.return_logits) out.logits = soft_cap_logits(at::matmul(x.to(mm), head.to(mm).t()), cap).to(at::kFloat);
  return out;
}

}  // namespace memtune::models
