#include "models/layers/rotary.h"

#include <algorithm>
#include <cmath>

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

at::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& r) {
  const int64_t d = head_dim;
  at::Tensor inv = 1.0 / at::pow(theta, at::arange(0, d, 2, at::kFloat) / static_cast<double>(d));
  if (r.type == "linear") return inv / r.factor;
  // dynamic (NTK): transformers scales the base by (factor * L / max_position_embeddings -
  // (factor - 1))^(d / (d - 2)) for L = max(longest sequence, max_position_embeddings): 1 up
  // to max_position_embeddings, past which layer_context refuses the batch.
  if (r.type == "dynamic") return inv;
  if (r.type == "llama3") {
    const double old_len = static_cast<double>(r.original_max_position_embeddings);
    const double low_wavelen = old_len / r.low_freq_factor;
    const double high_wavelen = old_len / r.high_freq_factor;
    at::Tensor wavelen = 2.0 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    return at::where(medium, smoothed, scaled);
  }
  if (r.type == "yarn") {
    // Dimensions that rotate more than beta_fast times over the original context keep their
    // frequency, those under beta_slow are divided by the factor, a linear ramp between.
    const double orig = static_cast<double>(r.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return static_cast<double>(d) * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(theta));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(d - 1));
    if (low == high) high += 0.001;
    at::Tensor ramp = ((at::arange(d / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    at::Tensor keep = 1 - ramp;  // 1: extrapolate (original frequency), 0: interpolate
    return inv / r.factor * (1 - keep) + inv * keep;
  }
  return inv;
}

double rope_attention_factor(const RopeScaling& r) {
  if (r.type != "yarn") return 1.0;
  if (r.attention_factor) return *r.attention_factor;
  auto mscale = [&](double m) { return r.factor <= 1 ? 1.0 : 0.1 * m * std::log(r.factor) + 1.0; };
  if (r.mscale != 0 && r.mscale_all_dim != 0) return mscale(r.mscale) / mscale(r.mscale_all_dim);
  return mscale(1.0);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& position_ids, const at::Tensor& inv_freq,
                                                double scale) {
  at::Tensor freqs = position_ids.to(at::kFloat).unsqueeze(-1) * inv_freq.to(position_ids.device());
  at::Tensor emb = at::cat({freqs, freqs}, -1);  // (B,T,D)
  at::Tensor cos = emb.cos().unsqueeze(2), sin = emb.sin().unsqueeze(2);
  if (scale != 1.0) {
    cos = cos * scale;
    sin = sin * scale;
  }
  return {cos, sin};
}

}  // namespace memtune::models
