// The memory estimator's counts against hand-computed sizes and nf4_quantize's real
// storage, its monotonicity, and the consistency of max_micro_batch / max_seq_length with
// the peak it predicts. Every input comes from a config through trainer::estimate_input, on
// the model structure the trainer builds. (Agreement with measured peaks:
// tests/trainer/estimate_itest.cpp and bench/estimator_accuracy.py.)
#include <stdexcept>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "models/layers/cross_entropy.h"
#include "models/model_spec.h"
#include "models/registry.h"
#include "runtime/error.h"
#include "runtime/nf4.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {
namespace {

const EstimateComponent* find(const Estimate& e, const std::string& name) {
  for (const auto& c : e.components)
    if (c.name == name) return &c;
  return nullptr;
}

// llama: V 32, C 8, F 16, 2 layers, 2 heads of 4, 1 kv head, untied.
models::ModelSpec small_llama() {
  models::ModelSpec s;
  s.vocab_size = 32;
  s.hidden_size = 8;
  s.intermediate_size = 16;
  s.num_layers = 2;
  s.num_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = 4;
  return s;
}

// The estimate's input for `spec` under a config with LoRA r=2 on q and v, micro-batch 1 of
// 8 tokens, and `overrides`.
EstimateInput input(const models::ModelSpec& spec, std::vector<std::string> overrides = {}) {
  const Config c = parse_config(
      "runtime: {device: cpu}\n"
      "lora: {r: 2, target_modules: [q_proj, v_proj]}\n"
      "training: {per_device_train_batch_size: 1, gradient_checkpointing: false}\n"
      "data: {max_seq_length: 8}\n",
      "test", overrides);
  return estimate_input(c, spec);
}

// A registered architecture that states no layer accounting: one projection per layer.
class NoAccounting : public models::CausalLM {
 public:
  explicit NoAccounting(const models::ModelSpec& s) : CausalLM(s) {
    add_tensor("embed.weight", {s.vocab_size, s.hidden_size}, models::TensorRole::kEmbedding, &embed_);
    for (int i = 0; i < s.num_layers; ++i)
      add_linear(std::make_unique<models::Linear>("layers." + std::to_string(i) + ".proj", s.hidden_size,
                                                  s.hidden_size, false),
                 i);
    add_tensor("norm.weight", {s.hidden_size}, models::TensorRole::kNorm, &norm_);
    add_tensor("lm_head.weight", {s.vocab_size, s.hidden_size}, models::TensorRole::kHead, &head_);
  }
  at::Tensor embed(const at::Tensor&, const at::Tensor&) override { throw std::logic_error("not run"); }
  models::LayerContext layer_context(const data::Batch&) override { throw std::logic_error("not run"); }
  at::Tensor layer(int, const at::Tensor&, const models::LayerContext&) override { throw std::logic_error("not run"); }
  at::Tensor final_norm(const at::Tensor&) override { throw std::logic_error("not run"); }
  const at::Tensor& head_weight() const override { return head_; }

