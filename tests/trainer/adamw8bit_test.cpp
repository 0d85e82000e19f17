// bitsandbytes' 8-bit AdamW against an independent reference (tests/reference/adamw8bit_reference.py,
// NumPy, written from bitsandbytes' kernels): 20 steps per case, quantized states and absmax byte
// for byte, parameters bit for bit (fp32, same operations); tensors under 4096 elements on the
// 32-bit kernel. Plus training.optim's names.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "runtime/error.h"
#include "runtime/offload.h"
#include "test_util.h"
#include "trainer/optimizer.h"

namespace {

namespace mt = memtune::testing;
namespace tr = memtune::trainer;

std::string read_bytes(const mt::fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string bytes_of(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

at::Tensor floats(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size() / 4)}, at::kFloat);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
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
    std::istringstream lines(read_bytes(*dir_ / "cases.txt"));
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      Case c;
      f >> c.name >> c.n >> c.steps >> c.lr >> c.b1 >> c.b2 >> c.eps >> c.wd >> c.gs >> c.eight;
      out.push_back(c);
    }
    return out;
  }
  // Runs the case's steps through trainer::Optimizer; the parameter is a matrix (so it decays).
  static std::unique_ptr<tr::Optimizer> run(const Case& c, bool paged, at::Tensor* param) {
    at::Tensor p = floats(read_bytes(*dir_ / (c.name + ".p0"))).view({1, c.n});
    at::Tensor g = floats(read_bytes(*dir_ / (c.name + ".g")));
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
  EXPECT_TRUE(bytes_of(tr::dynamic_map(true)) == read_bytes(*dir_ / "dynamic_map"));
  EXPECT_TRUE(bytes_of(tr::dynamic_map(false)) == read_bytes(*dir_ / "udynamic_map"));
}

TEST_F(AdamW8bitReference, CodesMatchTheSearchOnEveryValue) {
  at::Tensor x = floats(read_bytes(*dir_ / "quant_x"));
  const std::string want_s = read_bytes(*dir_ / "quant_signed"), want_u = read_bytes(*dir_ / "quant_unsigned");
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
      EXPECT_TRUE(bytes_of(st[pre + "exp_avg"]) == read_bytes(*dir_ / (c.name + ".state1"))) << "state1 differs";
      EXPECT_TRUE(bytes_of(st[pre + "exp_avg_sq"]) == read_bytes(*dir_ / (c.name + ".state2"))) << "state2 differs";
      if (c.eight) {
        ++eight;
        EXPECT_TRUE(bytes_of(st[pre + "absmax1"]) == read_bytes(*dir_ / (c.name + ".absmax1"))) << "absmax1 differs";
        EXPECT_TRUE(bytes_of(st[pre + "absmax2"]) == read_bytes(*dir_ / (c.name + ".absmax2"))) << "absmax2 differs";
      }
      at::Tensor want = floats(read_bytes(*dir_ / (c.name + ".p")));
      at::Tensor got = p.reshape({-1});
      EXPECT_TRUE(bytes_of(got) == bytes_of(want))
          << "parameters differ; max |diff| " << (got - want).abs().max().item<float>();
      // and they moved: the reference is not the starting point
      EXPECT_FALSE(at::equal(want, floats(read_bytes(*dir_ / (c.name + ".p0")))));
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
