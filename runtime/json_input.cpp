#include "runtime/json_input.h"

#include "runtime/error.h"

namespace memtune {

void check_json_depth(std::string_view text, std::string_view origin) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      MEMTUNE_CHECK(++depth <= kMaxJsonDepth, origin, ": JSON nested more than ", kMaxJsonDepth,
                    " levels deep (at byte ", i, "); the file is damaged or not what it claims to be");
    } else if (ch == ']' || ch == '}') {
      --depth;  // unbalanced brackets are the parser's to report
    }
  }
}

nlohmann::json parse_json(std::string_view text, std::string_view origin) {
  check_json_depth(text, origin);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 6E88888
    fail(origin, ": not valid JSON (", e.what(), ")");
  }
}

const nlohmann::json& json_field(const nlohmann::json& obj, std::string_view key, std::string_view where) {
  MEMTUNE_CHECK(obj.is_object(), where, " is ", obj.dump(), "; expected an object");
  const auto it = obj.find(std::string(key));
  MEMTUNE_CHECK(it != obj.end(), where, ": key '", key, "' is missing (keys present: ", obj.dump().substr(0, 200), ")");
  return *it;
}

int64_t json_int(const nlohmann::json& obj, std::string_view key, int64_t lo, int64_t hi, std::string_view where) {
  const nlohmann::json& v = json_field(obj, key, where);
  bool ok = false;  // nlohmann keeps non-negative integers unsigned: compare without wrapping
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = hi >= 0 && u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
  } else if (v.is_number_integer()) {
    ok = v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  }
  MEMTUNE_CHECK(ok, where, ".", key, " is ", v.dump(), "; expected an integer in ", lo, "..", hi);
  return v.get<int64_t>();
}

double json_number(const nlohmann::json& obj, std::string_view key, double lo, double hi, std::string_view where) {
  const nlohmann::json& v = json_field(obj, key, where);
  MEMTUNE_CHECK(v.is_number() && v.get<double>() >= lo && v.get<double>() <= hi, where, ".", key, " is ", v.dump(),
                "; expected a number in ", lo, "..", hi);
  return v.get<double>();
}

}  // namespace memtune
