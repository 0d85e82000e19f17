// LLM.int8 (runtime/int8.h, models/layers/linear8bit.h) against math: the int32 product against
// an int64 loop, the dequantized weight within half a code of the float16 weight, the mixed
// product against the exact x @ W^T (and the outlier columns' part in it), the gradient of the
// input against g @ deq(W), and a Linear with an 8-bit base and LoRA against the same Linear
// holding deq(W) densely. bitsandbytes' exact bytes and roundings: tests/runtime/int8_test.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/io/safetensors.h"
#include "models/layers/linear.h"
#include "models/layers/linear8bit.h"
#include "models/layers/panel_product.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/int8.h"
#include "test_util.h"

namespace {

namespace mt = memtune::testing;
using memtune::Int8Flavour;
using memtune::models::Int8Product;
using memtune::models::Int8Weight;

// The int64 sum of a [m, k] @ b [n, k]^T, element by element.
std::vector<int64_t> int64_product(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  const auto A = a.contiguous(), B = b.contiguous();
  const int8_t* pa = A.data_ptr<int8_t>();
  const int8_t* pb = B.data_ptr<int8_t>();
  std::vector<int64_t> out(static_cast<size_t>(m * n), 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      int64_t s = 0;
      for (int64_t q = 0; q < k; ++q) s += int64_t{pa[i * k + q]} * int64_t{pb[j * k + q]};
      out[static_cast<size_t>(i * n + j)] = s;
    }
  return out;
}

TEST(Int8Matmul, Int32ProductIsExactWhereOneFp32SumIsNot) {
  at::manual_seed(3);
  // Every product 127 * 127: the sum over 3001 of them is odd and past 2^24, where fp32 holds
  // only multiples of 4, so a single fp32 sum cannot give it.
  const at::Tensor ones = at::full({3, 3001}, 127, at::kChar);
  const at::Tensor random = at::randint(-127, 128, {5, 3001}, at::kLong).to(at::kChar);
  for (const auto& [a, b] : std::vector<std::pair<at::Tensor, at::Tensor>>{{ones, ones}, {random, ones}, {random, random}}) {
    const at::Tensor got = memtune::int8_matmul_i32(a, b);
    ASSERT_EQ(got.scalar_type(), at::kInt);
    const std::vector<int64_t> want = int64_product(a, b);
    const at::Tensor g = got.to(at::kLong).contiguous();
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(g.data_ptr<int64_t>()[i], want[i]) << "element " << i;
  }
  const at::Tensor one_sum = at::mm(ones.to(at::kFloat), ones.to(at::kFloat).t()).to(at::kLong);
  EXPECT_NE(one_sum[0][0].item<int64_t>(), 127 * 127 * 3001) << "the fp32 sum was exact: the case shows nothing";
}

TEST(Int8Quantize, RowsWithinHalfACodeOfTheFloat16Weight) {
  at::manual_seed(4);
  at::Tensor w = at::randn({24, 80}) * 0.05;
  w[3].zero_();  // a zero row: codes 0, absmax 0
  w[5][7] = 3.0;  // a row whose absmax is one large value
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dt));
    const at::Tensor wd = w.to(dt);
    const memtune::Int8Rows q = memtune::int8_quantize_rows(wd, "w");
    ASSERT_EQ(q.codes.scalar_type(), at::kChar);
    const at::Tensor w16 = wd.to(at::kHalf).to(at::kDouble);
    // SCB is the float16 weight's row absmax; codes span [-127, 127] with 127 at the absmax.
    EXPECT_TRUE(at::equal(q.absmax.to(at::kDouble), w16.abs().amax(1)));
    EXPECT_LE(q.codes.abs().max().item<int64_t>(), 127);
    EXPECT_EQ(q.codes[5][7].item<int64_t>(), 127);
    EXPECT_EQ(q.codes[3].abs().sum().item<int64_t>(), 0);
    const at::Tensor deq = memtune::int8_dequantize(q.codes, q.absmax, at::kFloat).to(at::kDouble);
    // Half a code step, and the fp32 roundings of the scale and the product.
    const at::Tensor half_step = (q.absmax.to(at::kDouble) * (1.0 / 254.0 + 1e-6)).unsqueeze(1);
    EXPECT_TRUE(((deq - w16).abs() <= half_step).all().item<bool>()) << "max error " << (deq - w16).abs().max();
  }
}

