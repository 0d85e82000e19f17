// Test entry point: the same threading set-up as the memtune command, so that tests run
// at the speed users see (see runtime/threads.h).
#include <gtest/gtest.h>

#include "runtime/log.h"
#include "runtime/threads.h"

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  memtune::configure_threads(0);
  memtune::init_logging({.level = "warn"});
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
