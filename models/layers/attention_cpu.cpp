#include "models/layers/attention_cpu.h"

#include "models/layers/cpu_gemm.h"
#include "models/layers/cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "runtime/error.h"

namespace memtune::models::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kRows = 32;  // query rows per block
constexpr int64_t kLanes = kPanelLanes;  // the GEMM's panel width (cpu_gemm.h)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- Layout ------------------------------------------------------------------------------

// A tensor with a contiguous last dimension as pointer arithmetic: element (i0,i1,i2,..).
struct View {
  float* data;
  int64_t s0, s1, s2, s3;  // strides of the dimensions before the last (s3: 5-d only)
  explicit View(const at::Tensor& t)
      : data(t.data_ptr<float>()),
        s0(t.stride(0)),
        s1(t.stride(1)),
        s2(t.stride(2)),
        s3(t.dim() == 5 ? t.stride(3) : 0) {}
  float* at(int64_t b, int64_t h, int64_t g = 0) const { return data + b * s0 + h * s1 + g * s2; }
};

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Scratch of one thread, carved from one tensor: a task's packed keys and values, one
// query block's probabilities and their gradient (and with soft-capping, its scores' tanh),
// the packed rows of a block.
struct Scratch {
  int64_t T, D, Tp, Dp, ld;  // Tp, Dp: T and D rounded up to a panel; ld: a score row's stride
  bool capped;
  Scratch(int64_t T_, int64_t D_, bool capped_)
      : T(T_), D(D_), Tp(round_up(T_, kLanes)), Dp(round_up(D_, kLanes)), ld(round_up(T_, kLanes) + kLanes),
        capped(capped_) {}
  // K^T or V^T (D x T) and K or V (T x D) packed; a block's scores; a block's rows (kRows x D) packed.
  int64_t transposed() const { return D * Tp; }
  int64_t straight() const { return T * Dp; }
  int64_t scores() const { return kRows * ld; }
  int64_t block_rows() const { return kRows * Dp; }
  int64_t forward_floats() const { return transposed() + straight() + scores() + kRows; }
  int64_t backward_floats() const {
    return 2 * transposed() + straight() + (capped ? 3 : 2) * scores() + block_rows();
  }
};

// Keys K (T x D, row stride ld) packed as the right operand of Q K^T: panels of 16 keys.
Panels pack_transposed(const float* src, int64_t ld, const Scratch& s, float* dst) {
  return pack_panels(src, 1, ld, s.D, s.T, s.D, dst);
}
// Values V (T x D) packed as the right operand of P V: panels of 16 dimensions, T rows.
Panels pack_straight(const float* src, int64_t ld, const Scratch& s, float* dst) {
  return pack_panels(src, ld, 1, s.T, s.D, s.T, dst);
}

// Query rows [t0,t1) of q (row stride q_t) against the keys from k0 (`first` of t0 rounded
// down to a panel) to t1: scores into S (row stride s.ld), each row's allowed keys
// exponentiated with `row_shift` (forward: the row max, which it records; backward: the
// saved log-sum-exp), the rest zeroed. With `softcap` > 0 the scaled scores are soft-capped
// first (cpu_vec.h soft_cap: tanh into TH, same layout, when given, whose square the backward
// needs; row_shift then sees the capped scores, and `scale` is taken as 1 after). Returns k0.
template <typename Shift>
int64_t block_probs(GemmFn gemm, const Scratch& s, const int64_t* first, float scale, float softcap, const float* q,
                    int64_t q_t, Panels kt, int64_t t0, int64_t t1, float* S, float* TH, Shift&& row_shift,
                    float* row_sum) {
  const int64_t k0 = first[t0] / kLanes * kLanes, tk = t1 - k0;
  gemm(t1 - t0, tk, s.D, rows_of(q + t0 * q_t, q_t), {kt.at(k0 / kLanes, 0), kt.stride}, S, s.ld, false);
  for (int64_t t = t0; t < t1; ++t) {
    float* row = S + (t - t0) * s.ld;
    const int64_t lo = first[t] - k0, hi = t - k0 + 1;  // allowed columns [lo, hi)
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + tk, 0.0f);
    if (softcap > 0) soft_cap(row + lo, hi - lo, scale, softcap, TH == nullptr ? nullptr : TH + (t - t0) * s.ld + lo);
    const float shift = row_shift(t, row + lo, hi - lo);
    const float sum = exp_shift_sum(row + lo, hi - lo, softcap > 0 ? 1.0f : scale, shift);
    if (row_sum != nullptr) row_sum[t - t0] = sum;
  }
  return k0;
}

