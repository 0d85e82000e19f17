#pragma once
// The random generators a training step draws from (dropout), saved and restored so that a
// retried step and a resumed run draw exactly what the straight run drew.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace memtune {

// The CPU generator's state (uint8 tensor, LibTorch's own layout).
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

// distributed: each rank's draws of a step come from (seed, step, rank), so every rank
// resumes exactly from a checkpoint that holds only rank 0's generator.
void seed_cpu_rng(uint64_t seed, int64_t step, int rank);

}  // namespace memtune