 private:
  at::Tensor embed_, norm_, head_;
};
const models::ArchitectureRegistrar kNoAccounting("NoAccountingForCausalLM", [](const models::ModelSpec& s) {
  return std::make_unique<NoAccounting>(s);
});

// The estimate walks whatever structure the registry builds: a user's architecture is
// counted from its own tensor list, and where it states no layer accounting the estimate
// uses CausalLM's bound and says so.
TEST(Estimator, ARegisteredArchitectureIsCountedFromItsOwnTensorsAndSaysWhenItUsedTheBound) {
  models::ModelSpec s = small_llama();
  s.architecture = "NoAccountingForCausalLM";
  s.model_type = "noaccounting";
  const Estimate e = estimate_memory(input(s, {"lora.target_modules=[proj]"}));
  // embed 32*8 + 2 layers' proj 8*8 + norm 8 + head 32*8.
  EXPECT_EQ(e.weights_dense, (256 + 2 * 64 + 8 + 256) * 4);
  EXPECT_EQ(e.trainable_parameters, 2 * 2 * (8 + 8));
  EXPECT_FALSE(e.layers_stated);
  bool said = false;
  for (const auto& c : e.components) said |= c.note.find("NoAccountingForCausalLM states no layer accounting") != std::string::npos;
  EXPECT_TRUE(said);
  EXPECT_TRUE(estimate_memory(input(small_llama())).layers_stated);
}

// Adapters are counted where PEFT's match puts them, projection by projection: a regex
// that adapts q in layer 0 and v in layer 1 adds those two, not q and v in both layers.
TEST(Estimator, AdaptersAreCountedWhereTheTargetsMatch) {
  const Estimate e = estimate_memory(
      input(small_llama(), {"lora.target_modules=model\\.layers\\.(0\\.self_attn\\.q_proj|1\\.self_attn\\.v_proj)"}));
  EXPECT_EQ(e.trainable_parameters, 2 * (8 + 8) + 2 * (8 + 4));  // q (8 -> 8), v (8 -> 4), r = 2
}

// The estimate refuses the targets training refuses (models::check_lora_targets): one that
// selects no projection, and one that also selects Qwen3's per-head norms.
TEST(Estimator, TargetsTrainingRefusesAreRefused) {
  models::ModelSpec s = small_llama();
  s.model_type = "qwen3";
  s.architecture = "Qwen3ForCausalLM";
  s.qk_norm = true;
  EXPECT_GT(estimate_memory(input(s, {"lora.target_modules=.*\\.(q|v)_proj"})).trainable_parameters, 0);
  for (const auto& [target, words] : std::vector<std::pair<std::string, std::string>>{
           {"lora.target_modules=.*q_.*", "selects 'model.layers.0.self_attn.q_norm', a norm"},
           {"lora.target_modules=[gate]", "selects no projection"}}) {
    try {
      estimate_memory(input(s, {target}));
      ADD_FAILURE() << target << " was estimated";
    } catch (const memtune::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
}

TEST(Estimator, Nf4BytesByHand) {
  // 1000 elements, blocksize 64: 16 blocks; 500 code bytes.
  EXPECT_EQ(nf4_storage_bytes(1000, 64, false), 500 + 16 * 4);
  // Double quant: 16 uint8 absmax codes, 1 fp32 nested absmax, the 256-entry fp32 map.
  EXPECT_EQ(nf4_storage_bytes(1000, 64, true), 500 + 16 + 4 + 1024);
  // 4096 x 4096 at 64: 262144 blocks -> 1024 nested blocks.
  EXPECT_EQ(nf4_storage_bytes(4096LL * 4096, 64, true), 8388608 + 262144 + 4096 + 1024);
  EXPECT_EQ(nf4_storage_bytes(7, 32, false), 4 + 4);  // odd count: ceil(n/2) code bytes
}

TEST(Estimator, Nf4BytesEqualTheQuantizedTensors) {
  for (auto shape : std::vector<std::vector<int64_t>>{{64, 64}, {100, 37}, {513, 260}, {3, 5}})
    for (int64_t bs : {32, 64, 256})
      for (bool dq : {false, true}) {
        at::Tensor w = at::randn(shape);
        NF4Tensor q = nf4_quantize(w, bs, dq);
        EXPECT_EQ(nf4_storage_bytes(w.numel(), bs, dq), q.storage_bytes())
            << shape[0] << "x" << shape[1] << " blocksize " << bs << " dq " << dq;
      }
}

TEST(Estimator, WeightsLoraGradientsAndOptimizerByHand) {
  const std::vector<std::string> nf4 = {"model.quantization_config.load_in_4bit=true",
                                        "model.quantization_config.blocksize=32",
                                        "model.quantization_config.bnb_4bit_use_double_quant=false"};
  EstimateInput in = input(small_llama());
  Estimate e = estimate_memory(in);
  // Dense: embed 32*8 + head 32*8 + norms (2 per layer + final) 5*8 = 552; projections per
  // layer q 64 + k 32 + v 32 + o 64 + gate 128 + up 128 + down 128 = 576, x2 layers.
  EXPECT_EQ(e.weights_dense, (552 + 2 * 576) * 4);
  EXPECT_EQ(e.weights_quantized, 0);
  // LoRA r=2: q 2*(8+8) + v 2*(8+4) = 56 per layer.
  EXPECT_EQ(e.trainable_parameters, 112);
  EXPECT_EQ(e.lora_parameters, 112 * 4);
  EXPECT_EQ(e.gradients, 112 * 4);
  EXPECT_EQ(e.optimizer_states, 2 * 112 * 4);
  // torch's AdamW updates in place on either side (the CPU's fused kernel, a GPU's
  // multi-tensor one): no workspace.
  EXPECT_EQ(e.optimizer_workspace, 0);
  in.cpu_update = false;
  EXPECT_EQ(estimate_memory(in).optimizer_workspace, 0);
  ASSERT_NE(find(e, "weights: dense"), nullptr);
  EXPECT_EQ(find(e, "weights: dense")->bytes, e.weights_dense);

  in = input(small_llama(), nf4);
  e = estimate_memory(in);
  const int64_t nf4_bytes = [] {
    int64_t b = 0;
    for (int64_t n : {64, 32, 32, 64, 128, 128, 128}) b += n / 2 + (n + 31) / 32 * 4;
    return 2 * b;
  }();
  EXPECT_EQ(e.weights_quantized, nf4_bytes);
  EXPECT_EQ(e.weights_dense, 552 * 4);
  // What layer offload can move: the layers' NF4 projections and norms.
  EXPECT_EQ(e.weights_layers, nf4_bytes + 4 * 8 * 4);

  std::vector<std::string> sgd = nf4;
  sgd.push_back("training.optim=sgd");
  EXPECT_EQ(estimate_memory(input(small_llama(), sgd)).optimizer_states, 0) << "no momentum: no buffer";
  sgd.push_back("training.momentum=0.9");
  EXPECT_EQ(estimate_memory(input(small_llama(), sgd)).optimizer_states, 112 * 4);

  // Full fine-tuning: every base tensor is trained (fp32), none NF4.
  in = input(small_llama(), {"training.finetune=full"});
  in.cpu_update = false;
  e = estimate_memory(in);
  EXPECT_EQ(e.trainable_parameters, 552 + 2 * 576);
  EXPECT_EQ(e.optimizer_states, 2 * 4 * (552 + 2 * 576));
  EXPECT_EQ(e.optimizer_workspace, 0);
  // Adafactor's update needs a workspace the size of the largest trained tensor, the embedding.
  in = input(small_llama(), {"training.finetune=full", "training.optim=adafactor"});
  in.cpu_update = false;
  EXPECT_EQ(estimate_memory(in).optimizer_workspace, 32 * 8 * 4);
}

// Gradient clipping's norm on a GPU keeps one double per 4096 elements of each gradient until
// it adds them (trainer/cuda/optim_cuda.h); on the CPU it sums in place. The small llama's full
// fine-tune trains 21 tensors (embedding, head, 5 norms, 2 x 7 projections), each under 4096
// elements: 21 partial sums.
TEST(Estimator, OnAGpuTheGradientNormKeepsOnePartialSumPer4096Elements) {
  EstimateInput in = input(small_llama(), {"training.finetune=full"});
  in.cpu_update = true;
  const int64_t cpu = estimate_memory(in).optimizer_peak;
  in.cpu_update = false;
  EXPECT_EQ(estimate_memory(in).optimizer_peak - cpu, 21 * 8);
}

// Label smoothing takes the loss's fp32 route on CUDA in bf16 (the one-pass kernel serves
// the plain loss only): the chunk's logits cost 6 bytes each instead of 2 (bf16 in place).
TEST(Estimator, OnAGpuBf16LabelSmoothingHoldsTheLogitsInFp32Too) {
  EstimateInput in = input(small_llama());
  in.loss_bf16 = true;
  in.cuda_kernels = true;
  const int64_t plain = estimate_memory(in).loss;
  in.label_smoothing = true;
  const int64_t chunk = std::min<int64_t>(in.micro_batch * in.seq_length, models::loss_chunk_rows(small_llama().vocab_size));
  EXPECT_EQ(estimate_memory(in).loss - plain, chunk * small_llama().vocab_size * 4);
  in.cuda_kernels = false;  // elsewhere the route is the same either way
  const int64_t cpu = estimate_memory(in).loss;
  in.label_smoothing = false;
  EXPECT_EQ(estimate_memory(in).loss, cpu);
}

TEST(Estimator, OptimizerStateBytesPerOption) {
  // bitsandbytes' 8-bit AdamW: 2 uint8 codes + 2 fp32 absmax per 256-element block from 4096
  // elements on, 2 fp32 below; its 32-bit kernel needs no workspace; paged: nothing on the device.
  EXPECT_EQ(optimizer_state_bytes("adamw_8bit", false, {4096}, true), 2 * 4096 + 2 * 16 * 4);
  EXPECT_EQ(optimizer_state_bytes("adamw_8bit", false, {4097}, true), 2 * 4097 + 2 * 17 * 4);
  EXPECT_EQ(optimizer_state_bytes("adamw_8bit", false, {4095}, true), 2 * 4095 * 4);
  EXPECT_EQ(optimizer_state_bytes("adamw", false, {10}, true), 80);
  EXPECT_EQ(optimizer_state_bytes("adamw_32bit", false, {10}, true), 80);
  EXPECT_EQ(optimizer_state_bytes("sgd", false, {10}, true), 40);
  EXPECT_EQ(optimizer_state_bytes("sgd", false, {10}, false), 0);  // torch.optim.SGD at momentum 0: no buffer
  EXPECT_EQ(optimizer_state_bytes("adamw_8bit", true, {1 << 20}, true), 0);
  EXPECT_EQ(optimizer_state_bytes("adamw_32bit", true, {1 << 20}, true), 0);
  // Adafactor: a matrix keeps a row and a column second moment, a vector one per element; more
  // dimensions: one per row of each matrix and one per column of each (transformers' shapes).
  EXPECT_EQ(optimizer_state_bytes("adafactor", false, {300, 40}, true), (300 + 40) * 4);
  EXPECT_EQ(optimizer_state_bytes("adafactor", false, {40}, true), 40 * 4);
  EXPECT_EQ(optimizer_state_bytes("adafactor", false, {3, 5, 7}, true), (3 * 5 + 3 * 7) * 4);
  EXPECT_EQ(optimizer_state_bytes("adafactor", true, {300, 40}, true), 0);

  // Full fine-tune of the small llama with hidden 8: every tensor is under 4096, all fp32.
  Estimate e = estimate_memory(input(small_llama(), {"training.finetune=full", "training.optim=adamw_8bit"}));
  EXPECT_EQ(e.optimizer_states, 2 * 4 * (552 + 2 * 576));
  EXPECT_EQ(e.optimizer_workspace, 0);
  // Wider: hidden 64, vocab 128 -> embed and head 8192 elements each (8-bit), norms 64 (fp32).
  models::ModelSpec wide = small_llama();
  wide.hidden_size = 64;
  wide.vocab_size = 128;
  wide.num_heads = 4;
  wide.num_kv_heads = 4;
  wide.head_dim = 16;
  wide.intermediate_size = 64;
  e = estimate_memory(input(wide, {"training.finetune=full", "training.optim=adamw_8bit"}));
  const int64_t big = 2 * 8192 + 2 * 32 * 4;  // embed, head
  const int64_t proj = 2 * 4096 + 2 * 16 * 4;  // each 64 x 64 projection: 4096 elements
  EXPECT_EQ(e.optimizer_states, 2 * big + 2 * 4 * 64 * 5 + 2 * 7 * proj);
  e = estimate_memory(input(wide, {"training.finetune=full", "training.optim=paged_adamw_8bit"}));
  EXPECT_EQ(e.optimizer_states, 0);
  EXPECT_EQ(e.optimizer_workspace, 0);
  // On a GPU the paged states pass through two device slots, each the largest tensor's
  // states (the embedding's: 8192 codes twice, 32 absmax twice) at 256-byte boundaries
  // (the estimate allows 256 bytes for each of the four).
  EstimateInput streamed = input(wide, {"training.finetune=full", "training.optim=paged_adamw_8bit"});
  streamed.optimizer_streamed = true;
  e = estimate_memory(streamed);
  EXPECT_EQ(e.optimizer_states, 0);
  EXPECT_EQ(e.optimizer_workspace, 2 * (big + 4 * 256));
  // Gradients in host memory (memory.optimizer_offload: cpu): the update runs on the host.
  streamed.gradients_offloaded = true;
  EXPECT_EQ(estimate_memory(streamed).optimizer_workspace, 0);
  // A tensor whose states outgrow a slot passes through in runs: two slots of 64 MiB (an
  // embedding of 32000 x 4096: 2 x 131 MB of codes).
  wide.hidden_size = 4096;
  wide.vocab_size = 32000;
  wide.head_dim = 1024;
  wide.intermediate_size = 128;
  streamed = input(wide, {"training.finetune=full", "training.optim=paged_adamw_8bit"});
  streamed.optimizer_streamed = true;
  EXPECT_EQ(estimate_memory(streamed).optimizer_workspace, 2 * (int64_t{64} << 20));
}

// Llama's attention_bias (q, k, v, o) and mlp_bias (gate, up, down) add their vectors.
TEST(Estimator, LlamaBiasesByHand) {
  models::ModelSpec s = small_llama();
  const int64_t without = estimate_memory(input(s)).weights_dense;
  s.attention_bias = true;
  s.mlp_bias = true;
  // Per layer: q 8 + k 4 + v 4 + o 8 + gate 16 + up 16 + down 8 = 64, x2 layers.
  EXPECT_EQ(estimate_memory(input(s)).weights_dense - without, 2 * 64 * 4);
  // Qwen2's biases are on q, k and v only.
  s.model_type = "qwen2";
  s.architecture = "Qwen2ForCausalLM";
  s.mlp_bias = false;
  EXPECT_EQ(estimate_memory(input(s)).weights_dense - without, 2 * 16 * 4);
  // Qwen3's are on q, k, v and o, and each layer has a q and a k norm of head_dim.
  s.model_type = "qwen3";
  s.architecture = "Qwen3ForCausalLM";
  s.qk_norm = true;
  EXPECT_EQ(estimate_memory(input(s)).weights_dense - without, 2 * (24 + 2 * s.head_dim) * 4);
}

TEST(Estimator, Gpt2WeightsByHand) {
  models::ModelSpec s;
  s.architecture = "GPT2LMHeadModel";
  s.model_type = "gpt2";
  s.vocab_size = 50;
  s.hidden_size = 8;
  s.intermediate_size = 32;
  s.num_layers = 1;
  s.num_heads = 2;
  s.num_kv_heads = 2;
  s.head_dim = 4;
  s.max_position_embeddings = 16;
  s.tie_word_embeddings = true;
  const Estimate e = estimate_memory(input(s, {"lora.r=4", "lora.target_modules=[c_attn]"}));
  // wte 400 + wpe 128 + ln 4*8 + ln_f 16 + biases 24+8+32+8 + c_attn 192 + c_proj 64 + fc 256 + proj 256.
  EXPECT_EQ(e.weights_dense, (400 + 128 + 32 + 16 + 72 + 192 + 64 + 256 + 256) * 4);
  EXPECT_EQ(e.trainable_parameters, 4 * (8 + 24));
}

TEST(Estimator, MoreCheckpointingLowersThePeak) {
  models::ModelSpec s = small_llama();
  s.num_layers = 6;
  s.hidden_size = 64;
  s.intermediate_size = 172;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 16;
  EstimateInput in = input(s, {"data.max_seq_length=256", "training.per_device_train_batch_size=2",
                               "lora.target_modules=all-linear"});
  std::vector<int64_t> peak;
  for (int checkpointed = 0; checkpointed <= 6; ++checkpointed) {
    in.checkpoint_layers.assign(6, false);
    for (int i = 0; i < checkpointed; ++i) in.checkpoint_layers[i] = true;
    const Estimate e = estimate_memory(in);
    peak.push_back(e.peak_bytes);
    EXPECT_EQ(e.recompute > 0, checkpointed > 0);
  }
  // Each layer checkpointed below the top lowers the peak. The top layer is rebuilt as soon
  // as backward starts, so checkpointing it too saves only in the forward.
  for (int k = 0; k + 1 < 6; ++k) EXPECT_LT(peak[k + 1], peak[k]) << k + 1 << " layers checkpointed";
  EXPECT_LT(peak[6], peak[0]);
  // none > every 2nd layer > all.
  in.checkpoint_layers = {true, false, true, false, true, false};
  const int64_t every2 = estimate_peak(in);
  EXPECT_LT(every2, peak[0]);
  EXPECT_GT(every2, peak[6]);
}

// Activation offload where copies are asynchronous (CUDA) prefetches one checkpointed input
// ahead in backward: the backward holds one (B, T, C) input more than where fetch() copies
// on demand (the CPU), and nothing changes without activation offload.
TEST(Estimator, PrefetchedActivationsHoldOneCheckpointedInputMoreInBackward) {
  models::ModelSpec s = small_llama();
  s.num_layers = 4;
  EstimateInput in = input(s, {"data.max_seq_length=128", "training.per_device_train_batch_size=2"});
  in.checkpoint_layers.assign(4, true);
  in.offload_activations = true;
  const Estimate on_demand = estimate_memory(in);
  in.prefetch_activations = true;
  const Estimate prefetched = estimate_memory(in);
  const int64_t input_bytes = 2 * 128 * s.hidden_size * 4;  // B x T x C fp32
  EXPECT_EQ(prefetched.backward_peak - on_demand.backward_peak, input_bytes);
  EXPECT_EQ(prefetched.forward_peak, on_demand.forward_peak);
  in.offload_activations = false;
  const Estimate kept = estimate_memory(in);
  in.prefetch_activations = false;
  EXPECT_EQ(estimate_memory(in).backward_peak, kept.backward_peak);
}

// memory.optimizer_offload: cpu takes the gradients to the host where gradient offload runs:
// one rank, or a CPU group (Gloo reduces host tensors). Several GPU ranks reduce on the device
// (NCCL), so their estimate keeps the gradients there.
TEST(Estimator, OffloadedGradientsLeaveTheDeviceOnOneRankOrACpuGroup) {
  EstimateInput in = input(small_llama(), {"training.finetune=full", "training.gradient_accumulation_steps=2"});
  for (const bool cpu : {true, false})
    for (const int64_t ranks : {1, 2}) {
      in.cpu_update = cpu;
      in.world_size = ranks;
      in.gradients_offloaded = false;
      const Estimate kept = estimate_memory(in);
      in.gradients_offloaded = true;
      const Estimate off = estimate_memory(in);
      SCOPED_TRACE((cpu ? "cpu, " : "gpu, ") + std::to_string(ranks) + " ranks");
      if (cpu || ranks == 1) {
        // Accumulating: the forward no longer holds the previous micro-batches' gradients,
        // nor (several ranks) their all-reduce's flat copies.
        EXPECT_EQ(off.forward_peak, kept.forward_peak - kept.gradients - kept.allreduce_buffers);
        EXPECT_EQ(kept.allreduce_buffers, ranks > 1 ? kept.gradients : 0);
        EXPECT_LT(off.optimizer_peak, kept.optimizer_peak);
      } else {
        EXPECT_EQ(off.peak_bytes, kept.peak_bytes);
        EXPECT_EQ(off.optimizer_peak, kept.optimizer_peak);
      }
    }
}

TEST(Estimator, LargerShapesRaiseThePeak) {
  EstimateInput in = input(small_llama());
  int64_t previous = 0;
  for (int64_t b : {1, 2, 3, 4, 8, 16}) {
    in.micro_batch = b;
    const int64_t p = estimate_peak(in);
    EXPECT_GT(p, previous) << "micro-batch " << b;
    previous = p;
  }
  in.micro_batch = 1;
  previous = 0;
  for (int64_t t : {8, 64, 512, 1024}) {
    in.seq_length = t;
    const int64_t p = estimate_peak(in);
    EXPECT_GT(p, previous) << "length " << t;
    previous = p;
  }
}

TEST(Estimator, MaxMicroBatchIsTheLargestThatFits) {
  EstimateInput in = input(small_llama(), {"data.max_seq_length=128"});
  for (int64_t budget : {int64_t{200} << 10, int64_t{1} << 20, int64_t{5} << 20, int64_t{50} << 20}) {
    const int64_t b = max_micro_batch(in, budget);
    EstimateInput x = in;
    if (b == 0) {
      x.micro_batch = 1;
      EXPECT_GT(estimate_peak(x), budget);
      continue;
    }
    x.micro_batch = b;
    EXPECT_LE(estimate_peak(x), budget);
    x.micro_batch = b + 1;
    EXPECT_GT(estimate_peak(x), budget) << "budget " << budget;
  }
  in.micro_batch = 1;
  EXPECT_EQ(max_micro_batch(in, estimate_peak(in) - 1), 0);
  EXPECT_EQ(max_micro_batch(in, estimate_peak(in)), 1);
}

TEST(Estimator, MaxSeqLengthIsTheLargestThatFits) {
  models::ModelSpec s = small_llama();
  s.max_position_embeddings = 4096;
  EstimateInput in = input(s, {"training.per_device_train_batch_size=2", "data.max_seq_length=64"});
  const int64_t budget = estimate_peak(in) * 3;
  const int64_t t = max_seq_length(in, budget);
  ASSERT_GT(t, 64);
  EXPECT_EQ(t % 8, 0);
  EstimateInput x = in;
  x.seq_length = t;
  EXPECT_LE(estimate_peak(x), budget);
  x.seq_length = t + 8;
  EXPECT_GT(estimate_peak(x), budget);
  // Capped by the model's positions.
  EXPECT_EQ(max_seq_length(in, int64_t{1} << 40), 4096);
}

}  // namespace
}  // namespace memtune::trainer
