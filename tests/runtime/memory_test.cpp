// Device memory backends and the CPU budget allocator. Expected byte counts come from the
// tensors' shapes (N floats = 4N bytes), expected OOM texts from CUDA's format_size rules,
// host figures from getrusage/sysinfo, so none of them is read back from the code tested.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <thread>
#include <vector>

#include "runtime/compat.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/memory.h"
#include "test_util.h"

namespace memtune {
namespace {

constexpr int64_t kMiB = 1 << 20;

// Made during static initialisation, before any test installs the budget allocator.
at::Tensor& tensor_made_before_install() {
  static at::Tensor t = at::ones({kMiB / 4}, at::kFloat);
  return t;
}
const bool g_made_early = tensor_made_before_install().defined();

class CpuBudget : public ::testing::Test {
 protected:
  void SetUp() override { install_cpu_budget_allocator(); }
  void TearDown() override {
    set_cpu_memory_limit(0);
    cancel_injected_oom();
  }
};

at::Tensor bytes(int64_t n) { return at::empty({n}, at::kByte); }

// Parses "Tried to allocate A U; B U in use of C U limit" into bytes (2-decimal values).
struct OomNumbers {
  double tried = 0, in_use = 0, limit = 0;
};
double to_bytes(const std::string& v, const std::string& unit) {
  const double x = std::stod(v);
  if (unit == "bytes") return x;
  if (unit == "KiB") return x * 1024;
  if (unit == "MiB") return x * kMiB;
  return x * 1024.0 * kMiB;
}
OomNumbers parse_oom(const std::string& msg) {
  static const std::regex re(
      R"(CPU out of memory\. Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB); ([0-9.]+) (bytes|KiB|MiB|GiB) in use of ([0-9.]+) (bytes|KiB|MiB|GiB) limit \(budget set by memory\.device_limit\))");
  std::smatch m;
  EXPECT_TRUE(std::regex_search(msg, m, re)) << msg;
  if (m.empty()) return {};
  return {to_bytes(m[1], m[2]), to_bytes(m[3], m[4]), to_bytes(m[5], m[6])};
}

TEST_F(CpuBudget, InstalledAndIdempotent) {
  install_cpu_budget_allocator();
  EXPECT_TRUE(cpu_budget_allocator_installed());
  const c10::Allocator* a = c10::GetCPUAllocator();
  install_cpu_budget_allocator();
  EXPECT_EQ(a, c10::GetCPUAllocator());
  EXPECT_NE(a->raw_deleter(), nullptr);
}

TEST_F(CpuBudget, CountsExactBytesOfKnownTensors) {
  const auto base = cpu_allocator_counters();
  {
    at::Tensor f = at::empty({1000}, at::kFloat);  // 4000 bytes
    EXPECT_EQ(cpu_allocated_bytes() - base.allocated, 4000);
    at::Tensor d = at::empty({3, 5}, at::kDouble);  // 120 bytes
    at::Tensor h = at::empty({7}, at::kHalf);       // 14 bytes
    at::Tensor z = at::empty({0}, at::kFloat);      // nothing
    const auto now = cpu_allocator_counters();
    EXPECT_EQ(now.allocated - base.allocated, 4000 + 120 + 14);
    EXPECT_EQ(now.live_allocations - base.live_allocations, 3);
    EXPECT_EQ(now.total_allocations - base.total_allocations, 3);
    for (const at::Tensor* t : {&f, &d, &h})
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data_ptr()) % 64, 0u) << "64-byte alignment";
    // A view shares storage: nothing new.
    at::Tensor v = f.view({10, 100});
    EXPECT_EQ(cpu_allocated_bytes() - base.allocated, 4000 + 120 + 14);
  }
  const auto after = cpu_allocator_counters();
  EXPECT_EQ(after.allocated, base.allocated);
  EXPECT_EQ(after.live_allocations, base.live_allocations);
}

TEST_F(CpuBudget, RawAllocateRoundTrip) {
  const int64_t base = cpu_allocated_bytes();
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(1234);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(cpu_allocated_bytes() - base, 1234);
  a->raw_deallocate(p);
  EXPECT_EQ(cpu_allocated_bytes(), base);
}