TEST(Int8Quantize, RefusesWhatFloat16CannotHold) {
  at::Tensor w = at::zeros({4, 8});
  w[2][5] = 70000.0;  // past float16's 65504: bitsandbytes quantizes the float16 cast
  try {
    memtune::int8_quantize_rows(w, "model.layers.0.mlp.up_proj.weight");
    FAIL() << "accepted";
  } catch (const memtune::UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.layers.0.mlp.up_proj.weight: element [2, 5] is 70000"), std::string::npos) << m;
    EXPECT_NE(m.find("65504"), std::string::npos) << m;
  }
}

// LLM.int8's accuracy: N(0, 1) inputs against the exact product; an input column of outliers
// (|x| = 20) through the float16 path when the threshold takes it out, through int8 (its row's
// scale set by the outlier, the rest of the row crushed) when it does not.
TEST(Int8Mixed, NearTheExactProductAndOutliersTakenOut) {
  at::manual_seed(5);
  const at::Tensor w = at::randn({48, 256}) * 0.05;
  const memtune::Int8Rows q = memtune::int8_quantize_rows(w, "w");
  const at::Tensor deq = memtune::int8_dequantize(q.codes, q.absmax, at::kDouble);
  at::Tensor x = at::randn({6, 256});
  x.select(1, 17).fill_(20.0);
  const at::Tensor exact = at::mm(x.to(at::kDouble), deq.t());
  for (auto flavour : {Int8Flavour::kCuda, Int8Flavour::kDefault}) {
    memtune::Int8MixedParts parts;
    const at::Tensor y = memtune::int8_mixed_matmul(x, q.codes, q.absmax, {}, 6.0, flavour, at::ScalarType::Undefined, &parts);
    ASSERT_EQ(parts.outlier_cols.numel(), 1);
    EXPECT_EQ(parts.outlier_cols[0].item<int64_t>(), 17);
    EXPECT_EQ(parts.codes.select(1, 17).abs().sum().item<int64_t>(), 0);
    const double err = (y.to(at::kDouble) - exact).abs().max().item<double>() / exact.abs().max().item<double>();
    EXPECT_LT(err, 0.01);
    const at::Tensor all_int8 = memtune::int8_mixed_matmul(x, q.codes, q.absmax, {}, 0.0, flavour);
    const double err0 = (all_int8.to(at::kDouble) - exact).abs().max().item<double>() / exact.abs().max().item<double>();
    EXPECT_GT(err0, 3 * err) << "the outlier column made no difference";
    // Threshold 0 and a threshold above every |x| take the same path.
    const at::Tensor high = memtune::int8_mixed_matmul(x, q.codes, q.absmax, {}, 100.0, flavour);
    EXPECT_TRUE(mt::same_bits(all_int8, high));
  }
}

// Both products' input gradient is g @ deq(W) in x's dtype; the training product on a CPU is
// x @ deq(W)^T in the product's dtype.
TEST(Linear8bit, GradientOfTheInputIsGTimesTheDequantizedWeight) {
  at::manual_seed(6);
  const at::Tensor w = at::randn({40, 64}) * 0.05;
  const memtune::Int8Rows q = memtune::int8_quantize_rows(w, "w");
  const Int8Weight w8{q.codes, q.absmax, 6.0};
  const at::Tensor bias = at::randn({40}) * 0.1;
  for (auto product : {Int8Product::kDequantize, Int8Product::kMixed})
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(product == Int8Product::kMixed ? "mixed " : "dequantize ") + c10::toString(dt));
      at::Tensor x = at::randn({2, 3, 64}).to(dt).requires_grad_(true);
      const at::Tensor y = memtune::models::linear8bit(x, w8, bias.to(dt), true, at::ScalarType::Undefined, product);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 3, 40}));
      EXPECT_EQ(y.scalar_type(), dt);
      const at::Tensor g = at::randn({2, 3, 40}).to(dt);
      y.backward(g);
      const at::Tensor deq = memtune::int8_dequantize(q.codes, q.absmax, dt);
      const at::Tensor want = at::matmul(g, deq);
      EXPECT_TRUE(mt::same_bits(x.grad(), want));
      if (product == Int8Product::kDequantize) {
        EXPECT_TRUE(mt::same_bits(y.detach(), at::linear(x.detach(), deq, bias.to(dt))));
      }
    }
  EXPECT_EQ(memtune::models::int8_product(at::kCPU, true), Int8Product::kDequantize);
  EXPECT_EQ(memtune::models::int8_product(at::kCPU, false), Int8Product::kMixed);
}

