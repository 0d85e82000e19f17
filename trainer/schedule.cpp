#include "trainer/schedule.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace memtune::trainer {

double Schedule::lr(int64_t step) const {
  const double s = static_cast<double>(step);
  if (kind == "constant") return learning_rate;
  if (step < warmup_steps) return learning_rate * s / static_cast<double>(std::max<int64_t>(1, warmup_steps));
  if (kind == "constant_with_warmup") return learning_rate;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = (s - static_cast<double>(warmup_steps)) / span;
  if (kind == "linear") return learning_rate * std::max(0.0, 1.0 - progress);
  if (kind == "cosine") return learning_rate * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
  fail("training.lr_scheduler_type: unknown schedule '", kind, "' (constant, constant_with_warmup, linear, cosine)");
}

}  // namespace memtune::trainer
