#include "trainer/layer_shards.h"

#include <algorithm>
#include <limits>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include "models/layers/linear.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "runtime/offload.h"
#include "runtime/process_group.h"
#include "runtime/units.h"
#include "trainer/sharding.h"

namespace memtune::trainer {

namespace {

constexpr int kNf4Fields = 4;  // packed, absmax, nested_absmax, nested_quant_map
constexpr int64_t kAlign = 64;  // each piece starts on a cache line (and any dtype's alignment)

at::Tensor& nf4_field(NF4Tensor& q, int field) {
  switch (field) {
    case 0: return q.packed;
    case 1: return q.absmax;
    case 2: return q.nested_absmax;
    default: return q.nested_quant_map;
  }
}
const at::Tensor& nf4_field(const NF4Tensor& q, int field) { return nf4_field(const_cast<NF4Tensor&>(q), field); }

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

at::Tensor meta_like(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions(t.scalar_type()).device(at::kMeta));
}

// `bytes` of `buffer` from `offset` as a tensor shaped like `meta`.
at::Tensor view_in(const at::Tensor& buffer, int64_t offset, const at::Tensor& meta) {
  return buffer.narrow(0, offset, bytes_of(meta)).view(meta.scalar_type()).view(meta.sizes());
}

// The backward of a gathered trainable tensor: its gradient goes on to the tensor itself
// (its accumulator, where Sharding's hooks take it), whatever rank holds its storage.
struct GatheredTrainable : torch::autograd::Node {
  std::string name() const override { return "memtune::GatheredTrainable"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override { return std::move(grads); }
};

// `data` (a gathered copy of trainable `leaf`'s values) as the tensor the layer computes
// with: under grad mode, with a backward to `leaf`.
at::Tensor as_trainable(const at::Tensor& data, const at::Tensor& leaf) {
  if (!at::GradMode::is_enabled()) return data;
  auto node = std::shared_ptr<GatheredTrainable>(new GatheredTrainable(), torch::autograd::deleteNode);
  node->add_next_edge(torch::autograd::impl::gradient_edge(leaf));
  at::Tensor out = data.detach();
  torch::autograd::set_history(out, node);
  return out;
}

// What another rank's trainable tensor holds here: its shape over one NaN (a use outside a
// gather shows), so that its identity (the optimizer's, the hooks') stays.
at::Tensor placeholder(const at::Tensor& like, const c10::Device& device) {
  return at::full({1}, NAN, at::TensorOptions(like.scalar_type()).device(device)).expand(like.sizes());
}

}  // namespace

std::vector<int> LayerShards::owners(const models::CausalLM& model, int world, bool trainable) {
  const auto& slots = model.tensors();
  std::vector<int> out(slots.size(), -1);
  // The slots `in` picks, partitioned by `partition` over their element counts.
  auto assign = [&](const std::function<bool(const models::TensorSlot&)>& in,
                    std::vector<int> (*partition)(const std::vector<int64_t>&, int)) {
    std::vector<size_t> index;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!in(slots[i])) continue;
      int64_t n = 1;
      for (int64_t d : slots[i].shape) n *= d;
      index.push_back(i);
      numels.push_back(n);
    }
    const std::vector<int> owner = partition(numels, world);
    for (size_t k = 0; k < index.size(); ++k) out[index[k]] = owner[k];
  };
  if (trainable) {  // the layers' tensors, in the model's order: the group shard_owners divides by itself
    assign([](const models::TensorSlot& s) { return s.layer >= 0; },
           [](const std::vector<int64_t>& n, int w) { return shard_owners(n, w); });
    return out;
  }
  for (int layer = 0; layer < model.num_layers(); ++layer)
    assign([layer](const models::TensorSlot& s) { return s.layer == layer; }, partition_by_numel);
  return out;
}

