#include "trainer/sharding.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "models/io/safetensors.h"
#include "runtime/atomic_file.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/offload.h"
#include "runtime/process_group.h"
#include "runtime/units.h"
#include "trainer/grad_scaler.h"
#include "trainer/optimizer.h"
#include "trainer/train_state.h"

namespace memtune::trainer {

namespace fs = std::filesystem;

ShardLevel shard_level(const std::string& name) {
  if (name == "none") return ShardLevel::none;
  if (name == "optimizer" || name == "zero1") return ShardLevel::optimizer;
  if (name == "gradients" || name == "zero2") return ShardLevel::gradients;
  if (name == "full" || name == "zero3") return ShardLevel::full;
  fail("distributed.sharding: unknown level '", name, "' (none, optimizer, gradients, full; zero1, zero2, zero3)");
}

const char* shard_level_name(ShardLevel level) {
  switch (level) {
    case ShardLevel::none: return "none";
    case ShardLevel::optimizer: return "optimizer";
    case ShardLevel::gradients: return "gradients";
    case ShardLevel::full: return "full";
  }
  return "none";
}

std::vector<int> partition_by_numel(const std::vector<int64_t>& numels, int world) {
  MEMTUNE_INTERNAL_ASSERT(world >= 1, "partition_by_numel: world size ", world);
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());  // the first of equals: the lower rank
    owner[i] = static_cast<int>(least - load.begin());
    *least += numels[i];
  }
  return owner;
}

std::vector<int> partition_contiguous(const std::vector<int64_t>& numels, int world) {
  MEMTUNE_INTERNAL_ASSERT(world >= 1, "partition_contiguous: world size ", world);
  std::vector<int64_t> prefix(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) prefix[i + 1] = prefix[i] + numels[i];
  const int64_t total = prefix.back();
  std::vector<int> owner(numels.size(), 0);
  size_t begin = 0;
  for (int r = 0; r < world; ++r) {
    // Rank r's run ends at the boundary nearest r+1 of W of the total (the earlier one on a
    // tie), never before its start; the last rank takes the rest.
    size_t end = numels.size();
    if (r + 1 < world) {
      const double target = static_cast<double>(total) * (r + 1) / world;
      end = begin;
      while (end < numels.size() &&
             std::abs(static_cast<double>(prefix[end + 1]) - target) < std::abs(static_cast<double>(prefix[end]) - target))
        ++end;
    }
    for (size_t i = begin; i < end; ++i) owner[i] = r;
    begin = end;
  }
  return owner;
}

std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world, const std::vector<bool>& separate) {
  if (std::find(separate.begin(), separate.end(), true) == separate.end()) {
    const std::vector<int> runs = partition_contiguous(std::vector<int64_t>(numels.rbegin(), numels.rend()), world);
    return std::vector<int>(runs.rbegin(), runs.rend());
  }
  MEMTUNE_INTERNAL_ASSERT(separate.size() == numels.size(), "shard_owners: ", separate.size(), " flags for ",
                          numels.size(), " tensors");
  std::vector<int> owner(numels.size(), 0);
  for (const bool group : {true, false}) {  // each group's runs over its own elements
    std::vector<size_t> index;
    std::vector<int64_t> part;
    for (size_t i = 0; i < numels.size(); ++i)
      if (separate[i] == group) {
        index.push_back(i);
        part.push_back(numels[i]);
      }
    const std::vector<int> o = shard_owners(part, world);
    for (size_t k = 0; k < index.size(); ++k) owner[index[k]] = o[k];
  }
  return owner;
}

// Runs before tensor i's AccumulateGrad while Sharding::backward collects: takes the
// gradient and passes on an undefined one, which AccumulateGrad ignores (this rank keeps
// only the reduced sums of its own tensors). Otherwise it passes everything on.
struct Sharding::Hook : torch::autograd::FunctionPreHook {
  Hook(Sharding* s, size_t i) : owner(s), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!owner->collecting_ || grads.size() != 1 || !grads[0].defined()) return grads;
    owner->arrive(index, grads[0]);
    return {at::Tensor()};
  }
  Sharding* owner;
  size_t index;
};

