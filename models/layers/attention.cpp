#include "models/layers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers/attention_cpu.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/step_profiler.h"

namespace memtune::models {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The keys query rows [t0,t1) may see start here: 0, or with a sliding window of W keys
// (the query's own included), the first key row t0's window reaches.
int64_t first_key(int64_t t0, int64_t window) { return window > 0 ? std::max<int64_t>(0, t0 - window + 1) : 0; }

// The blocked kernel keeps the probabilities of B rows of H heads when half their fp32
// (T x T) matrices fit the limit (the causal half is what the blocks hold), and the scores
// are not soft-capped (the backward forms the capped scores again for their derivative).
bool keeps_probabilities(int64_t B, int64_t H, int64_t T, int64_t limit, double softcap) {
  return softcap <= 0 && B * H * T * T * 4 / 2 <= limit;
}

// Scores the blocked kernel forms: the sum over query blocks of rows x keys up to the block's end.
int64_t block_area(int64_t T, int64_t block) {
  int64_t area = 0;
  for (int64_t t0 = 0; t0 < T; t0 += block) area += (std::min(T, t0 + block) - t0) * std::min(T, t0 + block);
  return area;
}

// Additive mask (B,1,1,bt,tk) in fp32 over keys [k0,t1): 0 where query t0+i may see key
// k0+j (same segment, not later, within the window), -inf elsewhere.
at::Tensor block_mask(const at::Tensor& seg, int64_t t0, int64_t t1, int64_t k0, int64_t window) {
  at::Tensor sq = seg.slice(1, t0, t1).unsqueeze(2);   // (B,bt,1)
  at::Tensor sk = seg.slice(1, k0, t1).unsqueeze(1);   // (B,1,tk)
  at::Tensor qpos = at::arange(t0, t1, seg.options()).unsqueeze(1);  // (bt,1)
  at::Tensor kpos = at::arange(k0, t1, seg.options()).unsqueeze(0);  // (1,tk)
  at::Tensor allowed = (sq == sk).logical_and(kpos <= qpos);         // (B,bt,tk)
  if (window > 0) allowed = allowed.logical_and(qpos - kpos < window);
  at::Tensor bias = at::zeros(allowed.sizes(), seg.options().dtype(at::kFloat));
  bias.masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  return bias.unsqueeze(1).unsqueeze(1);
}

// Scores of query rows [t0,t1) against keys [k0,t1), scaled (and soft-capped): (B,Hkv,G,bt,tk)
// fp32, not masked. Scaled in q's dtype, then widened, as transformers' eager attention
// (`matmul(q, k^T) * scaling`, Gemma 2's `/ softcap, tanh, * softcap`, then the softmax in
// fp32): in bf16 and fp16 the scaled scores are rounded once more, unless the scale is a
// power of two (head_dim 16, 64, 256), and once per capping step.
at::Tensor block_raw_scores(const at::Tensor& q, const at::Tensor& k, int64_t t0, int64_t t1, int64_t window,
                            double scale, double softcap) {
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(4), bt = t1 - t0;
  const int64_t k0 = first_key(t0, window);
  at::Tensor qb = q.slice(3, t0, t1).reshape({B, Hkv, G * bt, D});
  at::Tensor kb = k.slice(2, k0, t1);
  at::Tensor s = at::matmul(qb, kb.transpose(-1, -2)).view({B, Hkv, G, bt, t1 - k0}).mul_(scale);
  if (softcap > 0) s.div_(softcap).tanh_().mul_(softcap);
  return s.to(at::kFloat);
}

// block_raw_scores masked: -inf where a query may not see a key.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& seg, int64_t t0,
                        int64_t t1, int64_t window, double scale, double softcap) {
  return block_raw_scores(q, k, t0, t1, window, scale, softcap)
      .add_(block_mask(seg, t0, t1, first_key(t0, window), window));
}

// Attention dropout's scaled mask Z (0 or 1/(1-p)) for query rows [t0,t1) against keys
// [k0,t1), shaped like block_scores: (B,Hkv,G,bt,tk) fp32. Query head h*G+g of row b draws
// attention_keep_mask's bits, as the fused CPU kernel does.
at::Tensor block_dropout(const at::Tensor& seeds, double p, int64_t Hkv, int64_t G, int64_t t0, int64_t t1,
                         int64_t k0) {
  at::Tensor keep = attention_keep_mask(seeds, Hkv * G, t0, t1, k0, t1, p);  // (B,Hkv*G,bt,tk)
  return keep.to(at::kFloat).mul_(1.0 / (1.0 - p)).view({keep.size(0), Hkv, G, t1 - t0, t1 - k0});
}

