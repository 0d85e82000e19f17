// Resident memory readings follow memory this test maps and touches.
#include "runtime/host_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>

using memtune::current_rss_bytes;
using memtune::peak_rss_bytes;
using memtune::reset_peak_rss;

namespace {
constexpr int64_t kMiB = 1 << 20;
constexpr size_t kBlock = 128 * kMiB;

// 128 MiB of anonymous memory, every page written (resident), outside malloc's arenas.
void* touch_block() {
  void* p = mmap(nullptr, kBlock, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  std::memset(p, 1, kBlock);
  return p;
}
}  // namespace

TEST(HostMemory, CurrentRssFollowsTouchedMemory) {
  const int64_t before = current_rss_bytes();
  ASSERT_GT(before, 0);
  void* p = touch_block();
  const int64_t during = current_rss_bytes();
  EXPECT_GE(during - before, 120 * kMiB) << before << " -> " << during;
  // The kernel's counters are updated lazily: allow a few pages of difference.
  EXPECT_GE(peak_rss_bytes(), during - 4 * kMiB);
  munmap(p, kBlock);
  EXPECT_LE(current_rss_bytes(), during - 120 * kMiB);
  EXPECT_GE(peak_rss_bytes(), during - 4 * kMiB);  // the peak remembers
}

TEST(HostMemory, ResetPeakLowersItToCurrent) {
  munmap(touch_block(), kBlock);
  const int64_t high = peak_rss_bytes();
  ASSERT_GE(high - current_rss_bytes(), 120 * kMiB);
  if (!reset_peak_rss()) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
  EXPECT_LE(peak_rss_bytes(), current_rss_bytes() + 8 * kMiB);
  EXPECT_LE(peak_rss_bytes(), high - 100 * kMiB);
}
