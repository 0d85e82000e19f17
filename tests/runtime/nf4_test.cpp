// NF4 and FP4 against an independent reference (tests/reference/nf4_reference.py, NumPy,
// written from bitsandbytes' algorithm) byte for byte, plus cases worked out here from the
// algorithm and the vector kernels against the scalar ones.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>


#include "runtime/error.h"
#include "models/io/bnb_nf4.h"
#include "runtime/nf4.h"
#include "runtime/nf4_kernels.h"
#include "test_util.h"

namespace {

namespace mt = memtune::testing;
using memtune::NF4Tensor;
using memtune::QuantType;

using mt::bytes_of;
using mt::reference_bytes;
using mt::tensor_from_bytes;

struct RefCase {
  std::string name, quant_type, dtype, json;
  int64_t blocksize = 0;
  bool double_quant = false;
  uint32_t offset_bits = 0;
  std::vector<int64_t> shape;
};

class Nf4Reference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (mt::python_torch_available()) dir_ = new mt::fs::path(mt::make_reference_fixtures("nf4_reference.py"));
  }
  void SetUp() override {
    if (!mt::python_torch_available()) GTEST_SKIP() << "python3 with torch is not installed";
  }
  static std::vector<RefCase> cases() {
    std::vector<RefCase> out;
    for (const std::string& line : mt::reference_lines(*dir_ / "cases.txt")) {
      std::istringstream f(line);
      RefCase c;
      f >> c.name >> c.quant_type >> c.dtype >> c.blocksize >> c.double_quant >> c.offset_bits >> c.json;
      for (char& ch : c.json)
        if (ch == '\x01') ch = ' ';
      int64_t d;
      while (f >> d) c.shape.push_back(d);
      out.push_back(c);
    }
    return out;
  }
  static at::ScalarType dtype_of(const std::string& s) {
    return s == "float16" ? at::kHalf : s == "bfloat16" ? at::kBFloat16 : at::kFloat;
  }
  static at::Tensor input(const RefCase& c) {
    return tensor_from_bytes(reference_bytes(*dir_ / (c.name + ".input")), dtype_of(c.dtype), c.shape);
  }
  static NF4Tensor quantize(const RefCase& c) {
    return memtune::nf4_quantize(input(c), c.blocksize, c.double_quant, c.name,
                                 memtune::quant_type_from_name(c.quant_type));
  }
  static mt::fs::path* dir_;
};
mt::fs::path* Nf4Reference::dir_ = nullptr;

TEST_F(Nf4Reference, QuantizeMatchesByteForByte) {
  auto all = cases();
  ASSERT_GE(all.size(), 15u);
  for (const auto& c : all) {
    SCOPED_TRACE(c.name);
    NF4Tensor q = quantize(c);
    EXPECT_EQ(q.shape, c.shape);
    EXPECT_EQ(q.dtype, dtype_of(c.dtype));
    EXPECT_EQ(q.packed.numel(), (q.numel() + 1) / 2);
    EXPECT_TRUE(bytes_of(q.packed) == reference_bytes(*dir_ / (c.name + ".packed"))) << "packed codes differ";
    EXPECT_TRUE(bytes_of(q.absmax) == reference_bytes(*dir_ / (c.name + ".absmax"))) << "absmax differs";
    if (c.double_quant) {
      EXPECT_EQ(q.absmax.scalar_type(), at::kByte);
      EXPECT_TRUE(bytes_of(q.nested_absmax) == reference_bytes(*dir_ / (c.name + ".nested_absmax")));
      uint32_t bits;
      std::memcpy(&bits, &q.nested_offset, 4);
      EXPECT_EQ(bits, c.offset_bits) << "offset " << q.nested_offset;
      EXPECT_TRUE(bytes_of(q.nested_quant_map) == reference_bytes(*dir_ / "dynamic_map"));
    } else {
      EXPECT_EQ(q.absmax.scalar_type(), at::kFloat);
    }
    // Dequantized fp32 values, bit for bit.
    at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat);
    EXPECT_EQ(deq.sizes().vec(), c.shape);
    EXPECT_TRUE(bytes_of(deq) == reference_bytes(*dir_ / (c.name + ".deq"))) << "dequantized values differ";
    // The JSON bitsandbytes packs, as Python's json.dumps writes it, under its type's key.
    int states = 0;
    for (const auto& [key, t] : memtune::nf4_to_bnb("m.w.weight", q))
      if (key == "m.w.weight.quant_state.bitsandbytes__" + c.quant_type) {
        ++states;
        EXPECT_EQ(bytes_of(t), c.json);
      }
    EXPECT_EQ(states, 1);
  }
}

