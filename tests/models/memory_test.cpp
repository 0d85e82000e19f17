// CausalLM's default layer accounting, for architectures that state none, is a bound: on
// the built-in families, whose stated accounting agrees with the allocator
// (tests/trainer/estimate_itest.cpp), it never counts less, for any training of the
// projections, input gradient, kernel or shape.
#include <gtest/gtest.h>

#include "models/registry.h"

namespace memtune::models {
namespace {

ModelSpec family(const std::string& name) {
  std::optional<ModelSpec> s = preset(name);
  EXPECT_TRUE(s.has_value()) << name;
  return *s;
}

TEST(LayerMemory, TheDefaultIsABoundOnEveryStatedFamily) {
  for (const char* name : {"tiny-llama", "tiny-gpt2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"}) {
    std::unique_ptr<CausalLM> model = build_model(family(name));
    for (const char* training : {"frozen", "lora", "lora+dropout", "nf4+lora", "full"})
      for (bool input_grad : {false, true})
        for (bool fused : {false, true})
          for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 64}, {4, 256}, {2, 1024}}) {
            const std::string t = training;
            LayerPlan plan;
            plan.input_grad = input_grad || t == "full";
            plan.training = [&](const Linear&) {
              LinearTraining lt;
              lt.full = t == "full";
              if (t.find("lora") != std::string::npos) lt.lora_r = 8;
              if (t == "lora+dropout") lt.lora_dropout = 0.1;
              lt.nf4 = t == "nf4+lora";
              return lt;
            };
            StepShape s;
            s.batch = B;
            s.tokens = T;
            s.fused_cpu_attention = fused;
            s.threads = 2;
            const LayerMemory stated = model->layer_memory(0, s, plan);
            const LayerMemory bound = model->CausalLM::layer_memory(0, s, plan);
            const std::string where = std::string(name) + " " + t + (input_grad ? " input-grad" : "") + (fused ? " fused" : "") +
                                      " B" + std::to_string(B) + " T" + std::to_string(T);
            EXPECT_TRUE(stated.stated) << where;
            EXPECT_FALSE(bound.stated) << where;
            EXPECT_GE(bound.kept, stated.kept) << where;
            EXPECT_GE(bound.forward, stated.forward) << where;
            EXPECT_GE(bound.forward_no_grad, stated.forward_no_grad) << where;
            EXPECT_GE(bound.backward, stated.backward) << where;
            // The stated accounting counts something real: a trained layer keeps its inputs.
            if (t != "frozen" || input_grad) {
              EXPECT_GT(stated.kept, 0) << where;
            }
          }
  }
}

// What a layer keeps grows with the tokens it holds, and by the kernels' own terms: the
// fused attention keeps no probabilities, so its layer keeps less than the blocked one's
// while those fit (their limit then stops the blocked kernel keeping them).
TEST(LayerMemory, GrowsWithTheShapeAndFollowsTheKernel) {
  std::unique_ptr<CausalLM> model = build_model(family("tiny-llama"));
  LayerPlan plan;
  plan.input_grad = true;
  plan.training = [](const Linear&) { return LinearTraining{false, 8, 0.0, false}; };
  int64_t previous = 0;
  for (int64_t T : {8, 64, 256, 1024}) {
    StepShape s;
    s.tokens = T;
    const int64_t kept = model->layer_memory(0, s, plan).kept;
    EXPECT_GT(kept, previous) << T;
    previous = kept;
    StepShape fused = s;
    fused.fused_cpu_attention = true;
    EXPECT_LT(model->layer_memory(0, fused, plan).kept, kept) << T;
  }
}

}  // namespace
}  // namespace memtune::models
