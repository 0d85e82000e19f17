// bitsandbytes' state-dict layout of 4-bit (NF4, FP4) weights (models/io/bnb_nf4.h): the
// entries and the JSON state as bitsandbytes writes them, read back exactly, damaged states
// refused by name.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "models/io/bnb_nf4.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "test_util.h"

namespace {

using memtune::NF4Tensor;

using memtune::testing::bytes_of;

std::map<std::string, at::Tensor> as_map(const std::vector<std::pair<std::string, at::Tensor>>& v) {
  return std::map<std::string, at::Tensor>(v.begin(), v.end());
}

TEST(BnbNf4, RoundTrip) {
  at::Tensor x = at::randn({96, 80}).to(at::kBFloat16);
  for (auto [dq, type] : {std::pair{true, memtune::QuantType::kNF4}, {false, memtune::QuantType::kNF4},
                          {true, memtune::QuantType::kFP4}, {false, memtune::QuantType::kFP4}}) {
    SCOPED_TRACE(memtune::quant_type_name(type));
    NF4Tensor q = memtune::nf4_quantize(x, 64, dq, "", type);
    const std::string w = "model.layers.0.self_attn.q_proj.weight";
    auto entries = memtune::nf4_to_bnb(w, q);
    auto m = as_map(entries);
    std::vector<std::string> keys;
    for (auto& e : entries) keys.push_back(e.first);
    std::vector<std::string> want = {w, w + ".absmax", w + ".quant_map"};
    if (dq) {
      want.push_back(w + ".nested_absmax");
      want.push_back(w + ".nested_quant_map");
    }
    want.push_back(w + ".quant_state.bitsandbytes__" + memtune::quant_type_name(type));
    EXPECT_EQ(keys, want);
    EXPECT_EQ(m[w].sizes().vec(), (std::vector<int64_t>{96 * 80 / 2, 1}));
    EXPECT_EQ(m[w].scalar_type(), at::kByte);
    at::Tensor qm = m[w + ".quant_map"];
    ASSERT_EQ(qm.numel(), 16);
    // get_4bit_type(type): NF4's quantiles, or FP4's e2m1 values over 12 (code 8 is +0.0).
    const std::vector<float> nf4 = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                    0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                    0.7229568362236023f, 1.0f};
    const float e2m1[16] = {0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3};
    for (int i = 0; i < 16; ++i) {
      const float want_value = type == memtune::QuantType::kNF4 ? nf4[i] : e2m1[i] / 12.0f;
      EXPECT_EQ(bytes_of(qm[i]), bytes_of(at::tensor(want_value))) << i;  // bits, so +0.0 is not -0.0
    }
    EXPECT_TRUE(memtune::is_bnb_4bit(keys, w));
    EXPECT_FALSE(memtune::is_bnb_4bit(keys, "model.layers.0.self_attn.k_proj.weight"));

    NF4Tensor back = memtune::nf4_from_bnb(
        [&](const std::string& k) { return m.count(k) ? m[k] : at::Tensor(); }, w);
    EXPECT_EQ(back.shape, q.shape);
    EXPECT_EQ(back.blocksize, 64);
    EXPECT_EQ(back.dtype, at::kBFloat16);
    EXPECT_EQ(back.double_quant, dq);
    EXPECT_EQ(back.quant_type, type);
    EXPECT_TRUE(at::equal(back.packed, q.packed));
    EXPECT_TRUE(at::equal(back.absmax, q.absmax));
    if (dq) {
      EXPECT_EQ(back.nested_offset, q.nested_offset);  // JSON repr round-trips the float
      EXPECT_TRUE(at::equal(back.nested_absmax, q.nested_absmax));
      EXPECT_TRUE(at::equal(back.nested_quant_map, q.nested_quant_map));
    }
    EXPECT_TRUE(at::equal(memtune::nf4_dequantize(back, at::kFloat), memtune::nf4_dequantize(q, at::kFloat)));
  }
}

