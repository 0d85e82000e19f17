#pragma once
// The training loop: `memtune train CONFIG`. An explicit loop, not a base class of hooks:
// each step owns the samples the sampler gives it and runs them under the memory supervisor.
#include <cstdint>
#include <filesystem>
#include <string>

#include "data/dataset.h"
#include "trainer/config.h"

namespace memtune::trainer {

struct TrainResult {
  int64_t steps = 0;            // optimizer steps completed (including resumed ones)
  double last_loss = 0;         // mean token loss of the last step
  int exit_code = 0;            // 0, or 128+signal when stopped by SIGINT/SIGTERM after a checkpoint
  std::string checkpoint;       // the last checkpoint written
};

// The data section as the dataset reads it; `memtune train` and `memtune tokenize --config`
// both build their dataset from it, so a key means the same in both.
data::DatasetOptions dataset_options(const DataConfig& data, const std::filesystem::path& output_dir);
// One side of data.eval_split over data.train_file: the held-out documents, or the others
// (the training set). training.seed draws them; without shuffling, the file's last ones.
// No split (all of the file) when eval_split is 0. `memtune tokenize --config` writes the
// whole file: its documents split the same way when trained from, where each document is
// one in the .bin (a template whose eos closes every message makes several there).
data::HoldOut eval_split_side(const Config& config, bool held_out);

// Runs the configured training to the end, or until SIGINT/SIGTERM (then it checkpoints and
// returns). Throws UserError on bad input and MemoryExhausted when nothing fits.
TrainResult train(const Config& config);

}  // namespace memtune::trainer