struct SegmentAttention : public torch::autograd::Function<SegmentAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& seg, double scale, int64_t window,
                            int64_t block, int64_t keep_probs_bytes, double dropout, const at::Tensor& seeds,
                            double softcap) {
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = at::empty({B, Hkv, G, T}, q.options().dtype(at::kFloat));
    const bool keep = keeps_probabilities(B, Hkv * G, T, keep_probs_bytes, softcap);
    variable_list probs;
    for (int64_t t0 = 0; t0 < T; t0 += block) {
      const int64_t t1 = std::min(T, t0 + block), bt = t1 - t0;
      const int64_t k0 = first_key(t0, window);
      at::Tensor s = block_scores(q, k, seg, t0, t1, window, scale, softcap);
      at::Tensor m = std::get<0>(s.max(-1, true));
      at::Tensor p = (s - m).exp_();
      at::Tensor denom = p.sum(-1, true);
      p.div_(denom);
      lse.slice(3, t0, t1).copy_((m + denom.log()).squeeze(-1));
      at::Tensor pc = p.to(q.scalar_type());
      // Dropout follows the softmax: the kept probabilities (P Z) weight the values.
      at::Tensor pv = dropout > 0 ? p.mul(block_dropout(seeds, dropout, Hkv, G, t0, t1, k0)).to(q.scalar_type()) : pc;
      at::Tensor o = at::matmul(pv.view({B, Hkv, G * bt, t1 - k0}), v.slice(2, k0, t1));
      out.slice(3, t0, t1).copy_(o.view({B, Hkv, G, bt, D}));
      if (keep) probs.push_back(pc);
    }
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    ctx->saved_data["block"] = block;
    ctx->saved_data["keep"] = keep;
    ctx->saved_data["dropout"] = dropout;
    ctx->saved_data["softcap"] = softcap;
    variable_list saved = {q, k, v, seg, out, lse, seeds};
    saved.insert(saved.end(), probs.begin(), probs.end());
    ctx->save_for_backward(saved);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &seg = saved[3], &out = saved[4],
                     &lse = saved[5];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t block = ctx->saved_data["block"].toInt();
    const int64_t window = ctx->saved_data["window"].toInt();
    const bool keep = ctx->saved_data["keep"].toBool();
    const double dropout = ctx->saved_data["dropout"].toDouble();
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const at::Tensor& seeds = saved[6];
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
    at::Tensor dout = grads[0].contiguous();
    at::Tensor dq = at::empty_like(q);
    at::Tensor dk = at::zeros_like(k);
    at::Tensor dv = at::zeros_like(v);
    // D_i = sum_d dO_i,d * O_i,d: the row term of softmax's backward.
    at::Tensor delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1);  // (B,Hkv,G,T)
    int64_t index = 0;
    for (int64_t t0 = 0; t0 < T; t0 += block, ++index) {
      const int64_t t1 = std::min(T, t0 + block), bt = t1 - t0, k0 = first_key(t0, window), tk = t1 - k0;
      at::Tensor p, capped;  // capped: the soft-capped scores, whose tanh's derivative dS takes
      if (keep) {
        p = saved[7 + index].to(at::kFloat);
      } else if (softcap > 0) {
        capped = block_raw_scores(q, k, t0, t1, window, scale, softcap);
        p = (capped + block_mask(seg, t0, t1, k0, window)).sub_(lse.slice(3, t0, t1).unsqueeze(-1)).exp_();
      } else {
        p = block_scores(q, k, seg, t0, t1, window, scale, 0);
        p.sub_(lse.slice(3, t0, t1).unsqueeze(-1)).exp_();
      }
      // With dropout's scaled mask Z: dV += (P Z)^T dO and dS = P (Z (dO V^T) - D) scale.
      const at::Tensor z = dropout > 0 ? block_dropout(seeds, dropout, Hkv, G, t0, t1, k0) : at::Tensor();
      at::Tensor pc = (z.defined() ? p * z : p).to(q.scalar_type()).view({B, Hkv, G * bt, tk});
      at::Tensor dob = dout.slice(3, t0, t1).reshape({B, Hkv, G * bt, D});
      dv.slice(2, k0, t1).add_(at::matmul(pc.transpose(-1, -2), dob));
      at::Tensor dp = at::matmul(dob, v.slice(2, k0, t1).transpose(-1, -2)).view({B, Hkv, G, bt, tk}).to(at::kFloat);
      if (z.defined()) dp.mul_(z);
      at::Tensor ds = p * dp.sub_(delta.slice(3, t0, t1).unsqueeze(-1));
      // Soft-capping: d(c tanh(u / c)) / du = 1 - (capped / c)^2.
      if (capped.defined()) ds.mul_(capped.div_(softcap).square_().neg_().add_(1.0));
      ds.mul_(scale);
      at::Tensor dsc = ds.to(q.scalar_type()).view({B, Hkv, G * bt, tk});
      dq.slice(3, t0, t1).copy_(at::matmul(dsc, k.slice(2, k0, t1)).view({B, Hkv, G, bt, D}));
      at::Tensor qb = q.slice(3, t0, t1).reshape({B, Hkv, G * bt, D});
      dk.slice(2, k0, t1).add_(at::matmul(dsc.transpose(-1, -2), qb));
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};