TEST_F(Nf4Reference, DequantizePathsAgree) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    NF4Tensor q = quantize(c);
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::Tensor fast = memtune::nf4_dequantize(q, dt);
      at::Tensor generic = memtune::nf4_dequantize_generic(q, dt);
      EXPECT_EQ(fast.scalar_type(), dt);
      EXPECT_TRUE(bytes_of(fast) == bytes_of(generic)) << dt;
      // One rounding from the fp32 value (round to nearest even).
      EXPECT_TRUE(bytes_of(fast) == bytes_of(memtune::nf4_dequantize(q, at::kFloat).to(dt))) << dt;
    }
    // Ranges starting and ending mid-byte and mid-block.
    at::Tensor full = memtune::nf4_dequantize(q, at::kFloat).reshape({-1});
    const int64_t n = q.numel();
    for (auto [b, len] : std::vector<std::pair<int64_t, int64_t>>{{0, n}, {1, n - 2}, {3, 70}, {n - 1, 1}, {n / 2 + 1, n / 3}}) {
      at::Tensor part = at::empty({len}, at::TensorOptions(at::kFloat));
      memtune::nf4_dequantize_range_into(q, b, len, part);
      EXPECT_TRUE(at::equal(part, full.narrow(0, b, len))) << b << "+" << len;
    }
  }
}

// ---- cases worked out from the algorithm ---------------------------------------------

// Codes of a flattened tensor, high nibble first.
std::vector<int> codes_of(const NF4Tensor& q) {
  std::vector<int> out;
  at::Tensor p = q.packed.contiguous();
  for (int64_t i = 0; i < p.numel(); ++i) {
    out.push_back(p.data_ptr<uint8_t>()[i] >> 4);
    out.push_back(p.data_ptr<uint8_t>()[i] & 15);
  }
  out.resize(q.numel());
  return out;
}

TEST(Nf4, CodebookValuesAndMidpoints) {
  const auto& cb = memtune::codebook_4bit(memtune::QuantType::kNF4);
  EXPECT_EQ(cb[0], -1.0f);
  EXPECT_EQ(cb[7], 0.0f);
  EXPECT_EQ(cb[15], 1.0f);
  // bitsandbytes' dQuantizeNF4 compares against these fp32 literals, the midpoints of
  // neighbouring codes (a few land one fp32 step off the fp32 midpoint).
  const float mids[15] = {-0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f,
                          -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                          -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                          0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
                          0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};
  for (int i = 0; i < 15; ++i) {
    const double exact = (static_cast<double>(cb[i]) + cb[i + 1]) / 2;
    EXPECT_LE(std::fabs(mids[i] - exact), std::fabs(std::nextafter(mids[i], 2.0f) - mids[i])) << i;
  }
  // One block with absmax exactly 1 (so x * (1/absmax) == x): each code value, each
  // midpoint (a tie goes to the lower code: the kernel compares with ">"), and the floats
  // just above (upper code) and below (lower code) it.
  std::vector<float> x;
  std::vector<int> want;
  for (int i = 0; i < 16; ++i) {
    x.push_back(cb[i]);
    want.push_back(i);
  }
  for (int i = 0; i < 15; ++i) {
    x.push_back(mids[i]);
    want.push_back(i);
    x.push_back(std::nextafter(mids[i], 2.0f));
    want.push_back(i + 1);
    x.push_back(std::nextafter(mids[i], -2.0f));
    want.push_back(i);
  }
  x.push_back(-0.0f);  // negative zero codes as zero
  want.push_back(7);
  while (x.size() % 64) {
    // 0.5 is 0.0593 from 0.44070983 (code 12) and 0.0626 from 0.56261700 (code 13).
    x.push_back(0.5f);
    want.push_back(12);
  }
  at::Tensor t = at::tensor(x, at::TensorOptions(at::kFloat));
  NF4Tensor q = memtune::nf4_quantize(t, 64, false);
  EXPECT_EQ(codes_of(q), want);
  at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(deq[i].item<float>(), cb[i]);
}

