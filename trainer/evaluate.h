#pragma once
// Evaluation: mean next-token cross-entropy, perplexity and token count on a dataset.
#include <cstdint>
#include <functional>

namespace memtune::models {
class CausalLM;
}
namespace memtune::data {
class Dataset;
}

namespace memtune::trainer {

struct EvalResult {
  double loss = 0;        // mean cross-entropy per target token (label-smoothed when asked, as transformers' eval_loss)
  double perplexity = 0;  // exp(mean cross-entropy), without smoothing
  int64_t tokens = 0;     // target tokens counted
  double token_accuracy = 0;  // share of targets that are the most likely next token
  bool stopped = false;       // `stop` said so before every row was seen: the figures cover fewer rows
  int64_t micro_batch = 0;    // samples at a time at the end: the one asked for, or less after out-of-memory errors
  int64_t oom_retries = 0;    // micro-batches run again, halved, after an out-of-memory error
};

// `max_rows` < 0: every sample. Runs without gradients, `micro_batch` (>= 1) samples at a
// time; `stop`, asked before each micro-batch, ends it early (a SIGTERM during evaluation).
// After an out-of-memory error `on_oom` is called (to release cached memory) and says whether
// to halve the micro-batch for the rest of the evaluation and run the same samples again (the
// loss is a sum over tokens, so the figures stay); without it, or at one sample, the error is
// rethrown. Leave it out where a forward holds collectives (layers sharded over ranks): one
// rank's retry would pair its gathers with the other ranks' next layer.
// `label_smoothing`: the loss's (training.label_smoothing_factor), as transformers'
// evaluation computes its eval_loss with the Trainer's label smoother.
EvalResult evaluate(models::CausalLM& model, const data::Dataset& dataset, int64_t micro_batch,
                    int64_t max_rows = -1, const std::function<bool()>& stop = {},
                    const std::function<bool()>& on_oom = {}, double label_smoothing = 0);

}  // namespace memtune::trainer
