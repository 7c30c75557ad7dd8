// The tokenizer against the `tokenizers` library: every golden set in tests/golden/tokenizers/NAME/
// (tokenizer.json + cases.json written by that library) must match id for id and decode byte for
// byte; then unit tests of each pipeline stage and of the errors for files we do not support.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "util/harness.h"
#include "io/json.h"
#include "tokenizer/detail.h"
#include "tokenizer/tokenizer.h"

namespace oomless::test {
namespace {

namespace fs = std::filesystem;

fs::path golden_root() { return fs::path(test::source_path("tests/golden/tokenizers")); }

std::vector<int32_t> to_ids(const json::Value& v) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < v.size(); ++i) ids.push_back(static_cast<int32_t>(v[i].as_int()));
  return ids;
}

std::string show(const std::vector<int32_t>& ids) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? " " : "") << ids[i];
  os << "]";
  return os.str();
}

TEST(TokenizerGolden, EveryGoldenSetMatchesTokenizersIdForId) {
  const fs::path root = golden_root();
  ASSERT_FALSE(root.empty()) << "tests/golden/tokenizers not found above " << fs::current_path()
                             << "; set OOMLESS_SOURCE_DIR to the source tree";
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && fs::exists(e.path() / "cases.json")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  ASSERT_GE(dirs.size(), 1u);
  for (const fs::path& dir : dirs) {
    const std::string name = dir.filename().string();
    SCOPED_TRACE(name);
    Tokenizer tok = [&] {
      try {
        return Tokenizer::from_file((dir / "tokenizer.json").string());
      } catch (const Error& e) {
        ADD_FAILURE() << e.what();
        throw;
      }
    }();
    const json::Value cases = json::parse_file((dir / "cases.json").string());
    size_t passed = 0, failures = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const json::Value& c = cases[i];
      const std::string& text = c.at("text").as_string();
      const std::vector<int32_t> want = to_ids(c.at("ids")), want_plain = to_ids(c.at("ids_plain"));
      const std::vector<int32_t> got = tok.encode(text, true), got_plain = tok.encode(text, false);
      const std::string decoded = tok.decode(want, false);
      const bool ok = got == want && got_plain == want_plain && decoded == c.at("decoded").as_string();
      if (ok) {
        ++passed;
      } else if (++failures <= 5) {
        ADD_FAILURE() << name << " case " << i << " text " << json::quote(text) << "\n  ids   want " << show(want)
                      << "\n        got  " << show(got) << "\n  plain want " << show(want_plain) << "\n        got  "
                      << show(got_plain) << "\n  decoded want " << json::quote(c.at("decoded").as_string())
                      << "\n          got  " << json::quote(decoded);
      }
    }
    std::printf("[ golden   ] %-20s %zu/%zu cases match\n", name.c_str(), passed, cases.size());
    EXPECT_EQ(passed, cases.size()) << name;
  }
}


// ---- unit tests of the pipeline stages ----

std::string u8(const char8_t* s) { return std::string(reinterpret_cast<const char*>(s)); }

Tokenizer parse_tokenizer(const std::string& text) { return Tokenizer::from_json(json::parse(text), "<test>"); }

// A tiny BPE document; pieces of it are replaced by the tests.
std::string doc(const std::string& model_extra = "", const std::string& added = "[]",
                const std::string& normalizer = "null", const std::string& pre = "null",
                const std::string& decoder = "null", const std::string& post = "null") {
  return R"({"version": "1.0", "truncation": null, "padding": null, "added_tokens": )" + added +
         R"(, "normalizer": )" + normalizer + R"(, "pre_tokenizer": )" + pre + R"(, "post_processor": )" + post +
         R"(, "decoder": )" + decoder +
         R"(, "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false, "byte_fallback": false,)"
         R"( "vocab": {"a": 0, "b": 1, " ": 2, "<": 3, "W": 4, ">": 5, "<L>": 6, "<R>": 7, "<W>": 8},)"
         R"( "merges": [])" + model_extra + "}}";
}

