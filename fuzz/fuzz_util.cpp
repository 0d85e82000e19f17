#include "fuzz_util.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <typeinfo>

#include <cxxabi.h>

#include "runtime/error.h"
#include "runtime/log.h"

namespace memtune::fuzz {

namespace {

std::string type_name(const std::exception& e) {
  int status = 0;
  char* name = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? name : typeid(e).name();
  std::free(name);
  return out;
}

// memtune logs warnings about odd but accepted input; a fuzzer's output is its stats.
struct Quiet {
  Quiet() {
    LogOptions o;
    o.level = "error";
    init_logging(o);
  }
} quiet;

}  // namespace

void expect_clean(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const UserError&) {
    // a clean refusal
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FINDING: %s escaped: %s\n", type_name(e).c_str(), e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "FINDING: a non-std exception escaped\n");
    std::abort();
  }
}

const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = std::filesystem::temp_directory_path() /
                              ("memtune-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return dir;
}

std::filesystem::path write_file(const std::string& name, const uint8_t* data, size_t size) {
  std::filesystem::path p = scratch_dir() / name;
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", p.c_str());
    std::abort();
  }
  return p;
}

}  // namespace memtune::fuzz