// fn(b, h, buf) for every (batch row, kv head), spread over the intra-op threads; buf is
// the calling thread's `floats` of one scratch tensor (budget-tracked, allocated per call).
template <typename Fn>
void for_each_kv_head(int64_t B, int64_t Hkv, int64_t floats, const at::TensorOptions& options, Fn&& fn) {
  at::Tensor scratch = at::empty({at::get_num_threads() * floats}, options);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    float* buf = scratch.data_ptr<float>() + at::get_thread_num() * floats;
    for (int64_t task = begin; task < end; ++task) fn(task / Hkv, task % Hkv, buf);
  });
}

float row_dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Attention dropout's mask (runtime/keyed_dropout.h), drawn again wherever it is needed:
// forward and backward compute the same bits from (row seed, head, query, key).
class DropMask {
 public:
  DropMask(double p, const at::Tensor& seeds)
      : p_(p), threshold_(dropout_keep_threshold(p)), scale_(static_cast<float>(1.0 / (1.0 - p))),
        seeds_(p > 0 ? seeds.data_ptr<int64_t>() : nullptr) {}
  bool active() const { return p_ > 0; }

  // Row t's allowed keys [lo, hi) of a block whose columns start at key k0: dropped ones
  // zeroed, kept ones scaled.
  void apply(float* row, int64_t b, int64_t head, int64_t t, int64_t lo, int64_t hi, int64_t k0) const {
    const uint32_t h = attention_row_hash(static_cast<uint32_t>(seeds_[b]), head, t);
    for (int64_t s = lo; s < hi; ++s) row[s - k0] = attention_kept(h, s, threshold_) ? row[s - k0] * scale_ : 0.0f;
  }

  // Row t's backward: p (the probabilities) becomes p Z, dp (dO V^T) becomes
  // dS = p (Z dp - dl) scale over all tk columns (those outside [lo, hi) have p = 0).
  void backward(float* p, float* dp, float dl, float scale, int64_t b, int64_t head, int64_t t, int64_t lo,
                int64_t hi, int64_t k0, int64_t tk) const {
    const uint32_t h = attention_row_hash(static_cast<uint32_t>(seeds_[b]), head, t);
    for (int64_t j = 0; j < tk; ++j) {
      const int64_t s = k0 + j;
      const float z = s >= lo && s < hi && attention_kept(h, s, threshold_) ? scale_ : 0.0f;
      dp[j] = p[j] * (z * dp[j] - dl) * scale;
      p[j] *= z;
    }
  }

 private:
  double p_;
  uint32_t threshold_;
  float scale_;
  const int64_t* seeds_;
};

