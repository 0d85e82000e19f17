// Sharding (trainer/sharding.h) over Gloo with 2 and 3 processes on 127.0.0.1: gradients
// reduced to their owners (or to every rank) against sums worked out here, the global norm
// and the agreed skip, the update reaching every rank against SGD on those sums, and the
// bytes each rank sent against the counting rule, with buckets small enough that tensors
// split across them. LayerShards (distributed.sharding: full): every layer gathered equal to
// the whole model's tensors, the shards adding up to the model, the loss and the adapters'
// gradients of the sharded model equal to the whole model's, and an out-of-memory error on
// one rank (in a gather, or before it) reaching every rank from one agreement. Each process
// is this binary re-run with MEMTUNE_SHARDING_SCENARIO set.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "runtime/dist_env.h"
#include "runtime/error.h"
#include "runtime/process_group.h"
#include "test_util.h"
#include "runtime/compat.h"
#include "runtime/cpu_budget_allocator.h"
#include "data/batch.h"
#include "models/hf_model.h"
#include "models/layers/linear.h"
#include "runtime/nf4.h"
#include "trainer/grad_scaler.h"
#include "trainer/layer_shards.h"
#include "trainer/optimizer.h"
#include "trainer/sharding.h"

namespace fs = std::filesystem;
using namespace memtune;
using namespace memtune::trainer;