// An 8-bit Linear with LoRA computes, in training on a CPU, what a Linear holding deq(W)
// densely computes, to the order of its sums; merged, the weight is deq(W) + s B A.
TEST(Linear8bit, LoraOnAnInt8BaseIsLoraOnTheDequantizedWeight) {
  at::manual_seed(7);
  memtune::models::Linear dense("model.layers.0.self_attn.q_proj", 64, 48, true);
  dense.weight = at::randn({48, 64}) * 0.05;
  dense.bias = at::randn({48}) * 0.1;
  memtune::models::Linear int8 = memtune::models::Linear("model.layers.0.self_attn.q_proj", 64, 48, true);
  int8.weight = dense.weight.clone();
  int8.bias = dense.bias.clone();
  int8.quantize_int8(6.0);
  ASSERT_TRUE(int8.int8());
  EXPECT_EQ(int8.base_storage_bytes(), 48 * 64 + 4 * 48 + 4 * 48);  // codes, absmax, bias
  dense.weight = int8.dense_weight();
  memtune::models::LoraOptions o;
  o.r = 4;
  o.alpha = 8;
  at::manual_seed(8);
  dense.add_lora(o);
  at::manual_seed(8);
  int8.add_lora(o);
  {
    at::NoGradGuard ng;
    dense.lora->B.normal_(0, 0.1);
    int8.lora->B.copy_(dense.lora->B);
  }
  at::Tensor x1 = at::randn({3, 5, 64}).requires_grad_(true);
  at::Tensor x2 = x1.detach().clone().requires_grad_(true);
  // The dense Linear's adapter runs in lora_linear's one node, the 8-bit one's beside the base:
  // the same products, their sums formed in another order (LibTorch 2.6 rounds them apart).
  const at::Tensor y1 = dense.forward(x1, true), y2 = int8.forward(x2, true);
  mt::expect_close(y2.detach(), y1.detach(), 1e-6, "y");
  const at::Tensor g = at::randn_like(y1);
  y1.backward(g);
  y2.backward(g);
  mt::expect_close(x2.grad(), x1.grad(), 1e-6, "grad x");
  mt::expect_close(int8.lora->A.grad(), dense.lora->A.grad(), 1e-6, "grad A");
  mt::expect_close(int8.lora->B.grad(), dense.lora->B.grad(), 1e-6, "grad B");
  // In evaluation the mixed product: near, not equal.
  const at::Tensor e1 = dense.forward(x1.detach(), false), e2 = int8.forward(x2.detach(), false);
  mt::expect_close(e2, e1, 0.02, "evaluation");
  EXPECT_FALSE(mt::same_bits(e1, e2));
  const at::Tensor merged = at::matmul(int8.lora->B, int8.lora->A) * int8.lora->scaling + int8.dense_weight();
  int8.merge_lora();
  EXPECT_FALSE(int8.int8());
  EXPECT_TRUE(at::allclose(int8.weight, merged, 0, 1e-7));
}

// On a GPU the layer takes the CUDA kernels' flavour, in training too: the steps are tensor
// ops, so their bits are the CPU's running that flavour (the outlier columns' addmm is cuBLAS's
// against OpenBLAS's: to rounding), and the input's gradient g @ deq(W) likewise.
TEST(Linear8bit, OnCudaTheMixedProductIsTheCpusCudaFlavour_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  at::manual_seed(9);
  const at::Tensor w = at::randn({96, 256}) * 0.05;
  const memtune::Int8Rows q = memtune::int8_quantize_rows(w, "w");
  const memtune::Int8Rows qc = memtune::int8_quantize_rows(w.cuda(), "w");  // quantized on the GPU: the same bytes
  EXPECT_TRUE(mt::same_bits(qc.codes.cpu(), q.codes));
  EXPECT_TRUE(mt::same_bits(qc.absmax.cpu(), q.absmax));
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dt));
    at::Tensor x = at::randn({2, 8, 256});
    x.select(2, 5).fill_(9.0);
    x = x.to(dt);
    const at::Tensor bias = (at::randn({96}) * 0.1).to(dt);
    memtune::Int8MixedParts cpu;
    const at::Tensor want =
        memtune::int8_mixed_matmul(x.reshape({16, 256}), q.codes, q.absmax, bias, 6.0, Int8Flavour::kCuda,
                                   at::ScalarType::Undefined, &cpu);
    const Int8Weight w8{q.codes.cuda(), q.absmax.cuda(), 6.0};
    at::Tensor xc = x.cuda().requires_grad_(true);
    const at::Tensor y = memtune::models::linear8bit(xc, w8, bias.cuda(), /*training=*/true);
    mt::expect_close(y.reshape({16, 96}).cpu().to(at::kDouble), want.to(at::kDouble), dt == at::kFloat ? 1e-6 : 1e-2,
                     "y");
    const at::Tensor g = at::randn({2, 8, 96}).to(dt);
    y.backward(g.cuda());
    const at::Tensor gx = at::matmul(g.to(at::kFloat), memtune::int8_dequantize(q.codes, q.absmax, dt).to(at::kFloat));
    mt::expect_close(xc.grad().cpu().to(at::kDouble), gx.to(at::kDouble), dt == at::kFloat ? 1e-6 : 1e-2, "grad_x");
  }
}

