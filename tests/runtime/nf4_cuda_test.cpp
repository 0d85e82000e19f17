// NF4's CUDA kernels (runtime/cuda/nf4_cuda.h) against their CPU twins, which
// tests/runtime/nf4_test.cpp checks byte for byte against bitsandbytes' algorithm: the
// GPU's dequantized values and quantized bytes must be the CPU's, every bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/nf4.h"
#include "test_util.h"

namespace {

using memtune::NF4Tensor;
using memtune::QuantType;

NF4Tensor on(const NF4Tensor& q, const c10::Device& device) {
  NF4Tensor r = q;
  auto move = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  r.packed = move(q.packed);
  r.absmax = move(q.absmax);
  r.nested_absmax = move(q.nested_absmax);
  r.nested_quant_map = move(q.nested_quant_map);
  return r;
}

// Weights with the cases the kernels treat apart: a block of zeros (the zero code), a
// partial last block, an odd number of elements (a padding nibble), and values spread over
// orders of magnitude so that double quantization's nested blocks differ.
at::Tensor weights(const std::vector<int64_t>& shape, int64_t blocksize, at::ScalarType dtype, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor w = at::randn(shape, gen, at::TensorOptions(at::kFloat));
  at::Tensor flat = w.view({-1});
  const int64_t n = flat.numel();
  if (n >= 2 * blocksize) flat.narrow(0, blocksize, blocksize).zero_();  // the second block
  flat.mul_(at::exp(at::linspace(-6.0, 3.0, n, at::TensorOptions(at::kFloat))));
  return w.to(dtype);
}

struct Shape {
  std::vector<int64_t> shape;
  int64_t blocksize;
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {
      {{64, 128}, 64},          // whole blocks
      {{3, 37}, 32},            // 111 elements: a partial block and a padding nibble
      {{5, 1003}, 64},          // odd, and more than 256 blocks (two nested blocks)
      {{300, 700}, 128},        // 819 nested blocks' worth of groups
      {{2, 4096 + 40}, 4096},   // the largest block size, a partial second block
  };
  return s;
}

TEST(Nf4Cuda, DequantizeEqualsTheCpuBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  uint64_t seed = 1;
  for (const Shape& s : shapes())
    for (auto [dq, type] : {std::pair{true, QuantType::kNF4}, {false, QuantType::kNF4}, {true, QuantType::kFP4}}) {
      const NF4Tensor q =
          memtune::nf4_quantize(weights(s.shape, s.blocksize, at::kFloat, seed++), s.blocksize, dq, "", type);
      const NF4Tensor qg = on(q, cuda);
      for (at::ScalarType out : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const at::Tensor want = memtune::nf4_dequantize(q, out);
        const at::Tensor got = memtune::nf4_dequantize(qg, out);
        ASSERT_TRUE(got.is_cuda());
        EXPECT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(at::equal(got.cpu(), want))
            << "shape " << at::IntArrayRef(s.shape) << " blocksize " << s.blocksize << " double_quant " << dq
            << " " << memtune::quant_type_name(type) << " out " << out << ": "
            << (got.cpu().to(at::kFloat) != want.to(at::kFloat)).sum().item<int64_t>()
            << " elements differ";
      }
    }
}

// A packed buffer that starts at an odd address takes the kernel's byte-by-byte path, and so
// does one 4-byte aligned but not 8 for 16-bit outputs (whose vector path loads 8 bytes).
TEST(Nf4Cuda, DequantizeOfAnUnalignedStateEqualsTheCpu_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  const NF4Tensor q = memtune::nf4_quantize(weights({17, 64}, 64, at::kFloat, 7), 64, true);
  for (int64_t shift : {1, 4}) {
    NF4Tensor qg = on(q, cuda);
    at::Tensor shifted = at::empty({q.packed.numel() + shift}, qg.packed.options());
    shifted.narrow(0, shift, q.packed.numel()).copy_(qg.packed);
    qg.packed = shifted.narrow(0, shift, q.packed.numel());
    ASSERT_NE(reinterpret_cast<uintptr_t>(qg.packed.data_ptr()) % 8, 0u);
    for (at::ScalarType out : {at::kFloat, at::kHalf, at::kBFloat16})
      EXPECT_TRUE(at::equal(memtune::nf4_dequantize(qg, out).cpu(), memtune::nf4_dequantize(q, out)))
          << out << ", packed shifted by " << shift;
  }
}

TEST(Nf4Cuda, QuantizeGivesTheCpusBytes_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  uint64_t seed = 100;
  for (const Shape& s : shapes())
    for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16})
      for (auto [dq, type] : {std::pair{true, QuantType::kNF4}, {false, QuantType::kNF4}, {false, QuantType::kFP4}}) {
        const at::Tensor w = weights(s.shape, s.blocksize, dtype, seed++);
        const NF4Tensor want = memtune::nf4_quantize(w, s.blocksize, dq, "", type);
        const NF4Tensor got = memtune::nf4_quantize(w.to(cuda), s.blocksize, dq, "", type);
        const std::string what = "shape " + std::to_string(s.shape[0]) + "x" + std::to_string(s.shape[1]) +
                                 " blocksize " + std::to_string(s.blocksize) + " " + c10::toString(dtype) +
                                 (dq ? " double_quant " : " ") + memtune::quant_type_name(type);
        ASSERT_TRUE(got.packed.is_cuda()) << what;
        EXPECT_TRUE(at::equal(got.packed.cpu(), want.packed)) << what << ": codes";
        EXPECT_TRUE(at::equal(got.absmax.cpu(), want.absmax)) << what << ": absmax";
        EXPECT_EQ(got.dtype, dtype) << what;
        if (dq) {
          EXPECT_EQ(got.nested_offset, want.nested_offset) << what;
          EXPECT_TRUE(at::equal(got.nested_absmax.cpu(), want.nested_absmax)) << what;
          EXPECT_TRUE(at::equal(got.nested_quant_map.cpu(), want.nested_quant_map)) << what;
        }
      }
}

TEST(Nf4Cuda, QuantizeRefusesANonFiniteWeightAsTheCpuDoes_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  at::Tensor w = weights({4, 64}, 64, at::kFloat, 3);
  w.view({-1})[70] = std::numeric_limits<float>::infinity();
  try {
    memtune::nf4_quantize(w.cuda(), 64, true, "layers.0.q_proj.weight");
    FAIL() << "an inf was quantized";
  } catch (const memtune::UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'layers.0.q_proj.weight' holds 1 non-finite value(s)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("first at flat index 70"), std::string::npos) << msg;
  }
}

}  // namespace
