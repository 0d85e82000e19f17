// The fused LoRA node against the same math written as separate ATen ops under autograd:
// outputs and every gradient (x, A, B, bias, dropout input), dense, NF4 and FP4 bases.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>

#include "models/layers/linear.h"
#include "models/layers/lora_linear.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;
using memtune::NF4Tensor;
using memtune::models::FrozenWeight;
using memtune::models::lora_linear;

struct Case {
  const char* name;
  std::vector<int64_t> x_shape;
  int64_t out, r;
  bool nf4, bias, bias_grad, dropout, x_grad, transposed;
  memtune::QuantType type = memtune::QuantType::kNF4;  // the 4-bit code, with nf4
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class LoraLinearTest : public ::testing::TestWithParam<Case> {};

TEST_P(LoraLinearTest, MatchesComposedOps) {
  const Case c = GetParam();
  torch::manual_seed(7);
  const int64_t in = c.x_shape.back();
  const double scaling = 2.0;
  at::Tensor w_stored = at::randn(c.transposed ? std::vector<int64_t>{in, c.out} : std::vector<int64_t>{c.out, in});
  at::Tensor w = c.transposed ? w_stored.t() : w_stored;  // [out, in] view
  FrozenWeight frozen;
  if (c.nf4) {
    frozen.nf4 = std::make_shared<const NF4Tensor>(memtune::nf4_quantize(w.contiguous(), 64, true, "", c.type));
    w = memtune::nf4_dequantize(*frozen.nf4, at::kFloat);  // the reference multiplies what NF4 holds
  } else {
    frozen.dense = w;
  }
  at::Tensor A = (at::randn({c.r, in}) * 0.1).requires_grad_(true);
  at::Tensor B = (at::randn({c.out, c.r}) * 0.1).requires_grad_(true);  // non-zero: B's path matters
  at::Tensor b = c.bias ? at::randn({c.out}).requires_grad_(c.bias_grad) : at::Tensor();
  at::Tensor x = at::randn(c.x_shape).requires_grad_(c.x_grad);
  // Dropout's mask drawn once, shared by both sides: the adapter sees x * mask / (1 - p).
  at::Tensor mask = (at::rand(c.x_shape) > 0.3).to(at::kFloat) / 0.7;

  at::Tensor h = c.dropout ? x * mask : at::Tensor();
  at::Tensor y = lora_linear(x, h, frozen, b, A, B, scaling);

  at::Tensor A_ref = A.detach().clone().requires_grad_(true), B_ref = B.detach().clone().requires_grad_(true);
  at::Tensor b_ref = c.bias ? b.detach().clone().requires_grad_(c.bias_grad) : at::Tensor();
  at::Tensor x_ref = x.detach().clone().requires_grad_(c.x_grad);
  at::Tensor h_ref = c.dropout ? x_ref * mask : x_ref;
  at::Tensor y_ref = at::linear(x_ref, w, b_ref) + at::linear(at::linear(h_ref, A_ref), B_ref) * scaling;
  expect_close(y, y_ref, 1e-5, "forward");

  at::Tensor gy = at::randn(y.sizes());
  y.backward(gy);
  y_ref.backward(gy);
  expect_close(A.grad(), A_ref.grad(), 1e-5, "grad_A");
  expect_close(B.grad(), B_ref.grad(), 1e-5, "grad_B");
  if (c.x_grad) {
    expect_close(x.grad(), x_ref.grad(), 1e-5, "grad_x");
  } else {
    EXPECT_FALSE(x.grad().defined());
  }
  if (c.bias && c.bias_grad) expect_close(b.grad(), b_ref.grad(), 1e-5, "grad_bias");
  if (c.bias && !c.bias_grad) {
    EXPECT_FALSE(b.grad().defined());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LoraLinearTest,
    ::testing::Values(Case{"dense", {4, 8, 32}, 24, 4, false, false, false, false, true, false},
                      Case{"dense_bias", {5, 32}, 40, 8, false, true, false, false, true, false},
                      Case{"dense_bias_grad", {5, 32}, 40, 8, false, true, true, false, true, false},
                      Case{"dense_dropout", {3, 6, 32}, 24, 4, false, true, false, true, true, false},
                      Case{"dense_no_x_grad", {2, 7, 32}, 24, 4, false, false, false, false, false, false},
                      Case{"conv1d_transposed", {3, 32}, 48, 4, false, true, false, false, true, true},
                      // Rows enough to spread over threads, a rank off the 16-wide panels.
                      Case{"dense_many_rows_r20", {3, 70, 96}, 72, 20, false, false, false, true, true, false},
                      Case{"nf4", {2, 9, 128}, 96, 8, true, false, false, false, true, false},
                      Case{"nf4_bias_dropout", {2, 9, 128}, 96, 8, true, true, false, true, true, false},
                      Case{"nf4_no_x_grad", {10, 128}, 64, 16, true, false, false, false, false, false},
                      Case{"fp4_bias_dropout", {2, 9, 128}, 96, 8, true, true, false, true, true, false,
                           memtune::QuantType::kFP4}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(LoraLinear, RejectsMismatchedShapes) {
  FrozenWeight w{at::randn({8, 16}), nullptr};
  EXPECT_THROW(lora_linear(at::randn({2, 16}), {}, w, {}, at::randn({4, 15}), at::randn({8, 4}), 1.0),
               memtune::UserError);
  EXPECT_THROW(lora_linear(at::randn({2, 16}), {}, w, {}, at::randn({4, 16}), at::randn({8, 3}), 1.0),
               memtune::UserError);
  // The adapter alone takes no bias; a base is dense or 4-bit, not both.
  EXPECT_THROW(lora_linear(at::randn({2, 16}), {}, FrozenWeight{}, at::randn({8}), at::randn({4, 16}),
                           at::randn({8, 4}), 1.0),
               memtune::UserError);
  const auto q = std::make_shared<NF4Tensor>(memtune::nf4_quantize(at::randn({8, 64}), 64, false, "w"));
  EXPECT_THROW(lora_linear(at::randn({2, 64}), {}, FrozenWeight{at::randn({8, 64}), q}, {}, at::randn({4, 64}),
                           at::randn({8, 4}), 1.0),
               memtune::UserError);
}

// A bf16 model (model.torch_dtype: bfloat16) with PEFT's fp32 adapters: Linear::forward takes
// the fused node, whose output and gradients are PEFT's ops under autograd: the base in bf16,
// the adapter on x taken to fp32 (with dropout: dropped after the cast); on a dense base the
// sum formed in fp32 and rounded once (lora.Linear: `result + lora_B(lora_A(x)) * scaling`,
// then `.to(torch_result_dtype)`), on a 4-bit base the adapter's output rounded to bf16 and
// then added (bnb's Linear4bit: `output.to(expected_dtype)`, then `result + output`).
TEST(LoraLinear, Fp32AdapterOnABf16BaseIsPeftsComposition) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(11);
  const int64_t in = 128, out = 96, r = 8;
  for (bool nf4 : {false, true}) {
    for (bool bias : {false, true}) {
      for (bool dropout : {false, true}) {
        SCOPED_TRACE(std::string(nf4 ? "NF4" : "dense") + (bias ? " with bias" : "") + (dropout ? " dropout" : ""));
        memtune::models::Linear l("model.layers.0.self_attn.q_proj", in, out, bias);
        l.weight = at::randn({out, in}).to(at::kBFloat16);
        if (bias) l.bias = at::randn({out}).to(at::kBFloat16);
        if (nf4) l.quantize(64, true, memtune::QuantType::kNF4);
        l.compute_dtype = at::kBFloat16;
        memtune::models::LoraOptions o;
        o.r = r;
        o.alpha = 16;
        l.add_lora(o);
        {
          at::NoGradGuard g;
          l.lora->B.normal_(0.0, 0.1);  // non-zero: the adapter's path matters
        }
        at::Tensor x = at::randn({3, 5, in}).to(at::kBFloat16).requires_grad_(true);
        // Dropout's mask drawn once, shared by both sides: the adapter sees x (in fp32) * mask / (1 - p).
        const at::Tensor mask = (at::rand({3, 5, in}) > 0.3).to(at::kFloat) / 0.7;

        const int64_t before = memtune::cpu_allocated_bytes();
        at::Tensor h = dropout ? x.to(at::kFloat) * mask : at::Tensor();
        at::Tensor y = dropout ? memtune::models::lora_linear(
                                     x, h, memtune::models::FrozenWeight{nf4 ? at::Tensor() : l.weight, l.qweight()},
                                     l.bias, l.lora->A, l.lora->B, l.lora->scaling)
                               : l.forward(x, true);
        // Kept: x A^T in fp32 (x itself is the caller's), nothing of x in fp32 but the dropped input.
        const int64_t kept = memtune::cpu_allocated_bytes() - before - y.numel() * 2;
        EXPECT_LE(kept, 15 * r * 4 + (dropout ? 15 * in * 4 : 0) + 512) << "more than x A^T kept";
        EXPECT_EQ(y.scalar_type(), at::kBFloat16);

        at::Tensor A = l.lora->A.detach().clone().requires_grad_(true);
        at::Tensor B = l.lora->B.detach().clone().requires_grad_(true);
        at::Tensor x_ref = x.detach().clone().requires_grad_(true);
        const at::Tensor w = nf4 ? memtune::nf4_dequantize(*l.qweight(), at::kBFloat16) : l.weight;
        // On the rows as one matrix, as PyTorch 2's linear takes a contiguous 3-d input (the bias
        // added inside the GEMM, one rounding).
        at::Tensor base = at::linear(x_ref.reshape({-1, in}), w, bias ? l.bias : at::Tensor()).view({3, 5, out});
        at::Tensor h_ref = dropout ? x_ref.to(at::kFloat) * mask : x_ref.to(at::kFloat);
        at::Tensor delta = at::linear(at::linear(h_ref, A), B) * l.lora->scaling;
        at::Tensor y_ref = nf4 ? base + delta.to(at::kBFloat16) : (base + delta).to(at::kBFloat16);
        auto same = [](const at::Tensor& a, const at::Tensor& b) {
          return (a == b).to(at::kDouble).mean().item<double>();
        };
        expect_close(y.to(at::kFloat), y_ref.to(at::kFloat), 1e-2, "forward");
        EXPECT_GT(same(y, y_ref), 0.98) << same(y, y_ref);

        const at::Tensor g = at::randn(y.sizes()).to(at::kBFloat16);
        y.backward(g);
        y_ref.backward(g);
        EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
        expect_close(x.grad().to(at::kFloat), x_ref.grad().to(at::kFloat), 1e-2, "grad_x");
        EXPECT_GT(same(x.grad(), x_ref.grad()), 0.95) << same(x.grad(), x_ref.grad());
        EXPECT_EQ(l.lora->A.grad().scalar_type(), at::kFloat);
        expect_close(l.lora->A.grad(), A.grad(), 1e-5, "grad_A");
        expect_close(l.lora->B.grad(), B.grad(), 1e-5, "grad_B");
      }
    }
  }
}

// Under the Trainer's bf16 autocast (Linear::autocast, training.bf16) an fp32 adapter runs as
// PEFT's does under torch.autocast: x taken to fp32 (and dropped there), then every product
// on bf16 copies of its operands, rounded to bf16; the adapter's output scaled in bf16 and
// added to the base's bf16 output. A bf16 model takes the fused node; an fp32 model computing
// in bf16 the base, then the adapter alone, its output taken back to fp32. The reference
// writes autocast's casts out (PyTorch 1.13's CPU autocast gives the same bits:
// tests/reference/hf_reference.py runs it for HfReferenceLora.AdapterGradientsMatchUnderBf16Autocast).
// A's and B's gradients are the same bf16 products summed in fp32 where autograd rounds them
// to bf16: within bf16's rounding of the reference's. (What that buys, a gradient that does
// not depend on the micro-batch split: Train.Bf16ModelAccumulationEqualsTheUnsplitBatch.)
void expect_autocast_adapter_is_pefts(const c10::Device& device) {
  torch::manual_seed(12);
  const int64_t in = 128, out = 96, r = 8;
  const auto bf16 = at::kBFloat16;
  for (bool fp32_model : {false, true}) {
    for (bool nf4 : {false, true}) {
      for (double alpha : {16.0, 12.0}) {  // scaling 2 (a power of two) and 1.5
        for (bool dropout : {false, true}) {
          SCOPED_TRACE(std::string(fp32_model ? "fp32 model" : "bf16 model") + (nf4 ? ", NF4" : ", dense") +
                       ", alpha " + std::to_string(alpha) + (dropout ? ", dropout" : ""));
          const auto model_dtype = fp32_model ? at::kFloat : bf16;
          memtune::models::Linear l("model.layers.0.self_attn.q_proj", in, out, true);
          l.weight = at::randn({out, in}).to(device, model_dtype);
          l.bias = at::randn({out}).to(device, model_dtype);
          if (nf4) l.quantize(64, true, memtune::QuantType::kNF4);
          l.compute_dtype = bf16;
          l.autocast = true;
          memtune::models::LoraOptions o;
          o.r = r;
          o.alpha = alpha;
          o.dropout = dropout ? 0.25 : 0.0;
          l.add_lora(o);
          {
            at::NoGradGuard g;
            l.lora->B.normal_(0.0, 0.1);  // non-zero: the adapter's path matters
            l.lora->A = l.lora->A.to(device).requires_grad_(true);
            l.lora->B = l.lora->B.to(device).requires_grad_(true);
          }
          at::Tensor x = at::randn({3, 5, in}).to(device, model_dtype).requires_grad_(true);
          torch::manual_seed(40);  // the dropout mask: drawn alike on both sides
          at::Tensor y = l.forward(x, true);
          EXPECT_EQ(y.scalar_type(), model_dtype);

          at::Tensor A = l.lora->A.detach().clone().requires_grad_(true);
          at::Tensor B = l.lora->B.detach().clone().requires_grad_(true);
          at::Tensor x_ref = x.detach().clone().requires_grad_(true);
          const at::Tensor w = nf4 ? memtune::nf4_dequantize(*l.qweight(), bf16) : l.weight.to(bf16);
          at::Tensor base = at::linear(x_ref.to(bf16).reshape({-1, in}), w, l.bias.to(bf16)).view({3, 5, out});
          torch::manual_seed(40);
          at::Tensor h = x_ref.to(at::kFloat);
          if (dropout) h = at::dropout(h, 0.25, true);
          at::Tensor delta = at::linear(at::linear(h.to(bf16), A.to(bf16)), B.to(bf16)) * l.lora->scaling;
          EXPECT_EQ(delta.scalar_type(), bf16);
          at::Tensor y_ref = (base + delta).to(model_dtype);
          auto same = [](const at::Tensor& a, const at::Tensor& b) {
            return (a == b).to(at::kDouble).mean().item<double>();
          };
          expect_close(y.to(at::kFloat), y_ref.to(at::kFloat), 1e-2, "forward");
          EXPECT_GT(same(y, y_ref), 0.98) << same(y, y_ref);

          const at::Tensor g = at::randn(y.sizes()).to(device, model_dtype);
          y.backward(g);
          y_ref.backward(g);
          expect_close(x.grad().to(at::kFloat), x_ref.grad().to(at::kFloat), 1e-2, "grad_x");
          // The fused node's gradient is autograd's to the bit mostly; the fp32 model's (the
          // adapter alone, then the casts) differs in the last bits in about half the elements.
          if (!fp32_model) {
            EXPECT_GT(same(x.grad(), x_ref.grad()), 0.9) << same(x.grad(), x_ref.grad());
          }
          for (auto [got, ref, what] : {std::tuple{l.lora->A.grad(), A.grad(), "grad_A"},
                                        std::tuple{l.lora->B.grad(), B.grad(), "grad_B"}}) {
            EXPECT_EQ(got.scalar_type(), at::kFloat) << what;
            expect_close(got, ref, 1e-2, what);
          }
        }
      }
    }
  }
}

TEST(LoraLinear, UnderBf16AutocastTheAdapterRunsAsPeftsUnderAutocast) { expect_autocast_adapter_is_pefts(c10::kCPU); }

TEST(LoraLinear, UnderBf16AutocastOnCudaTheAdapterRunsAsPeftsUnderAutocast_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  expect_autocast_adapter_is_pefts(c10::Device(c10::kCUDA, 0));
}

// The adapter's output added into a 16-bit projection output (detail::add_adapter_output),
// against a loop that writes PEFT's 16-bit ops out: the short product summed in fp32 over k
// in order, rounded to T, scaled (rounded), added to y (rounded). On CUDA the kernel sums in
// that order, so it must give the loop's bits; on the CPU ATen's product may sum in another
// order, which can move a rounded product by one unit in its last place. The cases: tails
// of the kernel's 16 x 256 tile, ranks past its chunk of 16, a y whose rows are wider than
// its columns (a row stride a multiple of 8, or odd) or start off a 16-byte boundary, b as
// a transposed view (the forward's B^T).
template <class T>
at::Tensor add_adapter_output_loop(const at::Tensor& y, const at::Tensor& a, const at::Tensor& b, double s) {
  at::Tensor out = y.to(at::kCPU).clone(at::MemoryFormat::Contiguous);  // never y itself
  const at::Tensor ac = a.to(at::kCPU).contiguous(), bc = b.to(at::kCPU).contiguous();
  const int64_t m = out.size(0), n = out.size(1), r = ac.size(1);
  const T* pa = ac.data_ptr<T>();
  const T* pb = bc.data_ptr<T>();
  T* py = out.data_ptr<T>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < r; ++k) acc = std::fma(static_cast<float>(pa[i * r + k]), static_cast<float>(pb[k * n + j]), acc);
      const float scaled = static_cast<float>(T(static_cast<float>(T(acc)) * static_cast<float>(s)));
      py[i * n + j] = T(static_cast<float>(py[i * n + j]) + scaled);
    }
  }
  return out;
}

