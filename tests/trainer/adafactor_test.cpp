// training.optim: adafactor against an independent reference (tests/reference/adafactor_reference.py,
// PyTorch, written from the algorithm as Hugging Face's Trainer configures transformers'
// Adafactor): 20 steps per case, the factored states and the parameters bit for bit (the same fp32
// operations on the same ATen), with weight decay, a clipping coefficient, the update's RMS clip
// and eps dominating; the same with the states offloaded; a resume from the state tensors halfway
// that ends where the straight run does; and the state bytes the estimate counts.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "trainer/optimizer.h"

namespace {

namespace mt = memtune::testing;
namespace tr = memtune::trainer;

using mt::reference_bytes;
using mt::same_bits;

at::Tensor floats(const std::string& bytes, at::IntArrayRef shape) {
  return mt::tensor_from_bytes(bytes, at::kFloat, shape);
}

struct Case {
  std::string name;
  int64_t steps = 0;
  double lr = 0, wd = 0, gs = 0;
  std::vector<int64_t> shape;
};

class AdafactorReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (mt::python_torch_available()) dir_ = new mt::fs::path(mt::make_reference_fixtures("adafactor_reference.py"));
  }
  void SetUp() override {
    if (!mt::python_torch_available()) GTEST_SKIP() << "python3 with torch is not installed";
  }
  static std::vector<Case> cases() {
    std::vector<Case> out;
    for (const std::string& line : mt::reference_lines(*dir_ / "cases.txt")) {
      std::istringstream f(line);
      Case c;
      f >> c.name >> c.steps >> c.lr >> c.wd >> c.gs;
      for (int64_t d; f >> d;) c.shape.push_back(d);
      out.push_back(c);
    }
    return out;
  }
  // A matrix is named as a projection weight (decayed), a vector as a norm weight (not).
  static std::string param_name(const Case& c) { return c.shape.size() >= 2 ? "w.weight" : "norm.weight"; }
  static std::unique_ptr<tr::Optimizer> make(const Case& c, const at::Tensor& p, bool offload) {
    tr::OptimizerOptions o;
    tr::set_optimizer_kind("adafactor", o);
    o.weight_decay = c.wd;
    auto opt = std::make_unique<tr::Optimizer>(std::vector<std::pair<std::string, at::Tensor>>{{param_name(c), p}}, o);
    if (offload) opt->offload_states();
    return opt;
  }
  // Steps [from, to) of the case's gradients.
  static void steps(const Case& c, tr::Optimizer& opt, at::Tensor& p, int64_t from, int64_t to) {
    int64_t n = 1;
    for (int64_t d : c.shape) n *= d;
    const at::Tensor g = floats(reference_bytes(*dir_ / (c.name + ".g")), {c.steps * n});
    for (int64_t s = from; s < to; ++s) {
      p.mutable_grad() = g.narrow(0, s * n, n).view(c.shape).clone();
      opt.step(c.lr, c.gs);
    }
  }
  static std::map<std::string, at::Tensor> states(const tr::Optimizer& opt) {
    std::map<std::string, at::Tensor> st;
    for (auto& [k, t] : opt.state_tensors()) st[k] = t;
    return st;
  }
  static mt::fs::path* dir_;
};
mt::fs::path* AdafactorReference::dir_ = nullptr;

