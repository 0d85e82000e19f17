#pragma once
// Helpers shared by memtune's tests: temporary directories, running the real command,
// and the paths of the source tree and the build.
#include <filesystem>
#include <sys/types.h>
#include <string>
#include <vector>

namespace memtune::testing {

namespace fs = std::filesystem;

// A fresh, empty directory under the build tree, named after the running test.
fs::path temp_dir(const std::string& tag = "");

struct CommandResult {
  int exit_code = -1;   // the process's exit status, or 128 + signal
  std::string output;   // stdout and stderr together
};

// Runs `command` through /bin/sh with a time limit; output captured.
CommandResult run(const std::string& command, int timeout_s = 600);

// The built memtune binary, the source tree, and Debian's python3 (with python3-torch).
std::string memtune_bin();
fs::path source_dir();
std::string python();  // "/usr/bin/python3"
bool python_torch_available();

std::string read_file(const fs::path& path);  // the bytes as they are

// Runs tests/reference/SCRIPT OUT_DIR with python() into a fresh directory of this process
// under the build tree and returns it (ctest -j runs a suite's tests in parallel processes,
// each writing its own). A failing script fails the calling test with its output.
fs::path make_reference_fixtures(const std::string& script);

// A command (memtune launch) running in the background, its output in `log`; killed with
// SIGKILL when it goes out of scope while still running.
struct Background {
  pid_t pid = -1;
  fs::path log;

  Background(const std::string& cmd, fs::path log_file);
  ~Background();
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  // Exit status (128 + signal when killed), or -1 when still running after `limit_s`.
  int wait(double limit_s);
  // The pid of its child process with RANK=rank in its environment (a launcher's worker), or -1.
  pid_t worker(int rank) const;
};

// Runs `world` copies of this test binary at once as the ranks of a group on 127.0.0.1
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; one thread each), each with `env`
// ("NAME=value") set and only the test `worker` selected. Returns their exit codes; a
// failing rank's log (kept in `dir`) is added to the test's failures.
std::vector<int> run_workers(const std::string& env, const std::string& worker, int world, const fs::path& dir,
                             int timeout_s);
void write_file(const fs::path& path, const std::string& text);

}  // namespace memtune::testing

// GPU tests are named *_CUDA and skip themselves at run time without a GPU.
#define MEMTUNE_SKIP_WITHOUT_CUDA()                                     \
  do {                                                                  \
    if (!::memtune::testing::cuda_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Multi-process CPU tests need c10d's Gloo backend, absent from builds against a LibTorch
// without gloo's headers (runtime/process_group.h).
#define MEMTUNE_REQUIRE_GLOO()                                                               \
  do {                                                                                       \
    if (!::memtune::testing::gloo_built()) GTEST_SKIP() << "built without Gloo (no headers)"; \
  } while (0)

namespace memtune::testing {
bool cuda_available();
bool gloo_built();
}

#include <nlohmann/json.hpp>

namespace memtune::testing {
// The JSON objects of a .jsonl file (metrics.jsonl), in order; rows lacking `key` are
// skipped when a key is given.
std::vector<nlohmann::json> read_jsonl(const fs::path& path, const std::string& key = "");
}  // namespace memtune::testing

#include <map>

#include <ATen/core/Tensor.h>

namespace memtune::testing {
// Every tensor of a safetensors file, by name.
std::map<std::string, at::Tensor> load_all_tensors(const fs::path& file);
// The two files hold the same names, and each tensor agrees to tol x max(1, max |a|).
void expect_same_tensors(const fs::path& a, const fs::path& b, double tol);
// The same, but up to one element in `per` of all the files' elements may differ by more than
// tol x max(1, max |a|), each by at most outlier_tol x max(1, max |a|). For two runs that
// differ only in the order of their sums: Adam moves a weight whose gradient is near its eps,
// or whose 8-bit state code sits on the edge of two values, by a good part of the learning
// rate on rounding noise, while every other element agrees to rounding; a real difference of
// the math (a sample, a mask, a rank's state) moves most elements.
void expect_same_tensors(const fs::path& a, const fs::path& b, double tol, double outlier_tol, int64_t per);
// `actual` against a reference: same shape and dtype, max |actual - expected| <= tol x
// max(floor, max |expected|). `what` names the pair in the failure message.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol, const std::string& what,
                  double floor = 0.0);

// Reference fixtures as raw bytes (tests/reference/*.py write little-endian arrays).
// reference_bytes: a fixture file's bytes; a missing file fails the calling test.
std::string reference_bytes(const fs::path& path);
// The lines of a fixture's listing (cases.txt), one case each.
std::vector<std::string> reference_lines(const fs::path& path);
// A tensor of `dtype` and `shape` holding `bytes`; a size that does not match fails the test.
at::Tensor tensor_from_bytes(const std::string& bytes, at::ScalarType dtype, at::IntArrayRef shape);
// The bytes of a tensor (on any device), contiguous.
std::string bytes_of(const at::Tensor& t);
// Same shape, dtype and bytes (NaNs compare by their bits).
bool same_bits(const at::Tensor& a, const at::Tensor& b);
}  // namespace memtune::testing
