#include "tools/tokenize_file.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/tokenizer.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::cli {

namespace {

void write_ids(std::ostream& out, const std::vector<int32_t>& ids, bool as_json) {
  if (as_json) out << '[';
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out << (as_json ? "," : " ");
    out << ids[i];
  }
  if (as_json) out << ']';
  out << '\n';
}

}  // namespace

TokenizeStats tokenize_file(const TokenizeOptions& options, std::ostream& out, std::ostream& stats_out) {
  const std::string& format = options.format;
  MEMTUNE_CHECK(format == "jsonl" || format == "ids" || format == "text", "tokenize: format \"", format,
                "\" is unknown; use jsonl, ids or text");
  const auto tok = data::Tokenizer::load(options.tokenizer);
  std::ifstream in(options.input, std::ios::binary);
  MEMTUNE_CHECK(in, options.input.string(), ": cannot open the input file");
  TokenizeStats stats;
  auto emit = [&](const std::string& text, bool as_json) {
    const auto ids = tok->encode(text, options.add_special_tokens);
    write_ids(out, ids, as_json);
    ++stats.documents;
    stats.tokens += static_cast<int64_t>(ids.size());
    stats.bytes += static_cast<int64_t>(text.size());
  };
  if (format == "text") {
    std::ostringstream ss;
    ss << in.rdbuf();
    emit(ss.str(), false);
  } else {
    std::string line;
    for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (format == "ids") {
        emit(line, false);
        continue;
      }
      nlohmann::json j;
      check_json_depth(line, str_cat(options.input.string(), ":", lineno));
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        fail(options.input.string(), ":", lineno, ": not valid JSON near \"", line.substr(0, 80), "\" (", e.what(),
             "); --format jsonl expects one JSON string per line");
      }
      MEMTUNE_CHECK(j.is_string(), options.input.string(), ":", lineno, ": expected a JSON string, got ",
                    j.dump().substr(0, 80), "; --format jsonl expects one JSON string per line");
      emit(j.get<std::string>(), true);
    }
  }
  out.flush();
  if (options.stats) {
    stats_out << "documents " << stats.documents << ", tokens " << stats.tokens << ", bytes " << stats.bytes
              << ", bytes/token " << stats.bytes_per_token() << "\n";
  }
  return stats;
}

}  // namespace memtune::cli
