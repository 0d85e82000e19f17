// bitsandbytes' 8-bit AdamW against an independent reference (tests/reference/adamw8bit_reference.py,
// NumPy, written from bitsandbytes' kernels): 20 steps per case, quantized states and absmax byte
// for byte, parameters bit for bit (fp32, same operations); tensors under 4096 elements on the
// 32-bit kernel. Plus training.optim's names.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "runtime/error.h"
#include "runtime/offload.h"
#include "test_util.h"
#include "trainer/adamw8bit_kernels.h"
#include "trainer/optimizer.h"

namespace {

namespace mt = memtune::testing;
namespace tr = memtune::trainer;

using mt::bytes_of;
using mt::reference_bytes;

at::Tensor floats(const std::string& bytes) {  // a fixture's fp32 array, flat
  return mt::tensor_from_bytes(bytes, at::kFloat, {static_cast<int64_t>(bytes.size() / 4)});
}

struct Case {
  std::string name;
  int64_t n = 0, steps = 0;
  double lr = 0, b1 = 0, b2 = 0, eps = 0, wd = 0, gs = 0;
  int eight = 0;
};

class AdamW8bitReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (mt::python_torch_available()) dir_ = new mt::fs::path(mt::make_reference_fixtures("adamw8bit_reference.py"));
  }
  void SetUp() override {
    if (!mt::python_torch_available()) GTEST_SKIP() << "python3 with torch is not installed";
  }
  static std::vector<Case> cases() {
    std::vector<Case> out;
    for (const std::string& line : mt::reference_lines(*dir_ / "cases.txt")) {
      std::istringstream f(line);
      Case c;
      f >> c.name >> c.n >> c.steps >> c.lr >> c.b1 >> c.b2 >> c.eps >> c.wd >> c.gs >> c.eight;
      out.push_back(c);
    }
    return out;
  }
  // Runs the case's steps through trainer::Optimizer; the parameter is a matrix (so it decays).
  static std::unique_ptr<tr::Optimizer> run(const Case& c, bool paged, at::Tensor* param) {
    at::Tensor p = floats(reference_bytes(*dir_ / (c.name + ".p0"))).view({1, c.n});
    at::Tensor g = floats(reference_bytes(*dir_ / (c.name + ".g")));
    EXPECT_EQ(g.numel(), c.n * c.steps);
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(paged ? "paged_adamw_8bit" : "adamw_bnb_8bit", o);
    o.beta1 = c.b1;
    o.beta2 = c.b2;
    o.eps = c.eps;
    o.weight_decay = c.wd;
    auto opt = std::make_unique<tr::Optimizer>(std::vector<std::pair<std::string, at::Tensor>>{{"w.weight", p}}, o);
    for (int64_t s = 0; s < c.steps; ++s) {
      p.mutable_grad() = g.narrow(0, s * c.n, c.n).view({1, c.n}).clone();
      opt->step(c.lr, c.gs);
    }
    *param = p;
    return opt;
  }
  static mt::fs::path* dir_;
};
mt::fs::path* AdamW8bitReference::dir_ = nullptr;

TEST_F(AdamW8bitReference, MapsMatchBitsandbytes) {
  EXPECT_TRUE(bytes_of(tr::dynamic_map(true)) == reference_bytes(*dir_ / "dynamic_map"));
  EXPECT_TRUE(bytes_of(tr::dynamic_map(false)) == reference_bytes(*dir_ / "udynamic_map"));
}

TEST_F(AdamW8bitReference, CodesMatchTheSearchOnEveryValue) {
  at::Tensor x = floats(reference_bytes(*dir_ / "quant_x"));
  const std::string want_s = reference_bytes(*dir_ / "quant_signed"), want_u = reference_bytes(*dir_ / "quant_unsigned");
  ASSERT_EQ(static_cast<int64_t>(want_s.size()), x.numel());
  ASSERT_GT(x.numel(), 400000);
  const float* xp = x.data_ptr<float>();
  int64_t bad_s = 0, bad_u = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    bad_s += tr::quantize_dynamic(true, xp[i]) != static_cast<uint8_t>(want_s[i]);
    bad_u += tr::quantize_dynamic(false, std::fabs(xp[i])) != static_cast<uint8_t>(want_u[i]);
  }
  EXPECT_EQ(bad_s, 0);
  EXPECT_EQ(bad_u, 0);
}