std::string expect_error(const std::string& text) {
  try {
    parse_tokenizer(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenizerBytes, Gpt2ByteMap) {
  EXPECT_EQ(tok::byte_to_char(' '), U'\u0120');   // Ġ
  EXPECT_EQ(tok::byte_to_char('\n'), U'\u010A');  // Ċ
  EXPECT_EQ(tok::byte_to_char(0x00), U'\u0100');
  EXPECT_EQ(tok::byte_to_char(0x7F), U'\u0121');
  EXPECT_EQ(tok::byte_to_char(0xAD), U'\u0143');  // soft hyphen, the last unprintable byte
  EXPECT_EQ(tok::byte_to_char('A'), U'A');
  EXPECT_EQ(tok::byte_to_char(0xFF), U'\u00FF');
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tok::char_to_byte(tok::byte_to_char(static_cast<uint8_t>(b))), b);
  EXPECT_EQ(tok::char_to_byte(U'\u4E00'), -1);
  EXPECT_EQ(tok::bytes_to_byte_level("a b\n"), u8(u8"a\u0120b\u010A"));
}

TEST(TokenizerBytes, Utf8ValidationAndLossyDecoding) {
  EXPECT_EQ(tok::invalid_utf8_offset(u8(u8"h\u00e9llo \U0001F600")), std::string_view::npos);
  EXPECT_EQ(tok::invalid_utf8_offset("ab\xC3"), 2u);
  EXPECT_EQ(tok::invalid_utf8_offset("x\xED\xA0\x80"), 1u);  // a surrogate
  EXPECT_EQ(tok::invalid_utf8_offset("\xC0\xAF"), 0u);       // overlong
  // One U+FFFD per maximal invalid subpart, as Rust's from_utf8_lossy.
  EXPECT_EQ(tok::utf8_lossy("a\xF0\x9F\x98" "b"), u8(u8"a\uFFFDb"));
  EXPECT_EQ(tok::utf8_lossy("\xC0\xAF"), u8(u8"\uFFFD\uFFFD"));
  EXPECT_EQ(tok::utf8_lossy("\xE2\x88\x91"), u8(u8"\u2211"));
}

std::vector<std::string> split_texts(const std::string& text, std::string_view needle, tok::SplitBehavior b,
                                     bool invert = false) {
  std::vector<tok::Span> m;
  tok::find_literal(text, needle, m);
  std::vector<tok::Piece> out;
  tok::split_piece({text, true}, m, b, invert, out);
  std::vector<std::string> r;
  for (const auto& p : out) r.push_back(p.text);
  return r;
}

TEST(TokenizerPreTokenize, SplitBehavioursMatchTokenizersDocs) {
  using B = tok::SplitBehavior;
  using V = std::vector<std::string>;
  const std::string s = "the-final--countdown";
  EXPECT_EQ(split_texts(s, "-", B::removed), (V{"the", "final", "countdown"}));
  EXPECT_EQ(split_texts(s, "-", B::isolated), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split_texts(s, "-", B::merged_with_previous), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split_texts(s, "-", B::merged_with_next), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split_texts(s, "-", B::contiguous), (V{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(split_texts(s, "-", B::removed, true), (V{"-", "-", "-"}));
}

std::vector<std::string> pre_tokenize(const std::string& json_text, const std::string& text, bool at_origin) {
  auto p = tok::make_pre_tokenizer(json::parse(json_text), "<test>");
  std::vector<tok::Piece> out;
  p->pre_tokenize({text, at_origin}, out);
  std::vector<std::string> r;
  for (const auto& x : out) r.push_back(x.text);
  return r;
}

// Oniguruma semantics that tokenizers relies on: empty matches are kept unless they touch the previous
// match, and ^ / $ anchor at line boundaries (Ruby syntax). Expectations from tokenizers' Split.
TEST(TokenizerPreTokenize, SplitRegexEmptyMatchesAndLineAnchors) {
  using V = std::vector<std::string>;
  const auto split = [](const std::string& re, const std::string& behavior) {
    return R"({"type": "Split", "pattern": {"Regex": )" + json::quote(re) + R"(}, "behavior": ")" + behavior +
           R"(", "invert": false})";
  };
  EXPECT_EQ(pre_tokenize(split("x*", "Isolated"), "axxb", true), (V{"a", "xx", "b"}));
  EXPECT_EQ(pre_tokenize(split("x*", "MergedWithPrevious"), "axxbx", true), (V{"axx", "bx"}));
  EXPECT_EQ(pre_tokenize(split("(?=b)", "Isolated"), "abab", true), (V{"a", "ba", "b"}));
  EXPECT_EQ(pre_tokenize(split("\\b", "Removed"), "hi there", true), (V{"hi", " ", "there"}));
  EXPECT_EQ(pre_tokenize(split("^a", "Isolated"), "a\nab\na", true), (V{"a", "\n", "a", "b\n", "a"}));
}

TEST(TokenizerPreTokenize, MetaspacePrependSchemes) {
  using V = std::vector<std::string>;
  const auto ms = [](const char* scheme, bool split) {
    return std::string(R"({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": ")") + scheme +
           R"(", "split": )" + (split ? "true" : "false") + "}";
  };
  const std::string hey = u8(u8"\u2581Hey"), sp = u8(u8"\u2581"), fr = u8(u8"\u2581friend");
  EXPECT_EQ(pre_tokenize(ms("always", true), "Hey  friend", false), (V{hey, sp, fr}));
  EXPECT_EQ(pre_tokenize(ms("first", true), "Hey  friend", true), (V{hey, sp, fr}));
  EXPECT_EQ(pre_tokenize(ms("first", true), "Hey  friend", false), (V{"Hey", sp, fr}));
  EXPECT_EQ(pre_tokenize(ms("never", true), "Hey  friend", true), (V{"Hey", sp, fr}));
  EXPECT_EQ(pre_tokenize(ms("always", false), "Hey  friend", false), (V{hey + sp + fr}));
  // Text that already starts with the marker gets no second one.
  EXPECT_EQ(pre_tokenize(ms("always", true), " x", false), (V{u8(u8"\u2581x")}));
}

