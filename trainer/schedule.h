#pragma once
// Learning-rate schedules with Hugging Face's semantics: optimizer step k (0-based) uses
// learning_rate * lambda(k); with warmup, lambda rises linearly from 0.
#include <cstdint>
#include <string>

namespace memtune::trainer {

struct Schedule {
  std::string kind = "linear";  // constant|constant_with_warmup|linear|cosine
  double learning_rate = 2e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  double lr(int64_t step) const;
};

}  // namespace memtune::trainer
