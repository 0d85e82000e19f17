#pragma once
// Evaluation: mean next-token cross-entropy, perplexity and token count on a dataset.
#include <cstdint>

namespace memtune::models {
class CausalLM;
}
namespace memtune::data {
class Dataset;
}

namespace memtune::trainer {

struct EvalResult {
  double loss = 0;        // mean cross-entropy per target token
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // target tokens counted
};

// `max_rows` < 0: every sample. Runs without gradients, `micro_batch` samples at a time.
EvalResult evaluate(models::CausalLM& model, const data::Dataset& dataset, int64_t micro_batch,
                    int64_t max_rows = -1);

}  // namespace memtune::trainer
