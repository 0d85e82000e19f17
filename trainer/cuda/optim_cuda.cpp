#include "trainer/cuda/optim_cuda.h"

#include <algorithm>
#include <map>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/cuda/optim_cuda_kernels.h"

namespace memtune::trainer {

bool torch_adamw_cuda_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  if (!p.is_cuda()) return false;
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (!t->defined() || t->device() != p.device() || t->scalar_type() != at::kFloat || !t->is_contiguous() ||
        t->numel() != p.numel())
      return false;
  return true;
}

void torch_adamw_cuda(const TorchAdamW& s, const std::vector<AdamWCudaTensor>& tensors) {
  std::map<c10::DeviceIndex, std::vector<optim_cuda::AdamWTensor>> per_device;
  for (const AdamWCudaTensor& t : tensors) {
    TORCH_CHECK(torch_adamw_cuda_applies(t.p, t.g, t.m, t.v),
                "torch_adamw_cuda: the parameter, gradient and states disagree (device, dtype or size)");
    per_device[t.p.device().index()].push_back({t.p.data_ptr<float>(), t.g.data_ptr<float>(),
                                                t.m.data_ptr<float>(), t.v.data_ptr<float>(), t.p.numel(),
                                                t.decay});
  }
  for (const auto& [index, list] : per_device) {
    const c10::cuda::CUDAGuard guard(index);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
    for (size_t k = 0; k < list.size(); k += optim_cuda::kMaxTensors) {
      const int count = static_cast<int>(std::min<size_t>(optim_cuda::kMaxTensors, list.size() - k));
      C10_CUDA_CHECK(optim_cuda::torch_adamw(s, list.data() + k, count, stream));
    }
  }
}

bool square_sum_cuda_applies(const at::Tensor& x) {
  return x.defined() && x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous();
}

at::Tensor square_sum_cuda(const std::vector<at::Tensor>& xs) {
  TORCH_CHECK(!xs.empty(), "square_sum_cuda: no tensors");
  const c10::Device device = xs.front().device();
  std::vector<const float*> ptrs;
  std::vector<int64_t> sizes;
  int64_t partials = 0;
  for (const at::Tensor& x : xs) {
    TORCH_CHECK(square_sum_cuda_applies(x) && x.device() == device,
                "square_sum_cuda: every tensor fp32, contiguous, on one CUDA device");
    ptrs.push_back(x.data_ptr<float>());
    sizes.push_back(x.numel());
    partials += optim_cuda::square_sum_partials(x.numel());
  }
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor sums = at::empty({partials}, at::TensorOptions(at::kDouble).device(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  int64_t offset = 0;
  for (size_t k = 0; k < xs.size(); k += optim_cuda::kMaxTensors) {
    const int count = static_cast<int>(std::min<size_t>(optim_cuda::kMaxTensors, xs.size() - k));
    C10_CUDA_CHECK(optim_cuda::square_sums(ptrs.data() + k, sizes.data() + k, count,
                                           sums.data_ptr<double>() + offset, stream));
    for (int j = 0; j < count; ++j) offset += optim_cuda::square_sum_partials(sizes[k + j]);
  }
  return sums.sum();
}

}  // namespace memtune::trainer
