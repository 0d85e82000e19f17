#include "trainer/grad_scaler.h"

#include <limits>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "runtime/json_input.h"

namespace memtune::trainer {

GradScaler::GradScaler(bool enabled, double init_scale, int64_t growth_interval, double growth_factor,
                       double backoff_factor)
    : enabled_(enabled),
      scale_(init_scale),
      growth_interval_(growth_interval),
      growth_factor_(growth_factor),
      backoff_factor_(backoff_factor) {}

bool GradScaler::unscale(const std::vector<std::pair<std::string, at::Tensor>>& params) const {
  if (!enabled_) return true;
  at::NoGradGuard no_grad;
  bool finite = true;
  for (const auto& [name, p] : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    g.div_(scale_);
    finite = finite && at::isfinite(g).all().item<bool>();
  }
  return finite;
}

void GradScaler::update(bool found_inf) {
  if (!enabled_) return;
  if (found_inf) {
    scale_ *= backoff_factor_;
    good_steps_ = 0;
    ++skipped_;
    return;
  }
  if (++good_steps_ >= growth_interval_) {
    scale_ *= growth_factor_;
    good_steps_ = 0;
  }
}

nlohmann::json GradScaler::state() const {
  return {{"enabled", enabled_}, {"scale", scale_}, {"good_steps", good_steps_}, {"skipped", skipped_}};
}

void GradScaler::load_state(const nlohmann::json& s) {
  constexpr int64_t kMax = int64_t{1} << 40;
  scale_ = json_number(s, "scale", std::numeric_limits<double>::min(), std::numeric_limits<double>::max(), "scaler");
  good_steps_ = json_int(s, "good_steps", 0, kMax, "scaler");
  skipped_ = json_int(s, "skipped", 0, kMax, "scaler");
}

}  // namespace memtune::trainer