TEST_F(CpuBudget, PeakAndResetPeak) {
  reset_cpu_peak();
  const int64_t base = cpu_allocated_bytes();
  EXPECT_EQ(cpu_peak_bytes(), base);
  {
    at::Tensor a = bytes(1 * kMiB);
    {
      at::Tensor b = bytes(2 * kMiB);
    }
    at::Tensor c = bytes(kMiB / 2);  // reuses nothing: peak stays at a + b
    EXPECT_EQ(cpu_peak_bytes() - base, 3 * kMiB);
    reset_cpu_peak();
    EXPECT_EQ(cpu_peak_bytes() - base, kMiB + kMiB / 2);
  }
  EXPECT_EQ(cpu_peak_bytes() - base, kMiB + kMiB / 2);  // frees do not lower the peak

  // ScopedPeakReset measures a region and keeps the larger outer peak afterwards.
  reset_cpu_peak();
  { at::Tensor big = bytes(4 * kMiB); }
  {
    ScopedPeakReset scope;
    EXPECT_EQ(scope.peak(), base);
    { at::Tensor small = bytes(kMiB); }
    EXPECT_EQ(scope.peak() - base, kMiB);
  }
  EXPECT_EQ(cpu_peak_bytes() - base, 4 * kMiB);

  auto& cpu = memory_backend(at::kCPU);
  { at::Tensor t = bytes(kMiB); }
  cpu.reset_peak();
  EXPECT_EQ(cpu.stats().peak, cpu_allocated_bytes());
}

TEST_F(CpuBudget, FormatOomSizeFollowsCudaRules) {
  // c10/cuda/CUDACachingAllocator.cpp format_size: <= 1024 bytes, <= 1 MiB as KiB,
  // <= 1 GiB as MiB, else GiB; fixed, two decimals.
  EXPECT_EQ(format_oom_size(0), "0 bytes");
  EXPECT_EQ(format_oom_size(1024), "1024 bytes");
  EXPECT_EQ(format_oom_size(1536), "1.50 KiB");
  EXPECT_EQ(format_oom_size(1048576), "1024.00 KiB");
  EXPECT_EQ(format_oom_size(20 * kMiB), "20.00 MiB");
  EXPECT_EQ(format_oom_size(1073741824LL), "1024.00 MiB");
  EXPECT_EQ(format_oom_size(3LL * 1073741824LL / 2), "1.50 GiB");
}

TEST_F(CpuBudget, LimitThrowsOutOfMemoryWithCudaStyleMessage) {
  const int64_t base = cpu_allocated_bytes();
  const int64_t limit = base + 8 * kMiB;
  memory_backend(at::kCPU).set_limit(limit);
  EXPECT_EQ(memory_backend(at::kCPU).stats().limit, limit);
  at::Tensor held = bytes(6 * kMiB);  // fits
  const int64_t ooms_before = cpu_allocator_counters().ooms;
  bool thrown = false;
  try {
    at::Tensor t = at::empty({kMiB}, at::kFloat);  // 4 MiB more: 10 > 8
  } catch (const c10::OutOfMemoryError& e) {
    thrown = true;
    const std::string msg = e.what_without_backtrace();
    EXPECT_EQ(msg.rfind("CPU out of memory. Tried to allocate 4.00 MiB; ", 0), 0u) << msg;
    const OomNumbers n = parse_oom(msg);
    EXPECT_DOUBLE_EQ(n.tried, 4.0 * kMiB);
    // Two decimals of the printed unit.
    EXPECT_NEAR(n.in_use, static_cast<double>(base + 6 * kMiB), 0.006 * kMiB * 1024);
    EXPECT_NEAR(n.limit, static_cast<double>(limit), 0.006 * kMiB * 1024);
    EXPECT_TRUE(compat::is_out_of_memory(e));
  }
  EXPECT_TRUE(thrown);
  EXPECT_EQ(cpu_allocator_counters().ooms, ooms_before + 1);
  EXPECT_EQ(cpu_allocated_bytes(), base + 6 * kMiB);  // the failed request left nothing

  // Exactly at the limit fits; one byte over does not.
  at::Tensor rest = bytes(2 * kMiB);
  EXPECT_THROW(bytes(1), c10::OutOfMemoryError);
  rest.reset();
  held.reset();
  memory_backend(at::kCPU).set_limit(0);
  EXPECT_NO_THROW(bytes(16 * kMiB));
}