TEST_F(AdamW8bitReference, TwentyStepsMatchByteForByte) {
  auto all = cases();
  ASSERT_EQ(all.size(), 5u);
  int eight = 0;
  for (bool paged : {false, true})
    for (const Case& c : all) {
      SCOPED_TRACE(c.name + (paged ? " paged" : ""));
      at::Tensor p;
      auto opt = run(c, paged, &p);
      std::map<std::string, at::Tensor> st;
      for (auto& [k, t] : opt->state_tensors()) st[k] = t;
      const std::string pre = "w.weight.";
      ASSERT_TRUE(st.count(pre + "exp_avg") && st.count(pre + "exp_avg_sq"));
      EXPECT_EQ(st.count(pre + "absmax1"), c.eight ? 1u : 0u);
      EXPECT_EQ(st[pre + "exp_avg"].scalar_type(), c.eight ? at::kByte : at::kFloat);
      EXPECT_TRUE(bytes_of(st[pre + "exp_avg"]) == reference_bytes(*dir_ / (c.name + ".state1"))) << "state1 differs";
      EXPECT_TRUE(bytes_of(st[pre + "exp_avg_sq"]) == reference_bytes(*dir_ / (c.name + ".state2"))) << "state2 differs";
      if (c.eight) {
        ++eight;
        EXPECT_TRUE(bytes_of(st[pre + "absmax1"]) == reference_bytes(*dir_ / (c.name + ".absmax1"))) << "absmax1 differs";
        EXPECT_TRUE(bytes_of(st[pre + "absmax2"]) == reference_bytes(*dir_ / (c.name + ".absmax2"))) << "absmax2 differs";
      }
      at::Tensor want = floats(reference_bytes(*dir_ / (c.name + ".p")));
      at::Tensor got = p.reshape({-1});
      EXPECT_TRUE(bytes_of(got) == bytes_of(want))
          << "parameters differ; max |diff| " << (got - want).abs().max().item<float>();
      // and they moved: the reference is not the starting point
      EXPECT_FALSE(at::equal(want, floats(reference_bytes(*dir_ / (c.name + ".p0")))));
    }
  EXPECT_EQ(eight, 6);
}

TEST_F(AdamW8bitReference, StateBytesPerParameter) {
  // 8-bit: 2 codes + 2 absmax per 256 elements; under 4096 elements: 8 B (fp32 m, v).
  at::Tensor big = at::zeros({64, 256}), small = at::zeros({4095});
  tr::OptimizerOptions o;
  tr::set_optimizer_kind("adamw_8bit", o);
  tr::Optimizer a({{"a.weight", big}}, o), b({{"b.weight", small}}, o);
  EXPECT_EQ(a.state_bytes(), 64 * 256 * 2 + 64 * 2 * 4);
  EXPECT_EQ(b.state_bytes(), 4095 * 8);
}

// The memory ladder's optimizer_8bit rung quantizes AdamW's fp32 states as the 8-bit update
// leaves its own: per 256-block absmax = max |x| (worked out here), each code the search's
// (quantize_2d_search, the definition the fast tables are checked against) of x over it, the
// first moment's moved one step where its sign would flip. Ragged end, a zero block, negatives.
TEST(Adam8bitQuantize, StatesBecomeTheSearchsCodesOverEachBlocksAbsmax) {
  const int64_t n = 4096 + 300;
  at::manual_seed(3);
  at::Tensor m = at::randn({n}) * 1e-3, v = at::rand({n}) * 1e-6;
  m.narrow(0, 512, 256).zero_();  // a block of zeros: absmax 0
  v.narrow(0, 512, 256).zero_();
  const int64_t blocks = (n + tr::kBlock8bit - 1) / tr::kBlock8bit;
  std::vector<uint8_t> c1(n), c2(n);
  std::vector<float> a1(blocks), a2(blocks);
  tr::quantize_states_8bit(m.data_ptr<float>(), v.data_ptr<float>(), n, c1.data(), c2.data(), a1.data(), a2.data());
  const at::Tensor q1 = tr::dynamic_map(true), q2 = tr::dynamic_map(false);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t len = std::min<int64_t>(tr::kBlock8bit, n - b * tr::kBlock8bit);
    EXPECT_EQ(a1[b], m.narrow(0, b * tr::kBlock8bit, len).abs().max().item<float>()) << "block " << b;
    EXPECT_EQ(a2[b], v.narrow(0, b * tr::kBlock8bit, len).abs().max().item<float>()) << "block " << b;
  }
  int mismatches = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t b = j / tr::kBlock8bit;
    const float x = m[j].item<float>();
    int k1 = tr::quantize_2d_search(q1.data_ptr<float>(), true, x / a1[b]);
    if (std::signbit(q1[k1].item<float>()) != std::signbit(x)) k1 = x > 0.0f ? k1 + 1 : k1 - 1;
    mismatches += c1[j] != static_cast<uint8_t>(k1);
    mismatches += c2[j] != tr::quantize_2d_search(q2.data_ptr<float>(), false, v[j].item<float>() / a2[b]);
  }
  EXPECT_EQ(mismatches, 0);
}

