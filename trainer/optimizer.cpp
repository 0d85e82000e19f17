#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/json_input.h"
#include "runtime/offload.h"
#include "trainer/adamw8bit_kernels.h"
#include "trainer/optim_kernels.h"
#ifdef MEMTUNE_CUDA
#include "trainer/cuda/adamw_bnb_cuda.h"
#include "trainer/cuda/optim_cuda.h"
#endif

namespace memtune::trainer {

namespace {

// torch's AdamW as one kernel: the CPU's (trainer/optim_kernels.h) for fp32 tensors in host
// memory, and on a CUDA build the multi-tensor kernel for fp32 tensors on one GPU
// (trainer/cuda/optim_cuda.h, the same bits).
bool fused_adamw_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
#ifdef MEMTUNE_CUDA
  if (p.is_cuda()) return torch_adamw_cuda_applies(p, g, m, v);
#endif
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  return true;
}

// bitsandbytes' kOptimizerStatic8bit2StateBlockwise<ADAM, 256> (trainer/adamw8bit_kernels.h:
// the AVX2 kernel where the CPU has it, else the scalar one; the same bytes).
void bnb_adam8(const BnbScalars& s, const float* q1, const float* q2, float* p, const float* g, uint8_t* c1,
               uint8_t* c2, float* absmax1, float* absmax2, int64_t n) {
  const Adam8Tensors t{&code_table(true), &code_table(false), p, g, c1, c2, absmax1, absmax2, n};
  TORCH_CHECK(t.t1->code == q1 && t.t2->code == q2, "bnb_adam8: the maps are the dynamic maps");
  at::parallel_for(0, (n + kBlock8bit - 1) / kBlock8bit, 16,
                   [&](int64_t b0, int64_t b1) { adam8_blocks(s, t, b0, b1); });
}

bool cpu_f32_contiguous(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

}  // namespace

int64_t optimizer_state_bytes(const std::string& kind, bool paged, at::IntArrayRef shape, bool sgd_momentum) {
  if (paged) return 0;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (kind == "adafactor") {
    if (shape.size() < 2) return numel * 4;
    const int64_t cols = shape.back(), rows = numel / std::max<int64_t>(cols, 1);
    return (rows + numel / std::max<int64_t>(shape[shape.size() - 2], 1)) * 4;
  }
  if (kind == "sgd") return sgd_momentum ? numel * 4 : 0;
  if (kind == "adamw_8bit" && numel >= kMin8bitSize) return 2 * numel + 2 * ((numel + kBlock8bit - 1) / kBlock8bit) * 4;
  return 2 * numel * 4;
}

void set_optimizer_kind(const std::string& optim, OptimizerOptions& o) {
  o.paged = false;
  if (optim == "adamw_torch" || optim == "adamw_torch_fused" || optim == "adamw") {
    o.kind = "adamw";
  } else if (optim == "adamw_bnb_8bit" || optim == "adamw_8bit") {
    o.kind = "adamw_8bit";
  } else if (optim == "paged_adamw_8bit") {
    o.kind = "adamw_8bit";
    o.paged = true;
  } else if (optim == "paged_adamw_32bit") {
    o.kind = "adamw_32bit";
    o.paged = true;
  } else if (optim == "adafactor") {
    o.kind = "adafactor";
  } else if (optim == "sgd") {
    o.kind = "sgd";
  } else {
    fail("training.optim: unknown optimizer '", optim, "' (one of ", kOptimNames, ")");
  }
}

bool decays(const std::string& name, const at::Tensor& t) {
  // DoRA's magnitude: the Trainer decays every parameter but biases and norms' weights.
  if (name.size() >= 21 && name.compare(name.size() - 21, 21, "lora_magnitude_vector") == 0) return true;
  if (t.dim() < 2) return false;  // biases and norm weights
  return name.find("norm") == std::string::npos && name.find("ln_") == std::string::npos;
}

Optimizer::Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerOptions options,
                     std::vector<bool> owned)
    : options_(std::move(options)), params_(std::move(params)), owned_(std::move(owned)) {
  configured_kind_ = options_.ladder_from.empty() ? options_.kind : options_.ladder_from;
  if (owned_.empty()) owned_.assign(params_.size(), true);
  MEMTUNE_INTERNAL_ASSERT(owned_.size() == params_.size(), "optimizer: ", owned_.size(), " ownership flags for ",
                          params_.size(), " parameters");
  const std::string& k = options_.kind;
  MEMTUNE_CHECK(k == "adamw" || k == "adamw_8bit" || k == "adamw_32bit" || k == "adafactor" || k == "sgd",
                "training.optim: unknown optimizer kind '", k, "' (adamw, adamw_8bit, adamw_32bit, adafactor, sgd)");
  // A state tensor: on the parameter's device, or in host memory outside the budget (paged,
  // or offloaded from the start: a budget that holds only the offloaded run never holds it).
  offloaded_ = options_.offloaded && !options_.paged;
  auto state = [&](const at::Tensor& like, at::IntArrayRef sizes, at::ScalarType dt) {
    // Paged states of a GPU's parameter are pinned: they pass through the device per update.
    if (options_.paged || offloaded_) return offload_zeros(sizes, dt, options_.paged && like.is_cuda());
    return at::zeros(sizes, like.options().dtype(dt).requires_grad(false));
  };
  if (k == "adamw_8bit") {  // built (and counted) now, not during the first update
    dynamic_map(true);
    dynamic_map(false);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    MEMTUNE_INTERNAL_ASSERT(p.scalar_type() == at::kFloat, "optimizer: ", name, " must be fp32");
    sq_row_.emplace_back();
    sq_col_.emplace_back();
    if (!owned_[i]) {  // another rank's: no state here
      exp_avg_.emplace_back();
      if (k != "sgd") exp_avg_sq_.emplace_back();
      absmax1_.emplace_back();
      absmax2_.emplace_back();
      continue;
    }
    if (k == "adafactor") {  // no first moment; a matrix's second moment factored
      exp_avg_.emplace_back();
      absmax1_.emplace_back();
      absmax2_.emplace_back();
      if (p.dim() < 2) {
        exp_avg_sq_.push_back(state(p, p.sizes(), at::kFloat));
        continue;
      }
      exp_avg_sq_.emplace_back();
      std::vector<int64_t> col(p.sizes().begin(), p.sizes().end());
      col.erase(col.end() - 2);
      sq_row_.back() = state(p, p.sizes().slice(0, p.dim() - 1), at::kFloat);
      sq_col_.back() = state(p, col, at::kFloat);
      continue;
    }
    const bool eight = k == "adamw_8bit" && p.numel() >= kMin8bitSize;
    const at::ScalarType dt = eight ? at::kByte : at::kFloat;
    if (k == "sgd" && options_.momentum == 0) {  // torch.optim.SGD keeps no momentum buffer then
      exp_avg_.emplace_back();
      absmax1_.emplace_back();
      absmax2_.emplace_back();
      continue;
    }
    exp_avg_.push_back(state(p, p.sizes(), dt));
    if (k != "sgd") exp_avg_sq_.push_back(state(p, p.sizes(), dt));
    if (eight) {
      const int64_t blocks = (p.numel() + kBlock8bit - 1) / kBlock8bit;
      absmax1_.push_back(state(p, {blocks}, at::kFloat));
      absmax2_.push_back(state(p, {blocks}, at::kFloat));
    } else {
      absmax1_.emplace_back();
      absmax2_.emplace_back();
    }
  }
}

