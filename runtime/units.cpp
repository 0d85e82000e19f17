#include "runtime/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>

#include "runtime/error.h"

namespace memtune {

int64_t SizeSpec::resolve(int64_t reference_bytes) const {
  if (fraction > 0) return static_cast<int64_t>(fraction * static_cast<double>(reference_bytes));
  return bytes;
}

SizeSpec parse_size(const std::string& text, const std::string& where) {
  const std::string hint = " (write e.g. 6GiB, 512MiB, 2GB, 1048576, or a fraction like 0.9)";
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t num_start = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.' ||
                             text[i] == 'e' || text[i] == 'E' || text[i] == '+' || text[i] == '-'))
    ++i;
  MEMTUNE_CHECK(i > num_start, where, ": '", text, "' is not a size", hint);
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(text.substr(num_start, i - num_start), &used);
    MEMTUNE_CHECK(used == i - num_start, where, ": '", text, "' is not a size", hint);
  } catch (const std::logic_error&) {
    fail(where, ": '", text, "' is not a size", hint);
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit = text.substr(i);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  MEMTUNE_CHECK(std::isfinite(value) && value > 0, where, ": '", text, "' must be positive", hint);

  SizeSpec s;
  if (unit.empty()) {
    bool has_point = text.find('.') != std::string::npos || text.find('e') != std::string::npos ||
                     text.find('E') != std::string::npos;
    if (value <= 1.0 && has_point) {  // "0.9", "1.0": a fraction of the device
      s.fraction = value;
      return s;
    }
    s.bytes = static_cast<int64_t>(value);
    return s;
  }
  struct Unit {
    const char* name;
    double scale;
  };
  static const Unit units[] = {
      {"B", 1},           {"KiB", 1024.0},    {"MiB", 1048576.0},    {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},          {"GB", 1e9},
      {"TB", 1e12},       {"K", 1024.0},      {"M", 1048576.0},      {"G", 1073741824.0},
      {"k", 1024.0},      {"kB", 1e3},
  };
  for (const auto& u : units) {
    if (unit == u.name) {
      s.bytes = static_cast<int64_t>(std::llround(value * u.scale));
      MEMTUNE_CHECK(s.bytes > 0, where, ": '", text, "' is smaller than one byte", hint);
      return s;
    }
  }
  fail(where, ": unknown unit '", unit, "' in '", text, "'", hint);
}

std::string format_size(const SizeSpec& s) {
  if (s.fraction > 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", s.fraction);
    std::string out = buf;
    if (out.find('.') == std::string::npos) out += ".0";
    return out;
  }
  static const std::pair<const char*, int64_t> units[] = {
      {"TiB", 1LL << 40}, {"GiB", 1LL << 30}, {"MiB", 1LL << 20}, {"KiB", 1LL << 10}};
  for (const auto& [name, scale] : units)
    if (s.bytes >= scale && s.bytes % scale == 0) return std::to_string(s.bytes / scale) + name;
  return std::to_string(s.bytes);
}

std::string format_bytes(int64_t bytes) {
  const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int k = 0;
  while (v >= 1024.0 && k < 4) {
    v /= 1024.0;
    ++k;
  }
  char buf[48];
  if (k == 0)
    std::snprintf(buf, sizeof buf, "%s%lld B", bytes < 0 ? "-" : "", static_cast<long long>(v));
  else
    std::snprintf(buf, sizeof buf, "%s%.2f %s", bytes < 0 ? "-" : "", v, names[k]);
  return buf;
}

}  // namespace memtune