TEST_F(AdafactorReference, TwentyStepsMatchBitForBit) {
  const auto all = cases();
  ASSERT_EQ(all.size(), 6u);
  for (const bool offload : {false, true})
    for (const Case& c : all) {
      SCOPED_TRACE(c.name + (offload ? ", states offloaded" : ""));
      at::Tensor p = floats(reference_bytes(*dir_ / (c.name + ".p0")), c.shape);
      const at::Tensor p0 = p.clone();
      auto opt = make(c, p, offload);
      steps(c, *opt, p, 0, c.steps);
      const std::string pre = param_name(c);
      const auto st = states(*opt);
      EXPECT_EQ(st.count(pre + ".exp_avg"), 0u) << "no first moment (beta1 None)";
      if (c.shape.size() >= 2) {
        ASSERT_EQ(st.size(), 2u);
        const std::vector<int64_t> rows(c.shape.begin(), c.shape.end() - 1);
        EXPECT_TRUE(same_bits(st.at(pre + ".exp_avg_sq_row"), floats(reference_bytes(*dir_ / (c.name + ".row")), rows)))
            << "row second moment differs";
        EXPECT_TRUE(same_bits(st.at(pre + ".exp_avg_sq_col"),
                              floats(reference_bytes(*dir_ / (c.name + ".col")), {c.shape.back()})))
            << "column second moment differs";
      } else {
        ASSERT_EQ(st.size(), 1u);
        EXPECT_TRUE(same_bits(st.at(pre + ".exp_avg_sq"), floats(reference_bytes(*dir_ / (c.name + ".sq")), c.shape)));
      }
      const at::Tensor want = floats(reference_bytes(*dir_ / (c.name + ".p")), c.shape);
      EXPECT_TRUE(same_bits(p, want)) << "parameters differ; max |diff| " << (p - want).abs().max().item<float>();
      EXPECT_FALSE(at::equal(want, p0)) << "the reference moved nothing";
    }
}

TEST_F(AdafactorReference, AResumeFromTheStateTensorsEndsWhereTheStraightRunDoes) {
  const Case c = cases().at(1);  // weight decay and a clipping coefficient
  at::Tensor straight = floats(reference_bytes(*dir_ / (c.name + ".p0")), c.shape);
  auto a = make(c, straight, false);
  steps(c, *a, straight, 0, c.steps);

  at::Tensor first = floats(reference_bytes(*dir_ / (c.name + ".p0")), c.shape);
  auto b = make(c, first, false);
  steps(c, *b, first, 0, c.steps / 2);
  std::map<std::string, at::Tensor> saved;
  for (auto& [k, t] : b->state_tensors()) saved[k] = t.clone();
  const nlohmann::json scalars = b->state_scalars();

  at::Tensor resumed = first.detach().clone();
  auto r = make(c, resumed, false);
  r->load_state(saved, scalars);
  steps(c, *r, resumed, c.steps / 2, c.steps);
  EXPECT_TRUE(same_bits(resumed, straight));
  EXPECT_TRUE(same_bits(resumed, floats(reference_bytes(*dir_ / (c.name + ".p")), c.shape)));
}

TEST(Adafactor, StatesAreOneValuePerRowAndColumnPlusAWorkspaceTheSizeOfTheLargestTensor) {
  tr::OptimizerOptions o;
  tr::set_optimizer_kind("adafactor", o);
  at::Tensor embed = at::randn({1000, 64}), lora_b = at::randn({64, 8}), norm = at::randn({64});
  tr::Optimizer opt({{"embed.weight", embed}, {"b.weight", lora_b}, {"norm.weight", norm}}, o);
  const int64_t states = (1000 + 64 + 64 + 8 + 64) * 4;
  EXPECT_EQ(tr::optimizer_state_bytes("adafactor", false, embed.sizes(), false) +
                tr::optimizer_state_bytes("adafactor", false, lora_b.sizes(), false) +
                tr::optimizer_state_bytes("adafactor", false, norm.sizes(), false),
            states);
  EXPECT_EQ(opt.state_bytes(), states);  // the workspace comes with the first step
  for (at::Tensor* t : {&embed, &lora_b, &norm}) t->mutable_grad() = at::randn(t->sizes());
  opt.step(1e-3);
  EXPECT_EQ(opt.state_bytes(), states + 1000 * 64 * 4);
  // Against AdamW's 8 bytes per parameter: 0.02 of it here.
  EXPECT_LT(static_cast<double>(states), 0.02 * 8 * (1000 * 64 + 64 * 8 + 64));
}

}  // namespace
