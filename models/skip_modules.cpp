#include "models/skip_modules.h"

#include "models/causal_lm.h"
#include "models/module_regex.h"
#include "runtime/error.h"

namespace memtune::models {

SkipMatcher::SkipMatcher(const SkipModules& skip, const std::string& where) {
  if (!skip) return;
  patterns_ = *skip;
  regexes_.reserve(patterns_.size());
  for (const std::string& p : patterns_) {
    const std::string problem = compile_module_regex(p, regexes_.emplace_back());
    MEMTUNE_CHECK(problem.empty(), where, ": '", p, "' is not a valid regular expression (", problem,
                  "); transformers matches each entry as a regex at the start of a module's name, or as the end of "
                  "the name. Hint: a module's name as written (model.layers.1.mlp), or escape the special characters");
  }
}

int SkipMatcher::match(const std::string& module) const {
  for (size_t i = 0; i < patterns_.size(); ++i) {
    const std::string& p = patterns_[i];
    const bool suffix = module.size() >= p.size() && module.compare(module.size() - p.size(), p.size(), p) == 0;
    if (suffix || std::regex_search(module, regexes_[i], std::regex_constants::match_continuous))
      return static_cast<int>(i);
  }
  return -1;
}

std::string quoted_list(const std::vector<std::string>& patterns) {
  std::string list;
  for (const std::string& p : patterns) list += str_cat(list.empty() ? "" : ", ", "'", p, "'");
  return "[" + list + "]";
}

std::vector<bool> dense_projections(const CausalLM& model, const SkipModules& skip, const std::string& where) {
  const SkipMatcher matcher(skip, where);
  std::vector<bool> dense;
  dense.reserve(model.tensors().size());
  for (const TensorSlot& t : model.tensors())
    dense.push_back(t.role == TensorRole::kLinearWeight && matcher.keeps_dense(t.linear->name()));
  return dense;
}

std::vector<std::string> check_skip_modules(const CausalLM& model, const std::vector<std::string>& patterns,
                                            const std::string& where) {
  bool names_head = false;
  std::vector<std::string> unused;
  for (const std::string& p : patterns) {
    const SkipMatcher one(std::vector<std::string>{p}, where);
    const bool head = one.keeps_dense(kOutputModule);
    bool any = head;
    for (const Linear* l : model.linears()) any = any || one.keeps_dense(l->name());
    names_head = names_head || head;
    if (!any) unused.push_back(p);
  }
  MEMTUNE_CHECK(names_head, where, ": ", quoted_list(patterns), " does not name ", kOutputModule,
                ". A list replaces transformers' default (the output layer), so transformers would quantize ",
                kOutputModule, " too, and memtune keeps the output layer dense. Hint: add '", kOutputModule,
                "' to the list");
  return unused;
}

}  // namespace memtune::models