void expect_adapter_output_is_the_loops(const c10::Device& device) {
  struct Shape {
    int64_t m, n, r;
  };
  // LibTorch 1.13's CPU has no fp16 product.
  const std::vector<at::ScalarType> dtypes =
      device.is_cuda() ? std::vector<at::ScalarType>{at::kBFloat16, at::kHalf} : std::vector<at::ScalarType>{at::kBFloat16};
  for (at::ScalarType dtype : dtypes) {
    for (Shape sh : {Shape{1, 1, 1}, Shape{64, 512, 16}, Shape{37, 300, 16}, Shape{33, 257, 48}, Shape{5, 1000, 100},
                     Shape{70, 24, 8}}) {
      for (double s : {2.0, 1.5, 1.0}) {
        // 0: y contiguous; 1: rows of a whole number of 16 bytes, wider than y; 2: the same
        // rows, y starting 2 bytes in; 3: rows of an odd length.
        for (int layout = 0; layout < 4; ++layout) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + " m " + std::to_string(sh.m) + " n " +
                       std::to_string(sh.n) + " r " + std::to_string(sh.r) + " s " + std::to_string(s) +
                       " layout " + std::to_string(layout));
          torch::manual_seed(sh.m * 1000 + sh.n + sh.r);
          const auto opt = at::TensorOptions(dtype).device(device);
          const int64_t width = layout == 3 ? sh.n + 9 : (sh.n + 7) / 8 * 8 + 8;
          at::Tensor wide = (at::randn({sh.m, width}) * 4).to(opt);
          const int64_t offset = layout == 2 ? 1 : 0;
          at::Tensor y = layout == 0 ? wide.narrow(1, 0, sh.n).contiguous() : wide.narrow(1, offset, sh.n);
          const at::Tensor a = at::randn({sh.m, sh.r}).to(opt);
          const at::Tensor b = sh.m % 2 == 1 ? at::randn({sh.n, sh.r}).to(opt).t() : at::randn({sh.r, sh.n}).to(opt);
          const at::Tensor before = y.clone();
          const at::Tensor ref = dtype == at::kBFloat16 ? add_adapter_output_loop<c10::BFloat16>(y, a, b, s)
                                                        : add_adapter_output_loop<c10::Half>(y, a, b, s);
          memtune::models::detail::add_adapter_output(y, a, b, s);
          if (layout != 0) {
            EXPECT_TRUE(at::equal(wide.narrow(1, offset, sh.n).to(at::kCPU), y.to(at::kCPU))) << "y in place";
          }
          const at::Tensor got = y.to(at::kCPU).to(at::kFloat), want = ref.to(at::kFloat);
          if (device.is_cuda()) {
            EXPECT_TRUE(at::equal(got, want)) << (got != want).sum().item<int64_t>() << " elements differ";
          } else {
            expect_close(got, want, dtype == at::kHalf ? 2e-3 : 1.6e-2, "y");
            EXPECT_GT((got == want).to(at::kDouble).mean().item<double>(), 0.9);
          }
          // Not a no-op: the adapter's part moved y.
          EXPECT_FALSE(at::equal(before.to(at::kCPU), y.to(at::kCPU)));
        }
      }
    }
  }
}

