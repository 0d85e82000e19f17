// LLM.int8 against an independent reference (tests/reference/int8_reference.py, written from
// bitsandbytes' source op by op): weight codes, row absmax and dequantized values byte for
// byte; the mixed product's input codes, scales, outlier columns, int32 product and scaled-back
// output byte for byte in both flavours (CUDA kernels, default ops); its output with the
// outlier columns and the CPU training product against the reference's float64 values.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "models/layers/linear8bit.h"
#include "runtime/int8.h"
#include "test_util.h"

namespace {

namespace mt = memtune::testing;
using memtune::testing::bytes_of;
using memtune::testing::reference_bytes;
using memtune::testing::tensor_from_bytes;

at::ScalarType dtype_of(const std::string& s) {
  return s == "float16" ? at::kHalf : s == "bfloat16" ? at::kBFloat16 : at::kFloat;
}

struct WeightCase {
  std::string name, dtype;
  int64_t out = 0, in = 0;
};

struct LtCase {
  std::string name, weight, flavour, dtype, bias;
  double threshold = 0;
  int64_t rows = 0;
  bool autocast = false;
};

struct FpCase {
  std::string name, weight, dtype;
  int64_t rows = 0;
  bool bias = false;
};

class Int8Reference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (mt::python_torch_available()) dir_ = new mt::fs::path(mt::make_reference_fixtures("int8_reference.py"));
  }
  void SetUp() override {
    if (!mt::python_torch_available()) GTEST_SKIP() << "python3 with torch is not installed";
  }
  static std::string file(const std::string& name) { return reference_bytes(*dir_ / name); }
  static std::vector<WeightCase> weights() {
    std::vector<WeightCase> out;
    for (const std::string& line : mt::reference_lines(*dir_ / "weights.txt")) {
      std::istringstream f(line);
      WeightCase c;
      f >> c.name >> c.dtype >> c.out >> c.in;
      out.push_back(c);
    }
    return out;
  }
  static WeightCase weight(const std::string& name) {
    for (const WeightCase& w : weights())
      if (w.name == name) return w;
    ADD_FAILURE() << "no weight case " << name;
    return {};
  }
  static at::Tensor codes(const WeightCase& w) { return tensor_from_bytes(file(w.name + ".cb"), at::kChar, {w.out, w.in}); }
  static at::Tensor absmax(const WeightCase& w) { return tensor_from_bytes(file(w.name + ".scb"), at::kFloat, {w.out}); }
  static mt::fs::path* dir_;
};
mt::fs::path* Int8Reference::dir_ = nullptr;

TEST_F(Int8Reference, WeightCodesAbsmaxAndDequantizedValuesByteForByte) {
  const auto all = weights();
  ASSERT_GE(all.size(), 9u);
  for (const WeightCase& w : all) {
    SCOPED_TRACE(w.name);
    const at::Tensor dense = tensor_from_bytes(file(w.name + ".w"), dtype_of(w.dtype), {w.out, w.in});
    const memtune::Int8Rows q = memtune::int8_quantize_rows(dense, w.name);
    EXPECT_TRUE(bytes_of(q.codes) == file(w.name + ".cb")) << "codes differ";
    EXPECT_TRUE(bytes_of(q.absmax) == file(w.name + ".scb")) << "row absmax differs";
    for (const char* dt : {"float32", "bfloat16", "float16"})
      EXPECT_TRUE(bytes_of(memtune::int8_dequantize(q.codes, q.absmax, dtype_of(dt))) == file(w.name + ".deq_" + dt))
          << "dequantized " << dt << " differs";
  }
}