Sharding::~Sharding() {
  for (size_t i = 0; i < hooks_.size(); ++i) {
    auto& pre = std::static_pointer_cast<torch::autograd::Node>(accumulators_[i])->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(), [&](const auto& h) { return h.get() == hooks_[i]; }), pre.end());
  }
}

Sharding::Sharding(ShardLevel level, ProcessGroup* pg, const Params& params, int64_t bucket_bytes,
                   std::vector<bool> on_demand)
    : level_(level), pg_(pg), params_(params), on_demand_(std::move(on_demand)) {
  if (on_demand_.empty()) on_demand_.assign(params.size(), false);
  MEMTUNE_INTERNAL_ASSERT(on_demand_.size() == params.size(), "sharding: ", on_demand_.size(), " on-demand flags for ",
                          params.size(), " tensors");
  if (pg_) {
    rank_ = pg_->rank();
    world_ = pg_->world_size();
  }
  if (world_ <= 1) level_ = ShardLevel::none;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    // (another rank's on-demand tensor is a placeholder: its shape over one element)
    MEMTUNE_INTERNAL_ASSERT(p.scalar_type() == at::kFloat && (p.is_contiguous() || on_demand_[i]),
                            "sharding: trainable tensor ", name, " must be contiguous fp32");
    numels_.push_back(p.numel());
    total_numel_ += p.numel();
  }
  const size_t n = params.size();
  owners_ = level_ == ShardLevel::none ? std::vector<int>(n, rank_) : shard_owners(numels_, world_, on_demand_);
  MEMTUNE_INTERNAL_ASSERT(level_ == ShardLevel::full || std::count(on_demand_.begin(), on_demand_.end(), true) == 0,
                          "sharding: tensors gathered on demand under ", shard_level_name(level_));
  for (size_t i = 0; i < params.size(); ++i) {
    owned_.push_back(owners_[i] == rank_);
    if (owned_.back()) {
      owned_names_.insert(params[i].first);
      owned_numel_ += numels_[i];
    }
  }
  if (level_ == ShardLevel::none) return;

  // Buckets: the tensors in backward's order, cut into runs of at most bucket_numel elements
  // and where the owner changes.
  const int64_t bucket_numel = std::max<int64_t>(1, bucket_bytes / 4);
  int64_t largest = 0;
  tensor_buckets_.assign(n, {});
  for (size_t k = n; k-- > 0;) {
    for (int64_t off = 0; off < numels_[k];) {
      if (buckets_.empty() || buckets_.back().owner != owners_[k] || buckets_.back().numel == bucket_numel)
        buckets_.push_back(Bucket{owners_[k], {}, 0, 0});
      Bucket& b = buckets_.back();
      const int64_t len = std::min(numels_[k] - off, bucket_numel - b.numel);
      if (b.segments.empty() || b.segments.back().tensor != k) {
        ++b.tensors;
        tensor_buckets_[k].push_back(buckets_.size() - 1);
      }
      b.segments.push_back({k, off, len});
      b.numel += len;
      largest = std::max(largest, b.numel);
      off += len;
    }
  }
  buffer_ = at::empty({std::max<int64_t>(1, largest)}, at::TensorOptions(at::kFloat).device(pg_->device()));
  if (!shards_gradients()) return;
  log_once("sharding-reduce-scatter",
           "distributed.sharding: gradients: each bucket is reduced to its owner with one reduce as backward "
           "completes it (the exact equivalent of a reduce-scatter: Gloo in LibTorch 1.13 has no reduce_scatter, "
           "and whole-tensor shards differ in size)");
  // The hooks that take each gradient as backward produces it (idle outside backward()).
  pending_.assign(n, at::Tensor());
  accumulated_.assign(n, false);
  arrived_.assign(buckets_.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params_[i].second;
    if (!p.requires_grad()) continue;
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(p);
    MEMTUNE_INTERNAL_ASSERT(acc != nullptr, "sharding: ", params_[i].first, " has no gradient accumulator");
    auto hook = std::make_unique<Hook>(this, i);
    hooks_.push_back(hook.get());
    acc->add_pre_hook(std::move(hook));
    accumulators_.push_back(std::move(acc));
  }
}

