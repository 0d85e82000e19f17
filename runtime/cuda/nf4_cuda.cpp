#include "runtime/cuda/nf4_cuda.h"

#include <ATen/ATen.h>
#include <algorithm>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "runtime/cuda/nf4_cuda_kernels.h"
#include "runtime/error.h"
#include "runtime/nf4_kernels.h"

namespace memtune {

at::Tensor nf4_dequantize_cuda(const NF4Tensor& q, at::ScalarType out_dtype) {
  check_nf4_state(q);
  const c10::Device device = q.device();
  TORCH_CHECK(device.is_cuda(), "nf4_dequantize_cuda: the quantized state is on ", device);
  auto on_device = [&](const at::Tensor& t) { return !t.defined() || t.device() == device; };
  TORCH_CHECK(on_device(q.absmax) && on_device(q.nested_absmax) && on_device(q.nested_quant_map),
              "nf4_dequantize_cuda: the quantized state's tensors are not all on ", device);
  nf4_cuda::OutType out_type;
  switch (out_dtype) {
    case at::kFloat: out_type = nf4_cuda::OutType::kFloat; break;
    case at::kHalf: out_type = nf4_cuda::OutType::kHalf; break;
    case at::kBFloat16: out_type = nf4_cuda::OutType::kBFloat16; break;
    default: TORCH_CHECK(false, "nf4_dequantize_cuda: unsupported output dtype ", out_dtype);
  }
  // The kernel's groups of 8 lie in one block and its index is a shift: what nf4_quantize makes.
  TORCH_CHECK(q.blocksize >= 32 && q.blocksize <= 4096 && (q.blocksize & (q.blocksize - 1)) == 0,
              "nf4_dequantize_cuda: blocksize ", q.blocksize, " is not a power of two in [32, 4096]");
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty(q.shape, q.packed.options().dtype(out_dtype));
  nf4_cuda::Scales scales;
  if (q.double_quant) {
    scales.absmax_codes = q.absmax.data_ptr<uint8_t>();
    scales.nested_absmax = q.nested_absmax.data_ptr<float>();
    scales.nested_map = q.nested_quant_map.data_ptr<float>();
    scales.nested_offset = q.nested_offset;
  } else {
    scales.absmax = q.absmax.data_ptr<float>();
  }
  C10_CUDA_CHECK(nf4_cuda::dequantize(q.packed.data_ptr<uint8_t>(), scales, codebook_4bit(q.quant_type).data(),
                                      q.numel(), q.blocksize, out_type, out.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream(device.index()).stream()));
  return out;
}

void nf4_quantize_blocks_cuda(const at::Tensor& w, int64_t blocksize, QuantType quant_type, at::Tensor& packed,
                              at::Tensor& absmax) {
  TORCH_CHECK(w.is_cuda(), "nf4_quantize_blocks_cuda: the tensor is on ", w.device());
  nf4_cuda::InType in_type;
  switch (w.scalar_type()) {
    case at::kFloat: in_type = nf4_cuda::InType::kFloat; break;
    case at::kHalf: in_type = nf4_cuda::InType::kHalf; break;
    case at::kBFloat16: in_type = nf4_cuda::InType::kBFloat16; break;
    default: TORCH_CHECK(false, "nf4_quantize_blocks_cuda: unsupported dtype ", w.scalar_type());
  }
  const c10::cuda::CUDAGuard guard(w.device());
  const at::Tensor x = w.contiguous();
  const int64_t n = x.numel();
  packed = at::empty({(n + 1) / 2}, x.options().dtype(at::kByte));
  absmax = at::empty({(n + blocksize - 1) / blocksize}, x.options().dtype(at::kFloat));
  nf4_cuda::CodeRule rule;
  if (quant_type == QuantType::kFP4) {
    rule.sign_magnitude = true;
    std::copy(nf4_kernels::kFp4MagnitudeThresholds.begin(), nf4_kernels::kFp4MagnitudeThresholds.end(),
              rule.thresholds);
    std::copy(nf4_kernels::kFp4MagnitudeCodes.begin(), nf4_kernels::kFp4MagnitudeCodes.end(), rule.magnitude_codes);
  } else {
    std::copy(nf4_kernels::kNf4Thresholds.begin(), nf4_kernels::kNf4Thresholds.end(), rule.thresholds);
  }
  C10_CUDA_CHECK(nf4_cuda::quantize(x.data_ptr(), in_type, rule, n, blocksize, packed.data_ptr<uint8_t>(),
                                    absmax.data_ptr<float>(),
                                    c10::cuda::getCurrentCUDAStream(w.device().index()).stream()));
}

}  // namespace memtune
