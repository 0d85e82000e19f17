// Datasets against hand-computed examples: a byte tokenizer (id = byte value, bos 256,
// eos 257) makes every id and target predictable from the text.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <functional>
#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/mapped_file.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using memtune::UserError;
using memtune::data::Dataset;
using memtune::data::DatasetOptions;
using memtune::data::kIgnoreIndex;
using memtune::data::Sample;
using memtune::testing::temp_dir;
using memtune::testing::write_file;

constexpr int32_t kBos = 256, kEos = 257, X = kIgnoreIndex;

class ByteTokenizer : public memtune::data::Tokenizer {
 public:
  ByteTokenizer() {
    bos_id = kBos;
    eos_id = kEos;
  }
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    if (add_special_tokens) ids.push_back(kBos);
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override {
    std::string s;
    for (int32_t id : ids) s += id < 256 ? std::string(1, char(id)) : skip_special_tokens ? "" : id_to_token(id);
    return s;
  }
  int64_t vocab_size() const override { return 258; }
  std::optional<int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  std::string id_to_token(int32_t id) const override {
    return id == kBos ? "<s>" : id == kEos ? "</s>" : std::string(1, char(id));
  }
};

std::vector<int32_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Writes `text` to a fresh file named `name` and returns its path.
fs::path file(const std::string& name, const std::string& text) {
  const fs::path p = temp_dir() / name;
  write_file(p, text);
  return p;
}

DatasetOptions opts(int64_t max_seq_length = 64, bool pack = false) {
  DatasetOptions o;
  o.max_seq_length = max_seq_length;
  o.pack_sequences = pack;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

ByteTokenizer tok;

}  // namespace

TEST(Dataset, TextPackedRowsRestartPositionsPerDocument) {
  const auto path = file("t.jsonl", "{\"text\": \"ab\"}\n{\"text\": \"cde\"}\n\n{\"text\": \"f\"}\n");
  Dataset ds(path, &tok, opts(8, /*pack=*/true));
  EXPECT_EQ(ds.format(), "text");
  // Documents [bos a b] (3), [bos c d e] (4), [bos f] (2): the first two fill 7 of 8, the
  // third does not fit and starts row 1.
  ASSERT_EQ(ds.size(), 2);
  const Sample r0 = ds.sample(0), r1 = ds.sample(1);
  EXPECT_EQ(r0.input_ids, (std::vector<int32_t>{kBos, 'a', 'b', kBos, 'c', 'd', 'e'}));
  EXPECT_EQ(r0.targets, (std::vector<int32_t>{'a', 'b', kEos, 'c', 'd', 'e', kEos}));
  EXPECT_EQ(r0.position_ids, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3}));
  EXPECT_EQ(r0.segment_ids, (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(r1.input_ids, (std::vector<int32_t>{kBos, 'f'}));
  EXPECT_EQ(r1.targets, (std::vector<int32_t>{'f', kEos}));
  const auto& st = ds.stats();
  EXPECT_EQ(st.documents, 3);
  EXPECT_EQ(st.tokens, 9);
  EXPECT_EQ(st.samples, 2);
  EXPECT_EQ(st.target_tokens, 9);
  EXPECT_EQ(st.truncated + st.dropped + st.skipped_invalid, 0);
}

TEST(Dataset, WithoutEosTheLastTokenPredictsNothing) {
  const auto path = file("t.jsonl", "{\"body\": \"ab\"}\n{\"body\": \"cd\"}\n");
  auto o = opts(16, true);
  o.text_field = "body";
  o.add_eos_token = false;
  Dataset ds(path, &tok, o);
  ASSERT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.sample(0).targets, (std::vector<int32_t>{'a', 'b', X, 'c', 'd', X}));
  EXPECT_EQ(ds.stats().target_tokens, 4);
}

TEST(Dataset, InstructionAlpacaTrainsOnTheOutputOnly) {
  const auto path = file("i.jsonl", "{\"instruction\": \"Rev\", \"input\": \"ab\", \"output\": \"ba\"}\n");
  Dataset ds(path, &tok, opts(128));
  EXPECT_EQ(ds.format(), "instruction");
  const std::string prompt = "### Instruction:\nRev\n\n### Input:\nab\n\n### Response:\n";
  const auto want_ids = cat(cat({kBos}, bytes(prompt)), bytes("ba"));
  const Sample s = ds.sample(0);
  ASSERT_EQ(s.input_ids, want_ids);
  std::vector<int32_t> want_targets(want_ids.size(), X);
  const size_t p = 1 + prompt.size();  // index of 'b'
  want_targets[p - 1] = 'b';
  want_targets[p] = 'a';
  want_targets[p + 1] = kEos;
  EXPECT_EQ(s.targets, want_targets);
  EXPECT_EQ(ds.stats().target_tokens, 3);

  auto o = opts(128);
  o.train_on_prompt = true;
  o.cache_dir = (temp_dir("cache") / "c").string();
  Dataset all(path, &tok, o);
  EXPECT_EQ(all.stats().target_tokens, static_cast<int64_t>(want_ids.size()));  // every next token and eos
}

