#include "trainer/optimizer.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::trainer {

namespace {

// torch.optim.AdamW's update in one pass over contiguous fp32 CPU tensors, in the order and
// precision of the ATen op chain below (one read and write of p, g, m, v instead of ten
// passes and a scalar-to-tensor conversion per op, for every adapter matrix).
struct AdamWStep {
  float scale, decay, b1, one_minus_b1, b2, one_minus_b2, sqrt_bc2, eps, step;
  void run(float* p, float* g, float* m, float* v, int64_t n) const {
    at::parallel_for(0, n, 16384, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const float gj = g[j] * scale;
        g[j] = gj;
        const float pj = p[j] * decay;
        const float mj = m[j] * b1 + one_minus_b1 * gj;
        const float vj = v[j] * b2 + one_minus_b2 * (gj * gj);
        m[j] = mj;
        v[j] = vj;
        p[j] = pj + step * (mj / (std::sqrt(vj) / sqrt_bc2 + eps));
      }
    });
  }
};

bool fused_adamw_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  return true;
}

}  // namespace

bool decays(const std::string& name, const at::Tensor& t) {
  if (t.dim() < 2) return false;  // biases and norm weights
  return name.find("norm") == std::string::npos && name.find("ln_") == std::string::npos;
}

Optimizer::Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerOptions options)
    : options_(std::move(options)), params_(std::move(params)) {
  MEMTUNE_CHECK(options_.kind == "adamw" || options_.kind == "sgd", "training.optim: unknown optimizer '",
                options_.kind, "' (adamw_torch, adamw, sgd)");
  for (const auto& [name, p] : params_) {
    MEMTUNE_INTERNAL_ASSERT(p.scalar_type() == at::kFloat, "optimizer: ", name, " must be fp32");
    exp_avg_.push_back(at::zeros_like(p));
    if (options_.kind == "adamw") exp_avg_sq_.push_back(at::zeros_like(p));
    at::Tensor& w = workspaces_[p.device().str()];
    if (!w.defined() || w.numel() < p.numel()) w = at::empty({p.numel()}, p.options().requires_grad(false));
  }
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
}

void Optimizer::step(double lr, double grad_scale) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& [name, p] = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    const double wd = decays(name, p) ? options_.weight_decay : 0.0;
    if (options_.kind == "adamw" && fused_adamw_applies(p, g, exp_avg_[i], exp_avg_sq_[i])) {
      const AdamWStep s{static_cast<float>(grad_scale), static_cast<float>(1.0 - lr * wd), static_cast<float>(b1),
                        static_cast<float>(1.0 - b1), static_cast<float>(b2), static_cast<float>(1.0 - b2),
                        static_cast<float>(std::sqrt(bc2)), static_cast<float>(options_.eps),
                        static_cast<float>(-lr / bc1)};
      s.run(p.data_ptr<float>(), g.data_ptr<float>(), exp_avg_[i].data_ptr<float>(), exp_avg_sq_[i].data_ptr<float>(),
            p.numel());
      continue;
    }
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
      p.addcdiv_(exp_avg_[i], denom, -lr / bc1);
    } else {
      // torch.optim.SGD with (L2) weight decay and momentum (dampening 0).
      if (wd != 0) g.add_(p, wd);
      if (options_.momentum != 0) {
        if (steps_ == 1) exp_avg_[i].copy_(g);
        else exp_avg_[i].mul_(options_.momentum).add_(g);
        p.add_(exp_avg_[i], -lr);
      } else {
        p.add_(g, -lr);
      }
    }
  }
}

int64_t Optimizer::state_bytes() const {
  int64_t n = 0;
  for (const auto& [device, w] : workspaces_) n += w.numel() * 4;
  for (const auto& t : exp_avg_) n += t.numel() * 4;
  for (const auto& t : exp_avg_sq_) n += t.numel() * 4;
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].first + ".exp_avg", exp_avg_[i]);
    if (!exp_avg_sq_.empty()) out.emplace_back(params_[i].first + ".exp_avg_sq", exp_avg_sq_[i]);
  }
  return out;
}

nlohmann::json Optimizer::state_scalars() const {
  return {{"kind", options_.kind}, {"steps", steps_}, {"params", params_.size()}};
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& tensors, const nlohmann::json& scalars) {
  MEMTUNE_CHECK(scalars.value("kind", std::string()) == options_.kind, "checkpoint optimizer is '",
                scalars.value("kind", std::string()), "', the config asks for '", options_.kind,
                "' (training.optim changed since the checkpoint)");
  at::NoGradGuard no_grad;
  auto take = [&](const std::string& key, at::Tensor& dst) {
    auto it = tensors.find(key);
    MEMTUNE_CHECK(it != tensors.end(), "checkpoint optimizer state lacks '", key,
                  "' (trainable parameters changed since the checkpoint?)");
    MEMTUNE_CHECK(it->second.sizes() == dst.sizes(), "checkpoint optimizer state '", key, "' has shape ",
                  it->second.sizes(), ", expected ", dst.sizes());
    dst.copy_(it->second);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    take(params_[i].first + ".exp_avg", exp_avg_[i]);
    if (!exp_avg_sq_.empty()) take(params_[i].first + ".exp_avg_sq", exp_avg_sq_[i]);
  }
  steps_ = json_int(scalars, "steps", 0, int64_t{1} << 40, "optimizer");
}

double grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  at::NoGradGuard no_grad;
  double sq = 0;
  for (const auto& [name, p] : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous()) {
      // Squares summed in double, as the op chain below; no double copy of the gradient.
      const float* x = g.data_ptr<float>();
      const int64_t n = g.numel();
      std::vector<double> part(static_cast<size_t>(at::get_num_threads()), 0.0);
      at::parallel_for(0, n, 16384, [&](int64_t j0, int64_t j1) {
        double acc = 0;
        for (int64_t j = j0; j < j1; ++j) acc += static_cast<double>(x[j]) * x[j];
        part[static_cast<size_t>(at::get_thread_num())] += acc;
      });
      for (double v : part) sq += v;
    } else {
      sq += g.to(at::kDouble).pow(2).sum().item<double>();
    }
  }
  return std::sqrt(sq);
}

}  // namespace memtune::trainer
