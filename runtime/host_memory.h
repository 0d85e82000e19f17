#pragma once
// Resident host memory of this process, for tests and reports of loading memory
// (low_cpu_mem_usage). Linux /proc based; values in bytes.
#include <cstdint>

namespace memtune {

// Resident set size now (/proc/self/statm, resident pages x page size).
int64_t current_rss_bytes();

// Highest resident set size since the process started or the last reset_peak_rss()
// (/proc/self/status VmHWM, which the kernel updates lazily: it may trail a current_rss_bytes()
// reading by a few pages; getrusage's ru_maxrss where /proc has no VmHWM, which a reset
// does not lower).
int64_t peak_rss_bytes();

// Lowers the peak to the current RSS by writing "5" to /proc/self/clear_refs (Linux >=
// 4.0). Returns false where that is not permitted; the peak then keeps counting from
// process start.
bool reset_peak_rss();

}  // namespace memtune