TEST(Dataset, InstructionWithoutInputOmitsTheInputSection) {
  const auto path = file("i.jsonl", "{\"instruction\": \"Up: a\", \"output\": \"A\"}\n");
  Dataset ds(path, &tok, opts());
  EXPECT_EQ(ds.sample(0).input_ids, cat(cat({kBos}, bytes("### Instruction:\nUp: a\n\n### Response:\n")), bytes("A")));
}

TEST(Dataset, ChatChatmlTrainsOnAssistantTurns) {
  const auto path = file("c.jsonl",
                         R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
                         "\n");
  auto o = opts(128);
  o.template_name = "chatml";
  Dataset ds(path, &tok, o);
  EXPECT_EQ(ds.format(), "chat");
  const std::string prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  const std::string answer = "yo<|im_end|>\n";
  const Sample s = ds.sample(0);
  ASSERT_EQ(s.input_ids, bytes(prompt + answer));
  for (size_t t = 0; t + 1 < prompt.size(); ++t) EXPECT_EQ(s.targets[t], X) << t;
  for (size_t k = 0; k < answer.size(); ++k) EXPECT_EQ(s.targets[prompt.size() - 1 + k], answer[k]) << k;
  EXPECT_EQ(s.targets.back(), kEos);
  EXPECT_EQ(ds.stats().target_tokens, static_cast<int64_t>(answer.size()) + 1);
}

// A chat without an assistant message trains no token while train_on_prompt is false (ShareGPT's
// 'gpt' is not 'assistant'): each such document is counted, whatever the packing; with
// train_on_prompt every document trains.
TEST(Dataset, ChatsWithoutAnAssistantReplyAreCountedAsTrainingNothing) {
  std::string text;
  int64_t without = 0;
  for (int i = 0; i < 12; ++i) {
    const bool sharegpt = i % 4 == 0, prompt_only = i % 4 == 1;
    without += sharegpt || prompt_only;
    text += sharegpt ? R"({"messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]})"
            : prompt_only ? R"({"messages": [{"role": "user", "content": "q"}]})"
                          : R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})";
    text += "\n";
  }
  const auto path = file("mixed.jsonl", text);
  for (const bool pack : {false, true}) {
    auto o = opts(256, pack);
    o.template_name = "chatml";
    Dataset ds(path, &tok, o);
    EXPECT_EQ(ds.stats().no_target_documents, without) << "pack " << pack;
    EXPECT_NE(ds.no_target_reason().find("only messages whose role is 'assistant' train"), std::string::npos);
    o.train_on_prompt = true;
    Dataset all(path, &tok, o);
    EXPECT_EQ(all.stats().no_target_documents, 0) << "pack " << pack;
    EXPECT_EQ(all.no_target_reason(), "");
  }
  // A reply cut off by max_seq_length is named as such, with its own hint.
  const auto cut = file("cut.jsonl", R"({"messages": [{"role": "user", "content": ")" + std::string(100, 'q') +
                                         R"("}, {"role": "assistant", "content": "a"}]})" "\n" +
                                         R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", )"
                                         R"("content": "a"}]})" "\n");
  auto o = opts(64);
  o.template_name = "chatml";
  Dataset ds(cut, &tok, o);
  EXPECT_EQ(ds.stats().truncated, 1);
  EXPECT_EQ(ds.stats().no_target_documents, 1);
  EXPECT_EQ(ds.stats().no_target_cut, 1);
  EXPECT_EQ(ds.no_target_reason(), " (1 of them had their trained tokens past data.max_seq_length (64))");
  EXPECT_EQ(ds.no_target_hint(), "raise data.max_seq_length");
}

TEST(Dataset, ChatLlama3Rendering) {
  const auto path = file("c.jsonl",
                         R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, )"
                         R"({"role": "assistant", "content": "yo"}]})"
                         "\n");
  auto o = opts(256);
  o.template_name = "llama-3";
  Dataset ds(path, &tok, o);
  EXPECT_EQ(ds.sample(0).input_ids,
            bytes("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"));
  EXPECT_EQ(ds.stats().target_tokens, 2 + 10 + 1);  // "yo", "<|eot_id|>" (10 bytes), eos
}

// Gemma's turns: bos, the system message before the first user content, contents trimmed,
// the reply's role written "model"; the reply's content, <end_of_turn> and the newline after it
// are trained, and eos after them. (The ids against Gemma 3's own template and tokenizer:
// tests/data/tokenizer_itest.cpp.)
TEST(Dataset, ChatGemmaTrainsOnTheReplyAndItsEndOfTurn) {
  const auto path = file("g.jsonl",
                         R"({"messages": [{"role": "system", "content": "S "}, {"role": "user", "content": " hi\n"}, )"
                         R"({"role": "assistant", "content": "\tyo "}]})"
                         "\n");
  auto o = opts(256);
  o.template_name = "gemma";
  Dataset ds(path, &tok, o);
  const std::string prompt = "<start_of_turn>user\nS \n\nhi<end_of_turn>\n<start_of_turn>model\n";
  const std::string answer = "yo<end_of_turn>\n";
  const Sample s = ds.sample(0);
  ASSERT_EQ(s.input_ids, cat(cat({kBos}, bytes(prompt)), bytes(answer)));
  for (size_t t = 0; t < prompt.size(); ++t) EXPECT_EQ(s.targets[t], X) << t;  // bos predicts prompt[0]: untrained
  for (size_t k = 0; k < answer.size(); ++k) EXPECT_EQ(s.targets[prompt.size() + k], answer[k]) << k;
  EXPECT_EQ(s.targets.back(), kEos);
  // A user turn after a user turn: refused by line, as Gemma's template raises.
  const auto twice = file("g2.jsonl", R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})"
                                      "\n");
  const std::string e = error_of([&] { Dataset bad(twice, &tok, o); });
  EXPECT_NE(e.find("g2.jsonl:1: messages[1] is a 'user' message where the gemma template wants a reply"),
            std::string::npos) << e;
}

