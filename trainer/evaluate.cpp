#include "trainer/evaluate.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "data/batch.h"
#include "data/dataset.h"
#include "models/causal_lm.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace memtune::trainer {

EvalResult evaluate(models::CausalLM& model, const data::Dataset& dataset, int64_t micro_batch, int64_t max_rows,
                    const std::function<bool()>& stop, const std::function<bool()>& on_oom, double label_smoothing) {
  MEMTUNE_CHECK(micro_batch >= 1, "evaluation batch size is ", micro_batch, "; it must be at least 1");
  at::NoGradGuard no_grad;
  const int64_t n = max_rows < 0 ? dataset.size() : std::min(max_rows, dataset.size());
  const int32_t pad = 0;
  double sum = 0, plain = 0;  // the loss, and without smoothing
  int64_t correct = 0;
  EvalResult r;
  models::ForwardOptions opts;
  opts.label_smoothing = label_smoothing;
  for (int64_t i = 0; i < n;) {
    if (stop && stop()) {
      r.stopped = true;
      break;
    }
    std::vector<data::Sample> samples;
    for (int64_t j = i; j < std::min(n, i + micro_batch); ++j) samples.push_back(dataset.sample(j));
    models::ForwardOutput out;
    try {
      data::Batch b = data::collate(samples, 8, pad);
      out = model.forward(b, opts);
    } catch (const std::exception& e) {
      if (!compat::is_out_of_memory(e) || micro_batch == 1 || !on_oom || !on_oom()) throw;
      micro_batch = (micro_batch + 1) / 2;  // the same rows again, fewer at a time
      ++r.oom_retries;
      continue;
    }
    const double loss = out.loss_sum.item<double>();
    sum += loss;
    plain += label_smoothing > 0 ? out.cross_entropy_sum.item<double>() : loss;
    r.tokens += out.target_tokens;
    correct += out.correct_tokens;
    i += static_cast<int64_t>(samples.size());
  }
  r.micro_batch = micro_batch;
  r.token_accuracy = r.tokens > 0 ? static_cast<double>(correct) / static_cast<double>(r.tokens) : 0.0;
  r.loss = r.tokens > 0 ? sum / static_cast<double>(r.tokens) : 0.0;
  r.perplexity = std::exp(r.tokens > 0 ? plain / static_cast<double>(r.tokens) : 0.0);
  return r;
}

}  // namespace memtune::trainer