TEST_F(CpuBudget, LimitMessagePrintsSmallRequestsInBytes) {
  const int64_t base = cpu_allocated_bytes();
  set_cpu_memory_limit(base + 100);
  try {
    at::empty({100}, at::kFloat);  // 400 bytes > 100 left
    FAIL() << "no OOM";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_EQ(msg.rfind("CPU out of memory. Tried to allocate 400 bytes; ", 0), 0u) << msg;
    const OomNumbers n = parse_oom(msg);
    EXPECT_DOUBLE_EQ(n.tried, 400.0);
    EXPECT_NEAR(n.in_use, static_cast<double>(base), 0.006 * kMiB * 1024);
    EXPECT_NEAR(n.limit, static_cast<double>(base + 100), 0.006 * kMiB * 1024);
  }
  EXPECT_NO_THROW(at::empty({25}, at::kFloat));  // exactly 100 bytes fits
}

TEST_F(CpuBudget, NothingLeaksWhenAForwardBackwardRunsOutOfMemory) {
  at::manual_seed(0);
  at::Tensor w = at::randn({256, 256}).requires_grad_(true);
  const auto base = cpu_allocator_counters();
  // Room for a few activations of 64x256 floats (64 KiB each), not for 40 layers.
  set_cpu_memory_limit(base.allocated + 1 * kMiB);
  bool thrown = false;
  try {
    at::Tensor x = at::randn({64, 256});
    for (int i = 0; i < 40; ++i) x = at::relu(at::matmul(x, w));
    x.sum().backward();
  } catch (const c10::OutOfMemoryError&) {
    thrown = true;
  }
  EXPECT_TRUE(thrown);
  set_cpu_memory_limit(0);
  const auto after = cpu_allocator_counters();
  EXPECT_EQ(after.allocated, base.allocated);
  EXPECT_EQ(after.live_allocations, base.live_allocations);
  EXPECT_FALSE(w.grad().defined());
}

TEST_F(CpuBudget, FreesTensorsAllocatedBeforeInstallation) {
  ASSERT_TRUE(g_made_early);
  at::Tensor& early = tensor_made_before_install();
  if (!early.defined()) GTEST_SKIP() << "freed by an earlier repetition (--gtest_repeat)";
  // Made by c10's default allocator: its DataPtr carries that allocator's deleter.
  ASSERT_NE(early.storage().data_ptr().get_deleter(), c10::GetCPUAllocator()->raw_deleter());
  EXPECT_FLOAT_EQ(early.sum().item<float>(), static_cast<float>(kMiB / 4));
  const auto base = cpu_allocator_counters();
  early.reset();  // freed by its own deleter: the budget counters do not move
  const auto after = cpu_allocator_counters();
  EXPECT_EQ(after.allocated, base.allocated);
  EXPECT_EQ(after.live_allocations, base.live_allocations);
  // A tensor made from it afterwards is counted.
  at::Tensor t = at::ones({kMiB / 4}, at::kFloat);
  EXPECT_EQ(cpu_allocated_bytes() - base.allocated, kMiB);
}

TEST_F(CpuBudget, CountsExactlyUnderParallelFor) {
  const int threads_before = at::get_num_threads();
  at::set_num_threads(std::max(2, threads_before));
  const auto base = cpu_allocator_counters();
  constexpr int64_t n = 2000;
  std::vector<at::Tensor> slots(n);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      at::Tensor scratch = at::empty({i % 37 + 1}, at::kFloat);  // freed at once
      slots[i] = at::empty({i % 100 + 1}, at::kFloat);
    }
  });
  int64_t expect = 0;
  for (int64_t i = 0; i < n; ++i) expect += 4 * (i % 100 + 1);
  auto now = cpu_allocator_counters();
  EXPECT_EQ(now.allocated - base.allocated, expect);
  EXPECT_EQ(now.live_allocations - base.live_allocations, n);
  slots.clear();
  now = cpu_allocator_counters();
  EXPECT_EQ(now.allocated, base.allocated);
  EXPECT_EQ(now.live_allocations, base.live_allocations);
  at::set_num_threads(threads_before);
}