TEST(LoraLinear, AdapterOutputAddsAsPeftsSixteenBitOps) { expect_adapter_output_is_the_loops(c10::kCPU); }

TEST(LoraLinear, AdapterOutputOnCudaIsTheLoopsBits_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  expect_adapter_output_is_the_loops(c10::Device(c10::kCUDA, 0));
}

// A dense fp32 weight computing in bf16, frozen or trained: the products, outputs and
// gradients of at::linear on bf16 copies (Conv1D: x @ W + b) under autograd, but no bf16 copy
// of the weight kept between forward and backward (autograd keeps at::linear's). The trained
// bias beside a frozen weight is for the node's sake: configs train a bias only with its weight.
TEST(CastDenseWeight, Bf16ProductsKeepNoCopyOfTheWeight) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(9);
  const int64_t in = 512, out = 256, rows = 6;
  for (bool trained : {false, true}) {
    for (bool conv1d : {false, true}) {
      for (bool bias : {false, true}) {
        SCOPED_TRACE(std::string(trained ? "trained " : "frozen ") + (conv1d ? "Conv1D" : "Linear") +
                     (bias ? " with bias" : ""));
        memtune::models::Linear l("model.layers.0.mlp.up_proj", in, out, bias, conv1d);
        l.weight = (conv1d ? at::randn({in, out}) : at::randn({out, in})).requires_grad_(trained);
        if (bias) l.bias = at::randn({out}).requires_grad_(true);
        l.compute_dtype = at::kBFloat16;
        at::Tensor x = at::randn({2, rows / 2, in}).requires_grad_(true);

        const int64_t before = memtune::cpu_allocated_bytes();
        at::Tensor y = l.forward(x, true);
        // Kept: the output and, for a trained weight, the bf16 input.
        const int64_t kept = memtune::cpu_allocated_bytes() - before - y.numel() * 4 - (trained ? rows * in * 2 : 0);
        EXPECT_LT(kept, in * out * 2 / 8) << "a bf16 copy of the weight (" << in * out * 2 << " B) is kept";

        at::Tensor x_ref = x.detach().clone().requires_grad_(true);
        at::Tensor w_ref = l.weight.detach().clone().requires_grad_(trained);
        at::Tensor b_ref = bias ? l.bias.detach().clone().requires_grad_(true) : at::Tensor();
        const at::Tensor w16 = w_ref.to(at::kBFloat16);
        const at::Tensor b16 = bias ? b_ref.to(at::kBFloat16) : at::Tensor();
        // Conv1D as transformers writes it: addmm on the rows as one matrix, the bias inside.
        const at::Tensor x16 = x_ref.to(at::kBFloat16);
        at::Tensor y_ref = !conv1d ? at::linear(x16, w16, b16)
                           : (bias ? at::addmm(b16, x16.reshape({-1, in}), w16) : at::mm(x16.reshape({-1, in}), w16))
                                 .view({2, rows / 2, out});
        y_ref = y_ref.to(at::kFloat);
        EXPECT_TRUE(at::equal(y, y_ref));
        const at::Tensor g = at::randn_like(y);
        y.backward(g);
        y_ref.backward(g);
        EXPECT_TRUE(at::equal(x.grad(), x_ref.grad()));
        if (bias) expect_close(l.bias.grad(), b_ref.grad(), 1e-2, "bias grad");
        if (trained) {
          // The same bf16 products, summed in the GEMM's order for the other layout.
          ASSERT_TRUE(l.weight.grad().defined());
          EXPECT_EQ(l.weight.grad().scalar_type(), at::kFloat);
          expect_close(l.weight.grad(), w_ref.grad(), 1e-2, "weight grad");
          const double same = (l.weight.grad() == w_ref.grad()).to(at::kDouble).mean().item<double>();
          EXPECT_GT(same, 0.9) << "weight grad: only " << same << " of its elements are the reference's";
        } else {
          EXPECT_FALSE(l.weight.grad().defined());
        }
      }
    }
  }
}

}  // namespace