// Jinja's trim is Python's str.strip(): its whitespace (U+001C-U+001F and U+0085 among it),
// not a zero-width space; bytes that are not UTF-8 stay.
TEST(ChatTemplate, StripWhitespaceIsPythonsStrip) {
  using memtune::data::strip_whitespace;
  EXPECT_EQ(strip_whitespace(" \t\n\v\f\r a b \r\n"), "a b");
  EXPECT_EQ(strip_whitespace("\x1c\x1d\x1e\x1f" "a" "\xc2\x85\xc2\xa0"), "a");
  EXPECT_EQ(strip_whitespace("\xe3\x80\x80" "日本" "\xe2\x80\xa8\xe2\x80\x83"), "日本");  // U+3000; U+2028, U+2003
  EXPECT_EQ(strip_whitespace("\xe2\x80\x8b" "a"), "\xe2\x80\x8b" "a");  // U+200B is not whitespace
  EXPECT_EQ(strip_whitespace(" \xff a \xc3"), "\xff a \xc3");           // invalid bytes end the stripping
  EXPECT_EQ(strip_whitespace("   "), "");
  EXPECT_EQ(strip_whitespace(""), "");
}

TEST(Dataset, CustomTemplatePlaceholders) {
  const auto path = file("c.jsonl",
                         R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})"
                         "\n");
  auto o = opts();
  o.chat_template = "<{role}>{content}{eos}";
  o.add_eos_token = false;
  Dataset ds(path, &tok, o);
  const auto ids = cat(cat(cat(bytes("<user>a"), {kEos}), bytes("<assistant>b")), {kEos});
  const Sample s = ds.sample(0);
  ASSERT_EQ(s.input_ids, ids);
  std::vector<int32_t> want(ids.size(), X);
  want[ids.size() - 3] = 'b';   // '>' predicts b
  want[ids.size() - 2] = kEos;  // b predicts the pattern's {eos}
  EXPECT_EQ(s.targets, want);

  EXPECT_NE(error_of([] { memtune::data::ChatTemplate::parse("{role}: {text}"); }).find("{text}"),
            std::string::npos);
  EXPECT_NE(error_of([] { memtune::data::ChatTemplate::parse("{role}"); }).find("no {content}"), std::string::npos);
  EXPECT_NE(error_of([] { memtune::data::ChatTemplate::builtin("vicuna"); }).find("llama-3, chatml, alpaca, gemma"),
            std::string::npos);
}

// The template a run renders with (its data and, since it must match, the accuracy prompts):
// data.chat_template when set, else data.template_name.
TEST(ChatTemplate, OfPicksTheCustomPatternOverTheNamedOne) {
  using memtune::data::ChatTemplate;
  using memtune::data::TemplatePiece;
  const auto text = [](const std::vector<TemplatePiece>& pieces) {
    std::string t;
    for (const TemplatePiece& p : pieces) t += p.special ? "<" + std::to_string(*p.special) + ">" : p.text;
    return t;
  };
  const auto rendered = [&](const ChatTemplate& t) { return text(t.render_instruction("Add", "1 2", "3", 1, 2, false)); };
  EXPECT_EQ(rendered(ChatTemplate::of("chatml", "")), rendered(ChatTemplate::builtin("chatml")));
  EXPECT_EQ(rendered(ChatTemplate::of("chatml", "[{role}] {content}\n")),
            rendered(ChatTemplate::parse("[{role}] {content}\n")));
  EXPECT_NE(rendered(ChatTemplate::of("chatml", "[{role}] {content}\n")), rendered(ChatTemplate::builtin("chatml")));
}

TEST(Dataset, TruncationRightKeepsTheNextTokenAsTarget) {
  const auto path = file("t.jsonl", "{\"text\": \"abcdef\"}\n{\"text\": \"x\"}\n");
  Dataset ds(path, &tok, opts(4));
  ASSERT_EQ(ds.size(), 2);
  EXPECT_EQ(ds.sample(0).input_ids, (std::vector<int32_t>{kBos, 'a', 'b', 'c'}));
  EXPECT_EQ(ds.sample(0).targets, (std::vector<int32_t>{'a', 'b', 'c', 'd'}));
  EXPECT_EQ(ds.stats().truncated, 1);
  EXPECT_EQ(ds.stats().dropped, 0);
}

TEST(Dataset, TruncationDropSkipsLongDocuments) {
  const auto path = file("t.jsonl", "{\"text\": \"abcdef\"}\n{\"text\": \"x\"}\n");
  auto o = opts(4);
  o.truncation = "drop";
  Dataset ds(path, &tok, o);
  ASSERT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.sample(0).input_ids, (std::vector<int32_t>{kBos, 'x'}));
  EXPECT_EQ(ds.stats().dropped, 1);
  EXPECT_EQ(ds.stats().truncated, 0);
  const auto longer = file("l.jsonl", "{\"text\": \"abcdef\"}\n");
  EXPECT_NE(error_of([&] { Dataset(longer, &tok, o); }).find("dropped"), std::string::npos);
}

