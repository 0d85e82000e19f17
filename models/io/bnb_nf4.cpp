#include "models/io/bnb_nf4.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune {

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "NaN";  // json.dumps spellings
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0.0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's repr layout: fixed for 1e-4 <= |v| < 1e16.
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  const bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  const size_t epos = s.find('e');
  const int exp = std::atoi(s.c_str() + epos + 1);
  std::string digits;
  for (size_t i = 0; i < epos; ++i)
    if (s[i] != '.') digits += s[i];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += e;
  } else if (exp < 0) {
    out = "0." + std::string(-exp - 1, '0') + digits;
  } else if (static_cast<int>(digits.size()) <= exp + 1) {
    out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
  }
  return neg ? "-" + out : out;
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string state_suffix(QuantType t) { return std::string(".quant_state.bitsandbytes__") + quant_type_name(t); }

std::string json_state(const NF4Tensor& q) {
  // Key order and separators of json.dumps(QuantState.as_dict(packed=True)'s non-tensor items).
  std::string s = std::string("{\"quant_type\": \"") + quant_type_name(q.quant_type) +
                  "\", \"blocksize\": " + std::to_string(q.blocksize) + ", \"dtype\": \"" + nf4_dtype_name(q.dtype) +
                  "\", \"shape\": [";
  for (size_t i = 0; i < q.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(q.shape[i]);
  s += "]";
  if (q.double_quant) {
    s += ", \"nested_blocksize\": " + std::to_string(kNf4NestedBlocksize) +
         ", \"nested_dtype\": \"float32\", \"nested_offset\": " + python_float_repr(q.nested_offset);
  }
  return s + "}";
}

at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::TensorOptions(at::kByte));
  std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
  return t;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> nf4_to_bnb(const std::string& weight_name, const NF4Tensor& q) {
  check_nf4_state(q);
  const std::string& w = weight_name;
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back(w, q.packed.view({-1, 1}));
  out.emplace_back(w + ".absmax", q.absmax);
  const auto& codebook = codebook_4bit(q.quant_type);
  out.emplace_back(w + ".quant_map",
                   at::tensor(std::vector<float>(codebook.begin(), codebook.end()),
                              q.packed.options().dtype(at::kFloat)));
  if (q.double_quant) {
    out.emplace_back(w + ".nested_absmax", q.nested_absmax);
    out.emplace_back(w + ".nested_quant_map", q.nested_quant_map);
  }
  out.emplace_back(w + state_suffix(q.quant_type), bytes_tensor(json_state(q)).to(q.device()));
  return out;
}

bool is_bnb_4bit(const std::vector<std::string>& keys, const std::string& weight_name) {
  for (QuantType t : {QuantType::kNF4, QuantType::kFP4})
    if (std::find(keys.begin(), keys.end(), weight_name + state_suffix(t)) != keys.end()) return true;
  return false;
}

