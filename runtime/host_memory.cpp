#include "runtime/host_memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace memtune {

int64_t current_rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t total_pages = 0, resident_pages = 0;
  if (!(in >> total_pages >> resident_pages)) return -1;
  return resident_pages * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      long long kib = 0;
      if (std::sscanf(line.c_str() + 6, "%lld", &kib) == 1) return kib * 1024;
    }
  }
  struct rusage usage;
  std::memset(&usage, 0, sizeof(usage));
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // ru_maxrss is in KiB on Linux
}

bool reset_peak_rss() {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool written = std::fputs("5", f) >= 0;
  const bool closed = std::fclose(f) == 0;  // the kernel reports EINVAL/EPERM on flush
  return written && closed;
}

}  // namespace memtune
