// Hand-checkable cases on small tokenizer.json files written here: merges by rank, the
// byte-level alphabet, byte fallback with the Llama 2 normalizers and decoders, added
// tokens, special tokens, tokenizer_config.json, NFC, and errors on bad files.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "data/unicode_nfc.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using json = nlohmann::json;
using Ids = std::vector<int32_t>;

std::unique_ptr<data::Tokenizer> load_json(const json& j, const std::string& tag, const json& config = json()) {
  const fs::path dir = temp_dir(tag);
  write_file(dir / "tokenizer.json", j.dump());
  if (!config.is_null()) write_file(dir / "tokenizer_config.json", config.dump());
  return data::Tokenizer::load(dir);
}

// A character-level BPE over {a, b, c} with the given merges; no pre-tokenizer.
json abc_tokenizer(const json& merges) {
  return {{"model",
           {{"type", "BPE"},
            {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}, {"aa", 6}}},
            {"merges", merges}}}};
}

TEST(Tokenizer, MergesApplyInRankOrder) {
  // "abc": with (b c) ranked first the result is [a][bc]; with (a b) first, [ab][c].
  EXPECT_EQ(load_json(abc_tokenizer({"b c", "a b"}), "bc_first")->encode("abc", false), (Ids{0, 4}));
  EXPECT_EQ(load_json(abc_tokenizer({"a b", "b c"}), "ab_first")->encode("abc", false), (Ids{3, 2}));
  // Merges continue on merged symbols: (b c) then (a bc) -> [abc].
  EXPECT_EQ(load_json(abc_tokenizer({"b c", "a b", "a bc"}), "chain")->encode("abc", false), (Ids{5}));
  // Equal ranks resolve leftmost first: "aaa" -> [aa][a].
  EXPECT_EQ(load_json(abc_tokenizer({"a a"}), "left")->encode("aaa", false), (Ids{6, 0}));
  // The newer [a, b] list form reads the same as "a b".
  EXPECT_EQ(load_json(abc_tokenizer(json::array({json::array({"b", "c"}), json::array({"a", "b"})})), "list")
                ->encode("abcab", false),
            (Ids{0, 4, 3}));
}

// GPT-2's byte -> character table, written out from its definition: printable Latin-1
// bytes stand for themselves, the other 68 take U+0100.. in byte order.
std::vector<std::string> gpt2_byte_chars() {
  std::vector<std::string> t(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : 256 + n++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    t[b] = s;
  }
  return t;
}