std::string Optimizer::workspace_key(size_t i) const {
  const at::Tensor& p = params_[i].second;
  if (options_.kind == "adafactor" && states_offloaded()) return "host";
  return p.device().str();
}

void Optimizer::reserve_workspaces() {
#ifdef MEMTUNE_CUDA
  if (options_.paged) {  // bitsandbytes' paged kinds: the slots the states pass through, per device
    std::map<std::string, std::pair<c10::Device, int64_t>> slots;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i].second;
      if (!owned_[i] || !p.is_cuda() || !p.grad().defined() || p.grad().device() != p.device()) continue;
      const int64_t bytes = PagedStates::slot_bytes({exp_avg_[i], exp_avg_sq_[i], absmax1_[i], absmax2_[i]});
      auto& need = slots.try_emplace(p.device().str(), p.device(), 0).first->second.second;
      need = std::min(std::max(need, bytes), kPagedSlotBytes);
    }
    for (auto it = paged_.begin(); it != paged_.end();)  // devices no longer updated here
      it = slots.count(it->first) ? std::next(it) : paged_.erase(it);
    for (const auto& [where, what] : slots) {
      auto it = paged_.find(where);
      if (it != paged_.end() && it->second->capacity() >= what.second) continue;
      if (it != paged_.end()) paged_.erase(it);  // the smaller slots go first
      paged_.emplace(where, std::make_shared<PagedStates>(what.first, what.second));
    }
  }