TEST(BnbNf4, JsonLayout) {
  NF4Tensor q = memtune::nf4_quantize(at::ones({4, 64}).to(at::kHalf), 64, false);
  auto m = as_map(memtune::nf4_to_bnb("w", q));
  EXPECT_EQ(bytes_of(m["w.quant_state.bitsandbytes__nf4"]),
            R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float16", "shape": [4, 64]})");
  EXPECT_EQ(m["w.absmax"].scalar_type(), at::kFloat);
  q = memtune::nf4_quantize(at::ones({4, 64}), 64, false, "", memtune::QuantType::kFP4);
  m = as_map(memtune::nf4_to_bnb("w", q));
  EXPECT_EQ(m.count("w.quant_state.bitsandbytes__nf4"), 0u);
  EXPECT_EQ(bytes_of(m["w.quant_state.bitsandbytes__fp4"]),
            R"({"quant_type": "fp4", "blocksize": 64, "dtype": "float32", "shape": [4, 64]})");
}

TEST(BnbNf4, RejectsInconsistentState) {
  NF4Tensor q = memtune::nf4_quantize(at::randn({32, 64}), 64, true);
  const std::string w = "m.weight";
  auto load = [&](std::map<std::string, at::Tensor> m) {
    return memtune::nf4_from_bnb([&](const std::string& k) { return m.count(k) ? m[k] : at::Tensor(); }, w);
  };
  auto expect_error = [&](std::map<std::string, at::Tensor> m, const std::string& needle) {
    try {
      load(m);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const memtune::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto good = as_map(memtune::nf4_to_bnb(w, q));
  EXPECT_NO_THROW(load(good));

  auto m = good;
  m.erase(w + ".nested_absmax");
  expect_error(m, "m.weight.nested_absmax");

  m = good;
  m[w + ".absmax"] = good[w + ".absmax"].narrow(0, 0, 10);
  expect_error(m, "absmax' has 10 entries");

  m = good;
  m[w] = good[w].narrow(0, 0, 100);
  expect_error(m, "needs 1024");

  m = good;
  auto json = bytes_of(good[w + ".quant_state.bitsandbytes__nf4"]);
  auto set_json = [&](std::string from, std::string to) {
    std::string s = json;
    s.replace(s.find(from), from.size(), to);
    m[w + ".quant_state.bitsandbytes__nf4"] = at::tensor(std::vector<uint8_t>(s.begin(), s.end()), at::kByte);
  };
  set_json("\"nf4\"", "\"fp4\"");
  expect_error(m, "quant_type \"fp4\"; its key says nf4");
  m = good;
  set_json("[32, 64]", "[32, 65]");
  expect_error(m, "needs 1040");
  m = good;
  set_json("\"blocksize\": 64", "\"blocksize\": 48");
  expect_error(m, "blocksize 48");

  m = good;
  m.erase(w + ".quant_state.bitsandbytes__nf4");
  m[w + ".quant_state.bitsandbytes__fp4"] = good[w + ".quant_state.bitsandbytes__nf4"];
  expect_error(m, "quant_type \"nf4\"; its key says fp4");

  m = good;
  m[w + ".quant_state.bitsandbytes__fp4"] = good[w + ".quant_state.bitsandbytes__nf4"];
  expect_error(m, "both");

  m = good;
  m[w + ".quant_map"] = at::linspace(-1, 1, 16);
  expect_error(m, "not the nf4 codebook");

  // An FP4 state whose quant_map is NF4's.
  auto fp4 = as_map(memtune::nf4_to_bnb(w, memtune::nf4_quantize(at::randn({32, 64}), 64, true, "",
                                                                 memtune::QuantType::kFP4)));
  EXPECT_NO_THROW(load(fp4));
  fp4[w + ".quant_map"] = good[w + ".quant_map"];
  expect_error(fp4, "not the fp4 codebook");
}

TEST(BnbNf4, PythonFloatRepr) {
  // Expected strings from CPython's repr().
  const std::vector<std::pair<double, std::string>> cases = {
      {1e-05, "1e-05"}, {0.0001, "0.0001"}, {1.5e-05, "1.5e-05"}, {123.0, "123.0"},
      {1e16, "1e+16"}, {0.1, "0.1"}, {static_cast<double>(0.1f), "0.10000000149011612"},
      {12345678901234567.0, "1.2345678901234568e+16"}, {0.00012345, "0.00012345"}, {2.5, "2.5"},
      {1e22, "1e+22"}, {5e-324, "5e-324"}, {100.0, "100.0"}, {0.0, "0.0"},
      {static_cast<double>(3.3e-3f), "0.0032999999821186066"}};
  for (const auto& [v, s] : cases) EXPECT_EQ(memtune::python_float_repr(v), s);
}

}  // namespace
