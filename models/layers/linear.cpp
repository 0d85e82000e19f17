#include "models/layers/linear.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/layers/dora.h"
#include "models/layers/linear4bit.h"
#include "models/layers/linear8bit.h"
#include "models/layers/lora_linear.h"
#include "runtime/error.h"
#include "runtime/int8.h"
#include "runtime/keyed_dropout.h"
#include "runtime/nf4.h"
#include "runtime/step_profiler.h"

namespace memtune::models {

namespace {

// GPT-2's Conv1D: x @ W + b with W [in, out], the rows as one matrix and the bias added inside
// the GEMM (transformers' addmm: one rounding in 16-bit dtypes).
at::Tensor conv1d(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(1);
  return (b.defined() ? at::addmm(b, x2, w) : at::mm(x2, w)).view(sizes);
}

// A dense weight whose products run in another dtype (an fp32 model computing in bf16 or
// fp16): cast for the forward's product and again for backward's, so that no cast copy lives
// between them. Under at::linear autograd keeps the copy it multiplied by: a second copy of
// every weight of the model, in the compute dtype, from forward to backward. A trained weight
// keeps the (compute-dtype) input for its gradient, as at::linear does, and gets that gradient
// in its own dtype, as autograd's cast gives it. x and b are in the compute dtype; the products
// are at::linear's (Conv1D: x @ W + b). The bias travels as an optional: LibTorch 1.13's
// Function::apply rejects undefined tensors.
struct CastLinear : public torch::autograd::Function<CastLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& b_opt, const at::Tensor& weight, bool fan_in_fan_out) {
    const at::Tensor b = b_opt.has_value() ? *b_opt : at::Tensor();
    if (weight.requires_grad())
      ctx->save_for_backward({weight, x});
    else
      ctx->save_for_backward({weight});
    ctx->saved_data["fan_in_fan_out"] = fan_in_fan_out;
    ctx->saved_data["has_bias"] = b.defined();
    const at::Tensor w = weight.to(x.scalar_type());
    return fan_in_fan_out ? conv1d(x, w, b) : at::linear(x, w, b);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[0];
    const at::Tensor w = weight.to(g.scalar_type());
    const bool fan_in_fan_out = ctx->saved_data["fan_in_fan_out"].toBool();
    at::Tensor dx = ctx->needs_input_grad(0) ? at::matmul(g, fan_in_fan_out ? w.t() : w) : at::Tensor();
    // Edges exist only for tensor inputs: x, then the bias when given, then the weight.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor g2 = g.reshape({-1, g.size(-1)});
    at::Tensor db = has_bias && ctx->needs_input_grad(1) ? g2.sum(0) : at::Tensor();
    at::Tensor dw;
    if (saved.size() > 1 && ctx->needs_input_grad(has_bias ? 2 : 1)) {
      const at::Tensor x2 = saved[1].reshape({-1, saved[1].size(-1)});
      dw = (fan_in_fan_out ? at::mm(x2.t(), g2) : at::mm(g2.t(), x2)).to(weight.scalar_type());
    }
    return {dx, db, dw, at::Tensor()};
  }
};

// "memtune::" and the name's last two parts that are not layer numbers, the same for every
// layer's projection of a kind: "model.layers.3.self_attn.q_proj" -> "memtune::self_attn.q_proj".
std::string profile_scope(const std::string& name) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= name.size()) {
    const size_t dot = std::min(name.find('.', start), name.size());
    const std::string part = name.substr(start, dot - start);
    if (!part.empty() && part.find_first_not_of("0123456789") != std::string::npos) parts.push_back(part);
    start = dot + 1;
  }
  std::string scope = "memtune::";
  const size_t first = parts.size() > 2 ? parts.size() - 2 : 0;
  for (size_t k = first; k < parts.size(); ++k) scope += (k > first ? "." : "") + parts[k];
  return scope;
}

}  // namespace

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