#if MEMTUNE_HAS_SDPA
#if MEMTUNE_SDPA_HAS_GQA
// Whether SDPA runs grouped key/value heads (enable_gqa) on a fused kernel for this causal
// call, by PyTorch's own choice for the same arguments. Flash takes them (CUDA, 16-bit, sm80
// and newer); the memory-efficient kernel and the CPU's flash do not, and SDPA would take the
// grouped heads to its math kernel instead: (B, H, T, T) scores formed and kept for backward,
// where heads repeated to H run fused in linear memory.
bool sdpa_fuses_grouped_heads(const at::Tensor& qh, const at::Tensor& k, const at::Tensor& v, double scale) {
  constexpr int64_t kMath = 0;  // sdp::SDPBackend::math, the same value in every LibTorch 2.x
  return at::_fused_sdp_choice(qh, k, v, c10::nullopt, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true) != kMath;
}
#endif

// q (B,Hkv,G,T,D) through at::scaled_dot_product_attention: heads flattened to H = Hkv*G,
// k and v repeated to H (HF's repeat_kv), a boolean mask only where causal masking is not
// enough. Causal masking alone on LibTorch 2.5 or later takes k and v at their Hkv heads
// (enable_gqa) where a fused kernel runs them so, as transformers' sdpa_attention_forward does
// without a mask on a GPU: no copies repeated to H heads made, nor kept for backward (with a
// mask transformers repeats them, and so does this: SDPA's fused kernels would not take the
// mask with grouped heads).
at::Tensor sdpa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg,
                          double scale, int64_t window, bool one_segment_per_row) {
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
  at::Tensor qh = q.reshape({B, Hkv * G, T, D});
  const bool causal_only = one_segment_per_row && window <= 0;
#if MEMTUNE_SDPA_HAS_GQA
  if (causal_only && G > 1 && sdpa_fuses_grouped_heads(qh, k, v, scale))
    return at::scaled_dot_product_attention(qh, k, v, c10::nullopt, 0.0, true, scale, /*enable_gqa=*/true)
        .view({B, Hkv, G, T, D});
#endif
  at::Tensor kh = k.unsqueeze(2).expand({B, Hkv, G, T, D}).reshape({B, Hkv * G, T, D});
  at::Tensor vh = v.unsqueeze(2).expand({B, Hkv, G, T, D}).reshape({B, Hkv * G, T, D});
  c10::optional<at::Tensor> mask;
  if (!causal_only) {
    at::Tensor s = seg.to(q.device());
    at::Tensor pos = at::arange(T, s.options());
    at::Tensor qp = pos.view({T, 1}), kp = pos.view({1, T});
    at::Tensor allowed = (kp <= qp).unsqueeze(0).logical_and(s.unsqueeze(2) == s.unsqueeze(1));  // (B,T,T)
    if (window > 0) allowed = allowed.logical_and((qp - kp < window).unsqueeze(0));
    mask = allowed.unsqueeze(1);
  }
#if MEMTUNE_SDPA_HAS_SCALE
  at::Tensor o = at::scaled_dot_product_attention(qh, kh, vh, mask, 0.0, causal_only, scale);
#else
  // 2.0 scales by 1/sqrt(D) itself: fold the requested scale into q.
  at::Tensor o = at::scaled_dot_product_attention(qh * (scale * std::sqrt(static_cast<double>(D))), kh, vh, mask,
                                                  0.0, causal_only);
#endif
  return o.view({B, Hkv, G, T, D});
}