struct FusedCpuAttention : public torch::autograd::Function<FusedCpuAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& first_keys, double scale_d, int64_t window,
                            double dropout, const at::Tensor& dropout_seeds, double softcap_d) {
    at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
    const float scale = static_cast<float>(scale_d), softcap = static_cast<float>(softcap_d);
    const float exp_scale = softcap > 0 ? 1.0f : scale;  // soft-capped scores come scaled
    // Output in (B,T,Hkv,G,D) memory order, seen as (B,Hkv,G,T,D).
    at::Tensor out = at::empty_strided({B, Hkv, G, T, D}, {T * Hkv * G * D, G * D, D, Hkv * G * D, 1}, q.options());
    at::Tensor lse = at::empty({B, Hkv, G, T}, q.options());
    const Scratch s(T, D, softcap > 0);
    const View vq(q), vk(k), vv(v), vo(out), vl(lse);
    const GemmFn gemm = gemm_kernel();
    const DropMask drop(dropout, dropout_seeds);
    for_each_kv_head(B, Hkv, s.forward_floats(), q.options(), [&](int64_t b, int64_t h, float* kt_buf) {
      float* v_buf = kt_buf + s.transposed();
      float* S = v_buf + s.straight();
      float* sums = S + s.scores();
      const int64_t* first = first_keys.data_ptr<int64_t>() + b * T;
      const Panels kt = pack_transposed(vk.at(b, h), vk.s2, s, kt_buf);
      const Panels vp = pack_straight(vv.at(b, h), vv.s2, s, v_buf);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = vq.at(b, h, g);
        float* og = vo.at(b, h, g);
        float* lg = vl.at(b, h, g);
        for (int64_t t0 = 0; t0 < T; t0 += kRows) {
          const int64_t t1 = std::min(T, t0 + kRows);
          auto shift_by_max = [&](int64_t t, const float* x, int64_t n) {
            return lg[t] = row_max(x, n) * exp_scale;
          };
          const int64_t k0 =
              block_probs(gemm, s, first, scale, softcap, qg, vq.s3, kt, t0, t1, S, nullptr, shift_by_max, sums);
          if (drop.active())  // the sums stay those of every probability: dropout follows the softmax
            for (int64_t t = t0; t < t1; ++t)
              drop.apply(S + (t - t0) * s.ld, b, h * G + g, t, first[t], t + 1, k0);
          gemm(t1 - t0, D, t1 - k0, rows_of(S, s.ld), {vp.at(0, k0), vp.stride}, og + t0 * vo.s3, vo.s3, false);
          for (int64_t t = t0; t < t1; ++t) {
            const float inv = 1.0f / sums[t - t0];
            float* o = og + t * vo.s3;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
            lg[t] += std::log(sums[t - t0]);
          }
        }
      }
    });
    ctx->saved_data["scale"] = scale_d;
    ctx->saved_data["dropout"] = dropout;
    ctx->saved_data["softcap"] = softcap_d;
    ctx->save_for_backward({q, k, v, first_keys, out, lse, dropout_seeds});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &first_keys = saved[3], &out = saved[4],
                     &lse = saved[5];
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const float softcap = static_cast<float>(ctx->saved_data["softcap"].toDouble());
    const DropMask drop(ctx->saved_data["dropout"].toDouble(), saved[6]);
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
    at::Tensor dout = last_dim_contiguous(grads[0]);
    // Like q, k, v: the last dimension contiguous (empty_like keeps a dense layout, else
    // makes a contiguous one).
    at::Tensor dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const Scratch s(T, D, softcap > 0);
    const View vq(q), vk(k), vv(v), vo(out), vl(lse), vdo(dout), vdq(dq), vdk(dk), vdv(dv);
    const GemmFn gemm = gemm_kernel();
    for_each_kv_head(B, Hkv, s.backward_floats(), q.options(), [&](int64_t b, int64_t h, float* kt_buf) {
      float* vt_buf = kt_buf + s.transposed();
      float* k_buf = vt_buf + s.transposed();
      float* P = k_buf + s.straight();
      float* dP = P + s.scores();
      float* rows_buf = dP + s.scores();
      float* TH = s.capped ? rows_buf + s.block_rows() : nullptr;  // the capped scores' tanh
      const int64_t* first = first_keys.data_ptr<int64_t>() + b * T;
      const Panels kt = pack_transposed(vk.at(b, h), vk.s2, s, kt_buf);
      const Panels vt = pack_transposed(vv.at(b, h), vv.s2, s, vt_buf);
      const Panels kp = pack_straight(vk.at(b, h), vk.s2, s, k_buf);
      float* dkh = vdk.at(b, h);
      float* dvh = vdv.at(b, h);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = vq.at(b, h, g);
        const float* og = vo.at(b, h, g);
        const float* dog = vdo.at(b, h, g);
        const float* lg = vl.at(b, h, g);
        float* dqg = vdq.at(b, h, g);
        for (int64_t t0 = 0; t0 < T; t0 += kRows) {
          const int64_t t1 = std::min(T, t0 + kRows), bt = t1 - t0;
          auto saved_lse = [&](int64_t t, const float*, int64_t) { return lg[t]; };
          const int64_t k0 =
              block_probs(gemm, s, first, scale, softcap, qg, vq.s3, kt, t0, t1, P, TH, saved_lse, nullptr);
          const int64_t tk = t1 - k0;
          const float* dob = dog + t0 * vdo.s3;
          const Panels dop = pack_panels(dob, vdo.s3, 1, bt, D, bt, rows_buf);
          // dP = dO V^T, then per row dS = P (dP - rowsum(dO O)) scale into dP. With dropout's
          // kept mask Z (scaled by 1/(1-p)), O = (P Z) V: dS = P (Z dP - rowsum(dO O)) scale,
          // and P becomes P Z for dV. Soft-capping multiplies dS by cap tanh(u)'s derivative
          // in the scores, 1 - tanh(u)^2 (the scale is already in dS).
          gemm(bt, tk, D, rows_of(dob, vdo.s3), {vt.at(k0 / kLanes, 0), vt.stride}, dP, s.ld, false);
          for (int64_t i = 0; i < bt; ++i) {
            const float dl = row_dot(dob + i * vdo.s3, og + (t0 + i) * vo.s3, D);
            float* p = P + i * s.ld;
            float* dp = dP + i * s.ld;
            if (drop.active())
              drop.backward(p, dp, dl, scale, b, h * G + g, t0 + i, first[t0 + i], t0 + i + 1, k0, tk);
            else
              for (int64_t j = 0; j < tk; ++j) dp[j] = p[j] * (dp[j] - dl) * scale;
            if (TH != nullptr) {
              const float* th = TH + i * s.ld;
              const int64_t lo = first[t0 + i] - k0, hi = t0 + i - k0 + 1;  // dp is 0 outside
              for (int64_t j = lo; j < hi; ++j) dp[j] *= 1.0f - th[j] * th[j];
            }
          }
          // dV += P^T dO;  dQ = dS K;  dK += dS^T Q
          gemm(tk, D, bt, columns_of(P, s.ld), dop, dvh + k0 * vdv.s2, vdv.s2, true);
          gemm(bt, D, tk, rows_of(dP, s.ld), {kp.at(0, k0), kp.stride}, dqg + t0 * vdq.s3, vdq.s3, false);
          const Panels qp = pack_panels(qg + t0 * vq.s3, vq.s3, 1, bt, D, bt, rows_buf);
          gemm(tk, D, bt, columns_of(dP, s.ld), qp, dkh + k0 * vdk.s2, vdk.s2, true);
        }
      }
    });
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