#endif
  const bool adafactor = options_.kind == "adafactor";
  if (options_.kind != "adamw" && !adafactor) return;
  std::map<std::string, std::pair<int64_t, at::TensorOptions>> need;  // per device
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    const at::Tensor& g = p.grad();
    if (!owned_[i] || !g.defined()) continue;
    // AdamW: the host update of offloaded states and the fused kernels (the CPU's, a GPU's
    // multi-tensor one) need none.
    if (!adafactor &&
        ((offloaded_ && !p.device().is_cpu()) || fused_adamw_applies(p, g, exp_avg_[i], exp_avg_sq_[i])))
      continue;
    auto& [n, options] = need.try_emplace(workspace_key(i), 0, p.options().dtype(at::kFloat).requires_grad(false))
                             .first->second;
    n = std::max(n, p.numel());
  }
  for (const auto& [where, what] : need) {
    at::Tensor& w = workspaces_[where];
    if (w.defined() && w.numel() >= what.first) continue;
    w = where == "host" ? offload_zeros({what.first}, at::kFloat) : at::empty({what.first}, what.second);
  }
}

int64_t Optimizer::offload_states() {
  if (states_offloaded()) return 0;
  int64_t moved = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    for (const auto& [key, t] : states(i)) {
      moved += t->numel() * static_cast<int64_t>(t->element_size());
      *t = to_offload_storage(*t);
    }
  offloaded_ = true;
  if (options_.kind == "adafactor") workspaces_.clear();  // the host's from the next step on
  return moved;
}

int64_t Optimizer::restore_states() {
  if (!offloaded_) return 0;
  int64_t moved = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const c10::Device d = params_[i].second.device();
    for (const auto& [key, t] : states(i)) {
      moved += t->numel() * static_cast<int64_t>(t->element_size());
      *t = fetch_from_offload(*t, d);
    }
  }
  offloaded_ = false;
  if (options_.kind == "adafactor") workspaces_.clear();  // the device's from the next step on
  return moved;
}