Linear::Linear(std::string name, int64_t in_features, int64_t out_features, bool has_bias,
               bool fan_in_fan_out)
    : name_(std::move(name)),
      in_(in_features),
      out_(out_features),
      fan_in_fan_out_(fan_in_fan_out),
      has_bias_(has_bias),
      dropout_site_(dropout_site(name_)),
      profile_scope_(profile_scope(name_)) {}

at::Tensor Linear::forward(const at::Tensor& x, bool training) const {
  MEMTUNE_PROFILE_SCOPE(profile_scope_.c_str());
  if (lora && lora->dora()) return forward_dora(x, training);
  const bool cast_adapter = adapter_autocasts();
  // PEFT drops the adapter's input after taking it to the adapter's (fp32) dtype; autocast
  // then casts the dropped input for the product.
  auto adapter_input = [&]() {
    at::Tensor h = x.to(lora->A.scalar_type());
    if (training && lora->dropout > 0) h = keyed_dropout(h, lora->dropout, dropout_site_);
    return cast_adapter ? h.to(compute_dtype) : h;
  };

  // A LoRA adapter on a frozen base whose product runs in the input's dtype, the adapter in
  // that dtype or in fp32 (a bf16 or fp16 model): one node (models/layers/lora_linear.h).
  // Otherwise: the base, then the adapter added.
  const bool frozen_base = qweight_ || !weight.requires_grad();
  if (lora && frozen_base && !int8() && x.scalar_type() == compute_dtype &&
      (lora->A.scalar_type() == compute_dtype || lora->A.scalar_type() == at::kFloat) &&
      (!bias.defined() || bias.scalar_type() == compute_dtype) &&
      (qweight_ || weight.scalar_type() == compute_dtype)) {
    at::Tensor h = training && lora->dropout > 0 ? adapter_input() : at::Tensor();
    FrozenWeight w{qweight_ ? at::Tensor() : (fan_in_fan_out_ ? weight.t() : weight), qweight_};
    return lora_linear(x, h, w, bias, lora->A, lora->B, lora->scaling, Nf4MatmulPath::kAuto, cast_adapter);
  }
  at::Tensor y = base_product(x, training);
  if (!lora) return y.to(x.scalar_type());
  // Under autocast the adapter alone as lora_linear's node, in compute_dtype, and its sum
  // with the base's output there too (PEFT's `result + lora_B(lora_A(x)) * scaling` under
  // it); its input a cast of its own, as autocast's for each op, so the two paths' gradients
  // reach x each in x's dtype and are summed there. Otherwise in fp32, the adapters' dtype
  // whatever the compute dtype (fp16 gradients could not be unscaled).
  if (cast_adapter) {
    const at::Tensor delta = lora_linear(adapter_input(), {}, FrozenWeight{}, {}, lora->A, lora->B, lora->scaling,
                                         Nf4MatmulPath::kAuto, true);
    return (y + delta).to(x.scalar_type());
  }
  at::Tensor delta = at::linear(at::linear(adapter_input(), lora->A), lora->B) * lora->scaling;
  y = y.to(x.scalar_type());
  return y + delta.to(y.scalar_type());
}

at::Tensor Linear::module_bias() const {
  if (!bias.defined() || !bias.requires_grad() || int8()) return bias;
  const at::ScalarType home = qweight_ ? qweight_->dtype : weight.scalar_type();
  return bias.scalar_type() == home ? bias : bias.to(home);
}

bool Linear::adapter_autocasts() const {
  return lora && autocast && compute_dtype != at::kFloat && lora->A.scalar_type() == at::kFloat;
}

