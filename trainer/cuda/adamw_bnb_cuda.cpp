#include "trainer/cuda/adamw_bnb_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/adamw8bit_kernels.h"
#include "trainer/cuda/adamw_bnb_cuda_kernels.h"

namespace memtune::trainer {

bool bnb_cuda_applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& states) {
  if (!p.is_cuda() || p.scalar_type() != at::kFloat || !p.is_contiguous()) return false;
  if (!g.defined() || g.device() != p.device() || g.scalar_type() != at::kFloat || !g.is_contiguous()) return false;
  for (const at::Tensor& t : states)
    if (t.defined() && (t.device() != p.device() || !t.is_contiguous())) return false;
  return true;
}

void bnb_adam8_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& c1,
                    const at::Tensor& c2, const at::Tensor& absmax1, const at::Tensor& absmax2) {
  TORCH_CHECK(bnb_cuda_applies(p, g, {c1, c2, absmax1, absmax2}) && c1.scalar_type() == at::kByte &&
                  c2.scalar_type() == at::kByte && absmax1.scalar_type() == at::kFloat &&
                  absmax2.scalar_type() == at::kFloat && c1.numel() == p.numel() && c2.numel() == p.numel() &&
                  absmax1.numel() == (p.numel() + kBlock8bit - 1) / kBlock8bit &&
                  absmax2.numel() == absmax1.numel(),
              "bnb_adam8_cuda: the parameter, gradient and 8-bit states disagree (device, dtype or size)");
  const c10::cuda::CUDAGuard guard(p.device());
  C10_CUDA_CHECK(bnb_cuda::adam8(s, dynamic_map(true).data_ptr<float>(), dynamic_map(false).data_ptr<float>(),
                                 p.data_ptr<float>(), g.data_ptr<float>(), c1.data_ptr<uint8_t>(),
                                 c2.data_ptr<uint8_t>(), absmax1.data_ptr<float>(), absmax2.data_ptr<float>(),
                                 p.numel(), c10::cuda::getCurrentCUDAStream(p.device().index()).stream()));
}

void bnb_adam32_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v) {
  TORCH_CHECK(bnb_cuda_applies(p, g, {m, v}) && m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  m.numel() == p.numel() && v.numel() == p.numel(),
              "bnb_adam32_cuda: the parameter, gradient and states disagree (device, dtype or size)");
  const c10::cuda::CUDAGuard guard(p.device());
  C10_CUDA_CHECK(bnb_cuda::adam32(s, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                                  v.data_ptr<float>(), p.numel(),
                                  c10::cuda::getCurrentCUDAStream(p.device().index()).stream()));
}

}  // namespace memtune::trainer