namespace {

std::vector<int> run_workers(const std::string& scenario, int world, const fs::path& dir, int timeout_s = 120) {
  return memtune::testing::run_workers("MEMTUNE_SHARDING_SCENARIO=" + scenario, "ShardingWorker.Run", world, dir,
                                       timeout_s);
}

// The same tensors on every rank (sizes chosen so that 256-element buckets cut some).
std::vector<std::pair<std::string, at::Tensor>> make_params() {
  at::manual_seed(5);
  return {{"a.lora_A.weight", at::randn({4, 300})}, {"a.lora_B.weight", at::randn({70, 4})},
          {"norm.weight", at::randn({33})},         {"b.lora_A.weight", at::randn({4, 70})},
          {"b.lora_B.weight", at::randn({600})},    {"c.weight", at::randn({5})}};
}

// Rank r's gradient of tensor i: base_i * (r + 1); tensor 2 has none on rank 0 (counts as 0).
at::Tensor base_grad(size_t i, const at::Tensor& like) {
  at::manual_seed(100 + static_cast<int64_t>(i));
  return at::randn(like.sizes(), at::kDouble);
}
double weight_sum(size_t i, int world) {  // sum over the ranks that have a gradient of (r + 1)
  double s = 0;
  for (int r = 0; r < world; ++r)
    if (!(i == 2 && r == 0)) s += r + 1;
  return s;
}

void scenario(ProcessGroup& pg, ShardLevel level) {
  const int me = pg.rank(), w = pg.world_size();
  auto params = make_params();
  const auto initial = make_params();
  for (size_t i = 0; i < params.size(); ++i)
    if (!(i == 2 && me == 0)) params[i].second.mutable_grad() = (base_grad(i, params[i].second) * (me + 1)).to(at::kFloat);
  const int64_t bucket_bytes = 256 * 4;
  Sharding s(level, &pg, params, bucket_bytes);
  ASSERT_EQ(s.level(), level);
  std::vector<int64_t> numels;
  for (const auto& [name, p] : params) numels.push_back(p.numel());
  const std::vector<int> owner = shard_owners(numels, w);
  EXPECT_EQ(s.owners(), owner);
  EXPECT_EQ(s.buffer_bytes(), bucket_bytes) << "one bucket's buffer, every owner has more than a bucket";

  // Gradients: summed over the ranks, with the extra values.
  std::vector<int64_t> sent0 = pg.sent_bytes();
  at::Tensor extra = at::tensor({static_cast<double>(me), 1.0}, at::kDouble);
  const GradScaler off(false);
  s.reduce_gradients(params, extra, off);
  EXPECT_DOUBLE_EQ(extra[0].item<double>(), w * (w - 1) / 2.0);
  EXPECT_DOUBLE_EQ(extra[1].item<double>(), w);
  double sq = 0;
  std::vector<at::Tensor> expected;
  for (size_t i = 0; i < params.size(); ++i) {
    expected.push_back(base_grad(i, params[i].second) * weight_sum(i, w));
    sq += expected.back().pow(2).sum().item<double>();
    const at::Tensor& g = params[i].second.grad();
    if (level == ShardLevel::gradients && owner[i] != me) {
      EXPECT_FALSE(g.defined()) << "tensor " << i << " is rank " << owner[i] << "'s: no gradient kept here";
      continue;
    }
    ASSERT_TRUE(g.defined()) << "tensor " << i;
    EXPECT_TRUE(at::allclose(g.to(at::kDouble), expected.back(), 1e-6, 1e-6)) << "tensor " << i;
  }
  // Bytes: the counting rule of ProcessGroup::sent_bytes, worked out per rank.
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0}) * 4;
  std::vector<int64_t> own(static_cast<size_t>(w), 0);
  for (size_t i = 0; i < numels.size(); ++i) own[static_cast<size_t>(owner[i])] += numels[i] * 4;
  // Each owner's tensors in order, cut into buckets of 256 elements: a reduce of b bytes
  // costs b for each other rank and (W-1) b / W for its root.
  auto as_root = [&](int r) {
    const int64_t n = own[r] / 4, full = n / 256, rest = n % 256;
    return full * ((w - 1) * 1024 / w) + (rest ? (w - 1) * rest * 4 / w : 0);
  };
  std::vector<int64_t> sent = pg.sent_bytes();
  for (int r = 0; r < w; ++r) {
    // gradients: the extra values travel with [squared norm, non-finite, out of memory]
    const int64_t want = level == ShardLevel::gradients ? (total - own[r]) + as_root(r) + 2 * (w - 1) * 40 / w
                                                        : 2 * (w - 1) * total / w + 2 * (w - 1) * 16 / w;  // allreduce
    EXPECT_EQ(sent[r] - sent0[r], want) << "rank " << r << " in the reduction";
  }

  // The norm over every rank's share.
  const int64_t seq = pg.sequence();
  auto [skip, norm] = s.check_gradients(off, params);
  EXPECT_EQ(pg.sequence(), seq) << "no collective after the point where one rank may run out of memory";
  EXPECT_FALSE(skip);
  EXPECT_NEAR(norm, std::sqrt(sq), 1e-6 * std::sqrt(sq));

  // The update: SGD on the summed gradients, each tensor by its owner, then on every rank.
  OptimizerOptions o;
  o.kind = "sgd";
  Optimizer opt(params, o, s.owned());
  sent0 = pg.sent_bytes();
  s.step(opt, 0.1, 0.5);
  sent = pg.sent_bytes();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor want = initial[i].second.to(at::kDouble) - 0.1 * 0.5 * expected[i];
    EXPECT_TRUE(at::allclose(params[i].second.to(at::kDouble), want, 1e-6, 1e-6)) << "tensor " << i << " on rank " << me;
  }
  for (int r = 0; r < w; ++r) EXPECT_EQ(sent[r] - sent0[r], (w - 1) * own[r]) << "rank " << r << " in the gather";
  if (level != ShardLevel::gradients) return;

  // inf in one rank's gradient of tensor 0: its owner alone sees it after the reduction, and
  // every rank skips. Unscaling by 4 (fp16's scaler) divides each rank's own gradients.
  for (size_t i = 0; i < params.size(); ++i)
    params[i].second.mutable_grad() = (base_grad(i, params[i].second) * (me + 1)).to(at::kFloat);
  if (me == w - 1) params[0].second.grad()[0] = INFINITY;
  GradScaler scaler(true, 4.0);
  s.reduce_gradients(params, extra, scaler);
  auto [skip2, norm2] = s.check_gradients(scaler, params);
  EXPECT_TRUE(skip2);
  EXPECT_TRUE(std::isnan(norm2));
  double sq3 = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].second.mutable_grad() = (base_grad(i, params[i].second) * (me + 1)).to(at::kFloat);
    sq3 += (base_grad(i, params[i].second) * (w * (w + 1) / 2.0) / 4.0).pow(2).sum().item<double>();
  }
  s.reduce_gradients(params, extra, scaler);
  auto [skip3, norm3] = s.check_gradients(scaler, params);
  EXPECT_FALSE(skip3);
  EXPECT_NEAR(norm3, std::sqrt(sq3), 1e-6 * std::sqrt(sq3)) << "the norm of the unscaled sums";
  for (size_t i = 0; i < params.size(); ++i)
    if (owner[i] == me) {
      EXPECT_TRUE(at::allclose(params[i].second.grad().to(at::kDouble),
                               base_grad(i, params[i].second) * (w * (w + 1) / 2.0) / 4.0, 1e-6, 1e-6))
          << "tensor " << i << " unscaled once";
    }

  // Out of memory while the last rank unscales (its first allocation after the buckets):
  // every rank gets the error from the same collective, and the group goes on.
  for (size_t i = 0; i < params.size(); ++i)
    params[i].second.mutable_grad() = (base_grad(i, params[i].second) * (me + 1)).to(at::kFloat);
  if (me == w - 1) inject_oom_on_next_alloc();
  bool oom = false;
  try {
    s.reduce_gradients(params, extra, scaler);
  } catch (const std::exception& e) {
    oom = compat::is_out_of_memory(e);
    if (me != w - 1) {
      EXPECT_NE(std::string(e.what()).find("out of memory on another rank"), std::string::npos) << e.what();
    }
  }
  cancel_injected_oom();
  EXPECT_TRUE(oom) << "rank " << me;
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{1}, ReduceOp::sum)[0], w) << "the ranks still pair their collectives";
}