NF4Tensor nf4_from_bnb(const std::function<at::Tensor(const std::string&)>& get, const std::string& weight_name) {
  const std::string& w = weight_name;
  auto need = [&](const std::string& key) {
    at::Tensor t = get(key);
    MEMTUNE_CHECK(t.defined(), "bitsandbytes state of '", w, "': key '", key,
                  "' is missing; the checkpoint is incomplete or not a bitsandbytes 4-bit one");
    return t;
  };
  // The state's key names the quant type (QuantState.as_dict: "quant_state.bitsandbytes__" + type).
  const std::string nf4_key = w + state_suffix(QuantType::kNF4), fp4_key = w + state_suffix(QuantType::kFP4);
  at::Tensor nf4_state = get(nf4_key), fp4_state = get(fp4_key);
  MEMTUNE_CHECK(!(nf4_state.defined() && fp4_state.defined()), "bitsandbytes state of '", w, "' is both '", nf4_key,
                "' and '", fp4_key, "'; a weight has one quant type");
  const QuantType key_type = fp4_state.defined() ? QuantType::kFP4 : QuantType::kNF4;
  const std::string state_key = key_type == QuantType::kFP4 ? fp4_key : nf4_key;
  at::Tensor state = key_type == QuantType::kFP4 ? fp4_state : need(nf4_key);
  state = state.to(at::kCPU).contiguous();
  MEMTUNE_CHECK(state.scalar_type() == at::kByte, "bitsandbytes state '", state_key, "' has dtype ",
                state.scalar_type(), ", expected uint8 bytes of JSON");
  const std::string text(reinterpret_cast<const char*>(state.data_ptr<uint8_t>()), state.numel());
  check_json_depth(text, str_cat("bitsandbytes state '", state_key, "'"));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  MEMTUNE_CHECK(j.is_object(), "bitsandbytes state '", state_key, "' is not a JSON object: '", text, "'");
  auto field = [&](const char* k) -> const nlohmann::json& {
    MEMTUNE_CHECK(j.contains(k), "bitsandbytes state '", state_key, "' lacks field '", k, "': ", text);
    return j.at(k);
  };
  MEMTUNE_CHECK(field("quant_type") == quant_type_name(key_type), "bitsandbytes state '", state_key,
                "' has quant_type ", field("quant_type").dump(), "; its key says ", quant_type_name(key_type));

  NF4Tensor q;
  q.quant_type = key_type;
  const auto& bs = field("blocksize");
  MEMTUNE_CHECK(bs.is_number_integer(), "bitsandbytes state '", state_key, "': blocksize ", bs.dump(), " is not an integer");
  q.blocksize = bs.get<int64_t>();
  MEMTUNE_CHECK(q.blocksize >= 32 && q.blocksize <= 4096 && (q.blocksize & (q.blocksize - 1)) == 0,
                "bitsandbytes state '", state_key, "': blocksize ", q.blocksize, " is not a power of two in [32, 4096]");
  const std::string dt = field("dtype").is_string() ? field("dtype").get<std::string>() : field("dtype").dump();
  if (dt == "float32") q.dtype = at::kFloat;
  else if (dt == "float16") q.dtype = at::kHalf;
  else if (dt == "bfloat16") q.dtype = at::kBFloat16;
  else memtune::fail("bitsandbytes state '", state_key, "': dtype '", dt, "' is not float32, float16 or bfloat16");
  const auto& shape = field("shape");
  MEMTUNE_CHECK(shape.is_array(), "bitsandbytes state '", state_key, "': shape ", shape.dump(), " is not a list");
  for (const auto& d : shape) {
    MEMTUNE_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, "bitsandbytes state '", state_key, "': shape ",
                  shape.dump(), " holds a non-integer or negative size");
    q.shape.push_back(d.get<int64_t>());
  }
  const int64_t n = q.numel(), nb = q.nblocks();

  at::Tensor packed = need(w);
  if (packed.scalar_type() != at::kByte) packed = packed.contiguous().view({-1}).view(at::kByte);  // quant_storage
  MEMTUNE_CHECK(packed.numel() == ceil_div(n, 2), "bitsandbytes weight '", w, "' has ", packed.numel(),
                " bytes but its shape ", shape.dump(), " needs ", ceil_div(n, 2));
  q.packed = packed.contiguous().view({-1});

  at::Tensor qmap = need(w + ".quant_map").to(at::kCPU, at::kFloat).contiguous();
  const auto& codebook = codebook_4bit(key_type);
  bool is_codebook = qmap.numel() == 16;
  for (int64_t i = 0; is_codebook && i < 16; ++i) is_codebook = qmap.data_ptr<float>()[i] == codebook[i];
  MEMTUNE_CHECK(is_codebook, "bitsandbytes '", w, ".quant_map' is not the ", quant_type_name(key_type),
                " codebook (", qmap.numel(), " values); the weight was quantized with another 4-bit type");

  q.double_quant = j.contains("nested_offset") || get(w + ".nested_absmax").defined();
  at::Tensor absmax = need(w + ".absmax").contiguous().view({-1});
  MEMTUNE_CHECK(absmax.numel() == nb, "bitsandbytes '", w, ".absmax' has ", absmax.numel(), " entries; shape ",
                shape.dump(), " with blocksize ", q.blocksize, " has ", nb, " blocks");
  if (!q.double_quant) {
    MEMTUNE_CHECK(absmax.scalar_type() == at::kFloat, "bitsandbytes '", w, ".absmax' has dtype ",
                  absmax.scalar_type(), " without double quantization; expected float32");
    q.absmax = absmax;
    return q;
  }
  MEMTUNE_CHECK(absmax.scalar_type() == at::kByte, "bitsandbytes '", w, ".absmax' has dtype ", absmax.scalar_type(),
                " with double quantization; expected uint8 codes");
  q.absmax = absmax;
  MEMTUNE_CHECK(field("nested_blocksize") == kNf4NestedBlocksize, "bitsandbytes state '", state_key,
                "': nested_blocksize ", field("nested_blocksize").dump(), " is not 256");
  MEMTUNE_CHECK(field("nested_dtype") == "float32", "bitsandbytes state '", state_key, "': nested_dtype ",
                field("nested_dtype").dump(), " is not \"float32\"");
  MEMTUNE_CHECK(field("nested_offset").is_number(), "bitsandbytes state '", state_key, "': nested_offset ",
                field("nested_offset").dump(), " is not a number");
  q.nested_offset = static_cast<float>(field("nested_offset").get<double>());
  q.nested_absmax = need(w + ".nested_absmax").contiguous().view({-1});
  MEMTUNE_CHECK(q.nested_absmax.scalar_type() == at::kFloat && q.nested_absmax.numel() == ceil_div(nb, kNf4NestedBlocksize),
                "bitsandbytes '", w, ".nested_absmax' is ", q.nested_absmax.scalar_type(), " [", q.nested_absmax.numel(),
                "], expected float32 [", ceil_div(nb, kNf4NestedBlocksize), "]");
  q.nested_quant_map = need(w + ".nested_quant_map").contiguous().view({-1});
  MEMTUNE_CHECK(q.nested_quant_map.scalar_type() == at::kFloat && q.nested_quant_map.numel() == 256, "bitsandbytes '",
                w, ".nested_quant_map' is ", q.nested_quant_map.scalar_type(), " [", q.nested_quant_map.numel(),
                "], expected float32 [256]");
  return q;
}

}  // namespace memtune
