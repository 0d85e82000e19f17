#include "runtime/cpu_budget_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "runtime/compat.h"

namespace memtune {
namespace {

constexpr std::size_t kAlignment = 64;
constexpr std::size_t kHeader = 64;  // holds the block's size; keeps data 64-byte aligned
// Blocks from this size on are mapped pages of their own, kept for reuse when freed.
constexpr std::size_t kMappedMin = std::size_t{256} << 10;
// The least a cache may hold over the high water of live use (BlockCache).
constexpr int64_t kCacheFloor = int64_t{32} << 20;
// Above c10's default CPU allocator (0) and the mobile one (100 where it exists).
constexpr uint8_t kPriority = 200;

// Plain atomics: constant-initialized and trivially destructible, so storage freed during
// static destruction still finds them.
std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_limit{0};
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_total{0};
std::atomic<int64_t> g_ooms{0};
std::atomic<int64_t> g_inject_countdown{-1};  // < 0: disarmed
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_high_water{0};  // highest `allocated` ever (ScopedPeakReset leaves it)
std::atomic<int64_t> g_cached{0};
std::atomic<int64_t> g_maps{0};  // large blocks mapped anew

// Large blocks. A training step allocates the same sizes as the step before, so a freed
// block is kept and handed out again for a request of the same size class (mapped_size): no
// page faults, no zeroing by the kernel, and none of the fragmentation that makes glibc's
// heap grow well past the live peak. What is mapped (live + cached) stays under the highest
// live use plus a quarter (at least 32 MiB): a miss evicts cached blocks first, those freed
// longest ago first, and a freed block that would cross the line is unmapped.
// - With an eighth, the S benchmark's step (live peak ~110 MiB, 8 MiB logit chunks) missed
//   9000 pages a step, ~14 % of its time in page faults on this VM; with a quarter, 680.
// - The floor is for small runs whose loss chunks are large next to their live peak: S
//   with checkpointing (peak 60 MiB) missed four 8 MiB blocks a step under a 16 MiB floor,
//   7,900 pages; under 32 MiB, 13 to 25 (2026-11-27). A floor of four times the largest
//   block also fixed it, but would let a streaming load of a model with a 2 GiB embedding
//   keep 8 GiB of freed blocks.
// - Blocks of a sequence that grows by a token at a time (generation without a key/value
//   cache, batches padded to their longest row) change size at every forward: with exact
//   page sizes they never met a cached block, filled the cache, and with the largest
//   evicted first the blocks every forward does reuse (a projection's dequantized weight)
//   were the ones unmapped. GPT-2's shape in NF4 generating 64 tokens after 512 without the
//   cache mapped 4,765 blocks in one call (37 s); with size classes and the oldest evicted
//   first, none (30 s; docs/performance.md, 2026-11-29).
class BlockCache {
 public:
  // A mapping of `mapped` bytes (a size class: mapped_size()), or nullptr.
  void* take(std::size_t mapped, int64_t live) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(mapped);
    if (it != free_.end()) {
      void* base = it->second.back().base;  // the most recently freed of its class
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      g_cached.fetch_sub(static_cast<int64_t>(mapped), std::memory_order_relaxed);
      return base;
    }
    // A miss maps new pages: make room under the line by unmapping cached blocks, those
    // freed longest ago first (a size the run no longer asks for goes before one it does).
    const auto need = live + static_cast<int64_t>(mapped);
    while (!free_.empty() && need + g_cached.load(std::memory_order_relaxed) > line()) pop_oldest();
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    g_maps.fetch_add(1, std::memory_order_relaxed);
    return base;
  }