TEST_F(Int8Reference, MixedProductStepsByteForByteAndItsOutput) {
  int cases = 0, with_outliers = 0, cuda = 0;
  for (const std::string& line : mt::reference_lines(*dir_ / "lt.txt")) {
    std::istringstream f(line);
    LtCase c;
    f >> c.name >> c.weight >> c.flavour >> c.dtype >> c.threshold >> c.rows >> c.bias >> c.autocast;
    SCOPED_TRACE(c.name);
    const WeightCase w = weight(c.weight);
    const at::ScalarType D = dtype_of(c.dtype);
    const at::Tensor x = tensor_from_bytes(file(c.name + ".x"), D, {c.rows, w.in});
    const at::Tensor bias = c.bias == "none" ? at::Tensor() : tensor_from_bytes(file(c.name + ".bias"), dtype_of(c.bias), {w.out});
    memtune::Int8MixedParts parts;
    const at::Tensor y = memtune::int8_mixed_matmul(
        x, codes(w), absmax(w), bias, c.threshold,
        c.flavour == "cuda" ? memtune::Int8Flavour::kCuda : memtune::Int8Flavour::kDefault,
        c.autocast ? at::kBFloat16 : at::ScalarType::Undefined, &parts);
    EXPECT_TRUE(bytes_of(parts.codes) == file(c.name + ".ca")) << "input codes differ";
    EXPECT_TRUE(bytes_of(parts.absmax) == file(c.name + ".sca")) << "input row absmax differs";
    EXPECT_TRUE(bytes_of(parts.outlier_cols) == file(c.name + ".cols")) << "outlier columns differ";
    EXPECT_TRUE(bytes_of(parts.i32) == file(c.name + ".i32")) << "int32 product differs";
    EXPECT_TRUE(bytes_of(parts.base) == file(c.name + ".base")) << "scaled-back product differs";
    // The outlier columns' addmm: the reference's float64 of the rounded operands, within the
    // output dtype's rounding (and fp32 sums of up to 1536 terms).
    const at::Tensor want = tensor_from_bytes(file(c.name + ".y"), at::kDouble, {c.rows, w.out});
    const at::ScalarType yt = c.autocast && parts.outlier_cols.numel() > 0 ? at::kBFloat16 : D;
    EXPECT_EQ(y.scalar_type(), yt);
    mt::expect_close(y.to(at::kDouble), want, yt == at::kFloat ? 1e-6 : yt == at::kHalf ? 2e-3 : 1e-2, "y");
    ++cases;
    with_outliers += parts.outlier_cols.numel() > 0;
    cuda += c.flavour == "cuda";
  }
  EXPECT_GE(cases, 20);
  EXPECT_GE(with_outliers, 8);
  EXPECT_GE(cuda, 10);
}

TEST_F(Int8Reference, TrainingProductAndInputGradient) {
  int cases = 0;
  for (const std::string& line : mt::reference_lines(*dir_ / "fp.txt")) {
    std::istringstream f(line);
    FpCase c;
    f >> c.name >> c.weight >> c.dtype >> c.rows >> c.bias;
    SCOPED_TRACE(c.name);
    const WeightCase w = weight(c.weight);
    const at::ScalarType D = dtype_of(c.dtype);
    const at::Tensor x = tensor_from_bytes(file(c.name + ".x"), D, {c.rows, w.in}).requires_grad_(true);
    const at::Tensor g = tensor_from_bytes(file(c.name + ".g"), D, {c.rows, w.out});
    const at::Tensor bias = c.bias ? tensor_from_bytes(file(c.name + ".bias"), D, {w.out}) : at::Tensor();
    const at::Tensor y = memtune::models::linear8bit(x, {codes(w), absmax(w), 6.0}, bias, /*training=*/true);
    y.backward(g);
    const double tol = D == at::kFloat ? 1e-6 : 1e-2;
    mt::expect_close(y.detach().to(at::kDouble), tensor_from_bytes(file(c.name + ".y"), at::kDouble, {c.rows, w.out}),
                     tol, "y");
    mt::expect_close(x.grad().to(at::kDouble), tensor_from_bytes(file(c.name + ".gx"), at::kDouble, {c.rows, w.in}),
                     tol, "grad_x");
    ++cases;
  }
  EXPECT_GE(cases, 10);
}

}  // namespace
