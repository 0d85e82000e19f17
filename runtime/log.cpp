#include "runtime/log.h"

#include <mutex>
#include <set>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "runtime/error.h"

namespace memtune {

void init_logging(const LogOptions& options) {
  std::vector<spdlog::sink_ptr> sinks;
  if (options.console) sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!options.file.empty()) {
    try {
      sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(options.file, false));
    } catch (const spdlog::spdlog_ex& e) {
      fail("cannot open log file '", options.file, "': ", e.what());
    }
  }
  auto logger = std::make_shared<spdlog::logger>("memtune", sinks.begin(), sinks.end());
  std::string prefix = options.rank >= 0 ? str_cat("[rank ", options.rank, "] ") : "";
  logger->set_pattern("%Y-%m-%d %H:%M:%S %^%L%$ " + prefix + "%v");
  auto level = spdlog::level::from_str(options.level);
  MEMTUNE_CHECK(level != spdlog::level::off || options.level == "off", "log level '",
                options.level, "' is unknown (use trace, debug, info, warn, error, off)");
  logger->set_level(level);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void log_once(const std::string& key, const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(key).second) spdlog::info("{}", message);
}

}  // namespace memtune