TEST_F(CpuBudget, CountsExactlyUnderThreadsAndLimit) {
  // Four threads allocate and free under a budget that some requests exceed; the counters
  // must return to the start and never pass the limit.
  const int64_t base = cpu_allocated_bytes();
  const int64_t limit = base + 4 * kMiB;
  set_cpu_memory_limit(limit);
  reset_cpu_peak();
  std::atomic<int64_t> ooms{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3000; ++i) {
        try {
          at::Tensor a = bytes(((i * 7 + t) % 64 + 1) * 4096);  // up to 256 KiB
          at::Tensor b = bytes(((i * 13 + t) % 64 + 1) * 4096 + 5);
          if (i % 7 == 0) at::Tensor mid = bytes(3 * kMiB);  // fits only when others hold little
          if (i % 50 == 0) at::Tensor big = bytes(4 * kMiB);  // never fits beside a and b
        } catch (const c10::OutOfMemoryError&) {
          ooms.fetch_add(1);
        }
      }
    });
  for (auto& th : threads) th.join();
  set_cpu_memory_limit(0);
  EXPECT_EQ(cpu_allocated_bytes(), base);
  EXPECT_LE(cpu_peak_bytes(), limit);
  EXPECT_GE(ooms.load(), 4 * 60);
}

TEST_F(CpuBudget, InjectedOomIsOneShot) {
  const int64_t total0 = cpu_allocator_counters().total_allocations;
  inject_oom_after(2);
  at::Tensor a = bytes(10);
  at::Tensor zero = at::empty({0});  // zero-size requests do not count
  at::Tensor b = bytes(10);
  try {
    bytes(100);
    FAIL() << "the third allocation should fail";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("CPU out of memory. Tried to allocate 100 bytes; "), std::string::npos) << msg;
    EXPECT_NE(msg.find("(injected by inject_oom_after)"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(bytes(100));  // disarmed
  EXPECT_EQ(cpu_allocator_counters().total_allocations - total0, 3);

  inject_oom_on_next_alloc();
  EXPECT_THROW(at::ones({4}), c10::OutOfMemoryError);
  EXPECT_NO_THROW(at::ones({4}));

  inject_oom_on_next_alloc();
  cancel_injected_oom();
  EXPECT_NO_THROW(bytes(1));
}

TEST_F(CpuBudget, OomKeepsItsTypeThroughParallelForAndBackward) {
  const int threads_before = at::get_num_threads();
  at::set_num_threads(std::max(2, threads_before));
  const auto base = cpu_allocator_counters();
  inject_oom_after(1);
  EXPECT_THROW(at::parallel_for(0, 4, 1,
                                [](int64_t b, int64_t e) {
                                  for (int64_t i = b; i < e; ++i) at::Tensor t = at::empty({16});
                                }),
               c10::OutOfMemoryError);
  at::set_num_threads(threads_before);

  // In backward: the autograd engine rethrows the allocator's error unchanged.
  at::Tensor w = at::randn({32, 32}).requires_grad_(true);
  {
    at::Tensor loss = at::relu(at::matmul(at::randn({8, 32}), w)).sum();
    inject_oom_on_next_alloc();
    EXPECT_THROW(loss.backward(), c10::OutOfMemoryError);
  }
  w.mutable_grad().reset();
  w.reset();
  EXPECT_EQ(cpu_allocator_counters().allocated, base.allocated);
}

TEST_F(CpuBudget, CpuBackendStats) {
  auto& cpu = memory_backend(c10::Device("cpu"));
  EXPECT_EQ(&cpu, &memory_backend(at::kCPU));
  EXPECT_EQ(cpu.device(), "cpu");
  const int64_t base = cpu_allocated_bytes();
  at::Tensor t = bytes(3 * kMiB);
  MemoryStats s = cpu.stats();
  EXPECT_EQ(s.allocated, base + 3 * kMiB);
  EXPECT_EQ(s.reserved, s.allocated + cpu_allocator_counters().cached);  // live + cached large blocks
  EXPECT_GE(s.peak, s.allocated);
  EXPECT_EQ(s.alloc_count, cpu_allocator_counters().live_allocations);
  struct sysinfo si {};
  ASSERT_EQ(sysinfo(&si), 0);
  EXPECT_EQ(s.total, static_cast<int64_t>(si.totalram) * si.mem_unit);
  EXPECT_GT(s.free, 0);
  cpu.set_limit(base + 5 * kMiB);
  s = cpu.stats();
  EXPECT_EQ(s.limit, base + 5 * kMiB);
  EXPECT_EQ(s.free, 2 * kMiB);  // the budget is the binding constraint here
  cpu.set_limit(0);
  EXPECT_EQ(cpu.stats().limit, 0);
  cpu.release_cached();  // returns heap to the OS; must not disturb the counters
  EXPECT_EQ(cpu.stats().allocated, base + 3 * kMiB);

  const auto all = visible_backends();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all[0], &cpu);
  EXPECT_EQ(all.size(), 1u + static_cast<size_t>(at::hasCUDA() ? at::getNumGPUs() : 0));
}

TEST(HostMemory, MatchesKernelFigures) {
  HostMemory before = host_memory();
  // Touch 64 MiB so the resident set grows by about that much.
  const size_t n = 64 * kMiB;
  char* p = static_cast<char*>(std::malloc(n));
  ASSERT_NE(p, nullptr);
  for (size_t i = 0; i < n; i += 4096) p[i] = static_cast<char>(i);
  HostMemory h = host_memory();
  EXPECT_GE(h.rss - before.rss, 60 * kMiB);
  EXPECT_GE(h.peak_rss, h.rss);
  struct rusage ru {};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &ru), 0);
  EXPECT_NEAR(static_cast<double>(h.peak_rss), ru.ru_maxrss * 1024.0, 4.0 * kMiB);
  std::free(p);
  struct sysinfo si {};
  ASSERT_EQ(sysinfo(&si), 0);
  EXPECT_EQ(h.total, static_cast<int64_t>(si.totalram) * si.mem_unit);
  EXPECT_GT(h.available, 0);
  EXPECT_LE(h.available, h.total);
}

