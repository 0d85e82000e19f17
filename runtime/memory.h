#pragma once
// Device memory backends: one per device the process can see ("cpu", "cuda:0", ...), each
// reporting the same statistics and taking the same controls, so the supervisor, the
// monitor and `memtune mem` never ask which kind of device they hold.
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace memtune {

// All sizes in bytes.
struct MemoryStats {
  int64_t allocated = 0;    // in live tensors
  int64_t reserved = 0;     // held by the allocator (allocated + cached); CPU: + cached large blocks
  int64_t peak = 0;         // highest `allocated` since start or the last reset_peak()
  int64_t limit = 0;        // budget set by set_limit(); 0 = none
  int64_t total = 0;        // device capacity (CPU: the host's MemTotal)
  int64_t free = 0;         // what may still be taken: CUDA: cudaMemGetInfo free, capped
                            // by limit - reserved; CPU: MemAvailable, capped by
                            // limit - allocated (when a limit is set)
  int64_t alloc_count = 0;  // live allocations (blocks not yet freed)
};

class MemoryBackend {
 public:
  virtual ~MemoryBackend();
  virtual std::string device() const = 0;  // "cpu", "cuda:0"
  virtual MemoryStats stats() const = 0;
  // Emulates a smaller device: allocations past `bytes` fail with c10::OutOfMemoryError.
  // 0 removes the limit. CPU: counted by the budget allocator; CUDA: the caching
  // allocator's memory fraction (limit / total), which bounds reserved memory.
  virtual void set_limit(int64_t bytes) = 0;
  virtual void release_cached() = 0;  // CUDA: emptyCache; CPU: returns free heap to the OS
  virtual void reset_peak() = 0;      // peak := allocated
};

// The backend of `device` (a CUDA device without index means the current one), created on
// first use and alive until exit. The CPU backend installs the CPU budget allocator
// (runtime/cpu_budget_allocator.h) when created, so CPU counts start from that moment;
// call install_cpu_budget_allocator() at start-up to count everything.
MemoryBackend& memory_backend(const c10::Device& device);
std::vector<MemoryBackend*> visible_backends();  // cpu, then every CUDA device

// The host as the kernel sees it, in bytes.
struct HostMemory {
  int64_t rss = 0;        // /proc/self/status VmRSS
  int64_t peak_rss = 0;   // /proc/self/status VmHWM
  int64_t available = 0;  // /proc/meminfo MemAvailable
  int64_t total = 0;      // /proc/meminfo MemTotal
};
HostMemory host_memory();

// `memtune mem`: every visible device (allocated, reserved, peak, total, free, limit,
// alloc_count) and the host (rss, peak_rss, available, total).
// JSON: {"devices": [{"device": "cpu", "allocated": <bytes>, ...}], "host": {"rss": ...}}.
std::string memory_report_text();
nlohmann::json memory_report_json();

}  // namespace memtune
