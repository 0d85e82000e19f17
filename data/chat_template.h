#pragma once
// Renders instruction records and chat conversations into text pieces, each marked as
// trained (its tokens are targets) or prompt. No Jinja: built-in templates, or a custom
// per-message pattern with a minimal placeholder syntax:
//
//   {role}     the message's role (system, user, assistant, ...)
//   {content}  the message's content
//   {bos}      the tokenizer's bos token id (nothing when it has none)
//   {eos}      the tokenizer's eos token id (nothing when it has none)
//   {{ / }}    literal braces
//
// The pattern is emitted once per message, e.g. "<|{role}|>\n{content}{eos}\n". In an
// assistant message, {content} and everything after it in the pattern is trained; all
// else is prompt (trained too when train_on_prompt is true).
//
// Built-in templates:
//   llama-3  <|begin_of_text|> then per message
//            <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
//   chatml   <|im_start|>{role}\n{content}<|im_end|>\n
//   alpaca   {bos}, then system "{content}\n\n", user "### Instruction:\n{content}\n\n",
//            input "### Input:\n{content}\n\n", assistant "### Response:\n{content}"
//            (and "\n\n" after an assistant message that is not the last)
//   gemma    Gemma's instruction-tuned models' (Gemma 3's tokenizer_config.json; Gemma 2's
//            is the same without a system role): {bos}, then per turn
//            <start_of_turn>{user|model}\n{content}<end_of_turn>\n with each content trimmed
//            of whitespace (Jinja's trim), a first system message's content and "\n\n"
//            put before the first user turn's, and user turns alternating with others
//            (user, assistant, user, ...: else refused, as the template raises; a role other
//            than assistant, whose turn is "model", keeps its name)
// An instruction record {instruction, input, output} is the conversation
//   user: instruction (+ "\n\n" + input when input is not empty), assistant: output
// except under alpaca, where input is its own "### Input:" section.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace memtune::data {

struct Message {
  std::string role;
  std::string content;
};

// Text to encode without special tokens, or one special token id.
struct TemplatePiece {
  std::string text;
  std::optional<int32_t> special;
  bool trained = false;
};

class ChatTemplate {
 public:
  // name: llama-3|chatml|alpaca|gemma. Throws UserError naming the known names.
  static ChatTemplate builtin(const std::string& name);
  // A custom per-message pattern (syntax above). Throws UserError when it has no {content}
  // or an unknown placeholder.
  static ChatTemplate parse(const std::string& pattern);
  // data.chat_template when set (parse), else data.template_name (builtin): the template a
  // run's data is rendered with.
  static ChatTemplate of(const std::string& template_name, const std::string& chat_template) {
    return chat_template.empty() ? builtin(template_name) : parse(chat_template);
  }

  // Throws UserError where the template refuses the conversation (gemma's roles).
  std::vector<TemplatePiece> render(const std::vector<Message>& messages, std::optional<int32_t> bos,
                                    std::optional<int32_t> eos, bool train_on_prompt) const;
  std::vector<TemplatePiece> render_instruction(const std::string& instruction, const std::string& input,
                                                const std::string& output, std::optional<int32_t> bos,
                                                std::optional<int32_t> eos, bool train_on_prompt) const;

 private:
  std::vector<TemplatePiece> render_gemma(const std::vector<Message>& messages, std::optional<int32_t> bos,
                                          std::optional<int32_t> eos, bool train_on_prompt,
                                          std::vector<TemplatePiece>& out) const;

  std::string begin_;                         // once, before the first message
  std::string pattern_;                       // for roles not in role_patterns_
  std::map<std::string, std::string> role_patterns_;
  std::string after_assistant_;               // after an assistant message that is not the last
  bool input_as_message_ = false;             // instruction input becomes an "input" message
  // Gemma's turns: contents trimmed, a first system message put before the first turn's
  // content, roles alternating user / assistant from a user turn.
  bool gemma_turns_ = false;
};

// `s` without leading and trailing whitespace as Python's str.strip() (Jinja's trim filter)
// sees it: ASCII's, U+001C-U+001F, U+0085 and Unicode's space separators.
std::string strip_whitespace(const std::string& s);

}  // namespace memtune::data