LayerShards::LayerShards(models::CausalLM& model, ProcessGroup& pg)
    : model_(model), pg_(pg), rank_(pg.rank()), world_(pg.world_size()) {
  at::NoGradGuard no_grad;
  const c10::Device device = pg_.device();
  const std::vector<int> owner = owners(model_, world_);
  layers_.resize(static_cast<size_t>(model_.num_layers()));
  for (auto& L : layers_) {
    L.pieces.resize(static_cast<size_t>(world_));
    L.owner_bytes.assign(static_cast<size_t>(world_), 0);
  }
  // The nested offsets of NF4 weights (a float each, not a tensor): from their owners.
  std::vector<double> offsets;
  std::vector<models::Linear*> nf4_linears;
  auto& slots = model_.tensors();
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    if (s.layer < 0) continue;
    MEMTUNE_CHECK(!model_.offloaded(s.layer), "distributed.sharding: full: layer ", s.layer,
                  " is offloaded; a sharded layer already lives 1/W on each rank. Hint: drop the offload from "
                  "model.device_map, or shard at gradients");
    Layer& L = layers_[s.layer];
    const int r = owner[i];
    auto add = [&](Piece p) {
      p.offset = L.owner_bytes[r];
      p.bytes = bytes_of(p.meta);
      L.owner_bytes[r] += (p.bytes + kAlign - 1) / kAlign * kAlign;
      L.bytes += p.bytes;
      L.pieces[r].push_back(std::move(p));
    };
    if (s.role == models::TensorRole::kLinearWeight && s.linear->quantized()) {
      const NF4Tensor& q = *s.linear->qweight();
      if (q.double_quant) {
        offsets.push_back(r == rank_ ? q.nested_offset : 0.0);
        nf4_linears.push_back(s.linear);
      }
      for (int f = 0; f < kNf4Fields; ++f) {
        const at::Tensor& t = nf4_field(q, f);
        if (!t.defined()) continue;
        Piece p;
        p.linear = s.linear;
        p.field = f;
        p.meta = meta_like(t);
        add(std::move(p));
      }
    } else if (s.tensor->defined() && !s.tensor->requires_grad()) {
      Piece p;
      p.dense = s.tensor;
      p.meta = meta_like(*s.tensor);
      add(std::move(p));
    }
  }
  // Trainable tensors of the layers (a full fine-tune's weights, LoRA adapters): owned as
  // Sharding owns them (shard_owners over the model's trainable list, the layers' divided by
  // themselves: each rank keeps 1/W of them), so the rank that keeps one's storage is the
  // one that updates it. Each with the module's handle to it:
  struct Member {
    int layer;
    at::Tensor* tensor;
    bool adapter;  // a LoRA matrix (drawn, not read from the checkpoint)
  };
  std::vector<Member> members;
  for (auto& s : slots) {
    if (s.layer < 0) continue;
    if (s.tensor->defined() && s.tensor->requires_grad()) members.push_back({s.layer, s.tensor, false});
    if (s.role == models::TensorRole::kLinearWeight && s.linear->lora) {
      members.push_back({s.layer, &s.linear->lora->A, true});
      members.push_back({s.layer, &s.linear->lora->B, true});
      if (s.linear->lora->dora()) members.push_back({s.layer, &s.linear->lora->magnitude, true});
    }
  }
  const auto trainable = model_.trainable_parameters();
  std::vector<int64_t> numels;
  std::vector<bool> in_layer;
  for (const auto& named : trainable) {
    const at::Tensor& t = named.second;
    numels.push_back(t.numel());
    in_layer.push_back(std::any_of(members.begin(), members.end(), [&](const Member& m) { return m.tensor->is_same(t); }));
  }
  const std::vector<int> trainable_owner = shard_owners(numels, world_, in_layer);
  auto owner_of = [&](const at::Tensor& leaf) {
    for (size_t k = 0; k < trainable.size(); ++k)
      if (trainable[k].second.is_same(leaf)) return trainable_owner[k];
    fail("layer_shards: a trainable tensor of a layer is not among the model's trainable parameters");
  };
  for (const Member& m : members) {
    Layer& L = layers_[m.layer];
    const int r = owner_of(*m.tensor);
    Piece p;
    p.dense = m.tensor;
    p.leaf = *m.tensor;
    p.meta = meta_like(*m.tensor);
    p.from_rank0 = m.adapter;
    p.offset = L.owner_bytes[r];
    p.bytes = bytes_of(p.meta);
    L.owner_bytes[r] += (p.bytes + kAlign - 1) / kAlign * kAlign;
    L.bytes += p.bytes;
    L.pieces[r].push_back(std::move(p));
    ++trainable_pieces_;
  }
  if (!offsets.empty()) {
    offsets = pg_.allreduce(std::move(offsets), ReduceOp::sum);
    for (size_t k = 0; k < nf4_linears.size(); ++k) {
      auto q = std::make_shared<NF4Tensor>(*nf4_linears[k]->qweight());
      q->nested_offset = static_cast<float>(offsets[k]);
      nf4_linears[k]->set_quantized(std::move(q));
    }
  }
  for (Layer& L : layers_) {
    // Adapters start from rank 0's values, as every tensor of an unsharded run does: the
    // layer's, all owners', through one broadcast. Weights read from the checkpoint are the
    // same on every rank: each owner keeps its own (the others may not have read them).
    int64_t adapter_bytes = 0;
    for (const auto& owned : L.pieces)
      for (const Piece& p : owned) adapter_bytes += p.from_rank0 ? p.bytes : 0;
    at::Tensor staged;
    if (adapter_bytes > 0) {
      staged = at::empty({adapter_bytes}, at::TensorOptions(at::kByte).device(device));
      int64_t at = 0;
      for (const auto& owned : L.pieces)
        for (const Piece& p : owned)
          if (p.from_rank0) {
            view_in(staged, at, p.meta).copy_(p.leaf);
            at += p.bytes;
          }
      pg_.broadcast(staged, 0);
    }
    // This rank's pieces move into its buffer; the others' become meta tensors (trainable
    // ones keep their identity over a placeholder).
    L.own = at::empty({std::max<int64_t>(1, L.owner_bytes[rank_])}, at::TensorOptions(at::kByte).device(device));
    int64_t at = 0;
    for (int r = 0; r < world_; ++r)
      for (Piece& p : L.pieces[r]) {
        if (p.leaf.defined()) {  // trainable
          if (r == rank_) {
            MEMTUNE_INTERNAL_ASSERT(!p.leaf.is_meta(), "layer_shards: this rank's trainable tensor was not loaded");
            view_in(L.own, p.offset, p.meta).copy_(p.from_rank0 ? view_in(staged, at, p.meta) : p.leaf);
            p.leaf.set_data(view_in(L.own, p.offset, p.meta));
          } else if (p.leaf.is_meta()) {  // not read (setup_model's skip): a new tensor over the placeholder
            *p.dense = placeholder(p.meta, device).requires_grad_(true);
            p.leaf = *p.dense;
          } else {
            p.leaf.set_data(placeholder(p.meta, device));
          }
          at += p.from_rank0 ? p.bytes : 0;
          continue;
        }
        if (r != rank_) continue;
        const at::Tensor src = p.dense ? *p.dense : nf4_field(*p.linear->qweight(), p.field);
        MEMTUNE_INTERNAL_ASSERT(!src.is_meta(), "layer_shards: this rank's tensor was not loaded");
        view_in(L.own, p.offset, p.meta).copy_(src);
      }
    for (int r = 0; r < world_; ++r) point(L, r, r == rank_ ? L.own : at::Tensor());
    owned_bytes_ += L.owner_bytes[rank_];
    total_bytes_ += L.bytes;
  }
  model_.set_layer_source(this);
}

