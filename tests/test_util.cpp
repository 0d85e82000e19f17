#include "test_util.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <ATen/Context.h>

#include "runtime/atomic_file.h"
#include "runtime/dist_env.h"
#include "runtime/error.h"
#include "runtime/process_group.h"

namespace memtune::testing {

fs::path temp_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "test";
  for (char& c : name)
    if (c == '/') c = '_';
  if (!tag.empty()) name += "." + tag;
  fs::path dir = fs::path(MEMTUNE_BUILD_DIR) / "test-tmp" / name;
  remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

CommandResult run(const std::string& command, int timeout_s) {
  std::string wrapped = "timeout -k 10 " + std::to_string(timeout_s) + " sh -c '" + [&] {
    std::string escaped;
    for (char c : command) escaped += (c == '\'') ? std::string("'\\''") : std::string(1, c);
    return escaped;
  }() + "' 2>&1";
  CommandResult result;
  FILE* pipe = popen(wrapped.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  int status = pclose(pipe);
  if (WIFEXITED(status))
    result.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    result.exit_code = 128 + WTERMSIG(status);
  return result;
}

Background::Background(const std::string& cmd, fs::path log_file) : log(std::move(log_file)) {
  pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > " + log.string() + " 2>&1").c_str(), nullptr);
    _exit(127);
  }
}

Background::~Background() {
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
}

int Background::wait(double limit_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

pid_t Background::worker(int rank) const {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_file(entry.path() / "stat");
    size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    if (sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) != 2 || ppid != pid) continue;
    std::string env = read_file(entry.path() / "environ");
    if (env.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos ||
        env.rfind("RANK=" + std::to_string(rank) + '\0', 0) == 0)
      return std::stoi(name);
  }
  return -1;
}

std::vector<int> run_workers(const std::string& env, const std::string& worker, int world, const fs::path& dir,
                             int timeout_s) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const int port = free_tcp_port();
  std::string cmd;
  for (int r = 0; r < world; ++r)
    cmd += str_cat("(", env, " RANK=", r, " WORLD_SIZE=", world, " LOCAL_RANK=", r, " LOCAL_WORLD_SIZE=", world,
                   " MASTER_ADDR=127.0.0.1 MASTER_PORT=", port, " OMP_NUM_THREADS=1 ", self, " --gtest_filter=", worker,
                   " > ", (dir / str_cat("rank", r, ".log")).string(), " 2>&1; echo $? > ",
                   (dir / str_cat("rc", r)).string(), ") & ");
  cmd += "wait";
  run(cmd, timeout_s);
  std::vector<int> codes;
  for (int r = 0; r < world; ++r) {
    const std::string rc = read_file(dir / str_cat("rc", r));
    codes.push_back(rc.empty() ? -1 : std::atoi(rc.c_str()));
    if (codes.back() != 0) ADD_FAILURE() << "rank " << r << ":\n" << read_file(dir / str_cat("rank", r, ".log"));
  }
  return codes;
}


std::string memtune_bin() { return MEMTUNE_BIN; }
fs::path source_dir() { return MEMTUNE_SOURCE_DIR; }
std::string python() { return "/usr/bin/python3"; }

bool python_torch_available() {
  static int cached = -1;
  if (cached < 0) cached = run(python() + " -c 'import torch'", 120).exit_code == 0;
  return cached == 1;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path make_reference_fixtures(const std::string& script) {
  const fs::path dir = fs::path(MEMTUNE_BUILD_DIR) / "test-tmp" /
                       (fs::path(script).stem().string() + "-" + std::to_string(::getpid()));
  memtune::remove_tree(dir);
  const CommandResult r = run(python() + " " + (source_dir() / "tests/reference" / script).string() + " " + dir.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir;
}

void write_file(const fs::path& path, const std::string& text) {
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << text;
}

bool cuda_available() { return at::hasCUDA(); }
bool gloo_built() { return ProcessGroup::backend_built("gloo"); }

}  // namespace memtune::testing

namespace memtune::testing {

std::vector<nlohmann::json> read_jsonl(const fs::path& path, const std::string& key) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line);
    if (key.empty() || j.contains(key)) rows.push_back(std::move(j));
  }
  return rows;
}

}  // namespace memtune::testing

#include <ATen/ATen.h>

#include "models/io/safetensors.h"

namespace memtune::testing {

std::map<std::string, at::Tensor> load_all_tensors(const fs::path& file) {
  std::map<std::string, at::Tensor> out;
  models::SafetensorsFile f(file);
  for (const auto& n : f.names()) out[n] = f.load(n);
  return out;
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol, const std::string& what,
                  double floor) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const double err = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  const double scale = std::max(floor, expected.to(at::kDouble).abs().max().item<double>());
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << " vs scale " << scale;
}

namespace {

// Elements of `a` further than tol x max(1, max |a|) from `b`'s, and the largest difference
// over that scale, across same-named tensors.
struct TensorDifference {
  int64_t elements = 0, beyond = 0;
  double worst = 0;
};

TensorDifference tensor_difference(const std::map<std::string, at::Tensor>& a,
                                   const std::map<std::string, at::Tensor>& b, double tol) {
  TensorDifference d;
  for (const auto& [name, t] : a) {
    const auto other = b.find(name);
    if (other == b.end()) continue;
    const double scale = std::max(1.0, t.abs().max().item<double>());
    const at::Tensor diff = (t.to(at::kDouble) - other->second.to(at::kDouble)).abs() / scale;
    d.elements += t.numel();
    d.beyond += (diff > tol).sum().item<int64_t>();
    d.worst = std::max(d.worst, diff.max().item<double>());
  }
  return d;
}

}  // namespace

void expect_same_tensors(const fs::path& a, const fs::path& b, double tol, double outlier_tol, int64_t per) {
  auto ta = load_all_tensors(a), tb = load_all_tensors(b);
  ASSERT_EQ(ta.size(), tb.size());
  ASSERT_FALSE(ta.empty());
  for (const auto& [name, t] : ta) ASSERT_TRUE(tb.count(name)) << name;
  const TensorDifference d = tensor_difference(ta, tb, tol);
  EXPECT_LE(d.beyond * per, d.elements) << d.beyond << " of " << d.elements << " elements differ by more than " << tol;
  EXPECT_LE(d.worst, outlier_tol) << "the largest difference";
}

void expect_same_tensors(const fs::path& a, const fs::path& b, double tol) {
  auto ta = load_all_tensors(a), tb = load_all_tensors(b);
  ASSERT_EQ(ta.size(), tb.size());
  ASSERT_FALSE(ta.empty());
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << name;
    double scale = std::max(1.0, t.abs().max().item<double>());
    EXPECT_LE((t - tb[name]).abs().max().item<double>(), tol * scale) << name;
  }
}

std::string reference_bytes(const fs::path& path) {
  EXPECT_TRUE(fs::exists(path)) << "no reference fixture " << path;
  return read_file(path);
}

std::vector<std::string> reference_lines(const fs::path& path) {
  std::istringstream in(reference_bytes(path));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

at::Tensor tensor_from_bytes(const std::string& bytes, at::ScalarType dtype, at::IntArrayRef shape) {
  at::Tensor t = at::empty(shape, at::TensorOptions(dtype));
  const size_t size = static_cast<size_t>(t.numel()) * t.element_size();
  EXPECT_EQ(size, bytes.size()) << "bytes for a tensor of " << shape << " " << dtype;
  std::memcpy(t.data_ptr(), bytes.data(), std::min(size, bytes.size()));
  return t;
}

std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()) * c.element_size());
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && bytes_of(a) == bytes_of(b);
}

}  // namespace memtune::testing
