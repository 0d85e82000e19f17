#include "models/layers/rotary.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "runtime/error.h"
#include "runtime/step_profiler.h"

#ifdef MEMTUNE_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/layers/cuda/rotary_cuda_kernels.h"
#endif

namespace memtune::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.slice(-1, h), x.slice(-1, 0, h)}, -1);
}

// rotate_half's transpose: [y1, y2] -> [y2, -y1].
at::Tensor rotate_half_transposed(const at::Tensor& y) {
  const int64_t h = y.size(-1) / 2;
  return at::cat({y.slice(-1, h), -y.slice(-1, 0, h)}, -1);
}

// One pass over contiguous fp32 rows: out = x * c + rotate_half(x) * s, or with `inverse`
// (the backward) out = x * c + rotate_half^T(x * s). c and s hold one row of D per (b,t),
// shared by the H heads.
void rotate_rows(const float* x, const float* c, const float* s, float* out, int64_t rows, int64_t H, int64_t D,
                 bool inverse) {
  const int64_t h = D / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (H * D)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* cr = c + r * D;
      const float* sr = s + r * D;
      for (int64_t k = 0; k < H; ++k) {
        const float* xi = x + (r * H + k) * D;
        float* o = out + (r * H + k) * D;
        if (!inverse) {
          for (int64_t d = 0; d < h; ++d) o[d] = xi[d] * cr[d] - xi[d + h] * sr[d];
          for (int64_t d = h; d < D; ++d) o[d] = xi[d] * cr[d] + xi[d - h] * sr[d];
        } else {
          for (int64_t d = 0; d < h; ++d) o[d] = xi[d] * cr[d] + xi[d + h] * sr[d + h];
          for (int64_t d = h; d < D; ++d) o[d] = xi[d] * cr[d] - xi[d - h] * sr[d - h];
        }
      }
    }
  });
}

bool fast_path(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x.device().is_cpu() && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
         sin.scalar_type() == at::kFloat && cos.numel() == x.size(0) * x.size(1) * x.size(3) &&
         sin.numel() == cos.numel();
}

#ifdef MEMTUNE_CUDA
// x, cos and sin on one CUDA device in fp32, fp16 or bf16 (cos and sin of one dtype).
bool cuda_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using cuda_math::device_type;
  return x.is_cuda() && cos.device() == x.device() && sin.device() == x.device() && device_type(x.scalar_type()) &&
         device_type(cos.scalar_type()) && sin.scalar_type() == cos.scalar_type();
}

at::Tensor rotate_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  using cuda_math::device_type;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  C10_CUDA_CHECK(rotary_cuda::rotate(xc.data_ptr(), *device_type(x.scalar_type()), c.data_ptr(), s.data_ptr(),
                                     *device_type(cos.scalar_type()), x.size(0) * x.size(1), x.size(2), x.size(3),
                                     inverse, out.data_ptr(),
                                     c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  return out;
}
#endif

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
#ifdef MEMTUNE_CUDA
  if (cuda_kernel(x, cos, sin)) return rotate_cuda(x, cos, sin, inverse);
#endif
  if (fast_path(x, cos, sin)) {
    at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
    at::Tensor out = at::empty_like(xc, at::MemoryFormat::Contiguous);
    rotate_rows(xc.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(),
                x.size(0) * x.size(1), x.size(2), x.size(3), inverse);
    return out;
  }
  const at::Tensor c = cos.to(x.scalar_type()).reshape({x.size(0), x.size(1), 1, x.size(3)});
  const at::Tensor s = sin.to(x.scalar_type()).reshape({x.size(0), x.size(1), 1, x.size(3)});
  return inverse ? x * c + rotate_half_transposed(x * s) : x * c + rotate_half(x) * s;
}

struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate(x, cos, sin, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rotate(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  MEMTUNE_PROFILE_SCOPE("memtune::rotary");
  MEMTUNE_INTERNAL_ASSERT(x.dim() == 4 && x.size(3) % 2 == 0, "rotary: x (B,T,H,D) with D even, got ", x.sizes());
  MEMTUNE_INTERNAL_ASSERT(cos.numel() == x.size(0) * x.size(1) * x.size(3) && sin.sizes() == cos.sizes(),
              "rotary: cos/sin ", cos.sizes(), " do not match x ", x.sizes());
  return RotaryFunction::apply(x, cos, sin);
}

}  // namespace memtune::models
