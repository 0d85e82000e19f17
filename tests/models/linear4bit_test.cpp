// Linear4bit against a dense Linear holding deq(W) (NF4 and FP4), and the bytes its graph
// keeps alive.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "models/layers/linear4bit.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace {

using memtune::NF4Tensor;
using memtune::models::linear4bit;
using memtune::models::Nf4MatmulPath;

// max |a - b| <= tol * max |b|
void expect_close(const at::Tensor& a, const at::Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a - b).abs().max().item<double>();
  const double scale = b.abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << " vs scale " << scale;
}

struct Case {
  std::vector<int64_t> x_shape;
  int64_t out, in;
  bool bias, bias_grad;
};

class Linear4bitTest : public ::testing::TestWithParam<Nf4MatmulPath> {};

TEST_P(Linear4bitTest, MatchesDenseLinearOnDequantizedWeight) {
  torch::manual_seed(0);
  // Odd `in` makes rows start mid-byte and mid-block; out > one panel exercises panels.
  for (const Case& c : std::vector<Case>{{{8, 64}, 48, 64, true, true},
                                         {{2, 5, 67}, 33, 67, true, false},
                                         {{3, 1, 4096}, 700, 4096, false, false},
                                         {{16, 300}, 2000, 300, true, true}})
  for (memtune::QuantType type : {memtune::QuantType::kNF4, memtune::QuantType::kFP4}) {
    SCOPED_TRACE(std::to_string(c.in) + " " + memtune::quant_type_name(type));
    // Backward decodes the weight as forward did: with the other codebook grad_x would differ.
    auto w = std::make_shared<const NF4Tensor>(memtune::nf4_quantize(at::randn({c.out, c.in}), 64, true, "", type));
    at::Tensor dense_w = memtune::nf4_dequantize(*w, at::kFloat);
    at::Tensor b = c.bias ? at::randn({c.out}).requires_grad_(c.bias_grad) : at::Tensor();
    at::Tensor x = at::randn(c.x_shape).requires_grad_(true);
    at::Tensor y = linear4bit(x, w, b, at::kFloat, GetParam());

    at::Tensor x_ref = x.detach().clone().requires_grad_(true);
    at::Tensor b_ref = c.bias ? b.detach().clone().requires_grad_(c.bias_grad) : at::Tensor();
    at::Tensor y_ref = at::linear(x_ref, dense_w, b_ref);
    expect_close(y, y_ref, 1e-5, "forward");

    at::Tensor gy = at::randn(y.sizes());
    y.backward(gy);
    y_ref.backward(gy);
    expect_close(x.grad(), x_ref.grad(), 1e-5, "grad_x");
    if (c.bias && c.bias_grad) {
      expect_close(b.grad(), b_ref.grad(), 1e-5, "grad_bias");
    }
    if (c.bias && !c.bias_grad) {
      EXPECT_FALSE(b.grad().defined());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Linear4bitTest,
                         ::testing::Values(Nf4MatmulPath::kAuto, Nf4MatmulPath::kDequantizeThenMatmul,
                                           Nf4MatmulPath::kPanels));

TEST(Linear4bit, ComputeDtypeAndErrors) {
  auto w = std::make_shared<const NF4Tensor>(memtune::nf4_quantize(at::randn({32, 64}), 64, true));
  at::Tensor x = at::randn({4, 64}).requires_grad_(true);
  at::Tensor y = linear4bit(x, w, at::Tensor(), at::kBFloat16);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  at::Tensor y_ref = at::linear(x.detach().to(at::kBFloat16), memtune::nf4_dequantize(*w, at::kBFloat16));
  expect_close(y.to(at::kFloat), y_ref.to(at::kFloat), 1e-2, "bf16 forward");
  y.sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);  // the input's dtype
  EXPECT_THROW(linear4bit(at::randn({4, 65}), w, at::Tensor(), at::kFloat), memtune::UserError);
  EXPECT_THROW(linear4bit(x, w, at::randn({31}), at::kFloat), memtune::UserError);
}

// ---- bytes alive between forward and backward -----------------------------------------

// Counts live bytes of every CPU allocation while installed.
class CountingAllocator final : public c10::Allocator {
 public:
  MEMTUNE_ALLOCATOR_ALLOCATE(allocate_counted)  // allocate() is const only in 1.13 (compat.h)
  static c10::DataPtr allocate_counted(size_t n) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, std::max<size_t>(n, 1)) != 0) throw std::bad_alloc();
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = n;
    }
    live_ += static_cast<int64_t>(n);
    return {p, p, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  MEMTUNE_ALLOCATOR_COPY_DATA
  static int64_t live() { return live_.load(); }

 private:
  static void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(p);
      if (it != sizes_.end()) {
        live_ -= static_cast<int64_t>(it->second);
        sizes_.erase(it);
      }
    }
    std::free(p);
  }
  static inline std::atomic<int64_t> live_{0};
  static inline std::mutex mu_;
  static inline std::unordered_map<void*, size_t> sizes_;
};

TEST(Linear4bit, GraphKeepsOnlyQuantizedWeight) {
  static CountingAllocator counting;
  c10::Allocator* previous = c10::GetCPUAllocator();
  // Above the budget allocator's priority (200), which another test in this process may
  // have installed: a lower priority would be ignored and nothing counted.
  c10::SetCPUAllocator(&counting, /*priority=*/250);
  struct Restore {
    c10::Allocator* a;
    ~Restore() { c10::SetCPUAllocator(a, 250); }
  } restore{previous};

  const int64_t out = 1024, in = 2048, tokens = 16;
  const int64_t dense_bytes = out * in * 4;  // 8 MiB as fp32
  for (auto path : {Nf4MatmulPath::kPanels, Nf4MatmulPath::kDequantizeThenMatmul}) {
    SCOPED_TRACE(static_cast<int>(path));
    auto w = std::make_shared<const NF4Tensor>(memtune::nf4_quantize(at::randn({out, in}), 64, true));
    const int64_t quant_bytes = w->storage_bytes();  // about out * in / 2
    EXPECT_LT(quant_bytes, dense_bytes / 7);
    at::Tensor x = at::randn({tokens, in}).requires_grad_(true);
    const int64_t y_bytes = tokens * out * 4;

    const int64_t before = CountingAllocator::live();
    at::Tensor y = linear4bit(x, w, at::Tensor(), at::kFloat, path);
    const int64_t after_forward = CountingAllocator::live();
    ASSERT_GE(after_forward - before, y_bytes) << "allocations are not counted";
    // Alive now: y and a few scalars; no dense W (8 MiB), not even a panel of it.
    EXPECT_LT(after_forward - before, y_bytes + 64 * 1024);

    // Dropping our handle to W: the graph still holds the quantized tensors...
    w.reset();
    EXPECT_EQ(CountingAllocator::live(), after_forward);
    // ...and only them: releasing y (and with it the graph) frees y plus ~n/2 bytes.
    y = at::Tensor();
    const int64_t freed = after_forward - CountingAllocator::live();
    EXPECT_GE(freed, y_bytes + quant_bytes);
    EXPECT_LT(freed, y_bytes + quant_bytes + 64 * 1024);
  }
}

}  // namespace
