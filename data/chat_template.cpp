#include "data/chat_template.h"

#include "data/utf8.h"
#include "runtime/error.h"

namespace memtune::data {
namespace {

// Python's str.isspace() code points.
bool python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Appends `text` with {role}/{content}/{bos}/{eos} expanded; pieces before {content} are
// `prompt_trained`, {content} and after are `content_trained`.
void expand(const std::string& pattern, const Message& m, std::optional<int32_t> bos,
            std::optional<int32_t> eos, bool prompt_trained, bool content_trained,
            std::vector<TemplatePiece>& out) {
  bool trained = prompt_trained;
  std::string text;
  auto flush = [&] {
    if (!text.empty()) out.push_back({text, std::nullopt, trained});
    text.clear();
  };
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if ((c == '{' || c == '}') && i + 1 < pattern.size() && pattern[i + 1] == c) {
      text += c;
      ++i;
      continue;
    }
    if (c != '{') {
      text += c;
      continue;
    }
    const size_t close = pattern.find('}', i);
    const std::string name = pattern.substr(i + 1, close - i - 1);
    i = close;
    if (name == "role") {
      text += m.role;
    } else if (name == "content") {
      flush();
      trained = content_trained;
      text += m.content;
    } else {  // bos / eos (validated by parse)
      flush();
      const auto id = name == "bos" ? bos : eos;
      if (id) out.push_back({"", id, trained});
    }
  }
  flush();
}

}  // namespace

ChatTemplate ChatTemplate::builtin(const std::string& name) {
  ChatTemplate t;
  if (name == "llama-3") {
    t.begin_ = "<|begin_of_text|>";
    t.pattern_ = "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>";
  } else if (name == "chatml") {
    t.pattern_ = "<|im_start|>{role}\n{content}<|im_end|>\n";
  } else if (name == "alpaca") {
    t.begin_ = "{bos}";
    t.pattern_ = "{content}\n\n";
    t.role_patterns_ = {{"user", "### Instruction:\n{content}\n\n"},
                        {"input", "### Input:\n{content}\n\n"},
                        {"assistant", "### Response:\n{content}"}};
    t.after_assistant_ = "\n\n";
    t.input_as_message_ = true;
  } else if (name == "gemma") {
    t.begin_ = "{bos}";
    t.pattern_ = "<start_of_turn>{role}\n{content}<end_of_turn>\n";
    t.role_patterns_ = {{"assistant", "<start_of_turn>model\n{content}<end_of_turn>\n"}};
    t.gemma_turns_ = true;
  } else {
    fail("data.template_name: unknown template '", name,
         "'; built-in templates are llama-3, chatml, alpaca, gemma (or set data.chat_template)");
  }
  return t;
}

std::string strip_whitespace(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && utf8::valid_length(s, begin) > 0) {
    size_t i = begin;
    if (!python_space(utf8::next(s, i))) break;
    begin = i;
  }
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t i = start;
    if (utf8::valid_length(s, start) != static_cast<int>(end - start) || !python_space(utf8::next(s, i))) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

ChatTemplate ChatTemplate::parse(const std::string& pattern) {
  bool has_content = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if ((c == '{' || c == '}') && i + 1 < pattern.size() && pattern[i + 1] == c) {
      ++i;
      continue;
    }
    MEMTUNE_CHECK(c != '}', "data.chat_template: unmatched '}' at offset ", i, " in \"", pattern,
                  "\"; write }} for a literal brace");
    if (c != '{') continue;
    const size_t close = pattern.find('}', i);
    MEMTUNE_CHECK(close != std::string::npos, "data.chat_template: unclosed '{' at offset ", i, " in \"",
                  pattern, "\"; write {{ for a literal brace");
    const std::string name = pattern.substr(i + 1, close - i - 1);
    MEMTUNE_CHECK(name == "role" || name == "content" || name == "bos" || name == "eos",
                  "data.chat_template: unknown placeholder {", name, "} in \"", pattern,
                  "\"; known: {role}, {content}, {bos}, {eos} (no Jinja)");
    has_content |= name == "content";
    i = close;
  }
  MEMTUNE_CHECK(has_content, "data.chat_template: \"", pattern,
                "\" has no {content}; it is a per-message pattern such as \"<|{role}|>\\n{content}{eos}\\n\"");
  ChatTemplate t;
  t.pattern_ = pattern;
  return t;
}

std::vector<TemplatePiece> ChatTemplate::render(const std::vector<Message>& messages, std::optional<int32_t> bos,
                                                std::optional<int32_t> eos, bool train_on_prompt) const {
  std::vector<TemplatePiece> out;
  expand(begin_, Message{}, bos, eos, train_on_prompt, train_on_prompt, out);
  if (gemma_turns_) return render_gemma(messages, bos, eos, train_on_prompt, out);
  for (size_t i = 0; i < messages.size(); ++i) {
    const Message& m = messages[i];
    const auto it = role_patterns_.find(m.role);
    const std::string& pattern = it == role_patterns_.end() ? pattern_ : it->second;
    const bool assistant = m.role == "assistant";
    expand(pattern, m, bos, eos, train_on_prompt, train_on_prompt || assistant, out);
    if (assistant && i + 1 < messages.size() && !after_assistant_.empty())
      out.push_back({after_assistant_, std::nullopt, train_on_prompt});
  }
  return out;
}

std::vector<TemplatePiece> ChatTemplate::render_gemma(const std::vector<Message>& messages, std::optional<int32_t> bos,
                                                      std::optional<int32_t> eos, bool train_on_prompt,
                                                      std::vector<TemplatePiece>& out) const {
  const bool system = !messages.empty() && messages[0].role == "system";
  const std::string first_prefix = system ? messages[0].content + "\n\n" : "";  // not trimmed, as the template
  for (size_t i = system ? 1 : 0, turn = 0; i < messages.size(); ++i, ++turn) {
    const Message& m = messages[i];
    // The template's own test: a turn at an even place is a user's, one at an odd place not.
    MEMTUNE_CHECK((m.role == "user") == (turn % 2 == 0), "messages[", i, "] is a '", m.role, "' message where the ",
                  "gemma template wants ", turn % 2 == 0 ? "a 'user' one" : "a reply (not 'user')",
                  ": Gemma's chat template raises unless user turns alternate with others (user, assistant, user, "
                  "...), after an optional first system message. Hint: merge consecutive messages of one role");
    const bool assistant = m.role == "assistant";
    const auto it = role_patterns_.find(m.role);
    const Message turned{m.role, (turn == 0 ? first_prefix : "") + strip_whitespace(m.content)};
    expand(it == role_patterns_.end() ? pattern_ : it->second, turned, bos, eos, train_on_prompt,
           train_on_prompt || assistant, out);
  }
  return out;
}

std::vector<TemplatePiece> ChatTemplate::render_instruction(const std::string& instruction,
                                                            const std::string& input, const std::string& output,
                                                            std::optional<int32_t> bos, std::optional<int32_t> eos,
                                                            bool train_on_prompt) const {
  std::vector<Message> messages;
  if (input_as_message_) {
    messages.push_back({"user", instruction});
    if (!input.empty()) messages.push_back({"input", input});
  } else {
    messages.push_back({"user", input.empty() ? instruction : instruction + "\n\n" + input});
  }
  messages.push_back({"assistant", output});
  return render(messages, bos, eos, train_on_prompt);
}

}  // namespace memtune::data