bool Sharding::owns_state(const std::string& key) const {
  const size_t dot = key.rfind('.');
  return dot != std::string::npos && owned_names_.count(key.substr(0, dot)) > 0;
}

int64_t Sharding::buffer_bytes() const { return buffer_.defined() ? buffer_.numel() * 4 : 0; }

std::string Sharding::describe() const {
  if (level_ == ShardLevel::none)
    return str_cat("distributed.sharding: none", world_ > 1 ? "" : " (one process)", ": every rank keeps the whole "
                   "optimizer state and every gradient");
  const int64_t tensors = std::count(owned_.begin(), owned_.end(), true);
  return str_cat("distributed.sharding: ", shard_level_name(level_), ": rank ", rank_, " of ", world_, " owns ",
                 tensors, " of ", owned_.size(), " trainable tensors (", owned_numel_, " of ", total_numel_,
                 " parameters): their optimizer state", shards_gradients() ? " and reduced gradients" : "",
                 " live here only; ", buckets_.size(), " buckets through a buffer of ", format_bytes(buffer_bytes()));
}

void Sharding::backward(const at::Tensor& loss, bool host_gradients) {
  reduced_in_backward_ = shards_gradients() && !host_gradients;
  if (!reduced_in_backward_) {
    if (loss.requires_grad()) loss.backward();
    return;
  }
  // This micro-batch's gradients: none arrived, none launched; an owner's tensor holds the
  // sum of the earlier micro-batches (and of every rank) or nothing.
  std::fill(arrived_.begin(), arrived_.end(), 0);
  std::fill(pending_.begin(), pending_.end(), at::Tensor());
  for (size_t i = 0; i < params_.size(); ++i)
    accumulated_[i] = owners_[i] == rank_ && params_[i].second.grad().defined();
  next_ = 0;
  struct Collecting {  // off again however backward ends
    Sharding* s;
    ~Collecting() {
      s->collecting_ = false;
      std::fill(s->pending_.begin(), s->pending_.end(), at::Tensor());
    }
  } collecting{this};
  collecting_ = true;
  if (loss.requires_grad()) loss.backward();
  collecting_ = false;
  // Buckets backward left incomplete (a tensor it gave no gradient counts as zeros), in order:
  // every rank launches every bucket once per micro-batch, in the same order.
  while (next_ < buckets_.size()) launch(next_++);
}

void Sharding::arrive(size_t i, const at::Tensor& g) {
  const at::Tensor& p = params_[i].second;
  MEMTUNE_INTERNAL_ASSERT(g.scalar_type() == at::kFloat && g.sizes() == p.sizes() && !g.is_sparse(),
                          "sharding: the gradient of ", params_[i].first, " is ", g.scalar_type(), " ", g.sizes(),
                          ", expected a dense fp32 ", p.sizes());
  MEMTUNE_INTERNAL_ASSERT(!pending_[i].defined() && tensor_buckets_[i].front() >= next_, "sharding: ",
                          params_[i].first, " got a second gradient in one backward");
  pending_[i] = g;
  for (size_t b : tensor_buckets_[i]) ++arrived_[b];
  while (next_ < buckets_.size() && arrived_[next_] == buckets_[next_].tensors) launch(next_++);
}

