#include "runtime/memory.h"

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "runtime/cpu_budget_allocator.h"
#include "runtime/units.h"
#ifdef MEMTUNE_CUDA
#include "runtime/cuda/cuda_memory.h"
#endif

namespace memtune {

MemoryBackend::~MemoryBackend() = default;

namespace {

// Reads "Key:   123 kB" lines of a /proc file; returns bytes for each key asked, 0 if absent.
std::map<std::string, int64_t> read_proc_kb(const char* path, std::initializer_list<const char*> keys) {
  std::map<std::string, int64_t> out;
  for (const char* k : keys) out[k] = 0;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto it = out.find(line.substr(0, colon));
    if (it == out.end()) continue;
    long long kb = 0;
    if (std::sscanf(line.c_str() + colon + 1, "%lld", &kb) == 1) it->second = kb * 1024;
  }
  return out;
}

class CpuBackend final : public MemoryBackend {
 public:
  CpuBackend() { install_cpu_budget_allocator(); }
  std::string device() const override { return "cpu"; }
  MemoryStats stats() const override {
    const CpuAllocatorCounters c = cpu_allocator_counters();
    const HostMemory host = host_memory();
    MemoryStats s;
    s.allocated = c.allocated;
    s.reserved = c.allocated + c.cached;  // live blocks and freed large blocks kept for reuse
    s.peak = c.peak;
    s.limit = c.limit;
    s.total = host.total;
    s.free = host.available;
    if (c.limit > 0) s.free = std::min(s.free, std::max<int64_t>(0, c.limit - c.allocated));
    s.alloc_count = c.live_allocations;
    return s;
  }
  void set_limit(int64_t bytes) override { set_cpu_memory_limit(bytes); }
  void release_cached() override {
    release_cpu_cached_blocks();
    malloc_trim(0);
  }
  void reset_peak() override { reset_cpu_peak(); }
};

std::mutex g_mutex;
std::map<std::string, std::unique_ptr<MemoryBackend>>& backends() {
  static auto* map = new std::map<std::string, std::unique_ptr<MemoryBackend>>();  // never freed
  return *map;
}

MemoryBackend& backend_locked(const c10::Device& device) {
  std::string key;
  if (device.is_cpu()) {
    key = "cpu";
  } else if (device.is_cuda()) {
#ifdef MEMTUNE_CUDA
    const int index = device.has_index() ? device.index() : cuda_memory_current_device();
    TORCH_CHECK(index >= 0 && index < cuda_memory_device_count(), "memory backend: no device ",
                device.str(), " (", cuda_memory_device_count(), " CUDA devices visible)");
    key = "cuda:" + std::to_string(index);
#else
    TORCH_CHECK(false, "memory backend for ", device.str(), ": this memtune was built without CUDA");
#endif
  } else {
    TORCH_CHECK(false, "memory backend: unsupported device type ", device.str());
  }
  auto& slot = backends()[key];
  if (!slot) {
    if (key == "cpu") {
      slot = std::make_unique<CpuBackend>();
    } else {
#ifdef MEMTUNE_CUDA
      slot = make_cuda_memory_backend(std::stoi(key.substr(5)));
#endif
    }
  }
  return *slot;
}

std::string limit_text(int64_t limit) { return limit > 0 ? format_bytes(limit) : "none"; }

}  // namespace

MemoryBackend& memory_backend(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return backend_locked(device);
}

std::vector<MemoryBackend*> visible_backends() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<MemoryBackend*> out{&backend_locked(c10::Device(c10::DeviceType::CPU))};
#ifdef MEMTUNE_CUDA
  const int n = cuda_memory_device_count();
  for (int i = 0; i < n; ++i)
    out.push_back(&backend_locked(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i))));
#endif
  return out;
}

HostMemory host_memory() {
  const auto status = read_proc_kb("/proc/self/status", {"VmRSS", "VmHWM"});
  const auto meminfo = read_proc_kb("/proc/meminfo", {"MemAvailable", "MemTotal"});
  HostMemory h;
  h.rss = status.at("VmRSS");
  h.peak_rss = status.at("VmHWM");
  h.available = meminfo.at("MemAvailable");
  h.total = meminfo.at("MemTotal");
  return h;
}

nlohmann::json memory_report_json() {
  nlohmann::json devices = nlohmann::json::array();
  for (MemoryBackend* b : visible_backends()) {
    const MemoryStats s = b->stats();
    devices.push_back({{"device", b->device()},
                       {"allocated", s.allocated},
                       {"reserved", s.reserved},
                       {"peak", s.peak},
                       {"total", s.total},
                       {"free", s.free},
                       {"limit", s.limit},
                       {"alloc_count", s.alloc_count}});
  }
  const HostMemory h = host_memory();
  return {{"devices", devices},
          {"host", {{"rss", h.rss}, {"peak_rss", h.peak_rss}, {"available", h.available}, {"total", h.total}}}};
}

std::string memory_report_text() {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %12s %12s %12s %12s %12s %12s %12s\n", "device", "allocated",
                "reserved", "peak", "total", "free", "limit", "allocations");
  os << line;
  for (MemoryBackend* b : visible_backends()) {
    const MemoryStats s = b->stats();
    std::snprintf(line, sizeof line, "%-8s %12s %12s %12s %12s %12s %12s %12lld\n", b->device().c_str(),
                  format_bytes(s.allocated).c_str(), format_bytes(s.reserved).c_str(),
                  format_bytes(s.peak).c_str(), format_bytes(s.total).c_str(), format_bytes(s.free).c_str(),
                  limit_text(s.limit).c_str(), static_cast<long long>(s.alloc_count));
    os << line;
  }
  const HostMemory h = host_memory();
  os << "host: rss " << format_bytes(h.rss) << ", peak rss " << format_bytes(h.peak_rss) << ", available "
     << format_bytes(h.available) << " of " << format_bytes(h.total) << "\n";
  return os.str();
}

}  // namespace memtune