at::Tensor Linear::base_product(const at::Tensor& x, bool training) const {
  if (int8()) {
    // Linear8bitLt multiplies in the input's dtype (an autocast region's for F.linear and
    // addmm), whatever bnb_4bit_compute_dtype says.
    return linear8bit(x, Int8Weight{weight, weight_absmax, int8_threshold}, bias, training,
                      autocast && compute_dtype != x.scalar_type() ? compute_dtype : at::ScalarType::Undefined);
  }
  const at::Tensor xc = x.to(compute_dtype);
  const at::Tensor b = bias.defined() ? bias.to(compute_dtype) : bias;
  if (qweight_) return linear4bit(xc, qweight_, b, compute_dtype);
  if (weight.scalar_type() != compute_dtype && at::GradMode::is_enabled()) {
    c10::optional<at::Tensor> b_opt;
    if (b.defined()) b_opt = b;
    return CastLinear::apply(xc, b_opt, weight, fan_in_fan_out_);
  }
  const at::Tensor w = weight.to(compute_dtype);
  return fan_in_fan_out_ ? conv1d(xc, w, b) : at::linear(xc, w, b);
}

at::Tensor Linear::weight_rows_fp32(int64_t r0, int64_t n) const {
  if (qweight_) {
    // PEFT's dequantize_module_weight: bitsandbytes' dequantize_4bit, in the dtype the weight
    // was quantized from (quant_state.dtype), then taken to the adapter input's fp32.
    if (qweight_->device().is_cpu()) {
      at::Tensor out = at::empty({n * in_}, at::TensorOptions().dtype(qweight_->dtype));
      nf4_dequantize_range_into(*qweight_, r0 * in_, n * in_, out);
      return out.view({n, in_}).to(at::kFloat);
    }
    return nf4_dequantize(*qweight_, qweight_->dtype).narrow(0, r0, n).to(at::kFloat);
  }
  MEMTUNE_INTERNAL_ASSERT(!int8(), name_, ": DoRA on an 8-bit weight");
  const at::Tensor w = fan_in_fan_out_ ? weight.detach().t() : weight.detach();
  return w.narrow(0, r0, n).to(at::kFloat);
}

at::Tensor Linear::dora_weight_norm() const {
  MEMTUNE_INTERNAL_ASSERT(lora, name_, ": dora_weight_norm without an adapter");
  at::Tensor whole;  // a 4-bit weight on a GPU: dequantized once for every block
  auto rows = [&](int64_t r0, int64_t n) {
    if (qweight_ && !qweight_->device().is_cpu()) {
      if (!whole.defined()) whole = weight_rows_fp32(0, out_);
      return whole.narrow(0, r0, n);
    }
    return weight_rows_fp32(r0, n);
  };
  // Autocast forms B A from 16-bit copies, as its F.linear would (PEFT's lora_B(lora_A(eye))).
  return models::dora_weight_norm(rows, out_, lora->A, lora->B, lora->scaling,
                                  adapter_autocasts() ? compute_dtype : lora->A.scalar_type());
}

