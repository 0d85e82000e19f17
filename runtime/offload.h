#pragma once
// Offloaded weights: kept in host memory outside the device's budget, copied to the
// compute device just before their layer runs and released after.
#include <ATen/core/Tensor.h>

namespace memtune {

// A copy of `t` in plain host memory that the CPU budget allocator does not count (as
// weights offloaded to host RAM are not part of a GPU's memory). Undefined stays undefined.
at::Tensor to_offload_storage(const at::Tensor& t);

// Zeros in that host memory (outside the CPU budget), allocated there directly.
at::Tensor offload_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

// A copy of an offloaded tensor on `device`, allocated there (counted by its budget).
at::Tensor fetch_from_offload(const at::Tensor& t, const c10::Device& device);

}  // namespace memtune