TEST(Nf4, ScalingUsesReciprocalOfAbsmax) {
  // Block [4, v]: v * (1/4) lands on the value the kernel compares.
  const float absmax = 4.0f;
  std::vector<float> x = {absmax, -absmax, 0.3f, -1.7f};
  NF4Tensor q = memtune::nf4_quantize(at::tensor(x, at::TensorOptions(at::kFloat)), 32, false);
  auto codes = codes_of(q);
  EXPECT_EQ(codes[0], 15);
  EXPECT_EQ(codes[1], 0);
  // 0.3/4 = 0.075 -> between 0.0398 and 0.1203 -> code 8; -1.7/4 = -0.425 -> between
  // -0.46 and -0.3397 -> code 3.
  EXPECT_EQ(codes[2], 8);
  EXPECT_EQ(codes[3], 3);
  EXPECT_EQ(q.absmax.item<float>(), absmax);
}

TEST(Nf4, AllZeroBlockAndPartialBlock) {
  // Block 0 all zero, block 1 random, block 2 a partial (odd) tail.
  at::Tensor x = at::randn({64 * 2 + 7});
  x.narrow(0, 0, 64).zero_();
  x[3] = -0.0f;
  for (bool dq : {false, true}) {
    NF4Tensor q = memtune::nf4_quantize(x, 64, dq);
    auto codes = codes_of(q);
    for (int i = 0; i < 64; ++i) ASSERT_EQ(codes[i], 7) << i;
    // The padding nibble of the odd tail is the code of 0.0.
    EXPECT_EQ(q.packed[q.packed.numel() - 1].item<uint8_t>() & 15, 7);
    EXPECT_EQ(q.nblocks(), 3);
    at::Tensor absmax = memtune::nf4_absmax_fp32(q);
    at::Tensor tail = x.narrow(0, 128, 7);
    if (!dq) {
      EXPECT_EQ(absmax[0].item<float>(), 0.0f);
      EXPECT_EQ(absmax[2].item<float>(), tail.abs().max().item<float>());  // its own absmax
    }
    at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat);
    EXPECT_TRUE(at::all(deq.narrow(0, 0, 64) == 0).item<bool>());
  }
}

TEST(Nf4, RejectsNonFiniteWithCountAndIndex) {
  at::Tensor x = at::randn({10, 20});
  x[3][4] = std::numeric_limits<float>::infinity();
  x[7][1] = std::nanf("");
  try {
    memtune::nf4_quantize(x, 64, true, "layers.0.q_proj.weight");
    FAIL() << "no error";
  } catch (const memtune::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("2 non-finite"), std::string::npos) << m;
    EXPECT_NE(m.find("flat index 64"), std::string::npos) << m;
    EXPECT_NE(m.find("layers.0.q_proj.weight"), std::string::npos) << m;
  }
  EXPECT_THROW(memtune::nf4_quantize(at::randn({64}), 48), memtune::UserError);
  EXPECT_THROW(memtune::nf4_quantize(at::randn({64}), 8192), memtune::UserError);
  EXPECT_THROW(memtune::nf4_quantize(at::randn({64}).to(at::kDouble), 64), memtune::UserError);
}