// The bytes of every frozen tensor of each layer: dense ones, and each NF4 weight's tensors.
std::vector<std::vector<at::Tensor>> layer_tensors(models::CausalLM& m) {
  std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(m.num_layers()));
  for (const auto& s : m.tensors()) {
    if (s.layer < 0) continue;
    if (s.role == models::TensorRole::kLinearWeight && s.linear->quantized()) {
      const NF4Tensor& q = *s.linear->qweight();
      for (const at::Tensor& t : {q.packed, q.absmax, q.nested_absmax, q.nested_quant_map})
        if (t.defined()) out[s.layer].push_back(t);
    } else if (s.tensor->defined() && !s.tensor->requires_grad()) {
      out[s.layer].push_back(*s.tensor);
    }
  }
  return out;
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// tiny-llama with layers 0-1 in NF4 and 2-3 dense, LoRA on every projection.
std::unique_ptr<models::CausalLM> layers_model() {
  auto m = models::init_random_model(*models::preset("tiny-llama"), 11);
  at::manual_seed(5);
  models::LoraOptions lo;
  lo.r = 4;
  lo.init = "gaussian";  // B = 0 would give A no gradient
  for (models::Linear* l : m->linears()) {
    if (l->name().find("layers.0.") != std::string::npos || l->name().find("layers.1.") != std::string::npos)
      l->quantize(64, true, memtune::QuantType::kNF4);
    l->add_lora(lo);
    at::NoGradGuard ng;
    l->lora->B.normal_(0, 0.02);
  }
  return m;
}

data::Batch layers_batch(int rank) {
  std::vector<data::Sample> samples(2);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 20; ++t) {
      samples[b].input_ids.push_back((7 * t + 13 * b + 31 * rank + 1) % 1000);
      samples[b].targets.push_back(t + 1 < 20 ? (7 * (t + 1) + 13 * b + 31 * rank + 1) % 1000 : data::kIgnoreIndex);
      samples[b].position_ids.push_back(t);
      samples[b].segment_ids.push_back(0);
    }
  return data::collate(samples, 1, 0);
}