TEST(Dataset, UnpackedSamplesCollateToAMultipleOfEight) {
  const auto path = file("t.jsonl", "{\"text\": \"ab\"}\n{\"text\": \"cdef\"}\n");
  Dataset ds(path, &tok, opts(64, false));
  ASSERT_EQ(ds.size(), 2);
  const auto b = memtune::data::collate({ds.sample(0), ds.sample(1)}, 8, 0);
  EXPECT_EQ(b.rows(), 2);
  EXPECT_EQ(b.length(), 8);
  EXPECT_EQ(b.target_tokens, 3 + 5);
  EXPECT_EQ(b.targets[0][3].item<int64_t>(), X);     // padding
  EXPECT_EQ(b.segment_ids[1][5].item<int64_t>(), -1);
  EXPECT_EQ(b.targets[1][4].item<int64_t>(), kEos);
}

TEST(Dataset, PlainTextBlocksAndDirectories) {
  const auto txt = file("corpus.txt", "ab\ncd\n\n\n  \nef\n");
  Dataset blocks(txt, &tok, opts());
  EXPECT_EQ(blocks.format(), "plain");
  ASSERT_EQ(blocks.size(), 2);
  EXPECT_EQ(blocks.sample(0).input_ids, cat({kBos}, bytes("ab\ncd")));
  EXPECT_EQ(blocks.sample(1).input_ids, cat({kBos}, bytes("ef")));

  const fs::path dir = temp_dir("docs");
  write_file(dir / "b.txt", "xy\n");
  write_file(dir / "a.txt", "z");
  write_file(dir / "notes.md", "ignored");
  Dataset files(dir, &tok, opts());
  ASSERT_EQ(files.size(), 2);
  EXPECT_EQ(files.sample(0).input_ids, (std::vector<int32_t>{kBos, 'z'}));
  EXPECT_EQ(files.sample(1).input_ids, (std::vector<int32_t>{kBos, 'x', 'y'}));
}

namespace {
std::string raw_header(int32_t magic, int32_t version, int32_t count) {
  std::string h(1024, '\0');
  std::memcpy(&h[0], &magic, 4);
  std::memcpy(&h[4], &version, 4);
  std::memcpy(&h[8], &count, 4);
  return h;
}
}  // namespace

TEST(TokenFile, WritesLlmcHeaderAndLittleEndianTokens) {
  const fs::path dir = temp_dir();
  memtune::data::write_token_file(dir / "a.bin", {1, 258, 65535}, 65536);
  const std::string a = memtune::testing::read_file(dir / "a.bin");
  ASSERT_EQ(a.size(), 1024u + 6);
  EXPECT_EQ(a.substr(0, 1024), raw_header(20240520, 1, 3));
  EXPECT_EQ(a.substr(1024), std::string("\x01\x00\x02\x01\xff\xff", 6));

  memtune::data::write_token_file(dir / "b.bin", {70000, 3}, 128256);
  const std::string b = memtune::testing::read_file(dir / "b.bin");
  ASSERT_EQ(b.size(), 1024u + 8);
  EXPECT_EQ(b.substr(0, 1024), raw_header(20240801, 7, 2));
  EXPECT_EQ(b.substr(1024), std::string("\x70\x11\x01\x00\x03\x00\x00\x00", 8));  // 70000 = 0x11170

  memtune::data::TokenFile fb(dir / "b.bin");
  EXPECT_EQ(fb.size(), 2);
  EXPECT_EQ(fb.bytes_per_token(), 4);
  EXPECT_EQ(fb[0], 70000u);
  EXPECT_THROW(memtune::data::write_token_file(dir / "c.bin", {300}, 300), UserError);
}

TEST(Dataset, TokenFileSplitsDocumentsAtEos) {
  const fs::path p = temp_dir() / "d.bin";
  // llm.c layout: a separator before each document.
  memtune::data::write_token_file(p, {kEos, 1, 2, 3, kEos, 4, 5, kEos, 6}, 258);
  Dataset ds(p, &tok, opts(16, false));
  EXPECT_EQ(ds.format(), "tokens");
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.sample(0).input_ids, (std::vector<int32_t>{1, 2, 3, kEos}));
  EXPECT_EQ(ds.sample(0).targets, (std::vector<int32_t>{2, 3, kEos, X}));
  EXPECT_EQ(ds.sample(1).targets, (std::vector<int32_t>{5, kEos, X}));
  EXPECT_EQ(ds.sample(2).input_ids, (std::vector<int32_t>{6}));
  EXPECT_EQ(ds.sample(2).targets, (std::vector<int32_t>{X}));
  EXPECT_EQ(ds.stats().target_tokens, 5);
  EXPECT_EQ(ds.stats().tokens, 8);

  // Two separators in a row: the second is no document.
  const fs::path q2 = temp_dir("twice") / "t.bin";
  memtune::data::write_token_file(q2, {1, kEos, kEos, 2, kEos}, 258);
  Dataset twice(q2, &tok, opts(16, false));
  ASSERT_EQ(twice.size(), 2);
  EXPECT_EQ(twice.sample(1).input_ids, (std::vector<int32_t>{2, kEos}));

  // Round trip through token_stream.
  const fs::path q = temp_dir("rt") / "e.bin";
  const auto stream = ds.token_stream(kEos);
  EXPECT_EQ(stream, (std::vector<uint32_t>{1, 2, 3, kEos, kEos, 4, 5, kEos, kEos, 6, kEos}));
  memtune::data::write_token_file(q, stream, 258);
  Dataset back(q, &tok, opts(16, false));
  ASSERT_EQ(back.size(), 3);
  for (int64_t i = 0; i < 2; ++i) EXPECT_EQ(back.sample(i).input_ids, ds.sample(i).input_ids);
  EXPECT_EQ(back.sample(2).input_ids, (std::vector<int32_t>{6, kEos}));
}