// Packed documents through one causal call per length bucket: every document (a run of one
// segment id, padding included) is copied into a row of its bucket's width, the smallest
// power of two >= its length (at least 32), padded at its end. Under causal masking a
// position sees only the positions before it, so the padding after a document changes
// nothing it computes: exact, with no mask, at most 2x the document's own work, and log2(T)
// calls per layer however many documents a row packs. Gathers and the final permutation are
// index_select, whose backward scatters the gradients back.
at::Tensor sdpa_bucketed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                         const DocumentBuckets& db) {
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4), H = Hkv * G;
  // (B*T + 1, H, D): rows of positions, heads inside, and a zero row the padding gathers.
  auto rows = [&](const at::Tensor& x) {  // x (B,H,T,D)
    at::Tensor r = x.permute({0, 2, 1, 3}).reshape({B * T, H, D});
    return at::cat({r, at::zeros({1, H, D}, r.options())}, 0);
  };
  const at::Tensor qr = rows(q.reshape({B, H, T, D}));
  const at::Tensor kr = rows(k.unsqueeze(2).expand({B, Hkv, G, T, D}).reshape({B, H, T, D}));
  const at::Tensor vr = rows(v.unsqueeze(2).expand({B, Hkv, G, T, D}).reshape({B, H, T, D}));
  std::vector<at::Tensor> outputs;
  for (const DocumentBuckets::Bucket& bucket : db.buckets) {
    const int64_t n = bucket.documents, P = bucket.width;
    auto gather = [&](const at::Tensor& r) { return r.index_select(0, bucket.gather).view({n, P, H, D}).transpose(1, 2); };
#if MEMTUNE_SDPA_HAS_SCALE
    at::Tensor o = at::scaled_dot_product_attention(gather(qr), gather(kr), gather(vr), c10::nullopt, 0.0, true, scale);
#else
    at::Tensor o = at::scaled_dot_product_attention(gather(qr) * (scale * std::sqrt(static_cast<double>(D))),
                                                    gather(kr), gather(vr), c10::nullopt, 0.0, true);
#endif
    outputs.push_back(o.transpose(1, 2).reshape({n * P, H, D}).index_select(0, bucket.real));
  }
  // The buckets' real positions in bucket order; `order` puts them back in (b, t) order.
  at::Tensor out = at::cat(outputs, 0).index_select(0, db.order);
  return out.view({B, T, H, D}).permute({0, 2, 1, 3}).reshape({B, Hkv, G, T, D});
}

// Whether the runs are known for these rows and no window needs a mask.
bool documents_known(const AttentionOptions& o, int64_t B, int64_t T, int64_t window) {
  if (window > 0 || !o.segment_lengths || static_cast<int64_t>(o.segment_lengths->size()) != B) return false;
  for (const auto& row : *o.segment_lengths) {
    int64_t sum = 0;
    for (int64_t n : row) sum += n;
    if (sum != T) return false;
  }
  return true;
}

at::Tensor sdpa_documents(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const AttentionOptions& o) {
  if (o.document_buckets && o.document_buckets->device == q.device())
    return sdpa_bucketed(q, k, v, scale, *o.document_buckets);
  return sdpa_bucketed(q, k, v, scale, *document_buckets(*o.segment_lengths, q.size(3), q.device()));
}
#endif

}  // namespace

bool sdpa_available() { return MEMTUNE_HAS_SDPA; }