std::pair<double, std::vector<at::Tensor>> layers_loss_and_grads(models::CausalLM& m, const data::Batch& batch) {
  models::ForwardOptions fo;
  fo.training = true;
  fo.checkpoint_layers.assign(4, true);
  auto out = m.forward(batch, fo);
  out.loss_sum.backward();
  std::vector<at::Tensor> grads;
  for (auto& [name, p] : m.trainable_parameters()) {
    grads.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  return {out.loss_sum.item<double>(), grads};
}

void layers_scenario(ProcessGroup& pg) {
  const int me = pg.rank(), w = pg.world_size();
  auto m = layers_model();
  const auto whole = layer_tensors(*m);
  std::vector<std::vector<at::Tensor>> copies;
  for (const auto& l : whole) {
    copies.emplace_back();
    for (const auto& t : l) copies.back().push_back(t.clone());
  }
  const data::Batch batch = layers_batch(me);
  const auto [loss_whole, grads_whole] = layers_loss_and_grads(*m, batch);
  const auto adapters_before = m->trainable_parameters();
  std::vector<at::Tensor> adapter_copies;
  for (const auto& [name, t] : adapters_before) adapter_copies.push_back(t.detach().clone());

  LayerShards shards(*m, pg);
  ASSERT_TRUE(m->sharded(0));
  // A sharded layer is not offloaded (model.device_map's offload, the ladder's rung): refused by name.
  try {
    m->set_offloaded(1, true);
    ADD_FAILURE() << "a sharded layer offloaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("sharded over the ranks"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(m->offloaded(1));
  // Resident: this rank's tensors hold storage, the others are meta; together every byte once.
  int64_t resident = 0, total = 0;
  const auto after = layer_tensors(*m);
  for (size_t i = 0; i < after.size(); ++i)
    for (size_t k = 0; k < after[i].size(); ++k) {
      ASSERT_EQ(after[i][k].sizes(), copies[i][k].sizes());
      total += nbytes(copies[i][k]);
      if (!after[i][k].is_meta()) {
        EXPECT_TRUE(at::equal(after[i][k], copies[i][k])) << "layer " << i << " tensor " << k;
        resident += nbytes(after[i][k]);
      }
    }
  // The adapters: the same tensors (the optimizer's, the hooks'), each holding its values on
  // its owner and a placeholder of its shape elsewhere.
  const auto adapters = m->trainable_parameters();
  ASSERT_EQ(adapters.size(), adapters_before.size());
  int64_t adapter_bytes = 0, adapter_resident = 0;
  for (size_t k = 0; k < adapters.size(); ++k) {
    const at::Tensor& t = adapters[k].second;
    EXPECT_TRUE(t.is_same(adapters_before[k].second)) << adapters[k].first << ": not the same tensor";
    EXPECT_TRUE(t.is_leaf() && t.requires_grad()) << adapters[k].first;
    EXPECT_TRUE(shards.holds(t)) << adapters[k].first;
    EXPECT_EQ(t.sizes(), adapter_copies[k].sizes()) << adapters[k].first;
    adapter_bytes += nbytes(adapter_copies[k]);
    if (t.is_contiguous()) {  // its owner's
      EXPECT_TRUE(at::equal(t, adapter_copies[k])) << adapters[k].first;
      adapter_resident += nbytes(t);
    } else {
      EXPECT_TRUE(at::isnan(t).all().item<bool>()) << adapters[k].first;
    }
  }
  EXPECT_EQ(shards.trainable_tensors(), static_cast<int64_t>(adapters.size()));
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{adapter_resident}, ReduceOp::sum)[0], adapter_bytes)
      << "each adapter on one rank";
  EXPECT_EQ(shards.total_bytes(), total + adapter_bytes);
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{resident}, ReduceOp::sum)[0], total) << "each byte on one rank";
  EXPECT_LT(resident, total / w + shards.largest_layer_bytes()) << "about 1/W per rank";

  // Gathered: every tensor of the layer equal to the whole model's; released: meta again.
  for (int i = 0; i < 4; ++i) {
    shards.gather(i);
    const auto g = layer_tensors(*m);
    for (size_t k = 0; k < g[i].size(); ++k) {
      ASSERT_FALSE(g[i][k].is_meta()) << "layer " << i << " tensor " << k;
      EXPECT_TRUE(at::equal(g[i][k], copies[i][k])) << "layer " << i << " tensor " << k;
    }
    shards.release(i);
    const auto r = layer_tensors(*m);
    for (size_t k = 0; k < r[i].size(); ++k)
      EXPECT_EQ(r[i][k].is_meta(), after[i][k].is_meta()) << "layer " << i << " tensor " << k;
  }

  // The sharded model's loss and adapter gradients: the whole model's, exactly (the same
  // bytes in the same kernels).
  const auto [loss, grads] = layers_loss_and_grads(*m, batch);
  EXPECT_EQ(loss, loss_whole);
  ASSERT_EQ(grads.size(), grads_whole.size());
  for (size_t k = 0; k < grads.size(); ++k) EXPECT_TRUE(at::equal(grads[k], grads_whole[k])) << "gradient " << k;

  // Out of memory while the last rank allocates its receive buffers: every rank throws from
  // the gather's agreement and takes it as the stage's agreement; nothing is left gathered.
  if (me == w - 1) inject_oom_on_next_alloc();
  bool oom = false;
  try {
    shards.gather(2);
  } catch (const std::exception& e) {
    oom = compat::is_out_of_memory(e);
  }
  cancel_injected_oom();
  EXPECT_TRUE(oom) << "rank " << me;
  EXPECT_TRUE(shards.take_agreed_oom());
  EXPECT_FALSE(shards.take_agreed_oom()) << "once";
  EXPECT_EQ(layer_tensors(*m)[2][0].is_meta(), after[2][0].is_meta()) << "the layer is as it was";

  // A rank that ran out inside the layers (here: the last) enters the supervisor's
  // agreement while the others reach their next gather: they learn it there.
  if (me == w - 1) {
    EXPECT_TRUE(pg.agree(true, 3).first);
  } else {
    std::string what;
    try {
      shards.gather(3);
    } catch (const std::exception& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("out of memory on another rank"), std::string::npos) << what;
    EXPECT_TRUE(shards.take_agreed_oom());
  }
  // The ranks still pair their collectives, and the next gather works.
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{1}, ReduceOp::sum)[0], w);
  shards.gather(3);
  const auto g = layer_tensors(*m);
  for (size_t k = 0; k < g[3].size(); ++k) EXPECT_TRUE(at::equal(g[3][k], copies[3][k])) << "tensor " << k;
  shards.release(3);

  // Prefetch: a gather starts the next layer's (forward and evaluation, without grad mode: up;
  // backward's reruns: down); the next gather takes it, equal to the whole model's; a gather of
  // another layer drops it first.
  {
    at::NoGradGuard forward;
    shards.gather(1);
    EXPECT_EQ(shards.prefetched_layer(), 2);
    shards.release(1);
    shards.gather(2);
    EXPECT_EQ(shards.prefetched_layer(), 3);
    const auto p2 = layer_tensors(*m);
    for (size_t k = 0; k < p2[2].size(); ++k) EXPECT_TRUE(at::equal(p2[2][k], copies[2][k])) << "tensor " << k;
    shards.release(2);
    shards.gather(0);  // not the prefetched layer 3
    EXPECT_EQ(shards.prefetched_layer(), 1);
    const auto p0 = layer_tensors(*m);
    for (size_t k = 0; k < p0[0].size(); ++k) EXPECT_TRUE(at::equal(p0[0][k], copies[0][k])) << "tensor " << k;
    shards.release(0);
  }
  shards.gather(2);  // grad mode: the rerun's direction
  EXPECT_EQ(shards.prefetched_layer(), 1);
  shards.release(2);
  // Out of memory learned in a prefetch's agreement (the last rank ran out after gathering layer
  // 1, without prefetching): the others throw from their gather of layer 1, which goes back.
  {
    at::NoGradGuard forward;
    if (me == w - 1) shards.set_prefetch(false);
    bool oom = false;
    try {
      shards.gather(1);
    } catch (const std::exception& e) {
      oom = compat::is_out_of_memory(e);
    }
    if (me == w - 1) {
      EXPECT_FALSE(oom);
      shards.release(1);
      EXPECT_TRUE(pg.agree(true, 3).first);
    } else {
      EXPECT_TRUE(oom) << "rank " << me;
      EXPECT_TRUE(shards.take_agreed_oom());
    }
    shards.set_prefetch(true);
  }
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{1}, ReduceOp::sum)[0], w) << "the ranks still pair their collectives";
  shards.gather(1);  // (not left gathered)
  shards.release(1);
}