// A CPU's training product dequantizes W in panels of rows (16 MiB each) into one buffer:
// with W wider than a panel, the output is each panel's GEMM, and one GEMM over the whole
// dequantized W to rounding; the input's gradient, summed over the panels in fp32, equals
// the whole one to rounding; bf16 takes one GEMM in backward.
TEST(Linear8bit, PanelsOfRowsEqualOneProductOverTheWholeWeight) {
  at::manual_seed(10);
  const int64_t out = 2600, in = 4096;  // 1024 fp32 rows a panel: three panels, the last partial
  const memtune::Int8Rows q = memtune::int8_quantize_rows(at::randn({out, in}) * 0.02, "w");
  const Int8Weight w8{q.codes, q.absmax, 6.0};
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    const at::Tensor bias = (at::randn({out}) * 0.1).to(dt);
    at::Tensor x = at::randn({6, in}).to(dt).requires_grad_(true);
    const at::Tensor y = memtune::models::linear8bit(x, w8, bias, true, at::ScalarType::Undefined, Int8Product::kDequantize);
    const at::Tensor deq = memtune::int8_dequantize(q.codes, q.absmax, dt);
    // Each panel's columns are that panel's GEMM, bit for bit. One GEMM over the whole weight
    // may add in another order (OpenBLAS picks kernels and threads by the matrix's size: 1 ulp
    // apart on a 2-thread Intel Xeon, the same bits on AMD EPYC), so it agrees to rounding.
    const int64_t rows = memtune::models::panel_rows(in, 4);
    for (int64_t r0 = 0; r0 < out; r0 += rows) {
      const int64_t r = std::min(rows, out - r0);
      EXPECT_TRUE(mt::same_bits(y.detach().narrow(1, r0, r).contiguous(),
                                at::linear(x.detach(), deq.narrow(0, r0, r), bias.narrow(0, r0, r))))
          << "panel at row " << r0;
    }
    mt::expect_close(y.detach().to(at::kDouble), at::linear(x.detach(), deq, bias).to(at::kDouble),
                     dt == at::kFloat ? 1e-6 : 0, "y");
    const at::Tensor g = at::randn({6, out}).to(dt);
    y.backward(g);
    mt::expect_close(x.grad().to(at::kDouble), at::matmul(g, deq).to(at::kDouble), dt == at::kFloat ? 1e-6 : 0,
                     "grad_x");
  }
}

TEST(Linear8bit, RefusesAnInputOnAnotherDeviceOrOfAnotherWidth) {
  const memtune::Int8Rows q = memtune::int8_quantize_rows(at::randn({8, 16}), "w");
  const Int8Weight w8{q.codes, q.absmax, 6.0};
  EXPECT_THROW(memtune::models::linear8bit(at::randn({2, 15}), w8, {}, true), memtune::UserError);
  EXPECT_THROW(memtune::models::linear8bit(at::randn({2, 16}), Int8Weight{q.codes, q.absmax.narrow(0, 0, 7), 6.0}, {},
                                          true),
               memtune::UserError);
}

memtune::data::Batch batch_for(const memtune::models::ModelSpec& spec) {
  std::vector<memtune::data::Sample> samples;
  for (int64_t b = 0; b < 2; ++b) {
    memtune::data::Sample x;
    for (int64_t t = 0; t < 24; ++t) {
      x.input_ids.push_back(static_cast<int32_t>((b * 7919 + t * 31) % spec.vocab_size));
      x.targets.push_back(static_cast<int32_t>((b * 104729 + t * 17 + 3) % spec.vocab_size));
      x.position_ids.push_back(static_cast<int32_t>(t));
      x.segment_ids.push_back(0);
    }
    samples.push_back(x);
  }
  return memtune::data::collate(samples, 8, 0);
}

double loss(memtune::models::CausalLM& m, const memtune::models::ModelSpec& spec, bool training) {
  memtune::models::ForwardOptions o;
  o.training = training;
  at::NoGradGuard ng;
  return m.forward(batch_for(spec), o).loss_sum.item<double>();
}

// load_in_8bit on load from a Hugging Face directory: in training (a CPU) the model is the
// dense model holding each projection's dequantized weight, to the last bit; in evaluation
// (LLM.int8's int8 product) near it. A checkpoint in bitsandbytes' 8-bit layout (weight int8,
// SCB, weight_format; config.json's llm_int8_threshold) is read as stored, and gives the codes
// of quantizing on load; another weight_format is refused by name.
class Int8Model : public ::testing::TestWithParam<std::string> {};

