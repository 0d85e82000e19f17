#pragma once
// The best evaluation, as transformers' Trainer ranks them (metric_for_best_model,
// greater_is_better): what load_best_model_at_end loads, save_total_limit keeps and
// reduce_lr_on_plateau steps with.
#include <string>

#include "trainer/config.h"

namespace memtune::trainer {

// metric_for_best_model without its eval_ prefix (loss, perplexity or token_accuracy); unset,
// "loss" where load_best_model_at_end or reduce_lr_on_plateau needs one (transformers'
// default), else "": nothing ranks the evaluations.
std::string best_metric_name(const TrainingConfig& t);

// greater_is_better; unset, whether that name does not end in "loss" (transformers').
bool best_is_greater(const TrainingConfig& t);

}  // namespace memtune::trainer