// ZeRO-2's reduction in backward (Sharding::backward): the adapters of tiny-llama (layers
// checkpointed or not), each rank two micro-batches of its own, buckets of 300 elements so
// that tensors split across them. Each owner's gradients equal the sum over every rank's and
// micro-batch's gradients that plain autograd gives here (each rank knows every rank's
// batches); the other ranks hold none after each micro-batch. Then an out-of-memory error in
// the last rank's backward: every rank throws, the agreement is made once, the group still
// pairs, and the retried step gives the same sums.
void backward_scenario(ProcessGroup& pg, bool checkpointed) {
  const int me = pg.rank(), w = pg.world_size();
  install_cpu_budget_allocator();
  auto m = layers_model();
  const auto params = m->trainable_parameters();
  Sharding s(ShardLevel::gradients, &pg, params, 300 * 4);
  models::ForwardOptions fo;
  fo.training = true;
  fo.checkpoint_layers.assign(4, checkpointed);
  auto loss_of = [&](int rank, int micro) { return m->forward(layers_batch(2 * rank + micro), fo).loss_sum; };
  // The reference: plain autograd over every rank's micro-batches (the hooks pass it through).
  for (int r = 0; r < w; ++r)
    for (int micro = 0; micro < 2; ++micro) loss_of(r, micro).backward();
  std::vector<at::Tensor> want;
  for (const auto& [name, p] : params) {
    want.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  int64_t backward_allocations = 0;  // of the first micro-batch's backward
  auto run_step = [&] {
    for (int micro = 0; micro < 2; ++micro) {
      at::Tensor loss = loss_of(me, micro);
      const int64_t before = cpu_allocator_counters().total_allocations;
      s.backward(loss, /*host_gradients=*/false);
      if (micro == 0) backward_allocations = cpu_allocator_counters().total_allocations - before;
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_EQ(params[i].second.grad().defined(), s.owners()[i] == me)
            << params[i].first << " after micro-batch " << micro;
    }
    at::Tensor extra = at::zeros({1}, at::kDouble);
    const int64_t seq = pg.sequence();
    s.reduce_gradients(params, extra, GradScaler(false));
    EXPECT_EQ(pg.sequence(), seq + 1) << "reduced in backward: only the check's all-reduce is left";
    for (size_t i = 0; i < params.size(); ++i) {
      if (s.owners()[i] != me) continue;
      EXPECT_LE((params[i].second.grad() - want[i]).abs().max().item<double>(),
                1e-6 * want[i].abs().max().item<double>())  // fp32 sums in another order
          << params[i].first;
    }
  };
  std::set<int> owners(s.owners().begin(), s.owners().end());
  EXPECT_EQ(owners.size(), static_cast<size_t>(w)) << "every rank owns a run of the tensors";
  run_step();

  // Out of memory in the last rank's backward, half its allocations in.
  for (const auto& [name, p] : params) p.mutable_grad() = at::Tensor();
  at::Tensor loss = loss_of(me, 0);
  const int64_t seq = pg.sequence();
  if (me == w - 1) inject_oom_after(backward_allocations / 2);
  bool oom = false;
  std::string what;
  try {
    s.backward(loss, false);
  } catch (const std::exception& e) {
    oom = compat::is_out_of_memory(e);
    what = e.what();
  }
  cancel_injected_oom();
  loss = at::Tensor();
  EXPECT_TRUE(oom) << "rank " << me;
  if (me == w - 1) {
    EXPECT_NE(what.find("injected"), std::string::npos) << what;
    EXPECT_GT(pg.sequence(), seq) << "the error came after a bucket was reduced";
    // As the supervisor does: this rank agrees after the stage.
    EXPECT_FALSE(s.take_agreed_oom());
    EXPECT_TRUE(pg.agree(true, std::numeric_limits<int64_t>::max()).first);
  } else {
    EXPECT_NE(what.find("out of memory on another rank"), std::string::npos) << what;
    EXPECT_TRUE(s.take_agreed_oom());
    EXPECT_FALSE(s.take_agreed_oom()) << "once";
  }
  EXPECT_EQ(pg.allreduce(std::vector<int64_t>{1}, ReduceOp::sum)[0], w) << "the ranks still pair their collectives";
  // The step again from its start (the supervisor drops the gradients): the same sums.
  for (const auto& [name, p] : params) p.mutable_grad() = at::Tensor();
  run_step();
}

}  // namespace

