#pragma once
// Dynamic loss scaling for fp16 (LibTorch's C++ API has no GradScaler): the loss is
// multiplied by `scale` before backward; gradients are unscaled before the update; a step
// whose gradients hold inf/nan is skipped and the scale backed off; after
// `growth_interval` good steps in a row the scale grows. Device-generic tensor ops.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

namespace memtune::trainer {

class GradScaler {
 public:
  GradScaler(bool enabled, double init_scale = 65536.0, int64_t growth_interval = 2000,
             double growth_factor = 2.0, double backoff_factor = 0.5);

  bool enabled() const { return enabled_; }
  double scale() const { return enabled_ ? scale_ : 1.0; }
  // Divides every gradient by the scale; returns false when any holds inf or nan.
  bool unscale(const std::vector<std::pair<std::string, at::Tensor>>& params) const;
  // After the step: back off on overflow (the step was skipped), else count towards growth.
  void update(bool found_inf);
  int64_t skipped_steps() const { return skipped_; }

  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  bool enabled_;
  double scale_;
  int64_t growth_interval_;
  double growth_factor_, backoff_factor_;
  int64_t good_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace memtune::trainer
