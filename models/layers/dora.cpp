#include "models/layers/dora.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace memtune::models {

at::Tensor dora_weight_norm(const std::function<at::Tensor(int64_t, int64_t)>& rows, int64_t out, const at::Tensor& A,
                            const at::Tensor& B, double scaling, at::ScalarType product_dtype) {
  at::NoGradGuard no_grad;
  const at::Tensor a = A.detach().to(product_dtype);
  const at::Tensor b = B.detach().to(product_dtype);
  at::Tensor norm = at::empty({out}, A.options().dtype(at::kFloat));
  const int64_t block = dora_norm_rows(A.size(1));
  for (int64_t r0 = 0; r0 < out; r0 += block) {
    const int64_t k = std::min(block, out - r0);
    // PEFT: weight + scaling * lora_weight, the product taken to the input's (fp32) dtype.
    const at::Tensor lora_weight = at::mm(b.narrow(0, r0, k), a).to(at::kFloat);
    const at::Tensor w = rows(r0, k).to(lora_weight.device()) + lora_weight * scaling;
    norm.narrow(0, r0, k).copy_(at::linalg_vector_norm(w, 2, at::IntArrayRef{1}, false, c10::nullopt));
  }
  return norm;
}

}  // namespace memtune::models