at::Tensor Linear::forward_dora(const at::Tensor& x, bool training) const {
  const LoraAdapter& a = *lora;
  // Under autocast every product of the adapter runs on 16-bit copies of its operands.
  const bool cast = adapter_autocasts();
  const at::ScalarType pd = cast ? compute_dtype : a.A.scalar_type();
  const bool dropped = training && a.dropout > 0;
  const at::Tensor scale = (a.magnitude / dora_weight_norm()).view({1, -1});  // m / n, n detached
  // In fp32 without dropout, PEFT's result + (m/n - 1) x W^T + (m/n) s (x A^T) B^T is
  // m/n (x W^T + s (x A^T) B^T) + b: LoRA's one node (models/layers/lora_linear.h) and one
  // scaling, equal to fp32 rounding, keeping one [rows, out] tensor where the sum keeps two.
  const bool fp32 = x.scalar_type() == at::kFloat && compute_dtype == at::kFloat && a.A.scalar_type() == at::kFloat &&
                    !int8() && (qweight_ || weight.scalar_type() == at::kFloat) &&
                    (!bias.defined() || bias.scalar_type() == at::kFloat);
  if (fp32 && !dropped) {
    const FrozenWeight w{qweight_ ? at::Tensor() : (fan_in_fan_out_ ? weight.t() : weight), qweight_};
    const at::Tensor z = lora_linear(x, at::Tensor(), w, at::Tensor(), a.A, a.B, a.scaling) * scale;
    return bias.defined() ? z + bias : z;
  }
  const at::Tensor y = base_product(x, training);
  // PEFT's `result`: the base layer's output, in x's dtype (bitsandbytes' layers give it so,
  // and every layer outside autocast) or, for a dense layer under autocast, in autocast's.
  const at::Tensor result = qweight_ || !cast ? y.to(x.scalar_type()) : y;
  // The adapter's input in its own dtype, dropped in training (PEFT: _cast_input_dtype, then
  // dropout), in the products' dtype: x itself when it has that dtype and nothing drops it
  // (the casts there and back change no value), so that no copy of it is kept.
  const at::Tensor h = dropped ? keyed_dropout(x.to(a.A.scalar_type()), a.dropout, dropout_site_).to(pd) : x.to(pd);
  const at::Tensor lora_result = at::linear(at::linear(h, a.A.to(pd)), a.B.to(pd));
  at::Tensor base_result;  // x W^T without the bias
  if (!dropped) {
    base_result = bias.defined() ? result - module_bias() : result;
  } else if (qweight_) {  // the dropped input times W: PEFT's F.linear with the dequantized weight
    base_result = linear4bit(h, qweight_, at::Tensor(), pd);
  } else {
    base_result = at::linear(h, (fan_in_fan_out_ ? weight.t() : weight).to(pd));
  }
  const at::Tensor correction = (scale - 1) * base_result + scale * lora_result * a.scaling;
  return (result + correction).to(result.scalar_type()).to(x.scalar_type());
}

void Linear::quantize(int64_t blocksize, bool double_quant, QuantType quant_type) {
  if (qweight_) return;
  at::Tensor w = fan_in_fan_out_ ? weight.t().contiguous() : weight;  // bnb stores [out, in]
  qweight_ = std::make_shared<NF4Tensor>(nf4_quantize(w, blocksize, double_quant, name_, quant_type));
  weight = at::Tensor();
}

void Linear::quantize_int8(double threshold) {
  if (int8()) return;
  MEMTUNE_CHECK(!qweight_, name_, ": already 4-bit; 8-bit quantization reads a dense weight");
  const at::Tensor w = fan_in_fan_out_ ? weight.t().contiguous() : weight;  // bitsandbytes stores [out, in]
  Int8Rows q = int8_quantize_rows(w.detach(), name_);
  set_int8(std::move(q.codes), std::move(q.absmax), threshold);
}

void Linear::set_int8(at::Tensor codes, at::Tensor absmax, double threshold) {
  MEMTUNE_CHECK(codes.dim() == 2 && codes.size(0) == out_ && codes.size(1) == in_ && codes.scalar_type() == at::kChar,
                name_, ": 8-bit weight is ", codes.scalar_type(), " ", codes.sizes(), ", expected int8 [", out_, ", ",
                in_, "]");
  MEMTUNE_CHECK(absmax.dim() == 1 && absmax.size(0) == out_ && absmax.scalar_type() == at::kFloat, name_,
                ": the 8-bit weight's row absmax (SCB) is ", absmax.scalar_type(), " ", absmax.sizes(),
                ", expected float32 [", out_, "]");
  MEMTUNE_CHECK(threshold >= 0, name_, ": llm_int8_threshold is ", threshold, ", not >= 0");
  weight = std::move(codes);
  weight_absmax = std::move(absmax);
  int8_threshold = threshold;
}

void Linear::set_quantized(std::shared_ptr<const NF4Tensor> q) {
  MEMTUNE_CHECK(q->shape.size() == 2 && q->shape[0] == out_ && q->shape[1] == in_, name_,
                ": 4-bit weight has shape [", q->shape[0], ", ", q->shape.size() > 1 ? q->shape[1] : 0,
                "], expected [", out_, ", ", in_, "]");
  qweight_ = std::move(q);
  weight = at::Tensor();
}

