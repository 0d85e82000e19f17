#include "trainer/best_model.h"

namespace memtune::trainer {

std::string best_metric_name(const TrainingConfig& t) {
  std::string m = t.metric_for_best_model;
  if (m.rfind("eval_", 0) == 0) m = m.substr(5);
  if (m.empty() && (t.load_best_model_at_end || t.lr_scheduler_type == "reduce_lr_on_plateau")) m = "loss";
  return m;
}

bool best_is_greater(const TrainingConfig& t) {
  if (!t.greater_is_better.empty()) return t.greater_is_better == "true";
  const std::string m = best_metric_name(t);
  return !(m.size() >= 4 && m.compare(m.size() - 4, 4, "loss") == 0);
}

}  // namespace memtune::trainer