TEST(TokenizerPreTokenize, DigitsWhitespacePunctuation) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pre_tokenize(R"({"type": "Digits", "individual_digits": true})", "ab12c3", true),
            (V{"ab", "1", "2", "c", "3"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "Digits", "individual_digits": false})", "ab12c3", true), (V{"ab", "12", "c", "3"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "Whitespace"})", "Hey friend!! ok?", true), (V{"Hey", "friend", "!!", "ok", "?"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "WhitespaceSplit"})", " Hey\tfriend!!  ", true), (V{"Hey", "friend!!"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "Punctuation", "behavior": "Isolated"})", "Hey, you!", true),
            (V{"Hey", ",", " you", "!"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true})", "Hi there's", true),
            (V{u8(u8"\u0120Hi"), u8(u8"\u0120there"), "'s"}));
  EXPECT_EQ(pre_tokenize(R"({"type": "Split", "pattern": {"Regex": "\\s+(?!\\S)|\\p{N}{1,3}"},
                            "behavior": "Isolated", "invert": false})",
                         "a   b12345", true),
            (V{"a", "  ", " b", "123", "45"}));
}

std::string normalize(const std::string& json_text, std::string s) {
  tok::make_normalizer(json::parse(json_text), "<test>")->normalize(s);
  return s;
}

TEST(TokenizerNormalize, UnicodeFormsLowercaseStripReplace) {
  EXPECT_EQ(normalize(R"({"type": "NFC"})", u8(u8"e\u0301")), u8(u8"\u00e9"));
  EXPECT_EQ(normalize(R"({"type": "NFD"})", u8(u8"\u00e9")), u8(u8"e\u0301"));
  EXPECT_EQ(normalize(R"({"type": "NFKC"})", u8(u8"\uFB01\u2460")), "fi1");
  EXPECT_EQ(normalize(R"({"type": "NFKD"})", u8(u8"\u00C5")), u8(u8"A\u030A"));
  EXPECT_EQ(normalize(R"({"type": "Lowercase"})", u8(u8"\u0130STANBUL \u03A3")), u8(u8"i\u0307stanbul \u03C3"));
  EXPECT_EQ(normalize(R"({"type": "Strip", "strip_left": true, "strip_right": false})", u8(u8" \u3000a b  ")), "a b  ");
  EXPECT_EQ(normalize(R"({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "_"})", "a  b   c d"), "a_b_c d");
  EXPECT_EQ(normalize(R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]})", "a b"),
            u8(u8"\u2581a\u2581b"));
  EXPECT_EQ(normalize(R"({"type": "Prepend", "prepend": "x"})", ""), "");  // nothing to prepend to
}