at::Tensor Linear::dense_weight() const {
  if (qweight_) return nf4_dequantize(*qweight_, at::kFloat);
  if (int8()) return int8_dequantize(weight, weight_absmax, at::kFloat);
  at::Tensor w = weight.detach().to(at::kFloat);
  return fan_in_fan_out_ ? w.t().contiguous() : w.clone();
}

void Linear::add_lora(const LoraOptions& o) {
  MEMTUNE_CHECK(o.r > 0, name_, ": LoRA rank r must be positive, got ", o.r);
  auto adapter = std::make_unique<LoraAdapter>();
  adapter->A = at::empty({o.r, in_}, at::kFloat);
  if (o.init == "gaussian") {
    adapter->A.normal_(0.0, 1.0 / static_cast<double>(o.r));
  } else {
    // kaiming_uniform_(a=sqrt(5)) as nn.Linear and PEFT use: bound = 1/sqrt(fan_in).
    double bound = 1.0 / std::sqrt(static_cast<double>(in_));
    adapter->A.uniform_(-bound, bound);
  }
  adapter->B = at::zeros({out_, o.r}, at::kFloat);
  adapter->A.set_requires_grad(true);
  adapter->B.set_requires_grad(true);
  adapter->scaling = o.scaling();
  adapter->dropout = o.dropout;
  lora = std::move(adapter);
  if (o.use_dora) {
    // PEFT's DoraLinearLayer.update_layer: m = ||W + s B A||, B being zero here (the base's row norms).
    MEMTUNE_CHECK(!int8(), name_, ": DoRA (use_dora) on an 8-bit (load_in_8bit) weight is not supported; "
                  "use load_in_4bit or a dense base");
    // A weight another rank owns (not read here): NaN until its owner's norms arrive
    // (trainer/layer_shards.h share_dora_magnitudes).
    lora->magnitude = weight_loaded() ? dora_weight_norm() : at::full({out_}, NAN, at::kFloat);
    lora->magnitude.set_requires_grad(true);
  }
}

bool Linear::weight_loaded() const {
  if (qweight_) return !qweight_->packed.is_meta();
  return weight.defined() && !weight.is_meta();
}

void Linear::merge_lora() {
  if (!lora) return;
  at::NoGradGuard no_grad;
  const at::Tensor delta = at::matmul(lora->B.to(at::kFloat), lora->A.to(at::kFloat)) * lora->scaling;  // [out, in]
  // The merged weight [out, in] in fp32: W + delta, or DoRA's (m / ||W + delta||) (W + delta)
  // with the norm over each row (PEFT's DoraLinearVariant.merge).
  auto merged = [&](const at::Tensor& w) {
    at::Tensor sum = w + delta;
    if (!lora->dora()) return sum;
    const at::Tensor norm = at::linalg_vector_norm(sum, 2, at::IntArrayRef{1}, false, c10::nullopt);
    return sum * (lora->magnitude.detach().to(at::kFloat) / norm).view({-1, 1});
  };
  if (qweight_ || int8()) {  // a quantized base becomes dense fp32
    weight = merged(dense_weight().to(delta.device()));
    if (fan_in_fan_out_) weight = weight.t().contiguous();
    qweight_.reset();
    weight_absmax = at::Tensor();
  } else {
    const at::Tensor w = weight.to(at::kFloat);
    weight = (fan_in_fan_out_ ? merged(w.t()).t() : merged(w)).contiguous().to(weight.scalar_type());
  }
  lora.reset();
}

int64_t Linear::base_storage_bytes() const {
  int64_t b = bias.defined() ? bias.numel() * static_cast<int64_t>(bias.element_size()) : 0;
  if (qweight_) return b + qweight_->storage_bytes();
  if (int8()) return b + int8_storage_bytes(out_, in_);
  return b + (weight.defined() ? weight.numel() * static_cast<int64_t>(weight.element_size()) : 0);
}

}  // namespace memtune::models