std::shared_ptr<const DocumentBuckets> document_buckets(const std::vector<std::vector<int64_t>>& lengths, int64_t T,
                                                        const c10::Device& device) {
  const int64_t B = static_cast<int64_t>(lengths.size()), sentinel = B * T;  // the zero row
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> by_width;       // width -> (start, length)
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = b * T;
    for (int64_t len : lengths[static_cast<size_t>(b)]) {
      int64_t width = 32;
      while (width < len) width *= 2;
      by_width[width].emplace_back(start, len);
      start += len;
    }
  }
  auto db = std::make_shared<DocumentBuckets>();
  db->device = device;
  std::vector<int64_t> order(static_cast<size_t>(B * T));
  int64_t placed = 0;  // real positions before this bucket's, in bucket order
  const auto i64 = at::TensorOptions(at::kLong);
  for (const auto& [width, docs] : by_width) {
    std::vector<int64_t> gather, real;
    for (size_t i = 0; i < docs.size(); ++i) {
      const auto [start, len] = docs[i];
      for (int64_t p = 0; p < width; ++p) gather.push_back(p < len ? start + p : sentinel);
      for (int64_t p = 0; p < len; ++p) {
        real.push_back(static_cast<int64_t>(i) * width + p);
        order[static_cast<size_t>(start + p)] = placed++;
      }
    }
    db->buckets.push_back({width, static_cast<int64_t>(docs.size()), at::tensor(gather, i64).to(device),
                           at::tensor(real, i64).to(device)});
  }
  db->order = at::tensor(order, i64).to(device);
  return db;
}

std::shared_ptr<const std::vector<std::vector<int64_t>>> segment_run_lengths(const at::Tensor& segment_ids) {
  MEMTUNE_INTERNAL_ASSERT(segment_ids.dim() == 2, "segment_run_lengths: segment ids (B,T), got ", segment_ids.sizes());
  const at::Tensor seg = segment_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t B = seg.size(0), T = seg.size(1);
  const int64_t* p = seg.data_ptr<int64_t>();
  auto out = std::make_shared<std::vector<std::vector<int64_t>>>(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = p + b * T;
    std::vector<int64_t> seen;
    for (int64_t t = 0; t < T;) {
      int64_t e = t + 1;
      while (e < T && row[e] == row[t]) ++e;
      if (std::find(seen.begin(), seen.end(), row[t]) != seen.end()) return nullptr;  // a document resumes
      seen.push_back(row[t]);
      (*out)[b].push_back(e - t);
      t = e;
    }
  }
  return out;
}

AttentionOptions::Kernel parse_attention_kernel(const std::string& name) {
  if (name == "auto") return AttentionOptions::Kernel::kAuto;
  if (name == "eager") return AttentionOptions::Kernel::kEager;
  if (name == "sdpa") {
    MEMTUNE_CHECK(sdpa_available(), "model.attn_implementation: sdpa needs LibTorch 2.0 or later; this build uses ",
                  compat::torch_version(), ". Use auto or eager (memory-efficient attention on every version)");
    return AttentionOptions::Kernel::kSdpa;
  }
  MEMTUNE_CHECK(false, "model.attn_implementation: '", name, "' is not one of auto, eager, sdpa");
}

AttentionMemory attention_memory(int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D, int64_t a,
                                 bool fused_cpu, int64_t threads, const AttentionOptions& o) {
  constexpr int64_t kF32 = 4, kI64 = 8;
  const int64_t E = B * T, q = Hq * D, kv = Hkv * D;
  const int64_t bt = std::min(T, o.query_block);
  const bool keep = keeps_probabilities(B, Hq, T, o.keep_probs_bytes, o.softcap);
  const int64_t probs = keep ? B * Hq * block_area(T, o.query_block) * a : 0;
  const int64_t scores = B * Hq * bt * T * kF32;  // one query block's fp32 scores
  const int64_t mask = B * bt * T * (kF32 + 3);   // its additive mask and the booleans that build it
  const int64_t lse = E * Hq * kF32;
  AttentionMemory m;
  if (fused_cpu) {
    // Per thread the backward's scratch, the larger of the two passes (taken for both).
    const int64_t scratch =
        std::max<int64_t>(threads, 1) * detail::fused_cpu_attention_scratch_bytes(T, D, o.softcap > 0);
    m.kept = E * (2 * q + 2 * kv) * a + lse + E * kI64;  // q, k, v, out, lse, each query's first key
    m.forward_transient = scratch;
    m.no_grad_own = E * q * a + lse + E * kI64;  // reads q, k, v in place
    m.backward_transient = E * (2 * q + 2 * kv) * kF32 + scratch;
    return m;
  }
  // The blocked kernel: contiguous copies of q, k, v; the probabilities kept or formed again.
  // Dropout draws a block's mask from three int64 hashes at a time and keeps it as fp32.
  // Soft-capping forms the capped scores beside the probabilities in backward.
  const int64_t drop = o.dropout.active() ? scores / kF32 * (3 * kI64 + kF32) : 0;
  m.kept = E * (2 * q + 2 * kv) * a + lse + probs;
  m.forward_transient = scores + (keep ? 0 : scores) + mask + drop;
  m.no_grad_own = m.kept;
  m.backward_transient = E * (4 * q + 2 * kv) * kF32 + lse + (keep ? 2 * scores : 3 * scores + mask) + drop +
                         (o.softcap > 0 ? scores : 0);
  return m;
}