namespace {

bool dtypes_and_devices_fit(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg) {
  for (const at::Tensor* t : {&q, &k, &v})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat) return false;
  return seg.device().is_cpu();
}

// first[b][t]: the first key query t may see, keys first..t: the start of its segment's run,
// or of its sliding window. Undefined when a segment id comes back after another one (its
// keys would not be one range).
at::Tensor first_keys(const at::Tensor& segment_ids, int64_t window) {
  at::Tensor seg = segment_ids.to(at::kLong).contiguous();
  const int64_t B = seg.size(0), T = seg.size(1);
  at::Tensor first = at::empty({B, T}, seg.options());
  const int64_t* s = seg.data_ptr<int64_t>();
  int64_t* f = first.data_ptr<int64_t>();
  std::unordered_set<int64_t> ended;
  for (int64_t b = 0; b < B; ++b, s += T, f += T) {
    ended.clear();
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && s[t] != s[t - 1]) {
        if (!ended.insert(s[t - 1]).second || ended.count(s[t]) != 0) return at::Tensor();
        start = t;
      }
      f[t] = window > 0 ? std::max(start, t - window + 1) : start;
    }
  }
  return first;
}

}  // namespace

int64_t fused_cpu_attention_scratch_bytes(int64_t T, int64_t D, bool softcap) {
  return Scratch(T, D, softcap).backward_floats() * static_cast<int64_t>(sizeof(float));
}

bool fused_cpu_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& segment_ids) {
  return dtypes_and_devices_fit(q, k, v, segment_ids) && first_keys(segment_ids, 0).defined();
}

at::Tensor fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& segment_ids, double scale, int64_t sliding_window,
                               const AttentionDropout& dropout, double softcap) {
  if (!dtypes_and_devices_fit(q, k, v, segment_ids)) return at::Tensor();
  at::Tensor first = first_keys(segment_ids, sliding_window);
  if (!first.defined()) return at::Tensor();
  at::Tensor seeds = dropout.active() ? dropout.seeds.to(at::kCPU).to(at::kLong).contiguous() : at::zeros({0}, first.options());
  if (dropout.active())
    MEMTUNE_INTERNAL_ASSERT(seeds.numel() == q.size(0), "attention dropout: ", seeds.numel(), " seeds for ", q.size(0),
                            " rows");
  return FusedCpuAttention::apply(q, k, v, first, scale, sliding_window, dropout.active() ? dropout.p : 0.0, seeds,
                                  softcap);
}

}  // namespace memtune::models::detail
