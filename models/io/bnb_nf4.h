#pragma once
// bitsandbytes' state-dict layout of a 4-bit (NF4 or FP4) weight (Linear4bit's checkpoint
// format, as in "-bnb-4bit" models on the Hugging Face hub), written and read byte for byte.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "runtime/nf4.h"

namespace memtune {

// bitsandbytes' state-dict entries for a weight named e.g.
// "model.layers.0.self_attn.q_proj.weight": the weight itself (uint8 [ceil(n/2), 1]),
// .absmax, .quant_map, [.nested_absmax, .nested_quant_map], and
// .quant_state.bitsandbytes__nf4 or __fp4 (uint8 bytes of the JSON that
// QuantState.as_dict(packed=True) writes, field order and number format as Python's json.dumps).
std::vector<std::pair<std::string, at::Tensor>> nf4_to_bnb(const std::string& weight_name,
                                                           const NF4Tensor& q);

// Reads the entries nf4_to_bnb writes (or bitsandbytes wrote); `get` returns the tensor of
// a key, or an undefined tensor when the key is absent. Throws UserError naming the key on
// missing entries, a quant type or quant_map other than the state key's, and sizes that do
// not agree with the JSON state.
NF4Tensor nf4_from_bnb(const std::function<at::Tensor(const std::string&)>& get,
                       const std::string& weight_name);

// True when `keys` hold bitsandbytes' 4-bit state (NF4 or FP4) for weight_name.
bool is_bnb_4bit(const std::vector<std::string>& keys, const std::string& weight_name);

// Python's repr() of a double (shortest round-trip digits), as json.dumps writes floats.
std::string python_float_repr(double v);

}  // namespace memtune