// The expectations below were produced by the `tokenizers` library on the same documents.
TEST(TokenizerAddedTokens, LstripRstripSingleWord) {
  const Tokenizer t = parse_tokenizer(doc(
      "", R"([{"id": 6, "content": "<L>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false, "special": false},
             {"id": 7, "content": "<R>", "single_word": false, "lstrip": false, "rstrip": true, "normalized": false, "special": true},
             {"id": 8, "content": "<W>", "single_word": true, "lstrip": false, "rstrip": false, "normalized": false, "special": false}])"));
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode("a  <L>b"), (V{0, 6, 1}));
  EXPECT_EQ(t.encode("a<R>   b"), (V{0, 7, 1}));
  EXPECT_EQ(t.encode("a<W>b"), (V{0, 3, 4, 5, 1}));  // not a single word: left as text
  EXPECT_EQ(t.encode("a <W> b"), (V{0, 2, 8, 2, 1}));
  EXPECT_EQ(t.encode("<W>a"), (V{3, 4, 5, 0}));
  EXPECT_EQ(t.encode("  <L><R>  <L>  "), (V{6, 7, 6, 2, 2}));
  EXPECT_EQ(t.encode(u8(u8"a\u2000<L>")), (V{0, 6}));  // lstrip takes any Unicode whitespace
  const V ids{0, 6, 7, 1};
  EXPECT_EQ(t.decode(ids), "a <L> <R> b");  // no decoder: tokens joined by spaces
  EXPECT_EQ(t.decode(ids, true), "a <L> b");
  EXPECT_TRUE(t.is_special(7));
  EXPECT_FALSE(t.is_special(6));
  EXPECT_FALSE(t.is_special(0));
}

std::string handmade_path() { return (golden_root() / "unit_handmade" / "tokenizer.json").string(); }

TEST(TokenizerBpe, IgnoreMergesEmitsVocabWordsWhole) {
  const json::Value d = json::parse_file(handmade_path());
  const Tokenizer with = Tokenizer::from_json(d, "handmade");
  EXPECT_EQ(with.encode("abc"), (std::vector<int32_t>{6}));
  // Without ignore_merges the merges decide: "b c" has the lowest rank, and "a bc" is no merge.
  std::string text = json::dump(d);
  const size_t at = text.find("\"ignore_merges\":true");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 20, "\"ignore_merges\":false");
  EXPECT_EQ(parse_tokenizer(text).encode("abc"), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(with.encode("cd abcd"), (std::vector<int32_t>{8, 1, 5, 7}));
}

TEST(TokenizerBpe, ByteFallbackAndFusedUnk) {
  const Tokenizer t = Tokenizer::from_file(handmade_path());
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode(u8(u8"\u00e9")), (V{9, 10}));       // <0xC3><0xA9>
  EXPECT_EQ(t.encode(u8(u8"\u2211")), (V{11, 12, 13}));  // <0xE2><0x88><0x91>
  EXPECT_EQ(t.encode(u8(u8"\u00f6")), (V{0}));           // <0xB6> missing: unk
  EXPECT_EQ(t.encode(u8(u8"\u00f6\u00f6")), (V{0}));     // fused
  EXPECT_EQ(t.encode(u8(u8"a\u00f6\u00e9\u00f6b")), (V{1, 9, 10, 0, 2}));  // the unk run spans the bytes
  EXPECT_EQ(t.decode(V{9, 10}), u8(u8"\u00e9"));
  EXPECT_EQ(t.decode(V{9}), u8(u8"\uFFFD"));
  EXPECT_EQ(t.decode(V{9, 1, 10}), u8(u8"\uFFFDa\uFFFD"));
  // An invalid run becomes one U+FFFD per byte token, not one per invalid subsequence.
  EXPECT_EQ(t.decode(V{9, 9}), u8(u8"\uFFFD\uFFFD"));
  EXPECT_EQ(t.decode(V{11, 12}), u8(u8"\uFFFD\uFFFD"));
  EXPECT_EQ(t.decode(V{11, 12, 13, 9, 10}), u8(u8"\u2211\u00e9"));
}

