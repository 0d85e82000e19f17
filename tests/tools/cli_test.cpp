// Exit codes of the memtune command: each kind of failure has its own (tools/cli.h).
#include <gtest/gtest.h>

#include <stdexcept>

#include <c10/util/Exception.h>

#include "runtime/error.h"
#include "runtime/supervisor.h"
#include "tools/cli.h"

namespace memtune::cli {
namespace {

template <class E>
int code_for(const E& e) {
  return report_exception(std::make_exception_ptr(e));
}

int code_for_internal_assert() {
  try {
    const int layers = 3;
    MEMTUNE_INTERNAL_ASSERT(layers == 4, "the model has ", layers, " layers");
  } catch (...) {
    return report_exception(std::current_exception());
  }
  return -1;
}

TEST(Cli, EachKindOfFailureHasItsExitCode) {
  EXPECT_EQ(code_for(UserError("training.max_steps: -2")), 2);
  EXPECT_EQ(code_for(MemoryExhausted("nothing fits")), 3);
  EXPECT_EQ(code_for(InternalError("x")), 70);
  EXPECT_EQ(code_for_internal_assert(), 70);
  EXPECT_EQ(code_for(std::runtime_error("map::at")), 1);
}

TEST(Cli, InternalAssertNamesTheLineAndTheCondition) {
  try {
    MEMTUNE_INTERNAL_ASSERT(1 + 1 == 3, "arithmetic");
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cli_test.cpp:"), std::string::npos) << m;
    EXPECT_NE(m.find("1 + 1 == 3 does not hold: arithmetic"), std::string::npos) << m;
  } catch (const UserError&) {
    FAIL() << "an internal invariant reported itself as bad input";
  }
}

}  // namespace
}  // namespace memtune::cli