TEST_F(CpuBudget, ReportJsonAndText) {
  at::Tensor t = bytes(2 * kMiB);
  set_cpu_memory_limit(1LL << 40);
  const int64_t allocated = cpu_allocated_bytes();
  const nlohmann::json j = memory_report_json();
  ASSERT_TRUE(j.contains("devices") && j["devices"].is_array());
  ASSERT_GE(j["devices"].size(), 1u);
  const auto& cpu = j["devices"][0];
  EXPECT_EQ(cpu["device"], "cpu");
  for (const char* k : {"allocated", "reserved", "peak", "total", "free", "limit", "alloc_count"})
    EXPECT_TRUE(cpu.contains(k) && cpu[k].is_number_integer()) << k;
  EXPECT_EQ(cpu["allocated"].get<int64_t>(), allocated);
  EXPECT_EQ(cpu["limit"].get<int64_t>(), 1LL << 40);
  EXPECT_GE(cpu["alloc_count"].get<int64_t>(), 1);
  ASSERT_TRUE(j.contains("host"));
  for (const char* k : {"rss", "peak_rss", "available", "total"})
    EXPECT_TRUE(j["host"].contains(k) && j["host"][k].get<int64_t>() > 0) << k;

  const std::string text = memory_report_text();
  EXPECT_NE(text.find("allocated"), std::string::npos) << text;
  EXPECT_NE(text.find("\ncpu "), std::string::npos) << text;
  EXPECT_NE(text.find("1.00 TiB"), std::string::npos) << text;  // the limit
  EXPECT_NE(text.find("host: rss "), std::string::npos) << text;
}

TEST(MemoryBackend, ReportsAndLimitsCudaDevice_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  auto& gpu = memory_backend(c10::Device("cuda:0"));
  EXPECT_EQ(gpu.device(), "cuda:0");
  const MemoryStats s0 = gpu.stats();
  EXPECT_GT(s0.total, 0);
  EXPECT_GT(s0.free, 0);
  const auto opts = at::TensorOptions().device(c10::Device("cuda:0"));
  {
    at::Tensor t = at::empty({kMiB / 4}, opts.dtype(at::kFloat));  // 1 MiB: a 512-byte multiple
    const MemoryStats s = gpu.stats();
    EXPECT_EQ(s.allocated - s0.allocated, kMiB);
    EXPECT_GE(s.reserved, s.allocated);
    EXPECT_GE(s.peak, s.allocated);
    EXPECT_EQ(s.alloc_count - s0.alloc_count, 1);
  }
  gpu.reset_peak();
  EXPECT_EQ(gpu.stats().peak, gpu.stats().allocated);
  gpu.release_cached();
  const MemoryStats s1 = gpu.stats();
  EXPECT_EQ(s1.reserved - s1.allocated, 0);  // nothing cached after emptyCache

  // A budget of 256 MiB: a 1 GiB request fails with the c10 OOM type.
  gpu.set_limit(s1.reserved + 256 * kMiB);
  EXPECT_EQ(gpu.stats().limit, s1.reserved + 256 * kMiB);
  EXPECT_THROW(at::empty({1LL << 30}, opts.dtype(at::kByte)), c10::OutOfMemoryError);
  gpu.set_limit(0);
  gpu.release_cached();
  EXPECT_EQ(gpu.stats().limit, 0);
  EXPECT_NO_THROW(at::empty({64 * kMiB}, opts.dtype(at::kByte)));
}