TEST(TokenizerApi, VocabLookupsAndErrors) {
  const Tokenizer t = Tokenizer::from_file(handmade_path());
  EXPECT_EQ(t.vocab_size(), 14);
  EXPECT_EQ(t.token_to_id("abc"), 6);
  EXPECT_EQ(t.token_to_id("<unk>"), 0);
  EXPECT_FALSE(t.token_to_id("zzz").has_value());
  EXPECT_EQ(t.id_to_token(8), "cd");
  EXPECT_THROW(t.id_to_token(14), Error);
  EXPECT_THROW(t.id_to_token(-1), Error);
  EXPECT_EQ(t.decode(std::vector<int32_t>{1, 99, -5, 2}), "ab");  // ids without a token are skipped
  try {
    t.encode("abc\xFF");
    ADD_FAILURE() << "invalid UTF-8 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 3"), std::string::npos) << e.what();
  }
}

TEST(TokenizerApi, ConcurrentEncodesAgree) {
  const Tokenizer t = Tokenizer::from_file((golden_root() / "bundled" / "tokenizer.json").string());
  std::string text;
  for (int i = 0; i < 200; ++i) text += "In the beginning word" + std::to_string(i) + " was made. ";
  const auto want = t.encode(text);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) threads.emplace_back([&, k] { got[k] = t.encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

TEST(TokenizerErrors, UnsupportedAndMalformedFiles) {
  const auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos && msg.starts_with("[tokenizer] ");
  };
  std::string e = expect_error(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
  EXPECT_TRUE(has(e, "unsupported model type 'WordPiece'; supported: BPE")) << e;
  e = expect_error(R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})");
  EXPECT_TRUE(has(e, "unsupported model type 'Unigram'")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "merges": []}})");
  EXPECT_TRUE(has(e, "no \"vocab\"")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["ab"]}})");
  EXPECT_TRUE(has(e, "merge 0 \"ab\" is malformed")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b", "c"]]}})");
  EXPECT_TRUE(has(e, "malformed")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})");
  EXPECT_TRUE(has(e, "\"ab\", which is not in the vocab")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "vocab": {"a": -3}, "merges": []}})");
  EXPECT_TRUE(has(e, "ids must be integers")) << e;
  e = expect_error(doc("", "[]", R"({"type": "BertNormalizer"})"));
  EXPECT_TRUE(has(e, "<test>: unsupported normalizer type 'BertNormalizer'; supported: NFC")) << e;
  e = expect_error(doc("", "[]", "null", R"({"type": "BertPreTokenizer"})"));
  EXPECT_TRUE(has(e, "unsupported pre_tokenizer type 'BertPreTokenizer'")) << e;
  e = expect_error(doc("", "[]", "null", "null", R"({"type": "WordPiece", "prefix": "##"})"));
  EXPECT_TRUE(has(e, "unsupported decoder type 'WordPiece'")) << e;
  e = expect_error(doc("", "[]", "null", "null", "null", R"({"type": "RobertaProcessing"})"));
  EXPECT_TRUE(has(e, "unsupported post_processor type 'RobertaProcessing'")) << e;
  e = expect_error(doc("", "[]", "null", R"({"type": "Split", "pattern": {"Regex": "(a"}, "behavior": "Isolated"})"));
  EXPECT_TRUE(has(e, "does not compile")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "dropout": 0.1, "vocab": {"a": 0}, "merges": []}})");
  EXPECT_TRUE(has(e, "dropout")) << e;
  e = expect_error(R"([1, 2])");
  EXPECT_TRUE(has(e, "JSON object")) << e;
  e = expect_error(R"({"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []}})");
  EXPECT_TRUE(has(e, "vocab entry \"a\"")) << e;
  try {
    Tokenizer::from_file("/nonexistent/tokenizer.json");
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const Error& err) {
    EXPECT_TRUE(has(err.what(), "/nonexistent/tokenizer.json")) << err.what();
  }
}

}  // namespace
}  // namespace oomless::test