  void give(void* base, std::size_t mapped, int64_t live) {
    std::lock_guard<std::mutex> lock(mu_);
    if (live + g_cached.load(std::memory_order_relaxed) + static_cast<int64_t>(mapped) > line()) {
      munmap(base, mapped);
      return;
    }
    free_[mapped].push_back({base, ++clock_});
    g_cached.fetch_add(static_cast<int64_t>(mapped), std::memory_order_relaxed);
  }

  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!free_.empty()) pop_oldest();
  }

 private:
  struct Cached {
    void* base;
    uint64_t freed;  // when it was given back, in gives
  };
  static int64_t line() {
    const int64_t hw = g_high_water.load(std::memory_order_relaxed);
    return hw + std::max<int64_t>(hw / 4, kCacheFloor);
  }
  // Each class's blocks are in the order they were freed: the oldest is the first of one.
  void pop_oldest() {
    auto oldest = free_.begin();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second.front().freed < oldest->second.front().freed) oldest = it;
    munmap(oldest->second.front().base, oldest->first);
    g_cached.fetch_sub(static_cast<int64_t>(oldest->first), std::memory_order_relaxed);
    oldest->second.erase(oldest->second.begin());
    if (oldest->second.empty()) free_.erase(oldest);
  }

  std::mutex mu_;
  std::map<std::size_t, std::vector<Cached>> free_;  // size class -> cached mappings, oldest first
  uint64_t clock_ = 0;
};

// Never destroyed: blocks may be freed during static destruction.
BlockCache& block_cache() {
  static auto* cache = new BlockCache();
  return *cache;
}

std::size_t page_rounded(std::size_t bytes) {
  static const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// The mapping for a large block of `bytes`: whole pages, rounded up to an eighth of the
// largest power of two not above them, so that sizes within 12.5 % of each other share a
// class and its cached blocks. The pages past the request are never touched by it and so
// take no memory (a mapping's pages are backed when first written).
std::size_t mapped_size(std::size_t bytes) {
  const std::size_t pages = page_rounded(bytes);
  std::size_t power = 1;
  while (power <= pages / 2) power *= 2;
  const std::size_t step = std::max(page_rounded(1), power / 8);
  return (pages + step - 1) / step * step;
}

void raise_to(std::atomic<int64_t>& a, int64_t value) {
  int64_t p = a.load(std::memory_order_relaxed);
  while (value > p && !a.compare_exchange_weak(p, value, std::memory_order_relaxed)) {
  }
}

void raise_peak(int64_t value) {
  raise_to(g_peak, value);
  raise_to(g_high_water, value);
}

[[noreturn]] void throw_oom(int64_t n, int64_t in_use, int64_t limit, const char* why) {
  g_ooms.fetch_add(1, std::memory_order_relaxed);
  std::string msg = "CPU out of memory. Tried to allocate " + format_oom_size(n) + "; " +
                    format_oom_size(in_use) + " in use";
  if (limit > 0) msg += " of " + format_oom_size(limit) + " limit";
  msg += std::string(" (") + why + ")";
  compat::throw_out_of_memory(std::move(msg));
}

// True when the injection hook fires on this allocation (and disarms it).
bool injection_fires() {
  int64_t v = g_inject_countdown.load(std::memory_order_relaxed);
  while (v >= 0) {
    if (g_inject_countdown.compare_exchange_weak(v, v - 1, std::memory_order_relaxed))
      return v == 0;
  }
  return false;
}

// The header: the counted size n, then the mapping's size (0: from malloc).
void write_header(void* base, int64_t n, uint64_t mapped) {
  std::memcpy(base, &n, sizeof n);
  std::memcpy(static_cast<char*>(base) + sizeof n, &mapped, sizeof mapped);
}

void budget_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t n = 0;
  uint64_t mapped = 0;
  std::memcpy(&n, base, sizeof n);
  std::memcpy(&mapped, base + sizeof n, sizeof mapped);
  const int64_t live = g_allocated.fetch_sub(n, std::memory_order_relaxed) - n;
  g_live.fetch_sub(1, std::memory_order_relaxed);
  if (mapped != 0) block_cache().give(base, mapped, live);
  else std::free(base);
}

