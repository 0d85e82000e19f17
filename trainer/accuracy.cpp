#include "trainer/accuracy.h"

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "models/causal_lm.h"
#include "models/generate.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::trainer {

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string percent(int64_t c, int64_t t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", t ? 100.0 * static_cast<double>(c) / static_cast<double>(t) : 0.0);
  return buf;
}

}  // namespace

std::string AccuracyResult::describe() const {
  std::string s = percent(correct, total) + " (" + std::to_string(correct) + "/" + std::to_string(total) + ")";
  std::string tasks;
  for (const auto& [task, ct] : per_task) tasks += (tasks.empty() ? "" : ", ") + task + " " + percent(ct.first, ct.second);
  return tasks.empty() ? s : s + "; " + tasks;
}

AccuracyResult instruction_accuracy(models::CausalLM& model, const data::Tokenizer& tok, const data::ChatTemplate& tmpl,
                                    const std::filesystem::path& file, int64_t max_rows, int64_t max_new_tokens,
                                    const std::function<bool()>& stop) {
  std::ifstream in(file);
  MEMTUNE_CHECK(in.good(), file.string(), ": cannot read");
  AccuracyResult r;
  std::string line;
  int64_t line_no = 0;
  while (r.total < max_rows && std::getline(in, line)) {
    if (stop && stop()) {
      r.stopped = true;
      break;
    }
    ++line_no;
    if (trim(line).empty()) continue;
    nlohmann::json rec;
    check_json_depth(line, str_cat(file.string(), ":", line_no));
    try {
      rec = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(file.string(), ":", line_no, ": not valid JSON: ", e.what());
    }
    MEMTUNE_CHECK(rec.contains("instruction") && rec.contains("output"), file.string(), ":", line_no,
                  ": accuracy needs instruction records ({instruction, input, output})");
    // The prompt: every piece up to the response, i.e. the pieces that are not trained.
    auto pieces = tmpl.render_instruction(rec["instruction"].get<std::string>(), rec.value("input", std::string()), "",
                                          tok.bos_id, std::nullopt, /*train_on_prompt=*/false);
    std::vector<int32_t> prompt;
    for (const auto& p : pieces) {
      if (p.trained) break;
      if (p.special) prompt.push_back(*p.special);
      else for (int32_t id : tok.encode(p.text, false)) prompt.push_back(id);
    }
    models::GenerateOptions o;
    o.max_new_tokens = max_new_tokens;
    o.eos_id = tok.eos_id;
    std::vector<int32_t> out = models::generate(model, prompt, o);
    if (!out.empty() && tok.eos_id && out.back() == *tok.eos_id) out.pop_back();
    const bool ok = trim(tok.decode(out, true)) == trim(rec["output"].get<std::string>());
    const std::string task = rec.value("task", std::string("all"));
    r.correct += ok;
    r.total += 1;
    r.per_task[task].first += ok;
    r.per_task[task].second += 1;
  }
  return r;
}

}  // namespace memtune::trainer