TEST(Nf4, DequantizeErrorBound) {
  // |x - deq| <= absmax * (largest half gap between neighbouring codes), plus the error of
  // the reconstructed absmax under double quantization.
  const auto& cb = memtune::codebook_4bit(memtune::QuantType::kNF4);
  float half_gap = 0;
  for (int i = 0; i < 15; ++i) half_gap = std::max(half_gap, (cb[i + 1] - cb[i]) / 2);
  at::Tensor x = at::randn({256, 192}) * at::rand({256, 1}) * 3;
  for (bool dq : {false, true}) {
    NF4Tensor q = memtune::nf4_quantize(x, 64, dq);
    at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat).view({-1, 64});
    at::Tensor xb = x.view({-1, 64});
    at::Tensor true_absmax = xb.abs().amax(1, true);
    at::Tensor recon = memtune::nf4_absmax_fp32(q).unsqueeze(1);
    at::Tensor bound = true_absmax * half_gap * 1.0001 + (recon - true_absmax).abs();
    EXPECT_TRUE(at::all((deq - xb).abs() <= bound).item<bool>()) << "dq=" << dq;
    if (dq) {
      // The 8-bit dynamic map steps by at most (1 - 0.1) / 64 of the 256-block's scale
      // near its top, so absmax comes back within half of that times nested_absmax.
      at::Tensor nested = q.nested_absmax.repeat_interleave(256).narrow(0, 0, q.nblocks()).unsqueeze(1);
      EXPECT_TRUE(at::all((recon - true_absmax).abs() <= nested * (0.9 / 64 / 2) * 1.001).item<bool>());
    }
  }
}

// ---- bitsandbytes serialization ------------------------------------------------------

TEST(Nf4, BitsPerParameter) {
  const int64_t rows = 4096, cols = 4096, n = rows * cols;
  NF4Tensor dq = memtune::nf4_quantize(at::randn({rows, cols}), 64, true);
  const int64_t nb = n / 64, nb2 = (nb + 255) / 256;
  // packed n/2 bytes + one uint8 code per block + fp32 per 256 blocks + fp32[256] map.
  const double want = 8.0 * (n / 2 + nb + 4 * nb2 + 4 * 256) / n;
  EXPECT_DOUBLE_EQ(memtune::nf4_bits_per_parameter(dq), want);
  EXPECT_NEAR(memtune::nf4_bits_per_parameter(dq), 4.127, 0.001);
  NF4Tensor plain = memtune::nf4_quantize(at::randn({rows, 64}), 64, false);
  EXPECT_DOUBLE_EQ(memtune::nf4_bits_per_parameter(plain), 4.5);
}

// ---- FP4 ---------------------------------------------------------------------------

TEST(Fp4, ZeroBlockPaddingAndSignedZeros) {
  // FP4's code of 0.0 is 0 (NF4's is 7): an all-zero block and the odd tail's padding nibble
  // take it. A value below zero, however small, keeps the sign bit (code 8, -0 * absmax) in
  // IEEE fp32 (bitsandbytes' fast-math build flushes denormals: runtime/nf4.h).
  at::Tensor x = at::randn({64 + 64 + 7}).clamp(-3, 3);
  x.narrow(0, 0, 64).zero_();
  x[64] = 4.0f;           // block 1's absmax: x / 4 is what the tree sees
  x[65] = -1e-4f;         // -2.5e-5 after scaling: below the first pivot, negative
  x[66] = -0.0f;          // not below zero: code 0
  x[67] = -4.0f;
  NF4Tensor q = memtune::nf4_quantize(x, 64, false, "", QuantType::kFP4);
  EXPECT_EQ(q.quant_type, QuantType::kFP4);
  auto codes = codes_of(q);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(codes[i], 0) << i;
  EXPECT_EQ(codes[64], 0b0011);  // +1.0
  EXPECT_EQ(codes[65], 0b1000);
  EXPECT_EQ(codes[66], 0b0000);
  EXPECT_EQ(codes[67], 0b1011);  // -1.0
  EXPECT_EQ(q.packed[q.packed.numel() - 1].item<uint8_t>() & 15, 0);
  at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat);
  EXPECT_EQ(deq[64].item<float>(), 4.0f);
  EXPECT_EQ(deq[67].item<float>(), -4.0f);
  EXPECT_EQ(deq[65].item<float>(), 0.0f);
  EXPECT_TRUE(at::all(deq.narrow(0, 0, 64) == 0).item<bool>());
}