TEST(MemoryBackend, CudaBackendRefusedWithoutCudaBuildOrDevice) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA present: covered by the _CUDA test";
  EXPECT_THROW(memory_backend(c10::Device("cuda:0")), c10::Error);
}


// The loss's chunks free and take again blocks of one size (logits, their gradient) while
// the rest of the step is live, in phases of different sizes: the cache must hold both
// phases' blocks over the high water. S with checkpointing (live peak 60 MiB, 8 MiB chunks)
// mapped four blocks anew each step under a 16 MiB floor; under 32 MiB the same step, after
// the first, maps nothing new. This is that step in miniature, so it runs before the other
// cache tests raise the process's high water past it.
TEST_F(CpuBudget, AStepThatRepeatsItsSizesMapsNothingNew) {
  release_cpu_cached_blocks();
  const int64_t big = 8 * kMiB;
  at::Tensor rest = bytes(8 * kMiB);  // the rest of the step, live throughout
  const auto step = [&] {
    for (int64_t size : {big, big - kMiB / 2}) {  // two phases, three blocks each
      std::vector<at::Tensor> chunk;
      for (int i = 0; i < 3; ++i) chunk.push_back(bytes(size));
    }
  };
  step();
  const CpuAllocatorCounters warm = cpu_allocator_counters();
  // The case: this step set the high water, and a quarter of it is less than the blocks of
  // the phase the cache holds while the other phase is live.
  ASSERT_LE(warm.high_water, rest.nbytes() + 3 * big + kMiB)
      << "an earlier test raised the high water past this scenario: run it first";
  ASSERT_LT(warm.high_water / 4, 3 * big);
  step();
  step();
  EXPECT_EQ(cpu_allocator_counters().maps, warm.maps);
  rest = at::Tensor();
  release_cpu_cached_blocks();
}

// Large blocks: a freed block is handed out again for a size of its class (the same pages,
// no new mapping), cached bytes are not counted as allocated, and release unmaps them.
TEST_F(CpuBudget, LargeBlocksAreReusedAndReleased) {
  release_cpu_cached_blocks();
  const auto base = cpu_allocator_counters();
  EXPECT_EQ(base.cached, 0);
  void* first = nullptr;
  {
    at::Tensor t = at::empty({kMiB}, at::kByte);  // 1 MiB: above the cached size
    first = t.data_ptr();
    EXPECT_EQ(cpu_allocated_bytes() - base.allocated, kMiB);
  }
  const auto freed = cpu_allocator_counters();
  EXPECT_EQ(freed.allocated, base.allocated);
  // The block with its header, in whole pages rounded up to its class: an eighth of 1 MiB.
  EXPECT_EQ(freed.cached, kMiB + kMiB / 8);
  {
    at::Tensor again = at::empty({kMiB - 16}, at::kByte);  // a smaller size of the class
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(cpu_allocator_counters().cached, 0);
    again.fill_(7);
    EXPECT_EQ(again.sum().item<int64_t>(), 7 * (kMiB - 16));
  }
  {
    at::Tensor larger = at::empty({kMiB + kMiB / 10}, at::kByte);  // 10 % larger: the same class
    EXPECT_EQ(larger.data_ptr(), first);
    larger.fill_(1);
    EXPECT_EQ(larger.sum().item<int64_t>(), kMiB + kMiB / 10);
  }
  const int64_t maps = cpu_allocator_counters().maps;
  {
    at::Tensor next = at::empty({kMiB + kMiB / 8}, at::kByte);  // with its header, past the class
    EXPECT_NE(next.data_ptr(), first);
    EXPECT_EQ(cpu_allocator_counters().maps, maps + 1);
  }
  release_cpu_cached_blocks();
  EXPECT_EQ(cpu_allocator_counters().cached, 0);
}

