#pragma once
// Logging through spdlog: console and, when given, a file; a rank prefix under several
// processes. Everything logs through the default logger after init_logging().
#include <string>

#include <spdlog/spdlog.h>

namespace memtune {

struct LogOptions {
  std::string level = "info";  // trace, debug, info, warn, error
  std::string file;            // also log here when not empty (appends)
  int rank = -1;               // >= 0: prefix lines with "[rank N]"
  bool console = true;
};

void init_logging(const LogOptions& options);

// Logs `message` once per process per `key` (compatibility keys that do nothing, etc.).
void log_once(const std::string& key, const std::string& message);

}  // namespace memtune