TEST(Fp4, DequantizeErrorBound) {
  // FP4's levels are 1/12 of 0, 1/16, 2, 3, 4, 6, 8, 12: the largest half gap is (12 - 8) / 24.
  const auto& cb = memtune::codebook_4bit(QuantType::kFP4);
  std::vector<float> sorted(cb.begin(), cb.end());
  std::sort(sorted.begin(), sorted.end());
  float half_gap = 0;
  for (int i = 0; i < 15; ++i) half_gap = std::max(half_gap, (sorted[i + 1] - sorted[i]) / 2);
  EXPECT_FLOAT_EQ(half_gap, 4.0f / 24.0f);
  at::Tensor x = at::randn({128, 192});
  NF4Tensor q = memtune::nf4_quantize(x, 64, false, "", QuantType::kFP4);
  at::Tensor deq = memtune::nf4_dequantize(q, at::kFloat).view({-1, 64});
  at::Tensor xb = x.view({-1, 64});
  EXPECT_TRUE(at::all((deq - xb).abs() <= xb.abs().amax(1, true) * half_gap * 1.0001).item<bool>());
  // The nearest level, not merely a close one: FP4 codes the same tensor worse than NF4
  // (it spends levels on 1/192 and 1/6), which is why QLoRA recipes set nf4.
  NF4Tensor n = memtune::nf4_quantize(x, 64, false, "", QuantType::kNF4);
  const double err_fp4 = (deq - xb).pow(2).mean().item<double>();
  const double err_nf4 = (memtune::nf4_dequantize(n, at::kFloat).view({-1, 64}) - xb).pow(2).mean().item<double>();
  EXPECT_GT(err_fp4, err_nf4);
}

#ifdef MEMTUNE_X86
TEST(Nf4Kernels, Avx2EqualsScalarForBothCodes) {
  if (!memtune::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 kernels here (the CPU has none, or ATEN_CPU_CAPABILITY=default)";
  namespace k = memtune::nf4_kernels;
  // Every pivot of both codes and its fp32 neighbours, both signs, signed zeros, tiny values
  // (a denormal too), and random values, over a length that leaves a scalar tail.
  std::vector<float> x = {0.0f, -0.0f, 1e-30f, -1e-30f, -1e-40f, 1.0f, -1.0f};
  auto add_around = [&](float p) {
    for (float v : {std::nextafter(p, -2.0f), p, std::nextafter(p, 2.0f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  };
  for (float p : k::kNf4Thresholds) add_around(p);
  for (float p : k::kFp4MagnitudeThresholds) add_around(p);
  at::Tensor r = at::rand({300}) * 2 - 1;
  for (int64_t i = 0; i < r.numel(); ++i) x.push_back(r[i].item<float>());
  const int64_t n = static_cast<int64_t>(x.size());
  ASSERT_NE(n % 8, 0);
  for (QuantType t : {QuantType::kNF4, QuantType::kFP4}) {
    SCOPED_TRACE(memtune::quant_type_name(t));
    std::vector<uint8_t> scalar(n), vec(n);
    k::codes_scalar(t, x.data(), n, 1.0f, scalar.data());
    if (t == QuantType::kFP4) {
      k::fp4_codes_avx2(x.data(), n, 1.0f, vec.data());
    } else {
      k::nf4_codes_avx2(x.data(), n, 1.0f, vec.data());
    }
    EXPECT_EQ(vec, scalar);
    // Unpacking: every byte value, 16-byte groups and a tail.
    std::vector<uint8_t> bytes(256 + 5);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
    const int64_t nb = static_cast<int64_t>(bytes.size());
    std::vector<float> a(2 * nb), b(2 * nb);
    const float* cb = memtune::codebook_4bit(t).data();
    k::pairs_scalar(bytes.data(), nb, cb, 0.37f, a.data());
    k::pairs_avx2(bytes.data(), nb, cb, 0.37f, b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  }
}
#endif

}  // namespace
