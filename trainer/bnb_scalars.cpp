#include "trainer/bnb_scalars.h"

#include <cmath>

namespace memtune::trainer {

// The fp32 scalars bitsandbytes' kernels derive from (step, lr, betas).
BnbScalars::BnbScalars(int64_t step, double lr, double beta1, double beta2, double eps, double wd,
                       double grad_scale) {
  const float lrf = static_cast<float>(lr), wdf = static_cast<float>(wd), t = static_cast<float>(step);
  b1 = static_cast<float>(beta1);
  b2 = static_cast<float>(beta2);
  one_minus_b1 = 1.0f - b1;
  one_minus_b2 = 1.0f - b2;
  // beta^t as a correctly rounded fp32 (the power of the fp32 beta in double, rounded once):
  // the kernels' powf, without depending on which libm's last bit.
  auto powf = [&](float b) { return static_cast<float>(std::pow(static_cast<double>(b), static_cast<double>(t))); };
  const float c1 = 1.0f - powf(b1);
  const float c2 = std::sqrt(1.0f - powf(b2));
  step_size = (-lrf * c2) / c1;
  eps_c2 = c2 * static_cast<float>(eps);  // the 8-bit kernel's correction2 * eps
  decay_on = wdf > 0.0f;
  decay = 1.0f - lrf * wdf;
  gs = static_cast<float>(grad_scale);
}

}  // namespace memtune::trainer