TEST(Dataset, TokenFileWithoutTokenizerIsOneStreamInRows) {
  const fs::path p = temp_dir() / "s.bin";
  memtune::data::write_token_file(p, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 50257);
  Dataset ds(p, nullptr, opts(4, true));
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.sample(0).targets, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(ds.sample(1).input_ids, (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(ds.sample(1).position_ids, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(ds.sample(2).targets, (std::vector<int32_t>{9, X}));
  EXPECT_EQ(ds.stats().target_tokens, 9);

  // k T + 1 tokens (llm.c's layout: each window's last target is the next window's first
  // token) are k windows of T targets: every token but the first a target once, no window
  // left with the last token alone and nothing to train.
  const fs::path q = temp_dir() / "k.bin";
  memtune::data::write_token_file(q, {0, 1, 2, 3, 4, 5, 6, 7, 8}, 50257);
  Dataset k(q, nullptr, opts(4, true));
  ASSERT_EQ(k.size(), 2);
  EXPECT_EQ(k.sample(1).input_ids, (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(k.sample(1).targets, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(k.stats().target_tokens, 8);
  EXPECT_EQ(k.stats().samples, 2);

  // One token trains nothing: refused by name, not an empty epoch.
  const fs::path one = temp_dir() / "one.bin";
  memtune::data::write_token_file(one, {7}, 50257);
  const std::string e = error_of([&] { Dataset(one, nullptr, opts(4, true)); });
  EXPECT_NE(e.find("one.bin holds 1 token: a token trains only as the target of the one before it"), std::string::npos)
      << e;
}

// Without a tokenizer nothing else bounds a token file's ids: the model's vocab_size does
// (the trainer and `memtune estimate` pass it), where the embedding lookup would otherwise
// fail deep inside LibTorch ("index out of range in self").
TEST(DatasetBadInput, TokenFileIdsMustLieInTheModelsVocabulary) {
  const fs::path p = temp_dir() / "ids.bin";
  memtune::data::write_token_file(p, {0, 5, 255, 7, 256, 3}, 50257);
  auto o = opts(4, true);
  o.vocab_size = 257;  // 256 is the last id it has
  EXPECT_EQ(Dataset(p, nullptr, o).stats().tokens, 6);
  o.vocab_size = 256;
  const std::string e = error_of([&] { Dataset(p, nullptr, o); });
  EXPECT_NE(e.find("ids.bin: token 4 is 256, outside the model's vocabulary (vocab_size 256)"), std::string::npos)
      << e;
  // and through a tokenizer (258 ids) whose model has fewer: the model's bound is checked too
  o.vocab_size = 200;
  const std::string t = error_of([&] { Dataset(p, &tok, o); });
  EXPECT_NE(t.find("token 2 is 255, outside the model's vocabulary (vocab_size 200)"), std::string::npos) << t;
}

TEST(Dataset, CacheMakesTheSecondLoadImmediateAndRebuildsWhenDamaged) {
  const auto path = file("i.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"c\", \"output\": \"d\"}\n");
  auto o = opts();
  o.cache_dir = (temp_dir("cache") / "tok").string();
  Dataset first(path, &tok, o);
  EXPECT_FALSE(first.from_cache());
  Dataset second(path, &tok, o);
  EXPECT_TRUE(second.from_cache());
  ASSERT_EQ(second.size(), first.size());
  for (int64_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(second.sample(i).input_ids, first.sample(i).input_ids);
    EXPECT_EQ(second.sample(i).targets, first.sample(i).targets);
  }
  // Settings outside tokenization reuse the cache; train_on_prompt does not.
  auto packed = o;
  packed.pack_sequences = true;
  EXPECT_TRUE(Dataset(path, &tok, packed).from_cache());
  auto prompt = o;
  prompt.train_on_prompt = true;
  EXPECT_FALSE(Dataset(path, &tok, prompt).from_cache());

  // Damage every cache file: flip a byte in the middle, truncate another.
  for (const auto& e : fs::directory_iterator(o.cache_dir)) {
    std::string bytes = memtune::testing::read_file(e.path());
    bytes[bytes.size() / 2] ^= 0x5a;
    write_file(e.path(), bytes);
  }
  Dataset rebuilt(path, &tok, o);
  EXPECT_FALSE(rebuilt.from_cache());
  EXPECT_EQ(rebuilt.sample(1).input_ids, first.sample(1).input_ids);
  EXPECT_TRUE(Dataset(path, &tok, o).from_cache());

  // Changed content: a new key.
  write_file(path, "{\"instruction\": \"a\", \"output\": \"B\"}\n");
  Dataset changed(path, &tok, o);
  EXPECT_FALSE(changed.from_cache());
  EXPECT_EQ(changed.sample(0).input_ids.back(), 'B');
}

TEST(Dataset, Fnv1aMatchesPublishedVectors) {
  EXPECT_EQ(memtune::data::fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(memtune::data::fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(memtune::data::fnv1a64("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(memtune::data::fnv1a64("bar", memtune::data::fnv1a64("foo")), 0x85944171f73967e8ULL);
}

// ---- bad input ----

TEST(DatasetBadInput, MalformedJsonNamesFileLineAndText) {
  const auto path = file("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"oops\" nope}\n{\"text\": \"fine\"}\n");
  const std::string e = error_of([&] { Dataset(path, &tok, opts()); });
  EXPECT_NE(e.find("bad.jsonl:2"), std::string::npos) << e;
  EXPECT_NE(e.find("malformed JSON"), std::string::npos) << e;
  EXPECT_NE(e.find("nope"), std::string::npos) << e;  // the text near the error
  EXPECT_NE(e.find("skip_invalid"), std::string::npos) << e;

  auto o = opts(64, true);
  o.skip_invalid = true;
  Dataset ds(path, &tok, o);
  EXPECT_EQ(ds.stats().skipped_invalid, 1);
  EXPECT_EQ(ds.stats().documents, 2);
}

TEST(DatasetBadInput, MissingFieldNamesFieldLineAndFormat) {
  const auto path = file("m.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"x\"}\n");
  const std::string e = error_of([&] { Dataset(path, &tok, opts()); });
  EXPECT_NE(e.find("m.jsonl:2"), std::string::npos) << e;
  EXPECT_NE(e.find("'output' is missing"), std::string::npos) << e;
  EXPECT_NE(e.find("instruction format expects"), std::string::npos) << e;

  const auto chat = file("c.jsonl", R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})");
  const std::string c = error_of([&] { Dataset(chat, &tok, opts()); });
  EXPECT_NE(c.find("c.jsonl:1"), std::string::npos) << c;
  EXPECT_NE(c.find("messages[1] has no field 'content'"), std::string::npos) << c;

  const auto typed = file("t.jsonl", "{\"text\": 5}\n");
  auto o = opts();
  o.format = "text";
  const std::string t = error_of([&] { Dataset(typed, &tok, o); });
  EXPECT_NE(t.find("'text' is a number, not a string"), std::string::npos) << t;

  const auto unknown = file("u.jsonl", "{\"prompt\": \"a\", \"answer\": \"b\"}\n");
  const std::string u = error_of([&] { Dataset(unknown, &tok, opts()); });
  EXPECT_NE(u.find("(answer, prompt)"), std::string::npos) << u;
}

TEST(DatasetBadInput, EmptyDatasetIsAnError) {
  EXPECT_NE(error_of([] { Dataset(file("e.jsonl", ""), &tok, opts()); }).find("empty"), std::string::npos);
  auto o = opts();
  o.format = "text";
  EXPECT_NE(error_of([&] { Dataset(file("e.jsonl", "\n  \n"), &tok, o); }).find("empty"), std::string::npos);
  o.skip_invalid = true;
  const std::string all_bad = error_of([&] { Dataset(file("e.jsonl", "{oops\n[1,2]\n"), &tok, o); });
  EXPECT_NE(all_bad.find("2 invalid records skipped"), std::string::npos) << all_bad;
}

TEST(DatasetBadInput, TokenFileWrongMagicOrTruncated) {
  const std::string magic = error_of([] {
    Dataset(file("m.bin", raw_header(12345, 1, 0) + std::string(4, '\0')), &tok, opts());
  });
  EXPECT_NE(magic.find("wrong magic 12345"), std::string::npos) << magic;
  const std::string version = error_of([] { Dataset(file("v.bin", raw_header(20240520, 2, 0)), &tok, opts()); });
  EXPECT_NE(version.find("version 2"), std::string::npos) << version;
  const std::string cut = error_of([] {
    Dataset(file("t.bin", raw_header(20240520, 1, 10) + std::string(10, '\1')), &tok, opts());
  });
  EXPECT_NE(cut.find("truncated: the header says 10 tokens (20 bytes) but only 10 bytes"), std::string::npos) << cut;
  const std::string shorter = error_of([] { Dataset(file("s.bin", "tiny"), &tok, opts()); });
  EXPECT_NE(shorter.find("shorter than the 1024-byte header"), std::string::npos) << shorter;
  const std::string vocab = error_of([] {
    const fs::path p = temp_dir() / "big.bin";
    memtune::data::write_token_file(p, {1, 300}, 1000);
    Dataset(p, &tok, opts());
  });
  EXPECT_NE(vocab.find("outside the tokenizer's vocabulary of 258"), std::string::npos) << vocab;
}

TEST(DatasetBadInput, UnreadableFileIsAnError) {
  const std::string missing = error_of([] { Dataset(temp_dir() / "nope.jsonl", &tok, opts()); });
  EXPECT_NE(missing.find("does not exist"), std::string::npos) << missing;
  const fs::path dir = temp_dir() / "dir.jsonl";
  fs::create_directories(dir);
  auto o = opts();
  o.format = "text";
  const std::string not_file = error_of([&] { Dataset(dir, &tok, o); });
  EXPECT_NE(not_file.find("not a regular file"), std::string::npos) << not_file;
  o.format = "jsonl";
  EXPECT_NE(error_of([&] { Dataset(dir, &tok, o); }).find("unknown format 'jsonl'"), std::string::npos);
}

// ---- bundled data (examples/data, made by scripts/make_bundled_data.py) ----

TEST(BundledData, TaskFilesLoadAndTheirAnswersAreRight) {
  const fs::path dir = memtune::testing::source_dir() / "examples/data";
  auto o = opts(64, true);
  Dataset train(dir / "tasks_train.jsonl", &tok, o);
  EXPECT_EQ(train.format(), "instruction");
  EXPECT_EQ(train.stats().documents, 3000);
  EXPECT_EQ(train.stats().truncated + train.stats().skipped_invalid, 0);

  // Check every eval answer independently of the generator.
  std::ifstream in(dir / "tasks_eval.jsonl");
  int lines = 0;
  std::map<std::string, int> per_task;
  for (std::string line; std::getline(in, line); ++lines) {
    const auto j = nlohmann::json::parse(line);
    const std::string ins = j["instruction"], out = j["output"], task = j["task"];
    const std::string arg = ins.substr(ins.find(": ") + 2);
    std::string want;
    if (task == "parity") want = std::stoi(arg) % 2 == 0 ? "even" : "odd";
    else if (task == "length") want = std::to_string(arg.size());
    else if (task == "first") want = arg.substr(0, 1);
    else if (task == "last") want = arg.substr(arg.size() - 1);
    if (want.empty()) ADD_FAILURE() << "unknown task: " << line;
    EXPECT_EQ(out, want) << line;
    ++per_task[task];
  }
  EXPECT_EQ(lines, 200);
  EXPECT_EQ(per_task, (std::map<std::string, int>{{"first", 50}, {"last", 50}, {"length", 50}, {"parity", 50}}));

  Dataset blocks(dir / "corpus.txt", &tok, opts(1024));
  Dataset texts(dir / "corpus.jsonl", &tok, opts(1024));
  EXPECT_EQ(blocks.stats().documents, 60);
  EXPECT_EQ(texts.stats().documents, 60);
  EXPECT_EQ(blocks.sample(7).input_ids, texts.sample(7).input_ids);
}

TEST(Dataset, ChatAlpacaMultiTurn) {
  const auto path = file("c.jsonl",
                         R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, )"
                         R"({"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}, )"
                         R"({"role": "assistant", "content": "a2"}]})"
                         "\n");
  Dataset ds(path, &tok, opts(256));
  const std::string first = "S\n\n### Instruction:\nq1\n\n### Response:\n";
  const std::string second = "\n\n### Instruction:\nq2\n\n### Response:\n";
  const auto ids = cat(cat(cat(cat({kBos}, bytes(first)), bytes("a1")), bytes(second)), bytes("a2"));
  const Sample s = ds.sample(0);
  ASSERT_EQ(s.input_ids, ids);
  std::vector<int32_t> want(ids.size(), X);
  const size_t a1 = 1 + first.size(), a2 = a1 + 2 + second.size();
  want[a1 - 1] = 'a';
  want[a1] = '1';
  want[a2 - 1] = 'a';
  want[a2] = '2';
  want[a2 + 1] = kEos;
  EXPECT_EQ(s.targets, want);
  EXPECT_EQ(ds.sample_length(0), static_cast<int64_t>(ids.size()));
}

namespace {

// tests/reference/eval_split.py: datasets' count and the documented draw, in Python.
std::vector<int64_t> reference_held_out(int64_t n, double split, uint64_t seed, bool shuffle) {
  namespace t = memtune::testing;
  char split_text[32];
  std::snprintf(split_text, sizeof split_text, "%.17g", split);
  const auto r = t::run(t::python() + " " + (t::source_dir() / "tests/reference/eval_split.py").string() + " " +
                        std::to_string(n) + " " + split_text + " " + std::to_string(seed) + " " +
                        (shuffle ? "1" : "0"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::istringstream in(r.output);
  std::vector<int64_t> out;
  for (int64_t v; in >> v;) out.push_back(v);
  return out;
}

memtune::data::HoldOut hold(double split, uint64_t seed, bool held_out, bool shuffle = true) {
  memtune::data::HoldOut h;
  h.split = split;
  h.seed = seed;
  h.held_out = held_out;
  h.shuffle = shuffle;
  return h;
}

}  // namespace

// data.eval_split's documents: as many as datasets' train_test_split holds out (ceil of the
// share in doubles: 0.07 of 100 is 8), drawn as the Python reference draws them.
TEST(EvalSplit, HeldOutDocumentsAreTrainTestSplitsCountDrawnBySeed) {
  using memtune::data::held_out_documents;
  for (auto [n, split, seed, shuffle] : {std::tuple<int64_t, double, uint64_t, bool>{37, 0.1, 42, true},
                                         {100, 0.07, 3, true}, {7, 0.2, 9, true}, {30, 0.1, 1, true},
                                         {20, 5.0, 11, true}, {10, 3.0, 3, false}, {12, 0.25, 3, false}}) {
    const auto got = held_out_documents(n, hold(split, seed, true, shuffle), "f");
    EXPECT_EQ(got, reference_held_out(n, split, seed, shuffle)) << n << " " << split << " " << seed;
  }
  EXPECT_EQ(held_out_documents(100, hold(0.07, 3, true), "f").size(), 8u);
  const std::string all = error_of([] { held_out_documents(10, hold(0.95, 1, true), "f.jsonl"); });
  EXPECT_NE(all.find("data.eval_split 0.95 holds out 10 of the 10 documents of f.jsonl, leaving none to train on"),
            std::string::npos)
      << all;
  EXPECT_NE(error_of([] { held_out_documents(10, hold(1.5, 1, true), "f"); }).find("whole number"), std::string::npos);
  // Past int64's range: refused as too many, not cast.
  EXPECT_NE(error_of([] { held_out_documents(10, hold(1e19, 1, true), "f"); }).find("leaving none to train on"),
            std::string::npos);
}

// The two sides of a file: disjoint, together the file, each in file order, and rows made
// within a side (a packed row never mixes held-out and training documents).
TEST(EvalSplit, TheSidesPartitionTheFilesDocumentsAndPackWithinThemselves) {
  std::string text;
  std::vector<std::string> docs;
  for (int i = 0; i < 20; ++i) {
    docs.push_back("doc " + std::to_string(i) + std::string(static_cast<size_t>(i % 4), '+'));
    text += "{\"text\": \"" + docs.back() + "\"}\n";
  }
  const auto path = file("twenty.jsonl", text);
  const std::vector<int64_t> held = reference_held_out(20, 0.25, 5, true);
  ASSERT_EQ(held.size(), 5u);
  for (bool pack : {false, true}) {
    auto o = opts(24, pack);
    o.hold_out = hold(0.25, 5, true);
    Dataset eval(path, &tok, o);
    o.hold_out = hold(0.25, 5, false);
    Dataset train(path, &tok, o);
    EXPECT_EQ(eval.stats().documents, 5);
    EXPECT_EQ(train.stats().documents, 15);
    // Each side's documents, as the byte tokenizer spells them, in row order.
    auto texts = [](const Dataset& ds) {
      std::vector<std::string> out;
      for (int64_t i = 0; i < ds.size(); ++i) {
        std::string cur;
        for (int32_t id : ds.sample(i).input_ids) {
          if (id == kBos && !cur.empty()) out.push_back(cur), cur.clear();
          if (id < 256) cur += static_cast<char>(id);
        }
        out.push_back(cur);
      }
      return out;
    };
    std::vector<std::string> want_eval, want_train;
    for (int64_t d = 0; d < 20; ++d)
      (std::count(held.begin(), held.end(), d) ? want_eval : want_train).push_back(docs[static_cast<size_t>(d)]);
    EXPECT_EQ(texts(eval), want_eval) << "pack " << pack;
    EXPECT_EQ(texts(train), want_train) << "pack " << pack;
    Dataset whole(path, &tok, opts(24, pack));
    EXPECT_EQ(eval.stats().tokens + train.stats().tokens, whole.stats().tokens);
    EXPECT_EQ(eval.stats().target_tokens + train.stats().target_tokens, whole.stats().target_tokens);
  }
}

// A token file splits at its documents, left in the mapped file; one without separators is
// one stream, and holding out its "documents" is refused by name.
TEST(EvalSplit, TokenFilesSplitAtDocumentsAndAStreamIsRefused) {
  const fs::path p = temp_dir() / "d.bin";
  // Six documents (a lone separator, two in a row, is none), the last unterminated.
  memtune::data::write_token_file(p, {kEos, 1, kEos, 2, 2, kEos, kEos, 3, kEos, 4, kEos, 5, 5, kEos, 6}, 258);
  auto o = opts(16, false);
  o.hold_out = hold(2.0, 8, true, /*shuffle=*/false);  // the last two: [5 5 eos] and [6]
  Dataset eval(p, &tok, o);
  ASSERT_EQ(eval.size(), 2);
  EXPECT_EQ(eval.sample(0).input_ids, (std::vector<int32_t>{5, 5, kEos}));
  EXPECT_EQ(eval.sample(1).input_ids, (std::vector<int32_t>{6}));
  o.hold_out.held_out = false;
  Dataset train(p, &tok, o);
  ASSERT_EQ(train.size(), 4);
  EXPECT_EQ(train.sample(0).input_ids, (std::vector<int32_t>{1, kEos}));
  EXPECT_EQ(train.sample(3).input_ids, (std::vector<int32_t>{4, kEos}));

  const fs::path s = temp_dir() / "stream.bin";
  memtune::data::write_token_file(s, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 50257);
  auto so = opts(4, true);
  so.hold_out = hold(0.2, 1, false);
  const std::string e = error_of([&] { Dataset(s, nullptr, so); });
  EXPECT_NE(e.find("data.eval_split holds out documents, and " + s.string() + " is one stream of tokens"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("data.eval_file"), std::string::npos) << e;
}
