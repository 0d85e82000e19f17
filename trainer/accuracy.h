#pragma once
// Exact-match accuracy on instruction data: the prompt rendered by the template, a greedy
// continuation up to eos, compared with the record's output. Shows learning, not only a loss.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>

namespace memtune::models {
class CausalLM;
}
namespace memtune::data {
class ChatTemplate;
class Tokenizer;
}

namespace memtune::trainer {

struct AccuracyResult {
  int64_t correct = 0, total = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> per_task;  // "task" field -> (correct, total)
  bool stopped = false;  // `stop` ended it before max_rows
  double share() const { return total ? static_cast<double>(correct) / static_cast<double>(total) : 0.0; }
  std::string describe() const;  // "62.0% (124/200); add 40%, reverse 70%, ..."
};

// The first `max_rows` records of an instruction JSONL file (instruction, input, output),
// each prompt rendered by `tmpl` (the run's data template).
AccuracyResult instruction_accuracy(models::CausalLM& model, const data::Tokenizer& tokenizer,
                                    const data::ChatTemplate& tmpl, const std::filesystem::path& file,
                                    int64_t max_rows, int64_t max_new_tokens = 12,
                                    const std::function<bool()>& stop = {});

}  // namespace memtune::trainer