AttentionOptions with_dropout(const AttentionOptions& options, bool training, double p, uint64_t site, int64_t rows,
                              const c10::Device& device) {
  if (!training || p <= 0) return options;
  AttentionOptions o = options;
  o.dropout = {p, attention_dropout_seeds(site, rows, device)};
  return o;
}

bool uses_fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& segment_ids) {
  return detail::fused_cpu_attention_applies(q, k, v, segment_ids);
}

at::Tensor causal_segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& segment_ids, double scale, int64_t sliding_window,
                                    const AttentionOptions& options) {
  MEMTUNE_PROFILE_SCOPE("memtune::attention");
  MEMTUNE_INTERNAL_ASSERT(q.dim() == 5 && k.dim() == 4 && v.dim() == 4, "attention: q (B,Hkv,G,T,D), k/v (B,Hkv,T,D)");
  MEMTUNE_INTERNAL_ASSERT(q.size(3) == k.size(2) && k.sizes() == v.sizes(), "attention: q, k, v lengths differ");
  MEMTUNE_INTERNAL_ASSERT(segment_ids.dim() == 2 && segment_ids.size(0) == q.size(0) && segment_ids.size(1) == q.size(3),
              "attention: segment ids ", segment_ids.sizes(), " do not match q ", q.sizes());
  using Kernel = AttentionOptions::Kernel;
  const AttentionDropout& dropout = options.dropout;
  if (dropout.active()) {
    MEMTUNE_CHECK(options.kernel != Kernel::kSdpa,
                  "model.attn_implementation: sdpa draws its own dropout masks, which memtune cannot make follow "
                  "each sample, and this model drops attention probabilities in training (attention_dropout / "
                  "attn_pdrop ", dropout.p, "). Hint: attn_implementation auto or eager");
    MEMTUNE_INTERNAL_ASSERT(dropout.seeds.defined() && dropout.seeds.numel() == q.size(0), "attention dropout: ",
                            dropout.seeds.defined() ? dropout.seeds.numel() : 0, " seeds for ", q.size(0), " rows");
  }
  if (options.kernel == Kernel::kSdpa) {
    MEMTUNE_CHECK(options.softcap <= 0, "model.attn_implementation: sdpa cannot soft-cap attention scores, and this "
                  "model's are (attn_logit_softcapping ", options.softcap, "); transformers' own sdpa path drops the "
                  "capping and computes another model. Hint: attn_implementation auto or eager");
#if MEMTUNE_HAS_SDPA
    if (!options.one_segment_per_row && documents_known(options, q.size(0), q.size(3), sliding_window))
      return sdpa_documents(q, k, v, scale, options);
    return sdpa_attention(q, k, v, segment_ids, scale, sliding_window, options.one_segment_per_row);
#else
    TORCH_CHECK(false, "attention: sdpa needs LibTorch 2.0 or later (this build: ", compat::torch_version(), ")");
#endif
  }
  if (options.kernel == Kernel::kAuto) {
    at::Tensor out = detail::fused_cpu_attention(q, k, v, segment_ids, scale, sliding_window, dropout, options.softcap);
    if (out.defined()) return out;
#if MEMTUNE_HAS_SDPA
    if (dropout.active() || options.softcap > 0) {
      // SDPA's dropout is not keyed, and it cannot soft-cap: the blocked kernel below runs.
    } else if (q.is_cuda() && options.one_segment_per_row && sliding_window <= 0)
      return sdpa_attention(q, k, v, segment_ids, scale, sliding_window, true);
    else if (q.is_cuda() && documents_known(options, q.size(0), q.size(3), sliding_window))
      return sdpa_documents(q, k, v, scale, options);
#endif
  }
  const at::Tensor seeds = dropout.active() ? dropout.seeds.to(q.device()).to(at::kLong) : at::zeros({0}, q.options().dtype(at::kLong));
  return SegmentAttention::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                 segment_ids.to(q.device()), scale, sliding_window, options.query_block,
                                 options.keep_probs_bytes, dropout.active() ? dropout.p : 0.0, seeds, options.softcap);
}

}  // namespace memtune::models