void Sharding::launch(size_t index) {
  at::NoGradGuard no_grad;
  const Bucket& b = buckets_[index];
  const bool mine = b.owner == rank_;
  at::Tensor flat = buffer_.narrow(0, 0, b.numel);
  // This rank's part (the owner's with its sum so far: the reduction adds the others'), and
  // the owner's gradient tensors allocated, before the agreement: a rank that runs out of
  // memory here says so there, and no rank enters the reduce.
  bool oom = false;
  std::string what;
  try {
    int64_t pos = 0;
    for (const Segment& s : b.segments) {
      at::Tensor part = flat.narrow(0, pos, s.length);
      const at::Tensor& g = pending_[s.tensor];
      if (g.defined())
        part.copy_(g.reshape(-1).narrow(0, s.offset, s.length));
      else
        part.zero_();
      if (mine) {
        at::Tensor& grad = params_[s.tensor].second.mutable_grad();
        if (!grad.defined()) grad = at::empty_like(params_[s.tensor].second);
        if (accumulated_[s.tensor]) part.add_(grad.view(-1).narrow(0, s.offset, s.length));
      }
      pos += s.length;
    }
  } catch (const std::exception& e) {
    if (!compat::is_out_of_memory(e)) throw;
    oom = true;
    what = e.what();
  }
  if (pg_->agree(oom, std::numeric_limits<int64_t>::max()).first) {
    agreed_oom_ = true;
    compat::throw_out_of_memory(oom ? what
                                    : std::string("out of memory on another rank (learned before reducing a bucket "
                                                  "of gradients in backward)"));
  }
  pg_->reduce_sum(flat, b.owner);
  int64_t pos = 0;
  for (const Segment& s : b.segments) {
    if (mine) params_[s.tensor].second.grad().view(-1).narrow(0, s.offset, s.length).copy_(flat.narrow(0, pos, s.length));
    if (s.offset + s.length == numels_[s.tensor]) pending_[s.tensor] = at::Tensor();  // its last run is reduced
    pos += s.length;
  }
}

bool Sharding::take_agreed_oom() { return std::exchange(agreed_oom_, false); }

void Sharding::reduce_gradients(const Params& params, const at::Tensor& extra, const GradScaler& scaler,
                                bool host_gradients) {
  if (!pg_) return;
  at::NoGradGuard no_grad;
  if (std::exchange(reduced_in_backward_, false)) {  // backward() reduced them already
    MEMTUNE_INTERNAL_ASSERT(!host_gradients, "sharding: gradients reduced in backward are not in host memory");
    check_reduced(params, extra, scaler);
    return;
  }
  // Every rank passes every tensor (the same shapes in the same order): allocate the missing
  // ones before the first collective, so an out-of-memory error stops no rank inside one.
  for (const auto& [name, p] : params)
    if (!p.grad().defined())
      p.mutable_grad() = host_gradients ? offload_zeros(p.sizes(), at::kFloat) : at::zeros_like(p);
  if (!shards_gradients()) {
    std::vector<at::Tensor> grads;
    for (const auto& [name, p] : params) grads.push_back(p.grad());
    if (extra.defined()) grads.push_back(extra);
    pg_->allreduce_sum(grads, host_gradients);
    return;
  }
  for (const auto& [name, p] : params)
    MEMTUNE_INTERNAL_ASSERT(p.grad().is_contiguous(), "sharding: the gradient of ", name, " is not contiguous");
  for (const Bucket& b : buckets_) {
    at::Tensor flat = buffer_.narrow(0, 0, b.numel);
    int64_t pos = 0;
    for (const Segment& s : b.segments) {
      flat.narrow(0, pos, s.length).copy_(params[s.tensor].second.grad().view(-1).narrow(0, s.offset, s.length));
      pos += s.length;
    }
    pg_->reduce_sum(flat, b.owner);
    pos = 0;
    for (const Segment& s : b.segments) {
      const at::Tensor& p = params[s.tensor].second;
      if (b.owner == rank_)
        p.grad().view(-1).narrow(0, s.offset, s.length).copy_(flat.narrow(0, pos, s.length));
      else if (s.offset + s.length == numels_[s.tensor])  // its last run is reduced: the owner has it
        p.mutable_grad() = at::Tensor();
      pos += s.length;
    }
  }
  check_reduced(params, extra, scaler);
}