// The rung on an optimizer: AdamW's states of a tensor of 4096+ elements become codes and
// absmax (2 B per element and 8 per block, against 8), a small tensor's stay fp32; the next
// update is the one an adamw_8bit optimizer holding that state makes (byte for byte); back
// (grow-back), the fp32 states are the codes' values, within a step of the map of the originals.
TEST(Adam8bitQuantize, TheLadderRungTurnsAdamWIntoTheEightBitUpdate) {
  auto make = [] {
    at::manual_seed(7);
    return std::vector<std::pair<std::string, at::Tensor>>{{"big.weight", at::randn({40, 128}).requires_grad_()},
                                                           {"small.weight", at::randn({10, 10}).requires_grad_()}};
  };
  auto grads = [](std::vector<std::pair<std::string, at::Tensor>>& ps, int step) {
    at::manual_seed(100 + step);
    for (auto& [name, p] : ps) p.mutable_grad() = at::randn(p.sizes());
  };
  tr::OptimizerOptions o;
  tr::set_optimizer_kind("adamw_torch", o);
  o.weight_decay = 0.01;
  auto ps = make();
  tr::Optimizer adam(ps, o);
  for (int step = 0; step < 3; ++step) {
    grads(ps, step);
    adam.step(1e-3);
  }
  EXPECT_EQ(adam.state_bytes(), (40 * 128 + 100) * 8);
  EXPECT_FALSE(adam.states_quantized());
  const int64_t freed = adam.quantize_states();
  EXPECT_TRUE(adam.states_quantized());
  EXPECT_EQ(freed, 40 * 128 * 8 - (40 * 128 * 2 + 20 * 2 * 4));
  EXPECT_EQ(adam.state_bytes(), 40 * 128 * 2 + 20 * 2 * 4 + 100 * 8);
  EXPECT_EQ(adam.state_scalars()["kind"], "adamw_8bit");
  EXPECT_EQ(adam.quantize_states(), 0) << "once";

  // An adamw_8bit optimizer given that state (and the step count) updates the same way.
  auto ps8 = make();
  for (size_t i = 0; i < ps.size(); ++i) ps8[i].second.detach().copy_(ps[i].second.detach());
  tr::OptimizerOptions o8 = o;
  tr::set_optimizer_kind("adamw_8bit", o8);
  tr::Optimizer eight(ps8, o8);
  std::map<std::string, at::Tensor> state;
  for (const auto& [name, t] : adam.state_tensors()) state[name] = t.clone();
  EXPECT_TRUE(state.count("big.weight.absmax1") && !state.count("small.weight.absmax1"));
  eight.load_state(state, adam.state_scalars());
  for (int step = 3; step < 5; ++step) {
    grads(ps, step);
    grads(ps8, step);
    adam.step(1e-3);
    eight.step(1e-3);
  }
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(bytes_of(ps[i].second), bytes_of(ps8[i].second)) << ps[i].first;

  // Back to fp32: each value within the map's widest gap (times the block's absmax) of the codes'.
  auto ps2 = make();
  tr::Optimizer again(ps2, o);
  for (int step = 0; step < 3; ++step) {
    grads(ps2, step);
    again.step(1e-3);
  }
  const at::Tensor m0 = again.state_tensors()[0].second.clone();
  again.quantize_states();
  EXPECT_GT(again.dequantize_states(), 0);
  EXPECT_FALSE(again.states_quantized());
  EXPECT_EQ(again.state_scalars()["kind"], "adamw");
  const at::Tensor m1 = again.state_tensors()[0].second;
  EXPECT_EQ(m1.scalar_type(), at::kFloat);
  const double tol = m0.abs().max().item<double>() * 0.1;  // the signed map's widest step is under 0.1
  EXPECT_LE((m1 - m0).abs().max().item<double>(), tol);
  EXPECT_GT((m1 - m0).abs().max().item<double>(), 0.0) << "the codes lost something";
}

TEST(OptimizerNames, HuggingFaceNamesMapAndOthersAreRefused) {
  struct Want {
    const char* name;
    const char* kind;
    bool paged;
  };
  for (const Want& w : {Want{"adamw_torch", "adamw", false}, Want{"adamw", "adamw", false},
                        Want{"adamw_bnb_8bit", "adamw_8bit", false}, Want{"adamw_8bit", "adamw_8bit", false},
                        Want{"paged_adamw_8bit", "adamw_8bit", true}, Want{"paged_adamw_32bit", "adamw_32bit", true},
                        Want{"adafactor", "adafactor", false}, Want{"sgd", "sgd", false}}) {
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(w.name, o);
    EXPECT_EQ(o.kind, w.kind) << w.name;
    EXPECT_EQ(o.paged, w.paged) << w.name;
  }
  tr::OptimizerOptions o;
  try {
    tr::set_optimizer_kind("lion_32bit", o);
    FAIL() << "lion_32bit accepted";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("lion_32bit"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("paged_adamw_8bit"), std::string::npos);
  }
}

}  // namespace
