#include "fuzz_util.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <typeinfo>
#include <vector>

#include <cxxabi.h>

#include "data/tokenizer.h"
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

void exercise_tokenizer(const data::Tokenizer& tok, const std::string& tail) {
  const std::string sample =
      "Hello, world! 123 h\xC3\xA9llo\n\t<s> " + tail.substr(tail.size() - std::min<size_t>(tail.size(), 64));
  for (bool special : {false, true}) {
    std::vector<int32_t> ids = tok.encode(sample, special);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    (void)tok.decode(ids, special);
  }
  const int64_t n = std::min<int64_t>(tok.vocab_size(), 512);
  std::vector<int32_t> all;
  for (int32_t id = 0; id < n; ++id) {
    (void)tok.token_to_id(tok.id_to_token(id));
    all.push_back(id);
  }
  (void)tok.decode(all, false);
  (void)tok.decode(all, true);
}

const data::Tokenizer& tiny_tokenizer() {
  static const std::unique_ptr<data::Tokenizer> tok =
      data::Tokenizer::load(MEMTUNE_SOURCE_DIR "/examples/tiny-tokenizer");
  return *tok;
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