LayerShards::~LayerShards() { model_.set_layer_source(nullptr); }

void LayerShards::point(Layer& layer, int owner, const at::Tensor& buffer) {
  // NF4 weights are replaced whole (their holder is shared and const): group the fields.
  std::vector<std::pair<models::Linear*, std::shared_ptr<NF4Tensor>>> nf4;
  for (const Piece& p : layer.pieces[owner]) {
    if (p.leaf.defined()) continue;  // trainable: point_trainable
    at::Tensor t = buffer.defined() ? view_in(buffer, p.offset, p.meta) : p.meta;
    if (p.dense) {
      *p.dense = std::move(t);
      continue;
    }
    if (nf4.empty() || nf4.back().first != p.linear)
      nf4.emplace_back(p.linear, std::make_shared<NF4Tensor>(*p.linear->qweight()));
    nf4_field(*nf4.back().second, p.field) = std::move(t);
  }
  for (auto& [linear, q] : nf4) linear->set_quantized(std::move(q));
}

bool LayerShards::covers(int layer) const { return layer >= 0 && layer < static_cast<int>(layers_.size()); }

std::vector<at::Tensor> LayerShards::start_gather(int layer, std::vector<ProcessGroup::Pending>* pending) {
  Layer& L = layers_.at(static_cast<size_t>(layer));
  // Allocate first: a rank that runs out here says so in the agreement below, before any
  // rank enters a broadcast.
  std::vector<at::Tensor> received(static_cast<size_t>(world_));
  bool oom = false;
  std::string what;
  try {
    for (int r = 0; r < world_; ++r)
      if (r != rank_ && L.owner_bytes[r] > 0)
        received[r] = at::empty({L.owner_bytes[r]}, at::TensorOptions(at::kByte).device(pg_.device()));
  } catch (const std::exception& e) {
    if (!compat::is_out_of_memory(e)) throw;
    oom = true;
    what = e.what();
  }
  if (pg_.agree(oom, std::numeric_limits<int64_t>::max()).first) {
    agreed_oom_ = true;
    compat::throw_out_of_memory(oom ? what
                                    : str_cat("out of memory on another rank (learned before gathering layer ", layer,
                                              ")"));
  }
  for (int r = 0; r < world_; ++r) {
    if (L.owner_bytes[r] == 0) continue;
    const at::Tensor& buffer = r == rank_ ? L.own : received[r];
    if (pending)
      pending->push_back(pg_.broadcast_async(buffer, r));
    else
      pg_.broadcast(buffer, r);
  }
  return received;
}