void Sharding::check_reduced(const Params& params, const at::Tensor& extra, const GradScaler& scaler) {
  // This rank's gradients unscaled and their squared norm, then one all-reduce of [extra...,
  // squared norm, non-finite, out of memory]: a rank that runs out of memory here still
  // enters it, and every rank learns of it there.
  double sq = 0, nonfinite = 0, oom = 0;
  std::string oom_what;
  try {
    if (scaler.unscale(params))
      sq = grad_square_sum(params);
    else
      nonfinite = 1;
  } catch (const std::exception& e) {
    if (!compat::is_out_of_memory(e)) throw;
    oom = 1;
    oom_what = e.what();
  }
  MEMTUNE_INTERNAL_ASSERT(!extra.defined() || (extra.device().is_cpu() && extra.scalar_type() == at::kDouble &&
                                               extra.is_contiguous()),
                          "sharding: the extra values are a contiguous fp64 CPU tensor");
  const int64_t n = extra.defined() ? extra.numel() : 0;
  std::vector<double> v(extra.defined() ? extra.data_ptr<double>() : nullptr,
                        extra.defined() ? extra.data_ptr<double>() + n : nullptr);
  v.insert(v.end(), {sq, nonfinite, oom});
  v = pg_->allreduce(std::move(v), ReduceOp::sum);
  std::copy(v.begin(), v.begin() + n, extra.defined() ? extra.data_ptr<double>() : nullptr);
  if (v[n + 2] > 0)
    compat::throw_out_of_memory(oom > 0 ? oom_what
                                        : std::string("out of memory on another rank while it unscaled its gradients"));
  checked_ = true;
  skip_ = v[n + 1] > 0;
  norm_ = skip_ ? NAN : std::sqrt(v[n]);
}

std::pair<bool, double> Sharding::check_gradients(const GradScaler& scaler, const Params& params) {
  if (shards_gradients()) {
    MEMTUNE_INTERNAL_ASSERT(checked_, "sharding: check_gradients without reduce_gradients in this attempt");
    checked_ = false;
    return {skip_, norm_};
  }
  const bool finite = scaler.unscale(params);
  return {!finite, finite ? grad_norm(params) : NAN};
}

void Sharding::step(Optimizer& optimizer, double lr, double grad_scale) {
  optimizer.step(lr, grad_scale);
  if (level_ == ShardLevel::none) return;
  at::NoGradGuard no_grad;
  const auto& params = optimizer.params();
  for (const Bucket& b : buckets_) {
    int64_t sent = 0;  // the bucket's elements that travel: the on-demand tensors' stay with their owner
    for (const Segment& s : b.segments) sent += on_demand_[s.tensor] ? 0 : s.length;
    if (sent == 0) continue;
    at::Tensor flat = buffer_.narrow(0, 0, sent);
    int64_t pos = 0;
    if (b.owner == rank_)
      for (const Segment& s : b.segments) {
        if (on_demand_[s.tensor]) continue;
        flat.narrow(0, pos, s.length).copy_(params[s.tensor].second.detach().view(-1).narrow(0, s.offset, s.length));
        pos += s.length;
      }
    pg_->broadcast(flat, b.owner);
    if (b.owner == rank_) continue;
    pos = 0;
    for (const Segment& s : b.segments) {
      if (on_demand_[s.tensor]) continue;
      params[s.tensor].second.detach().view(-1).narrow(0, s.offset, s.length).copy_(flat.narrow(0, pos, s.length));
      pos += s.length;
    }
  }
}

int Sharding::write_state_shard(const fs::path& output_dir, int64_t step, const Optimizer& optimizer) {
  if (level_ == ShardLevel::none) return 0;
  const fs::path path = optimizer_shard_path(output_dir, step, rank_, world_);
  const auto tensors = optimizer.state_tensors();
  if (!tensors.empty()) {
    models::save_safetensors(path, tensors);  // temporary name, fsync, rename (runtime/atomic_file.h)
  } else {
    std::error_code ec;
    fs::remove(path, ec);  // a rank that owns nothing writes no shard
  }
  pg_->barrier();  // every shard is on disk before rank 0 moves them into the checkpoint
  return world_;
}

}  // namespace memtune::trainer