TEST_P(Int8Model, LoadedAsTheDequantizedDenseModelAndReadBackFromBitsandbytesLayout) {
  namespace models = memtune::models;
  const models::ModelSpec spec = *models::preset(GetParam());
  const mt::fs::path dir = mt::temp_dir("int8-model"), dense_dir = dir / "dense", q_dir = dir / "int8";
  models::save_hf_model(*models::init_random_model(spec, 3), dense_dir, {});
  models::LoadOptions o8;
  o8.load_in_8bit = true;
  o8.int8_threshold = 5.0;
  auto m8 = models::load_hf_model(dense_dir, o8);
  auto dense = models::load_hf_model(dense_dir, {});
  int quantized = 0;
  for (size_t k = 0; k < m8->linears().size(); ++k) {
    models::Linear* q = m8->linears()[k];
    models::Linear* d = dense->linears()[k];
    ASSERT_TRUE(q->int8()) << q->name();
    EXPECT_EQ(q->int8_threshold, 5.0);
    const at::Tensor w = q->dense_weight();
    d->weight = q->fan_in_fan_out() ? w.t().contiguous() : w;
    ++quantized;
  }
  EXPECT_GT(quantized, 0);
  EXPECT_LT(m8->base_storage_bytes(), dense->base_storage_bytes());
  const double l8 = loss(*m8, spec, true), ld = loss(*dense, spec, true);
  EXPECT_EQ(l8, ld);
  const double e8 = loss(*m8, spec, false);
  EXPECT_NEAR(e8, ld, 1e-2 * std::abs(ld));
  EXPECT_NE(e8, ld);

  // bitsandbytes' layout, written beside the dense tensors.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : mt::load_all_tensors(dense_dir / "model.safetensors")) {
    const models::Linear* l = nullptr;
    for (const models::Linear* q : m8->linears())
      if (name == q->name() + ".weight") l = q;
    if (!l) {
      tensors.emplace_back(name, t);
      continue;
    }
    tensors.emplace_back(name, l->weight);
    tensors.emplace_back(l->name() + ".SCB", l->weight_absmax);
    tensors.emplace_back(l->name() + ".weight_format", at::zeros({}, at::kByte));
  }
  auto write = [&](const mt::fs::path& to) {
    memtune::models::save_safetensors(to / "model.safetensors", tensors, {{"format", "pt"}});
    nlohmann::json config = nlohmann::json::parse(mt::read_file(dense_dir / "config.json"));
    config["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"load_in_8bit", true},
                                     {"llm_int8_threshold", 5.0}};
    mt::write_file(to / "config.json", config.dump(2));
  };
  write(q_dir);
  auto read = models::load_hf_model(q_dir, {});
  for (size_t k = 0; k < m8->linears().size(); ++k) {
    const models::Linear* a = m8->linears()[k];
    const models::Linear* b = read->linears()[k];
    ASSERT_TRUE(b->int8()) << b->name();
    EXPECT_TRUE(mt::same_bits(a->weight, b->weight)) << b->name();
    EXPECT_TRUE(mt::same_bits(a->weight_absmax, b->weight_absmax)) << b->name();
    EXPECT_EQ(b->int8_threshold, 5.0);
  }
  EXPECT_EQ(loss(*read, spec, false), e8);
  // Saved (memtune merge's writer), 8-bit projections are written dequantized, without a
  // quantization_config.
  models::save_hf_model(*read, dir / "saved", {});
  EXPECT_EQ(nlohmann::json::parse(mt::read_file(dir / "saved" / "config.json")).count("quantization_config"), 0u);
  auto back = models::load_hf_model(dir / "saved", {});
  for (size_t k = 0; k < back->linears().size(); ++k) {
    EXPECT_FALSE(back->linears()[k]->int8());
    EXPECT_TRUE(mt::same_bits(back->linears()[k]->dense_weight(), read->linears()[k]->dense_weight()));
  }
  for (auto& [name, t] : tensors)
    if (name.size() > 14 && name.compare(name.size() - 14, 14, ".weight_format") == 0) t = at::ones({}, at::kByte);
  write(dir / "col32");
  try {
    models::load_hf_model(dir / "col32", {});
    FAIL() << "an old layout was read";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("weight_format' is 1 (col32), not 0 (row-major)"), std::string::npos) << e.what();
  }
  memtune::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Presets, Int8Model, ::testing::Values("tiny-llama", "tiny-gpt2"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