void LayerShards::drop_prefetch() {
  for (auto& p : prefetch_.pending) p.wait();  // started on every rank: finished on every rank
  prefetch_ = Prefetch{};
}

void LayerShards::gather(int layer) {
  Layer& L = layers_.at(static_cast<size_t>(layer));
  MEMTUNE_INTERNAL_ASSERT(!L.gathered, "layer_shards: layer ", layer, " gathered twice");
  const bool grad_mode = at::GradMode::is_enabled();  // the layer's: trainable tensors carry a backward under it
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> received;
  if (prefetch_.layer == layer) {  // started by the gather before this one
    for (auto& p : prefetch_.pending) p.wait();
    received = std::move(prefetch_.received);
    prefetch_ = Prefetch{};
  } else {
    // Another layer prefetched (a step that ended early): finished and dropped, as every rank does.
    if (prefetch_.layer >= 0) drop_prefetch();
    received = start_gather(layer, nullptr);
  }
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) point(L, r, received[r]);
    at::AutoGradMode mode(grad_mode);
    point_trainable(L, r, r == rank_ ? L.own : received[r]);  // this rank's too: with their backward
  }
  L.received = std::move(received);
  L.gathered = true;
  // The next layer in this direction (forward: up; backward's reruns, under grad mode: down)
  // starts gathering while this one computes.
  const int next = grad_mode ? layer - 1 : layer + 1;
  if (!prefetch_enabled_ || !covers(next)) return;
  try {
    Prefetch p;
    p.layer = next;
    p.received = start_gather(next, &p.pending);
    prefetch_ = std::move(p);
  } catch (...) {  // learned in the prefetch's agreement: this layer goes back too
    release(layer);
    throw;
  }
}

