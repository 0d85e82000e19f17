#include "models/layers/panel_product.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace memtune::models {

at::Tensor panel_matmul_wt(const at::Tensor& x, int64_t out, int64_t in, int64_t rows, const at::Tensor& bias,
                           const FillPanel& fill) {
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  at::Tensor buf = at::empty({std::min(rows, out) * in}, x.options());
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t r = std::min(rows, out - r0);
    at::Tensor panel = buf.narrow(0, 0, r * in);
    fill(r0, r, panel);
    at::Tensor y_cols = y.narrow(1, r0, r);  // strided (ld = out): BLAS writes it in place
    if (bias.defined())
      at::addmm_out(y_cols, bias.narrow(0, r0, r), x, panel.view({r, in}).t());
    else
      at::mm_out(y_cols, x, panel.view({r, in}).t());
  }
  return y;
}

at::Tensor panel_matmul_w(const at::Tensor& g, int64_t out, int64_t in, int64_t rows, const FillPanel& fill) {
  at::Tensor gx = at::empty({g.size(0), in}, g.options());
  at::Tensor buf = at::empty({std::min(rows, out) * in}, g.options());
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t r = std::min(rows, out - r0);
    at::Tensor panel = buf.narrow(0, 0, r * in);
    fill(r0, r, panel);
    if (r0 == 0) at::mm_out(gx, g.narrow(1, r0, r), panel.view({r, in}));  // the first panel writes
    else gx.addmm_(g.narrow(1, r0, r), panel.view({r, in}));             // the others accumulate
  }
  return gx;
}

}  // namespace memtune::models