TEST(ShardingWorker, Run) {
  const char* which = std::getenv("MEMTUNE_SHARDING_SCENARIO");
  if (!which) GTEST_SKIP() << "a worker of ShardingItest";
  ProcessGroupOptions options;
  options.timeout_s = 60;
  options.join_timeout_s = 60;
  ProcessGroup pg(DistEnv::from_environment(), options);
  if (std::string(which) == "layers")
    layers_scenario(pg);
  else if (std::string(which).rfind("backward", 0) == 0)
    backward_scenario(pg, std::string(which) == "backward_checkpointed");
  else
    scenario(pg, shard_level(which));
}

class ShardingItest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ShardingItest, ReduceNormAndUpdateAgreeWithTheSums) {
  MEMTUNE_REQUIRE_GLOO();
  const auto [level, world] = GetParam();
  EXPECT_EQ(run_workers(level, world, memtune::testing::temp_dir()), std::vector<int>(static_cast<size_t>(world), 0));
}

INSTANTIATE_TEST_SUITE_P(LevelsAndWorlds, ShardingItest,
                         ::testing::Combine(::testing::Values("optimizer", "gradients"), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
                         });

class BackwardReduceItest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(BackwardReduceItest, OwnersHoldTheSumsOthersNoneAndAnOomReachesEveryRank) {
  MEMTUNE_REQUIRE_GLOO();
  const auto [which, world] = GetParam();
  EXPECT_EQ(run_workers(which, world, memtune::testing::temp_dir()), std::vector<int>(static_cast<size_t>(world), 0));
}

INSTANTIATE_TEST_SUITE_P(Worlds, BackwardReduceItest,
                         ::testing::Combine(::testing::Values("backward", "backward_checkpointed"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
                         });

class LayerShardsItest : public ::testing::TestWithParam<int> {};

TEST_P(LayerShardsItest, GatheredLayersEqualTheWholeModelAndAnOomReachesEveryRank) {
  MEMTUNE_REQUIRE_GLOO();
  const int world = GetParam();
  EXPECT_EQ(run_workers("layers", world, memtune::testing::temp_dir()), std::vector<int>(static_cast<size_t>(world), 0));
}

INSTANTIATE_TEST_SUITE_P(Worlds, LayerShardsItest, ::testing::Values(2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(ShardingItest, OneProcessActsAsNone) {
  auto params = make_params();
  Sharding s(ShardLevel::gradients, nullptr, params, 1024);
  EXPECT_EQ(s.level(), ShardLevel::none);
  EXPECT_EQ(s.owned(), std::vector<bool>(params.size(), true));
  EXPECT_EQ(s.buffer_bytes(), 0);
  EXPECT_TRUE(s.owns_state("a.lora_A.weight.exp_avg"));
  EXPECT_FALSE(s.owns_state("z.weight.exp_avg"));
}