void LayerShards::point_trainable(Layer& layer, int owner, const at::Tensor& buffer) {
  for (const Piece& p : layer.pieces[owner])
    if (p.leaf.defined()) *p.dense = buffer.defined() ? as_trainable(view_in(buffer, p.offset, p.meta), p.leaf) : p.leaf;
}

void LayerShards::release(int layer) {
  Layer& L = layers_.at(static_cast<size_t>(layer));
  if (!L.gathered) return;
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) point(L, r, at::Tensor());
    point_trainable(L, r, at::Tensor());
  }
  L.received.clear();  // freed once autograd no longer holds views of them
  L.gathered = false;
}

bool LayerShards::holds(const at::Tensor& t) const {
  for (const Layer& L : layers_)
    for (const auto& owned : L.pieces)
      for (const Piece& p : owned)
        if (p.leaf.defined() && p.leaf.is_same(t)) return true;
  return false;
}

void LayerShards::with_trainable_whole(int root, const std::function<void()>& fn) {
  at::NoGradGuard no_grad;
  // Layer by layer: gathered, the root's host copies taken, released.
  std::vector<std::pair<const Piece*, at::Tensor>> copies;
  for (int layer = 0; layer < static_cast<int>(layers_.size()); ++layer) {
    gather(layer);
    struct Released {  // however the copies end
      LayerShards* shards;
      int layer;
      ~Released() { shards->release(layer); }
    } released{this, layer};
    if (rank_ == root)
      for (const auto& owned : layers_[layer].pieces)
        for (const Piece& p : owned)
          if (p.leaf.defined()) {
            at::Tensor host = to_offload_storage(*p.dense);
            if (p.leaf.requires_grad()) host.requires_grad_(true);
            copies.emplace_back(&p, std::move(host));
          }
  }
  struct Restore {  // the tensors themselves again, however fn ends
    std::vector<std::pair<const Piece*, at::Tensor>>& copies;
    ~Restore() {
      for (auto& [p, host] : copies) *p->dense = p->leaf;
    }
  } restore{copies};
  for (auto& [p, host] : copies) *p->dense = host;
  fn();
}

bool LayerShards::take_agreed_oom() { return std::exchange(agreed_oom_, false); }

int64_t LayerShards::largest_layer_bytes() const {
  int64_t m = 0;
  for (const Layer& L : layers_) m = std::max(m, L.bytes);
  return m;
}

std::string LayerShards::describe() const {
  return str_cat("distributed.sharding: full: rank ", rank_, " of ", world_, " keeps ", format_bytes(owned_bytes_),
                 " of the layers' ", format_bytes(total_bytes_), " of weights (", trainable_pieces_,
                 " trainable tensors among them); each layer is gathered (at most ", format_bytes(largest_layer_bytes()),
                 ") just before it runs, in forward and again in backward");
}

int share_dora_magnitudes(models::CausalLM& model, ProcessGroup& pg, bool trainable) {
  const std::vector<int> owner = LayerShards::owners(model, pg.world_size(), trainable);
  const auto& slots = model.tensors();
  at::NoGradGuard no_grad;
  int shared = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const models::TensorSlot& s = slots[i];
    if (s.role != models::TensorRole::kLinearWeight || !s.linear->lora || !s.linear->lora->dora()) continue;
    at::Tensor& m = s.linear->lora->magnitude;
    const int from = owner[i] >= 0 ? owner[i] : 0;  // outside the layers every rank read it
    MEMTUNE_INTERNAL_ASSERT(pg.rank() != from || s.linear->weight_loaded(), s.name,
                            ": its owner did not read it, and DoRA's magnitude needs it");
    at::Tensor buffer = m.detach().to(pg.device()).contiguous();
    pg.broadcast(buffer, from);
    m.detach().copy_(buffer.to(m.device()));
    ++shared;
  }
  return shared;
}

}  // namespace memtune::trainer
