#pragma once
// A varied corpus for comparing memtune's tokenizers with the Hugging Face library: many
// scripts, emoji (ZWJ sequences, flags, skin tones), combining marks, whitespace runs,
// digits, code, special-token strings inside text, the empty string, pseudo-random
// strings from many Unicode blocks, and one input of 100k characters.
#include <cstdint>
#include <string>
#include <vector>

namespace memtune::testing {

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

inline std::vector<std::string> tokenizer_corpus() {
  std::vector<std::string> c = {
      "",
      "Hello world",
      "Hello, world! How are you doing today?",
      "The quick brown fox jumps over the lazy dog.",
      "I'm sure they're right, we've seen it, you'll agree, he'd say, it's DON'T and I'LL",
      "What is 12 + 35? The answer is 47.",
      "1234567890 3.14159 12,345,678.90 2024-01-01T12:00:00Z 0x1F -42 1e-9",
      "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679",
      "你好，世界！今天天气很好。我们去公园散步吧。",
      "こんにちは世界、カタカナとひらがなと漢字。",
      "안녕하세요 세계! 한국어 문장입니다.",
      "مرحبا بالعالم، كيف حالك؟ هذا اختبار.",
      "שלום עולם, זה מבחן.",
      "नमस्ते दुनिया, यह एक परीक्षण है। क्षत्रिय",
      "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
      "Привет, мир! Съешь же ещё этих мягких французских булок.",
      "Γειά σου Κόσμε! Ελληνικά.",
      "Ünïcödé façade naïve café résumé Ångström Straße ǅ",
      "e\u0301 a\u0308\u0304 n\u0303 A\u030A o\u0302\u0323 \u1100\u1161\u11A8 \u0915\u094D\u0937",
      "Z\u0351\u036B\u0343\u036A\u0302\u036B\u033D\u034F\u0334\u0319a\u0308lgo\u0301",
      "👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 🧑🏿‍🚀 😀😃😄 ✅",
      "emoji👨‍💻inside😀words",
      "  leading spaces",
      "trailing spaces   ",
      "\t\ttabs\tin\tthe middle\t",
      "\n\n\nnewlines\n\nand more\n",
      "a \n b \r\n c \n\n\n   d",
      "multiple     spaces      between       words",
      "\u00A0non-breaking\u00A0space and\u3000ideographic\u2003em space",
      "    ",
      "\n",
      " ",
      "\t",
      "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
      "int main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;\n\treturn 0;\n}\n",
      "{\"key\": [1, 2, {\"nested\": null}], \"url\": \"https://example.com/a?b=c&d=e#f\"}",
      "SELECT * FROM users WHERE id = 42 AND name LIKE '%abc%';",
      "<|begin_of_text|>Hello<|end_of_text|>",
      "text <|begin_of_text|> inside <|end_of_text|>text",
      "<s>Hello</s> <s> </s><unk>",
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
      "<|endoftext|>after<|endoftext|><|endoftext|>",
      "<|im_st partial <|im_end no close |> <| |>",
      "<think>\nreasoning\n</think>\n\nanswer",
      "<0x41> <0xFF> \u2581 \u2581\u2581 _underscore",
      "\x01\x02\x7f control chars \x1b[0m",
      "Mixed 中文 and English and العربية and हिन्दी in one line.",
      "!!!??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} ||| \\\\\\ ~~~ ``` ''' \"\"\"",
      "'s 't 're 've 'm 'll 'd 'S 'T 'RE",
      "Ⅻ ½ ² ³ ① ٣٤٥ ۱۲۳ १२३ 一二三",
      "\uFEFFbom at start",
      "tab\t\t\t\tand spaces    \n\t  \n",
  };
  // Pseudo-random strings from many blocks (assigned code points only, so that the
  // Unicode versions of the two regex engines agree).
  const std::vector<std::pair<uint32_t, uint32_t>> blocks = {
      {0x20, 0x7E},     {0x20, 0x7E},     {0x20, 0x7E},     {0xA1, 0xFF},     {0x100, 0x17F},
      {0x300, 0x36F},   {0x391, 0x3A9},   {0x410, 0x44F},   {0x5D0, 0x5EA},   {0x627, 0x64A},
      {0x660, 0x669},   {0x905, 0x939},   {0x93E, 0x94D},   {0xE01, 0xE2E},   {0x3041, 0x3096},
      {0x30A1, 0x30FA}, {0x4E00, 0x9FA5}, {0xAC00, 0xD7A3}, {0x1F600, 0x1F64F}, {0x2000, 0x200A},
      {0x9, 0xA},       {0x1F3FB, 0x1F3FF}};
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto rnd = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int s = 0; s < 200; ++s) {
    std::string t;
    const int n = 1 + static_cast<int>(rnd() % 60);
    for (int k = 0; k < n; ++k) {
      const auto& b = blocks[rnd() % blocks.size()];
      append_utf8(t, b.first + static_cast<uint32_t>(rnd() % (b.second - b.first + 1)));
    }
    c.push_back(t);
  }
  // One long input: the corpus interleaved to 100k characters (whole characters only).
  std::string big;
  size_t chars = 0;
  for (size_t k = 0; chars < 100000; ++k) {
    const std::string& piece = c[1 + (k * 7919) % (c.size() - 1)];
    for (size_t i = 0; i < piece.size() && chars < 100000; ++chars) {
      size_t n = 1;
      while (i + n < piece.size() && (static_cast<uint8_t>(piece[i + n]) & 0xC0) == 0x80) ++n;
      big.append(piece, i, n);
      i += n;
    }
    big += k % 5 == 0 ? "\n" : " ";
  }
  c.push_back(big);
  return c;
}

}  // namespace memtune::testing