int64_t Optimizer::quantize_states() {
  const std::string& k = options_.kind;
  if (k != "adamw" && k != "adamw_32bit") return 0;
  at::NoGradGuard no_grad;
  // From here the update is adamw_8bit's, tensor by tensor: 8-bit where a tensor's codes are
  // made, bitsandbytes' 32-bit kernel on the fp32 states of the others (small tensors; any an
  // error below left), so a state interrupted half way is still one the update runs on.
  options_.kind = "adamw_8bit";
  workspaces_.clear();  // torch's AdamW path's; bitsandbytes' kernels need none
  int64_t freed = 0;
  const bool host = states_offloaded();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!owned_[i] || params_[i].second.numel() < kMin8bitSize || absmax1_[i].defined()) continue;
    at::Tensor& m = exp_avg_[i];
    at::Tensor& v = exp_avg_sq_[i];
    const int64_t n = m.numel(), blocks = (n + kBlock8bit - 1) / kBlock8bit;
    const c10::Device device = m.device();
    // The rung runs when memory ran out: the fp32 states leave for host memory outside the
    // budget before the codes are made where they lived (2 B per element and 8 per block,
    // against the 8 freed); should that still fail they stay there (the update streams them).
    m = to_offload_storage(m);
    v = to_offload_storage(v);
    const at::Tensor mh = m.view({-1}), vh = v.view({-1});
    auto make = [&](int64_t size, at::ScalarType dt) {
      return host ? offload_zeros({size}, dt) : at::empty({size}, at::TensorOptions(dt).device(device));
    };
    at::Tensor c1 = make(n, at::kByte), c2 = make(n, at::kByte), a1 = make(blocks, at::kFloat),
               a2 = make(blocks, at::kFloat);
    const bool on_cpu = device.is_cpu() || host;
    at::Tensor c1h = on_cpu ? c1 : at::empty({n}, at::kByte), c2h = on_cpu ? c2 : at::empty({n}, at::kByte),
               a1h = on_cpu ? a1 : at::empty({blocks}, at::kFloat), a2h = on_cpu ? a2 : at::empty({blocks}, at::kFloat);
    quantize_states_8bit(mh.data_ptr<float>(), vh.data_ptr<float>(), n, c1h.data_ptr<uint8_t>(),
                         c2h.data_ptr<uint8_t>(), a1h.data_ptr<float>(), a2h.data_ptr<float>());
    if (!on_cpu) {
      c1.copy_(c1h);
      c2.copy_(c2h);
      a1.copy_(a1h);
      a2.copy_(a2h);
    }
    freed += 2 * n * 4 - (2 * n + 2 * blocks * 4);
    m = c1.view(params_[i].second.sizes());
    v = c2.view(params_[i].second.sizes());
    absmax1_[i] = a1;
    absmax2_[i] = a2;
  }
  return freed;
}

int64_t Optimizer::dequantize_states() {
  if (!states_quantized()) return 0;
  at::NoGradGuard no_grad;
  int64_t made = 0;
  const at::Tensor q1 = dynamic_map(true), q2 = dynamic_map(false);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!owned_[i] || !absmax1_[i].defined()) continue;
    at::Tensor& m = exp_avg_[i];
    at::Tensor& v = exp_avg_sq_[i];
    const int64_t n = m.numel();
    const bool host = states_offloaded();
    // code -> value, times its block's absmax (the update's own dequantization)
    auto back = [&](const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& map) {
      const at::Tensor c = codes.to(at::kCPU).reshape({-1}).to(at::kLong);
      at::Tensor vals = map.index_select(0, c);
      const at::Tensor scale = absmax.to(at::kCPU).repeat_interleave(kBlock8bit).narrow(0, 0, n);
      vals.mul_(scale);
      at::Tensor out = host ? offload_zeros({n}, at::kFloat) : at::empty({n}, params_[i].second.options());
      out.copy_(vals);
      return out.view(params_[i].second.sizes());
    };
    at::Tensor mf = back(m, absmax1_[i], q1), vf = back(v, absmax2_[i], q2);
    made += 2 * n * 4;
    m = mf;
    v = vf;
    absmax1_[i] = at::Tensor();
    absmax2_[i] = at::Tensor();
  }
  options_.kind = configured_kind_;
  return made;
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
}

