#pragma once
// Byte sizes as users write them: "6GiB", "512MiB", "1.5GB", "1048576", or a fraction
// "0.9" of a reference size (a device's total memory).
#include <cstdint>
#include <string>

namespace memtune {

struct SizeSpec {
  int64_t bytes = 0;       // absolute size in bytes, when fraction < 0
  double fraction = -1.0;  // share of a reference size in (0, 1], or < 0 when absolute
  bool is_set() const { return bytes > 0 || fraction > 0; }
  int64_t resolve(int64_t reference_bytes) const;  // bytes, given the reference size
};

// Parses a size; throws UserError naming `where` on bad input.
SizeSpec parse_size(const std::string& text, const std::string& where = "size");
std::string format_size(const SizeSpec& s);   // inverse of parse_size (round-trips)
std::string format_bytes(int64_t bytes);      // human form: "1.50 GiB"

}  // namespace memtune