// A sequence that grows a little at each forward (generation without a key/value cache,
// batches padded to their longest row) asks for a slightly larger block every time: sizes
// within an eighth share a class, so it maps a block per class it crosses, not one per step.
TEST_F(CpuBudget, AGrowingSizeMapsABlockPerClassNotPerStep) {
  release_cpu_cached_blocks();
  const int64_t maps = cpu_allocator_counters().maps;
  at::Tensor weight = bytes(6 * kMiB);  // a size every step also asks for, live throughout
  for (int64_t step = 0; step < 64; ++step) {
    at::Tensor activation = bytes(2 * kMiB + step * 8192);  // 2 MiB growing to 2.5 MiB
    at::Tensor dequantized = bytes(3 * kMiB);
  }
  // 2 MiB + header to 2.5 MiB crosses three classes of 256 KiB; the 3 MiB block maps once.
  EXPECT_LE(cpu_allocator_counters().maps - maps, 1 + 3 + 1);
  weight = at::Tensor();
  release_cpu_cached_blocks();
}

// When a miss must make room under the line, the blocks freed longest ago go first: blocks of
// sizes the run no longer asks for, not the ones it takes again at every step. Evicting the
// largest first, two sizes taken in turn each evicted the other: a mapping every time.
TEST_F(CpuBudget, AMissEvictsTheBlocksFreedLongestAgo) {
  release_cpu_cached_blocks();
  const auto line = [](const CpuAllocatorCounters& c) {
    return c.high_water + std::max<int64_t>(c.high_water / 4, 32 * kMiB);
  };
  // 40 MiB of blocks of a phase that is over, live together, then freed into the cache.
  {
    std::vector<at::Tensor> stale;
    for (int i = 0; i < 16; ++i) stale.push_back(bytes(2 * kMiB + i * 64 * 1024 + kMiB / 2));
  }
  auto c = cpu_allocator_counters();
  const int64_t room = line(c) - c.allocated - c.cached;
  ASSERT_GT(c.cached, 36 * kMiB);
  ASSERT_LT(room, 48 * kMiB) << "an earlier test raised the high water past this scenario: run it alone";
  // The live rest of the step leaves 16 MiB: room for either block of the step, not both.
  at::Tensor rest = bytes(room - 16 * kMiB);
  const auto step = [&] {
    { at::Tensor a = bytes(10 * kMiB); }
    { at::Tensor b = bytes(9 * kMiB); }
  };
  step();
  const int64_t warm = cpu_allocator_counters().maps;
  for (int i = 0; i < 8; ++i) step();
  EXPECT_EQ(cpu_allocator_counters().maps, warm);
  c = cpu_allocator_counters();
  EXPECT_LE(c.allocated + c.cached, line(c));
  rest = at::Tensor();
  release_cpu_cached_blocks();
}

// What the process holds (live + cached) stays under the live high-water mark plus a
// quarter (at least 32 MiB): freeing many blocks after a smaller peak does not keep them all.
TEST_F(CpuBudget, CacheStaysUnderTheHighWaterLine) {
  release_cpu_cached_blocks();
  const int64_t block = 4 * kMiB;
  std::vector<at::Tensor> ts;
  for (int i = 0; i < 16; ++i) ts.push_back(at::empty({block}, at::kByte));
  ts.clear();
  const auto line = [](const CpuAllocatorCounters& c) {
    return c.high_water + std::max<int64_t>(c.high_water / 4, 32 * kMiB);
  };
  auto after = cpu_allocator_counters();
  EXPECT_LE(after.allocated + after.cached, line(after));
  EXPECT_GE(after.cached, 16 * block);  // all fit: they were live at the high water
  // A different size misses: cached blocks are unmapped to keep the new one under the line.
  std::vector<at::Tensor> other;
  for (int i = 0; i < 12; ++i) other.push_back(at::empty({block + kMiB}, at::kByte));
  after = cpu_allocator_counters();
  EXPECT_LE(after.allocated + after.cached, line(after));
  EXPECT_LT(after.cached, 16 * block);
  other.clear();
  release_cpu_cached_blocks();
  EXPECT_EQ(cpu_allocator_counters().cached, 0);
}

}  // namespace
}  // namespace memtune