void Optimizer::step(double lr, double grad_scale) {
  at::NoGradGuard no_grad;
  reserve_workspaces();  // before anything of the step changes: an out-of-memory error here leaves it to retry
  // Paged states on their way back to the host are there when the step returns (a failed
  // copy throws then), or throws (the step's own error is the one reported).
  struct FinishPaged {
    Optimizer& optimizer;
    bool done = false;
    ~FinishPaged() {
      if (done) return;
      try {
        optimizer.finish_paged();
      } catch (...) {
      }
    }
  } unwinding{*this};
  ++steps_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  // torch's AdamW kernels' scalars, but for each tensor's decay (1 - lr * its weight decay).
  const TorchAdamW adamw{static_cast<float>(grad_scale), 1.0f, static_cast<float>(b1), static_cast<float>(1.0 - b1),
                         static_cast<float>(b2), static_cast<float>(1.0 - b2), static_cast<float>(std::sqrt(bc2)),
                         static_cast<float>(options_.eps), static_cast<float>(-lr / bc1)};
#ifdef MEMTUNE_CUDA
  std::vector<AdamWCudaTensor> on_gpu;  // torch's AdamW on GPU tensors: launched together below
#endif
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& [name, p] = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined() || !owned_[i]) continue;
    const double wd = decays(name, p) ? options_.weight_decay : 0.0;
    if (options_.kind == "adamw_8bit" || options_.kind == "adamw_32bit") {
      bnb_step(i, lr, wd, grad_scale);
      continue;
    }
    if (options_.kind == "adafactor") {
      adafactor_step(i, lr, wd, grad_scale);
      continue;
    }
    // Offloaded states of a parameter off the host: the update runs on the host, as
    // DeepSpeed's CPU Adam does (host arithmetic, equal to the device's to rounding).
    const bool on_host = offloaded_ && !p.device().is_cpu();
    const at::Tensor ph = on_host ? p.detach().to(at::kCPU).contiguous() : p;
    const at::Tensor gh = on_host ? g.to(at::kCPU, at::kFloat).contiguous() : g;
    if (options_.kind == "adamw" && fused_adamw_applies(ph, gh, exp_avg_[i], exp_avg_sq_[i])) {
      TorchAdamW s = adamw;
      s.decay = static_cast<float>(1.0 - lr * wd);
#ifdef MEMTUNE_CUDA
      if (ph.is_cuda()) {
        on_gpu.push_back({ph, gh, exp_avg_[i], exp_avg_sq_[i], s.decay});
        continue;
      }
#endif
      torch_adamw(s, ph.data_ptr<float>(), gh.data_ptr<float>(), exp_avg_[i].data_ptr<float>(),
                  exp_avg_sq_[i].data_ptr<float>(), ph.numel());
    } else {
      update(ph, gh, i, lr, wd, grad_scale, bc1, bc2);
    }
    if (on_host) const_cast<at::Tensor&>(p).copy_(ph);
  }
#ifdef MEMTUNE_CUDA
  if (!on_gpu.empty()) torch_adamw_cuda(adamw, on_gpu);
#endif
  unwinding.done = true;
  finish_paged();
}

