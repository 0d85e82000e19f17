#pragma once
// JSON that comes from outside (safetensors headers and indexes, config.json,
// tokenizer.json, adapter_config.json, state.json, data rows) is parsed through here.
// nlohmann::json recurses when it copies, prints or destroys a value, so a file of deeply
// nested brackets (100k levels fit in 200 KB) would overflow the stack; the nesting depth
// is bounded before anything recurses, at 128 levels as the safetensors reference
// implementation's parser bounds it. No file memtune reads nests deeper than 10.
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace memtune {

inline constexpr int kMaxJsonDepth = 128;

// Throws UserError naming `origin` when `text` nests arrays/objects deeper than
// kMaxJsonDepth (brackets inside strings do not count). One pass, no allocation.
void check_json_depth(std::string_view text, std::string_view origin);

// check_json_depth, then parse; invalid JSON is a UserError "<origin>: not valid JSON (...)".
nlohmann::json parse_json(std::string_view text, std::string_view origin);

// Fields of JSON that memtune wrote and reads back (a checkpoint's state.json): each is
// required, of its type and in its range, or a UserError names `where`.key, the value
// seen and what was expected. A damaged file never reaches the arithmetic.
int64_t json_int(const nlohmann::json& obj, std::string_view key, int64_t lo, int64_t hi, std::string_view where);
double json_number(const nlohmann::json& obj, std::string_view key, double lo, double hi, std::string_view where);
const nlohmann::json& json_field(const nlohmann::json& obj, std::string_view key, std::string_view where);

}  // namespace memtune