c10::DataPtr budget_allocate(std::size_t nbytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (nbytes == 0) return {nullptr, nullptr, &budget_delete, cpu};
  TORCH_CHECK(nbytes <= static_cast<std::size_t>(std::numeric_limits<int64_t>::max()) - kHeader,
              "CPU budget allocator: impossible size ", nbytes);
  const auto n = static_cast<int64_t>(nbytes);
  if (injection_fires())
    throw_oom(n, g_allocated.load(std::memory_order_relaxed), g_limit.load(), "injected by inject_oom_after");

  // Reserve n bytes under the budget before touching the system allocator.
  const int64_t limit = g_limit.load(std::memory_order_relaxed);
  int64_t cur = g_allocated.load(std::memory_order_relaxed);
  int64_t next = 0;
  do {
    next = cur + n;
    if (limit > 0 && next > limit) throw_oom(n, cur, limit, "budget set by memory.device_limit");
  } while (!g_allocated.compare_exchange_weak(cur, next, std::memory_order_relaxed));
  raise_peak(next);

  void* base = nullptr;
  uint64_t mapped = 0;
  if (nbytes >= kMappedMin) {
    mapped = mapped_size(nbytes + kHeader);
    base = block_cache().take(mapped, cur);
  } else if (posix_memalign(&base, kAlignment, nbytes + kHeader) != 0) {
    base = nullptr;
  }
  if (base == nullptr) {
    g_allocated.fetch_sub(n, std::memory_order_relaxed);
    throw_oom(n, cur, limit, "the system refused the allocation");
  }
  write_header(base, n, mapped);
  g_live.fetch_add(1, std::memory_order_relaxed);
  g_total.fetch_add(1, std::memory_order_relaxed);
  void* data = static_cast<char*>(base) + kHeader;
  // Context == data: a "simple" DataPtr, so raw_allocate() and copy-on-write work.
  return {data, data, &budget_delete, cpu};
}

struct BudgetAllocator final : c10::Allocator {
  MEMTUNE_ALLOCATOR_ALLOCATE(budget_allocate)
  c10::DeleterFnPtr raw_deleter() const override { return &budget_delete; }
  MEMTUNE_ALLOCATOR_COPY_DATA
};

// Never destroyed: SetCPUAllocator needs static lifetime, and static destructors that run
// after this file's may still allocate.
BudgetAllocator* budget_allocator() {
  static auto* allocator = new BudgetAllocator();
  return allocator;
}

}  // namespace

void install_cpu_budget_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetCPUAllocator(budget_allocator(), kPriority);
    TORCH_CHECK(c10::GetCPUAllocator() == budget_allocator(),
                "CPU budget allocator: c10::SetCPUAllocator kept another allocator "
                "(one registered with a priority above ", static_cast<int>(kPriority), ")");
    g_installed = true;
  });
}

bool cpu_budget_allocator_installed() { return g_installed.load(); }

CpuAllocatorCounters cpu_allocator_counters() {
  CpuAllocatorCounters c;
  c.allocated = g_allocated.load();
  c.peak = g_peak.load();
  c.limit = g_limit.load();
  c.live_allocations = g_live.load();
  c.total_allocations = g_total.load();
  c.ooms = g_ooms.load();
  c.cached = g_cached.load();
  c.high_water = g_high_water.load();
  c.maps = g_maps.load();
  return c;
}

void release_cpu_cached_blocks() { block_cache().release(); }

int64_t cpu_allocated_bytes() { return g_allocated.load(); }
int64_t cpu_peak_bytes() { return g_peak.load(); }

void set_cpu_memory_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "CPU memory limit must be >= 0 bytes, got ", bytes);
  if (bytes > 0) install_cpu_budget_allocator();  // a limit only binds once installed
  g_limit = bytes;
}
int64_t cpu_memory_limit() { return g_limit.load(); }

void reset_cpu_peak() { g_peak = g_allocated.load(); }

void inject_oom_after(int64_t allocations) {
  TORCH_CHECK(allocations >= 0, "inject_oom_after: allocations must be >= 0, got ", allocations);
  install_cpu_budget_allocator();
  g_inject_countdown = allocations;
}
void inject_oom_on_next_alloc() { inject_oom_after(0); }
void cancel_injected_oom() { g_inject_countdown = -1; }

// Same thresholds and precision as format_size() in c10/cuda/CUDACachingAllocator.cpp.
std::string format_oom_size(int64_t bytes) {
  char buf[48];
  const double b = static_cast<double>(bytes);
  if (bytes <= 1024)
    std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  else if (bytes <= 1048576)
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  else if (bytes <= 1073741824LL)
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  return buf;
}

ScopedPeakReset::ScopedPeakReset() : saved_peak_(g_peak.load()) { reset_cpu_peak(); }
ScopedPeakReset::~ScopedPeakReset() { raise_peak(saved_peak_); }
int64_t ScopedPeakReset::peak() const { return g_peak.load(); }

}  // namespace memtune