void Optimizer::finish_paged() {
#ifdef MEMTUNE_CUDA
  std::exception_ptr failed;
  for (auto& [where, ps] : paged_) {
    try {
      ps->finish();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
#endif
}

void Optimizer::update(const at::Tensor& p, const at::Tensor& g, size_t i, double lr, double wd, double grad_scale,
                       double bc1, double bc2) {
  const double b1 = options_.beta1, b2 = options_.beta2;
  if (grad_scale != 1.0) g.mul_(grad_scale);
  if (options_.kind == "adamw") {
    // torch.optim.AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    // p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
    if (wd != 0) p.mul_(1.0 - lr * wd);
    exp_avg_[i].mul_(b1).add_(g, 1.0 - b1);
    exp_avg_sq_[i].mul_(b2).addcmul_(g, g, 1.0 - b2);
    at::Tensor denom = workspaces_.at(p.device().str()).narrow(0, 0, p.numel()).view(p.sizes());
    at::sqrt_out(denom, exp_avg_sq_[i]);
    denom.div_(std::sqrt(bc2)).add_(options_.eps);
    const_cast<at::Tensor&>(p).addcdiv_(exp_avg_[i], denom, -lr / bc1);
  } else {
    // torch.optim.SGD with (L2) weight decay and momentum (dampening 0).
    if (wd != 0) g.add_(p, wd);
    if (options_.momentum != 0) {
      if (steps_ == 1) exp_avg_[i].copy_(g);
      else exp_avg_[i].mul_(options_.momentum).add_(g);
      const_cast<at::Tensor&>(p).add_(exp_avg_[i], -lr);
    } else {
      const_cast<at::Tensor&>(p).add_(g, -lr);
    }
  }
}

void Optimizer::bnb_step(size_t i, double lr, double wd, double grad_scale) {
  const at::Tensor& p = params_[i].second;
  const BnbScalars s(steps_, lr, options_.beta1, options_.beta2, options_.eps, wd, grad_scale);
  std::vector<at::Tensor> st = {exp_avg_[i], exp_avg_sq_[i], absmax1_[i], absmax2_[i]};
#ifdef MEMTUNE_CUDA
  // A parameter on a GPU with its states there: bitsandbytes' kernels on the device, in place.
  if (bnb_cuda_applies(p, p.grad(), st)) {
    if (absmax1_[i].defined())
      bnb_adam8_cuda(s, p, p.grad(), exp_avg_[i], exp_avg_sq_[i], absmax1_[i], absmax2_[i]);
    else
      bnb_adam32_cuda(s, p, p.grad(), exp_avg_[i], exp_avg_sq_[i]);
    return;
  }
  // Paged states in host memory, the parameter on a GPU: through the device, double-buffered.
  if (const auto ps = paged_.find(p.device().str()); ps != paged_.end() && ps->second->applies(p, p.grad(), st)) {
    ps->second->update(s, p, p.grad(), st);
    return;
  }
#endif
  // The CPU kernels run on host tensors. Parameters elsewhere whose states are in host memory
  // (paged, offloaded) are streamed through the host per tensor: copied in, updated, copied
  // back (host memory, outside the device's budget: nothing is allocated on the device).
  const bool host = cpu_f32_contiguous(p) && cpu_f32_contiguous(p.grad());
  at::Tensor ph = host ? p : p.detach().to(at::kCPU).contiguous();
  at::Tensor gh = host ? p.grad() : p.grad().to(at::kCPU, at::kFloat).contiguous();
  std::vector<at::Tensor> sh;
  for (const at::Tensor& t : st) sh.push_back(!t.defined() || t.device().is_cpu() ? t : t.to(at::kCPU));
  if (absmax1_[i].defined()) {
    bnb_adam8(s, dynamic_map(true).data_ptr<float>(), dynamic_map(false).data_ptr<float>(), ph.data_ptr<float>(),
              gh.data_ptr<float>(), sh[0].data_ptr<uint8_t>(), sh[1].data_ptr<uint8_t>(), sh[2].data_ptr<float>(),
              sh[3].data_ptr<float>(), p.numel());
  } else {
    bnb_adam32(s, ph.data_ptr<float>(), gh.data_ptr<float>(), sh[0].data_ptr<float>(), sh[1].data_ptr<float>(),
               p.numel());
  }
  if (!host) const_cast<at::Tensor&>(p).copy_(ph);
  for (size_t k = 0; k < st.size(); ++k)
    if (st[k].defined() && !st[k].is_same(sh[k])) st[k].copy_(sh[k]);
}

// transformers' Adafactor.step for one tensor with scale_parameter and relative_step off and no
// first moment, in its order of operations (ATen's ops, so the same bits on the same build):
//   u = g^2 + eps;  matrix: row = b2t row + (1-b2t) mean_col(u), col = b2t col + (1-b2t) mean_row(u),
//                           u = rsqrt(row / mean(row)) rsqrt(col) g;
//                   vector: v = b2t v + (1-b2t) u, u = rsqrt(v) g;
//   u /= max(1, rms(u) / clip);  u *= lr;  p += -wd lr p;  p -= u
// with b2t = 1 - t^decay_rate. u lives in the workspace; the row and column factors are the only
// allocations (one value per row and column). On fp32 CPU tensors the elementwise steps run as
// optim_kernels' three fused passes (the same bits); the means and the RMS stay ATen's.
void Optimizer::adafactor_step(size_t i, double lr, double wd, double grad_scale) {
  const at::Tensor& p = params_[i].second;
  // Offloaded states of a parameter off the host: the update runs on the host.
  const bool on_host = offloaded_ && !p.device().is_cpu();
  at::Tensor ph = on_host ? p.detach().to(at::kCPU).contiguous() : p;
  at::Tensor g = on_host ? p.grad().to(at::kCPU, at::kFloat) : p.grad();
  const int64_t n = p.numel();
  at::Tensor u = workspaces_.at(workspace_key(i)).narrow(0, 0, n).view(p.sizes());
  const bool fused = ph.device().is_cpu() && ph.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
                     ph.is_contiguous() && g.is_contiguous() && u.scalar_type() == at::kFloat;
  const double b2t = 1.0 - std::pow(static_cast<double>(steps_), options_.adafactor_decay_rate);
  if (fused) {
    adafactor_square(static_cast<float>(grad_scale), static_cast<float>(options_.adafactor_eps), g.data_ptr<float>(),
                     u.data_ptr<float>(), n);
  } else {
    if (grad_scale != 1.0) g.mul_(grad_scale);
    at::mul_out(u, g, g);
    u.add_(options_.adafactor_eps);
  }
  if (sq_row_[i].defined()) {
    at::Tensor& row = sq_row_[i];
    at::Tensor& col = sq_col_[i];
    row.mul_(b2t).add_(u.mean(-1), 1.0 - b2t);
    col.mul_(b2t).add_(u.mean(-2), 1.0 - b2t);
    const at::Tensor r = (row / row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
    const at::Tensor c = col.unsqueeze(-2).rsqrt();
    if (fused && u.dim() == 2) {
      adafactor_factored(r.data_ptr<float>(), c.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(),
                         u.size(0), u.size(1));
    } else {
      at::mul_out(u, r, c);  // the states and the workspace are on one side: the device, or the host
      u.mul_(g);
    }
  } else {
    exp_avg_sq_[i].mul_(b2t).add_(u, 1.0 - b2t);
    at::rsqrt_out(u, exp_avg_sq_[i]);
    u.mul_(g);
  }
  const at::Tensor rms = at::linalg_vector_norm(u, 2) / std::sqrt(static_cast<double>(n));
  const at::Tensor d = (rms / options_.adafactor_clip).clamp_min_(1.0);
  if (fused) {
    if (wd != 0) ph.add_(ph, -wd * lr);  // the decay reads p before the update, as in the chain
    adafactor_apply(d.item<float>(), static_cast<float>(lr), u.data_ptr<float>(), ph.data_ptr<float>(), n);
  } else {
    u.div_(d);
    u.mul_(lr);
    if (wd != 0) ph.add_(ph, -wd * lr);
    ph.sub_(u);
  }
  if (on_host) const_cast<at::Tensor&>(p).copy_(ph);
}

int64_t Optimizer::state_bytes() const {
  int64_t n = 0;
  for (const auto& [device, w] : workspaces_) n += w.numel() * 4;
  for (size_t i = 0; i < params_.size(); ++i)
    for (const auto& [key, t] : states(i)) n += t->numel() * static_cast<int64_t>(t->element_size());
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!owned_[i]) continue;
    for (const auto& [key, t] : states(i)) out.emplace_back(params_[i].first + key, *t);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor*>> Optimizer::states(size_t i) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  const std::pair<const char*, std::vector<at::Tensor>*> named[] = {
      {".exp_avg", &exp_avg_},      {".exp_avg_sq", &exp_avg_sq_},         {".absmax1", &absmax1_},
      {".absmax2", &absmax2_},      {".exp_avg_sq_row", &sq_row_},         {".exp_avg_sq_col", &sq_col_}};
  for (const auto& [key, v] : named)
    if (i < v->size() && (*v)[i].defined()) out.emplace_back(key, &(*v)[i]);
  return out;
}

std::vector<std::pair<std::string, const at::Tensor*>> Optimizer::states(size_t i) const {
  std::vector<std::pair<std::string, const at::Tensor*>> out;
  for (const auto& [key, t] : const_cast<Optimizer*>(this)->states(i)) out.emplace_back(key, t);
  return out;
}

nlohmann::json Optimizer::state_scalars() const {
  return {{"kind", options_.kind}, {"paged", options_.paged}, {"steps", steps_}, {"params", params_.size()}};
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& tensors, const nlohmann::json& scalars) {
  // An fp32 AdamW checkpoint into a state the ladder made 8-bit before the first step (a
  // resume under a limit that cannot hold it in fp32): quantized from the file, as the rung
  // would have done.
  const bool requantize = states_quantized() && scalars.value("kind", std::string()) == configured_kind_;
  MEMTUNE_CHECK(requantize || scalars.value("kind", std::string()) == options_.kind, "checkpoint optimizer is '",
                scalars.value("kind", std::string()), "', the config asks for '", options_.kind,
                "' (training.optim changed since the checkpoint)");
  MEMTUNE_CHECK(scalars.value("paged", false) == options_.paged, "checkpoint optimizer state is ",
                scalars.value("paged", false) ? "paged" : "not paged", ", the config's is ",
                options_.paged ? "paged" : "not paged", " (training.optim changed since the checkpoint)");
  at::NoGradGuard no_grad;
  auto take = [&](const std::string& key, at::Tensor& dst) {
    auto it = tensors.find(key);
    MEMTUNE_CHECK(it != tensors.end(), "checkpoint optimizer state lacks '", key,
                  "' (trainable parameters changed since the checkpoint?)");
    MEMTUNE_CHECK(it->second.sizes() == dst.sizes(), "checkpoint optimizer state '", key, "' has shape ",
                  it->second.sizes(), ", expected ", dst.sizes());
    MEMTUNE_CHECK(it->second.scalar_type() == dst.scalar_type(), "checkpoint optimizer state '", key, "' is ",
                  it->second.scalar_type(), ", expected ", dst.scalar_type());
    dst.copy_(it->second);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!owned_[i]) continue;
    if (requantize && absmax1_[i].defined()) {
      const std::string& name = params_[i].first;
      // One tensor's fp32 states at a time, in host memory outside the device budget.
      at::Tensor m = offload_zeros(exp_avg_[i].sizes(), at::kFloat), v = offload_zeros(exp_avg_sq_[i].sizes(), at::kFloat);
      take(name + ".exp_avg", m);
      take(name + ".exp_avg_sq", v);
      const int64_t n = m.numel(), blocks = absmax1_[i].numel();
      at::Tensor c1 = offload_zeros({n}, at::kByte), c2 = offload_zeros({n}, at::kByte),
                 a1 = offload_zeros({blocks}, at::kFloat), a2 = offload_zeros({blocks}, at::kFloat);
      quantize_states_8bit(m.data_ptr<float>(), v.data_ptr<float>(), n, c1.data_ptr<uint8_t>(), c2.data_ptr<uint8_t>(),
                           a1.data_ptr<float>(), a2.data_ptr<float>());
      exp_avg_[i].view({-1}).copy_(c1);
      exp_avg_sq_[i].view({-1}).copy_(c2);
      absmax1_[i].copy_(a1);
      absmax2_[i].copy_(a2);
      continue;
    }
    for (const auto& [key, t] : states(i)) take(params_[i].first + key, *t);
  }
  steps_ = json_int(scalars, "steps", 0, int64_t{1} << 40, "optimizer");
}

double grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  return std::sqrt(grad_square_sum(params));
}

