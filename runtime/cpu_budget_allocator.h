#pragma once
// The CPU budget allocator: an at::Allocator, installed process-wide with
// c10::SetCPUAllocator, that counts every byte of CPU tensor storage and, when a limit is
// set (memory.device_limit), throws c10::OutOfMemoryError past it with a message in the
// form of CUDA's. It makes "a 6 GiB device" real on any machine and every OOM path testable.
//
// Counting: a block of n bytes counts exactly n (the storage's nbytes, e.g. 4N for N
// floats; no rounding). Each block also carries a 64-byte header holding n, so the free
// path subtracts exactly what was added; the header is not counted. Data is 64-byte
// aligned. Zero-byte requests get a null pointer and are not counted.
//
// Blocks of 256 KiB and more are pages mapped for them alone and, once freed, cached and
// handed out again for a request of the same size class (whole pages, within 12.5 %: a
// training step repeats the sizes of the one before, a growing sequence nearly does): a
// step then costs no page faults, and the process holds
// at most the highest live use plus a quarter (at least 32 MiB), where glibc's heap
// fragments to far more.
// Cached blocks are not counted as allocated (they are free to reuse, as in CUDA's
// caching allocator's "reserved"); release_cpu_cached_blocks() unmaps them.
//
// Storage allocated before installation keeps the deleter of the allocator that made it
// (a DataPtr carries its deleter), so freeing it after installation is safe and changes
// no counter. All functions are thread-safe.
#include <cstdint>
#include <string>

namespace memtune {

// Installs the allocator (idempotent; first call wins). Call once at start-up, before
// the model loads, so that every later CPU tensor is counted.
void install_cpu_budget_allocator();
bool cpu_budget_allocator_installed();

struct CpuAllocatorCounters {
  int64_t allocated = 0;          // bytes in live blocks
  int64_t peak = 0;               // highest `allocated` since install or the last reset
  int64_t limit = 0;              // 0 = none
  int64_t live_allocations = 0;   // blocks not yet freed
  int64_t total_allocations = 0;  // blocks ever allocated (successful, non-zero size)
  int64_t ooms = 0;               // out-of-memory errors thrown (injected ones included)
  int64_t cached = 0;             // bytes of freed large blocks kept for reuse
  int64_t high_water = 0;         // highest `allocated` ever (peak resets leave it)
  int64_t maps = 0;               // large blocks mapped anew (fresh pages: page faults); a repeated step adds none
};
CpuAllocatorCounters cpu_allocator_counters();
int64_t cpu_allocated_bytes();
void release_cpu_cached_blocks();  // unmaps every cached block
int64_t cpu_peak_bytes();

// Budget in bytes; 0 removes it. A limit below the current use is allowed: the next
// allocation fails. Setting a limit (or an injection below) installs the allocator.
void set_cpu_memory_limit(int64_t bytes);
int64_t cpu_memory_limit();
void reset_cpu_peak();  // peak := allocated

// Test hooks (one-shot): of the non-zero-size allocation requests from now on, number
// `allocations` + 1 throws c10::OutOfMemoryError whatever the budget (message ends
// "(injected by inject_oom_after)"); then the hook disarms itself.
void inject_oom_after(int64_t allocations);
void inject_oom_on_next_alloc();  // inject_oom_after(0)
void cancel_injected_oom();

// Sizes as CUDA's caching allocator prints them in its OOM message: "512 bytes",
// "2.50 KiB", "20.00 MiB", "1.50 GiB" (two decimals, binary units).
std::string format_oom_size(int64_t bytes);

// Measures the peak of a region without losing the process-wide peak: resets the peak on
// construction, and on destruction sets it back to the larger of the saved and new peaks.
class ScopedPeakReset {
 public:
  ScopedPeakReset();
  ~ScopedPeakReset();
  ScopedPeakReset(const ScopedPeakReset&) = delete;
  ScopedPeakReset& operator=(const ScopedPeakReset&) = delete;
  int64_t peak() const;  // highest use since construction, in bytes

 private:
  int64_t saved_peak_;
};

}  // namespace memtune
