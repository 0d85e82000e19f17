#pragma once
// The memtune command line. memtune_main is the whole program; a user who registers their
// own architecture links it with their source file (examples/custom_model/).

#include <exception>

namespace memtune::cli {

int memtune_main(int argc, char** argv);

// Exit codes, one meaning each (documented in `memtune --help` and the README).
enum ExitCode : int {
  kExitOk = 0,
  kExitUnexpected = 1,     // an error memtune did not anticipate (a library's own), reported as a bug too
  kExitBadInput = 2,       // UserError: the config, a file, an argument
  kExitMemory = 3,         // out of memory even at micro-batch 1, or while loading
  kExitInternalBug = 70,   // InternalError: an invariant of memtune's own code broke (EX_SOFTWARE)
};                         // and 128 + N when stopped by signal N after a checkpoint

// Logs the exception in flight the way memtune_main does and returns its exit code.
int report_exception(std::exception_ptr error);

}  // namespace memtune::cli
