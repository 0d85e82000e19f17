// Test entry point: the same threading set-up as the memtune command, so that tests run
// at the speed users see (see runtime/threads.h).
#include <gtest/gtest.h>

#include "runtime/log.h"
#include "runtime/threads.h"

#ifdef __SANITIZE_ADDRESS__
// Sanitizer builds (scripts/sanitize.sh): LibTorch's and OpenBLAS's thread pools keep their
// allocations for the process's life, which LeakSanitizer would report at every exit
// (test discovery included); leaks are not what that build looks for.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  memtune::configure_threads(0);
  memtune::init_logging({.level = "warn"});
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