json byte_level_tokenizer(const json& extra_vocab, const json& merges) {
  json vocab = json::object();
  const auto chars = gpt2_byte_chars();
  for (int b = 0; b < 256; ++b) vocab[chars[b]] = b;
  for (auto it = extra_vocab.begin(); it != extra_vocab.end(); ++it) vocab[it.key()] = it.value();
  return {{"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"added_tokens",
           {{{"id", 300}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}},
            {{"id", 301}, {"content", "<|x|>"}, {"special", false}, {"normalized", false}}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", "<|end|>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
            {"special_tokens", {{"<|end|>", {{"id", "<|end|>"}, {"ids", {300}}, {"tokens", {"<|end|>"}}}}}}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST(Tokenizer, ByteLevelMapsEveryByte) {
  auto tok = load_json(byte_level_tokenizer(json::object(), json::array()), "bytes");
  // Known entries of the table: space is 'Ġ' (U+0120), newline 'Ċ' (U+010A), NUL 'Ā'.
  EXPECT_EQ(tok->id_to_token(' '), "\xC4\xA0");
  EXPECT_EQ(tok->id_to_token('\n'), "\xC4\x8A");
  EXPECT_EQ(tok->id_to_token(0), "\xC4\x80");
  EXPECT_EQ(tok->id_to_token('A'), "A");
  // With no merges every byte of the UTF-8 text is its own id (= the byte value).
  std::string text = "A\tz~ \x01\x7f";
  text += "\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80";  // é 你 😀
  Ids want;
  for (char c : text) want.push_back(static_cast<uint8_t>(c));
  EXPECT_EQ(tok->encode(text, false), want);
  EXPECT_EQ(tok->decode(want, false), text);
  // Every byte value decodes back; an invalid sequence decodes to U+FFFD.
  for (int b = 0; b < 128; ++b) EXPECT_EQ(tok->decode({b}, false), std::string(1, static_cast<char>(b)));
  EXPECT_EQ(tok->decode({0xFF}, false), "\xEF\xBF\xBD");
  EXPECT_EQ(tok->decode({0xE4, 0xBD}, false), "\xEF\xBF\xBD");
  EXPECT_EQ(tok->vocab_size(), 302);
}

TEST(Tokenizer, AddedTokensAreNeverSplit) {
  // Merges for "Ġ<", "<|" exist, yet an added token's text stays one id.
  auto tok = load_json(byte_level_tokenizer({{"<|", 256}, {"\xC4\xA0<", 257}},
                                            json::array({"< |", "\xC4\xA0 <"})),
                       "added");
  EXPECT_EQ(tok->encode("a<|end|>b", false), (Ids{'a', 300, 'b'}));
  EXPECT_EQ(tok->encode("<|x|><|end|>", false), (Ids{301, 300}));
  // Not an added token: ordinary BPE. The regex splits " <|" from "en"; (< |) ranks before
  // (Ġ <), so " <|" becomes [Ġ][<|].
  EXPECT_EQ(tok->encode(" <|en", false), (Ids{' ', 256, 'e', 'n'}));
  // Special tokens: the post-processor's bos, and skip_special_tokens in decode.
  EXPECT_EQ(tok->encode("a", true), (Ids{300, 'a'}));
  EXPECT_EQ(tok->decode({300, 'a', 301}, false), "<|end|>a<|x|>");
  EXPECT_EQ(tok->decode({300, 'a', 301}, true), "a<|x|>");
  EXPECT_EQ(tok->token_to_id("<|x|>"), 301);
  EXPECT_FALSE(tok->token_to_id("<|nope|>").has_value());
}

TEST(Tokenizer, ByteFallbackWithLlama2Normalizers) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  const std::string sp = "\xE2\x96\x81";  // ▁
  vocab[sp] = 259;
  vocab["h"] = 260;
  vocab["i"] = 261;
  vocab[sp + "h"] = 262;
  vocab[sp + "hi"] = 263;
  json j = {{"normalizer",
             {{"type", "Sequence"},
              {"normalizers",
               {{{"type", "Prepend"}, {"prepend", sp}},
                {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}}}}},
            {"decoder",
             {{"type", "Sequence"},
              {"decoders",
               {{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
                {{"type", "ByteFallback"}},
                {{"type", "Fuse"}},
                {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
            {"added_tokens", {{{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}}}},
            {"model",
             {{"type", "BPE"},
              {"vocab", vocab},
              {"merges", {sp + " h", sp + "h i"}},
              {"unk_token", "<unk>"},
              {"byte_fallback", true}}}};
  auto tok = load_json(j, "fallback", json{{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"add_bos_token", true}});
  // "hi ☃": ▁hi, ▁, then the three bytes of ☃ (E2 98 83) as <0xXX> tokens.
  const Ids want = {263, 259, 3 + 0xE2, 3 + 0x98, 3 + 0x83};
  EXPECT_EQ(tok->encode("hi \xE2\x98\x83", false), want);
  EXPECT_EQ(tok->decode(want, false), "hi \xE2\x98\x83");
  // add_bos_token from tokenizer_config.json; decode keeps or skips <s>.
  EXPECT_EQ(tok->encode("hi", true), (Ids{1, 263}));
  EXPECT_EQ(tok->bos_id, 1);
  EXPECT_EQ(tok->eos_id, 2);
  EXPECT_FALSE(tok->pad_id.has_value());
  EXPECT_EQ(tok->decode({1, 263}, true), "hi");
  // Lone bytes that are not valid UTF-8 decode to one U+FFFD each.
  EXPECT_EQ(tok->decode({263, 3 + 0xE2, 3 + 0x98}, false), "hi\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok->encode("", false), Ids{});
}

TEST(Tokenizer, ConfigReadsSpecialsAndChatTemplate) {
  const fs::path tiny = source_dir() / "examples" / "tiny-tokenizer";
  auto tok = data::Tokenizer::load(tiny);
  EXPECT_EQ(tok->bos_id, tok->token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(tok->eos_id, tok->token_to_id("<|end_of_text|>"));
  EXPECT_EQ(tok->pad_id, tok->token_to_id("<|pad|>"));
  EXPECT_NE(tok->chat_template.find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(tok->vocab_size(), 1024);
  // 256 byte tokens first: id = byte value.
  EXPECT_EQ(tok->token_to_id("A"), 65);
  const auto ids = tok->encode("Hi", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), *tok->bos_id);
}

TEST(Tokenizer, NfcComposesAndReorders) {
  EXPECT_EQ(data::nfc("e\xCC\x81"), "\xC3\xA9");                          // e + U+0301 -> é
  EXPECT_EQ(data::nfc("\xE2\x84\xAB"), "\xC3\x85");                       // Angstrom sign -> Å
  EXPECT_EQ(data::nfc("e\xCC\x82\xCC\xA3"), "\xE1\xBB\x87");              // e + ^ + dot below -> ệ
  EXPECT_EQ(data::nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(data::nfc("plain ascii"), "plain ascii");
}

std::string load_error(const std::string& tokenizer_json, const std::string& tag) {
  const fs::path dir = temp_dir(tag);
  write_file(dir / "tokenizer.json", tokenizer_json);
  try {
    data::Tokenizer::load(dir / "tokenizer.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Tokenizer, BadFilesNameTheFileAndTheProblem) {
  std::string e = load_error("{ this is not json", "notjson");
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;

  e = load_error(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})", "wordpiece");
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("model type \"WordPiece\" is not supported"), std::string::npos) << e;

  e = load_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}}})", "nomerges");
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("model.merges is missing"), std::string::npos) << e;

  e = load_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})", "badmerge");
  EXPECT_NE(e.find("merge 0"), std::string::npos) << e;

  // Ids index the id -> token table: a negative or huge id is refused before any write
  // (a negative one wrote out of bounds and crashed; one past 2^31 wrapped to negative).
  for (const char* id : {"-1", "-2147483648", "2147483648", "4294967296", "16777216", "1.5"}) {
    e = load_error(std::string(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": )") + id + R"(}, "merges": []}})",
                   "badid");
    EXPECT_NE(e.find("model.vocab[\"b\"] is " + std::string(id)), std::string::npos) << id << ": " << e;
  }
  e = load_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                     "added_tokens": [{"id": -7, "content": "<x>"}]})", "badadded");
  EXPECT_NE(e.find("added_tokens[].id is -7"), std::string::npos) << e;

  // A post-processor's special token must be a token (fuzz_bpe_tokenizer: its added_tokens
  // key misspelt, bos 1019 was emitted past a vocabulary that ended at 1018).
  json no_added = byte_level_tokenizer(json::object(), json::array());
  no_added.erase("added_tokens");
  e = load_error(no_added.dump(), "bospastvocab");
  EXPECT_NE(e.find("special token \"<|end|>\" has id 300, which neither model.vocab nor added_tokens holds"),
            std::string::npos) << e;
  no_added["post_processor"]["special_tokens"]["<|end|>"]["ids"] = {-3};
  e = load_error(no_added.dump(), "negativebos");
  EXPECT_NE(e.find("ids[] is -3"), std::string::npos) << e;

  e = load_error("{\"model\": " + std::string(100000, '[') + std::string(100000, ']') + "}", "deep");
  EXPECT_NE(e.find("nested more than 128 levels"), std::string::npos) << e;

  e = load_error(R"({"version": "1.0"})", "nomodel");
  EXPECT_NE(e.find("no \"model\""), std::string::npos) << e;

  try {
    data::Tokenizer::load(temp_dir("missing") / "nope.json");
    FAIL() << "no error for a missing file";
  } catch (const UserError& err) {
    EXPECT_NE(std::string(err.what()).find("nope.json"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace memtune::testing

namespace memtune::testing {
namespace {

// Protobuf wire format, for writing small SentencePiece ModelProtos by hand.
std::string varint(uint64_t v) {
  std::string s;
  do {
    s += static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return s;
}
std::string field_bytes(int num, const std::string& payload) { return varint(num << 3 | 2) + varint(payload.size()) + payload; }
std::string field_varint(int num, uint64_t v) { return varint(num << 3) + varint(v); }
std::string sp_piece(const std::string& text, float score, int type) {
  std::string f(4, '\0');
  std::memcpy(&f[0], &score, 4);  // little-endian float (x86, ARM)
  return field_bytes(1, field_bytes(1, text) + varint(2 << 3 | 5) + f + field_varint(3, type));
}

std::string sp_model(int model_type) {
  const std::string sp = "\xE2\x96\x81";
  std::string m = sp_piece("<unk>", 0, 2) + sp_piece("<s>", 0, 3) + sp_piece("</s>", 0, 3) +
                  sp_piece(sp, -10, 1) + sp_piece("a", -11, 1) + sp_piece("b", -12, 1) +
                  sp_piece(sp + "a", -2, 1) + sp_piece("ab", -1, 1) + sp_piece(sp + "ab", -3, 1);
  m += field_bytes(2, field_varint(3, model_type));
  m += field_bytes(3, field_varint(3, 1) + field_varint(4, 0));  // dummy prefix, keep spaces
  return m;
}

TEST(SentencePiece, BpeMergesHighestScoreFirst) {
  const fs::path f = temp_dir() / "tokenizer.model";
  write_file(f, sp_model(2));
  auto tok = data::Tokenizer::load(f);
  // "▁ab": (a b) scores -1, above (▁ a) at -2, so [▁][ab], then (▁ ab) -> [▁ab] = 8.
  EXPECT_EQ(tok->encode("ab", false), (Ids{8}));
  // "▁ba": only (▁ b)? not a piece; [▁][b][a]; "c" is unknown -> <unk> (no byte fallback).
  EXPECT_EQ(tok->encode("ba c", false), (Ids{3, 5, 4, 3, 0}));
  EXPECT_EQ(tok->encode("ab", true), (Ids{1, 8}));
  EXPECT_EQ(tok->encode("a</s>", false), (Ids{6, 2}));
  EXPECT_EQ(tok->decode({1, 8, 3, 5}, true), "ab b");
  EXPECT_EQ(tok->bos_id, 1);
  EXPECT_EQ(tok->eos_id, 2);
}

TEST(SentencePiece, UnigramTakesTheBestTotalScore) {
  const fs::path f = temp_dir() / "tokenizer.model";
  write_file(f, sp_model(1));
  auto tok = data::Tokenizer::load(f);
  // "▁ab": [▁ab] -3 beats [▁a][b] -14 and [▁][ab] -11.
  EXPECT_EQ(tok->encode("ab", false), (Ids{8}));
  // "▁ba": [▁][b][a] is the only path (-33); "c" is <unk>, and "cc" one fused <unk>.
  EXPECT_EQ(tok->encode("ba cc", false), (Ids{3, 5, 4, 3, 0}));
}

TEST(SentencePiece, BadModelsAreRefusedWithTheReason) {
  const fs::path f = temp_dir() / "tokenizer.model";
  write_file(f, sp_model(3));
  try {
    data::Tokenizer::load(f);
    FAIL() << "word model accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("word is not supported"), std::string::npos) << e.what();
  }
  write_file(f, "\x0a\xff\xff\xff garbage");
  try {
    data::Tokenizer::load(f);
    FAIL() << "garbage accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.model"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a SentencePiece .model"), std::string::npos) << e.what();
  }
}

// Found by fuzz/sentencepiece_fuzz.cpp (fuzz/regressions/sentencepiece-*): a BYTE piece whose
// text is not <0xHH> threw std::invalid_argument from stoi on load (exit 1), or
// std::out_of_range on decode when shorter than 3 bytes.
TEST(SentencePiece, BytePiecesMustBeHexBytes) {
  const fs::path f = temp_dir() / "tokenizer.model";
  for (const std::string bad : {"<0xZZ>", "x", "<0x4>", "<0x41]"}) {
    write_file(f, sp_piece("<unk>", 0, 2) + sp_piece("a", -1, 1) + sp_piece(bad, 0, 6) +
                      field_bytes(2, field_varint(3, 2)));
    try {
      data::Tokenizer::load(f);
      FAIL() << bad << " accepted as a byte piece";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("piece 2 is of type BYTE but its text"), std::string::npos) << e.what();
    }
  }
  write_file(f, sp_piece("<unk>", 0, 2) + sp_piece("a", -1, 1) + sp_piece("<0x41>", 0, 6) +
                    field_bytes(2, field_varint(3, 2)));
  EXPECT_EQ(data::Tokenizer::load(f)->decode({2, 1}, false), "Aa");
}

}  // namespace
}  // namespace memtune::testing

namespace memtune::testing {
namespace {

// Very long runs of one character class go through the regexes and BPE whole:
// decode(encode(x)) == x for the byte-level tiny tokenizer.
TEST(Tokenizer, LongRunsRoundTrip) {
  auto tok = data::Tokenizer::load(source_dir() / "examples" / "tiny-tokenizer");
  for (const std::string unit : {" ", "a", "\n", "1", "\t ", "!?", "\xE4\xBD\xA0", "ab "}) {
    std::string x;
    while (x.size() < 300000) x += unit;
    const auto ids = tok->encode(x, false);
    EXPECT_EQ(tok->decode(ids, false), x) << "unit " << unit;
  }
}

}  // namespace
}  // namespace memtune::testing