double grad_square_sum(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  at::NoGradGuard no_grad;
  double sq = 0;
  // Elsewhere than in host memory the sums stay on their device, one per device, read once at
  // the end: a read per tensor would wait for the device once per tensor (448 times a step for
  // LoRA on every projection of an 8B model).
  std::vector<at::Tensor> device_sums;  // one per device
  auto add_on_device = [&](const at::Tensor& s) {
    auto same = std::find_if(device_sums.begin(), device_sums.end(),
                             [&](const at::Tensor& t) { return t.device() == s.device(); });
    if (same == device_sums.end())
      device_sums.push_back(s);
    else
      same->add_(s);
  };
#ifdef MEMTUNE_CUDA
  // fp32 gradients on a GPU: each device's in a few multi-tensor launches, no fp64 copy.
  std::map<c10::DeviceIndex, std::vector<at::Tensor>> on_gpu;
#endif
  for (const auto& [name, p] : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (cpu_f32_contiguous(g)) {
      // Squares summed in double, as the op chain below; no double copy of the gradient.
      sq += square_sum(g.data_ptr<float>(), g.numel());
      continue;
    }
#ifdef MEMTUNE_CUDA
    if (square_sum_cuda_applies(g)) {
      on_gpu[g.device().index()].push_back(g);
      continue;
    }
#endif
    add_on_device(g.to(at::kDouble).pow(2).sum());
  }
#ifdef MEMTUNE_CUDA
  for (const auto& [index, grads] : on_gpu) add_on_device(square_sum_cuda(grads));
#endif
  for (const at::Tensor& s : device_sums) sq += s.item<double>();
  return sq;
}

}  // namespace memtune::trainer
