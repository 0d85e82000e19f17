#pragma once
// The element types memtune's CUDA kernels take, named without LibTorch so that the .cu
// files include no LibTorch header (runtime/cuda/device_math.cuh maps them to CUDA's
// types); C++ callers get the mapping from LibTorch's dtypes as well.
#include <optional>

#if !defined(__CUDACC__)
#include <c10/core/ScalarType.h>
#endif

namespace memtune::cuda_math {

enum class DType { kFloat, kHalf, kBFloat16 };

#if !defined(__CUDACC__)
// The kernels' name for `t`, or nothing for a dtype they do not take.
inline std::optional<DType> device_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return DType::kFloat;
    case c10::ScalarType::Half: return DType::kHalf;
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    default: return std::nullopt;
  }
}
#endif

}  // namespace memtune::cuda_math
