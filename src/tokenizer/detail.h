// Internals of the tokenizer, shared by its .cpp files: UTF-8 and character classes, the GPT-2 byte
// map, a PCRE2 wrapper, and the pipeline stages built from tokenizer.json. Not a public API.
//
// Character classes follow Rust's definitions, because tokenizers is written in Rust:
// char::is_whitespace (Unicode White_Space), char::is_numeric (Nd, Nl, No), char::is_punctuation.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/json.h"

namespace oomless::tok {

// ---- UTF-8 (bytes.cpp) ----
// Decodes the code point at s[i] and advances i; s must be valid UTF-8.
char32_t next_char(std::string_view s, size_t& i);
void append_utf8(std::string& out, char32_t c);
std::string utf8(char32_t c);
// Offset of the first byte that is not part of valid UTF-8, or npos.
size_t invalid_utf8_offset(std::string_view s);
// Bytes to text, each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

bool is_whitespace(char32_t c);   // Rust char::is_whitespace
bool is_numeric(char32_t c);      // Rust char::is_numeric
bool is_punctuation(char32_t c);  // ASCII punctuation or Unicode P*
bool is_word_char(char32_t c);    // regex \w (Unicode)

// ---- GPT-2 byte <-> unicode map (bytes.cpp) ----
// GPT-2 maps every byte to a printable code point so that BPE works on text; printable Latin-1 bytes
// map to themselves, the rest to U+0100.. in byte order ("Ġ" for space, "Ċ" for newline).
char32_t byte_to_char(uint8_t b);
const std::string& byte_to_utf8(uint8_t b);  // byte_to_char(b) encoded as UTF-8
int char_to_byte(char32_t c);                 // the byte, or -1 for a char outside the map
std::string bytes_to_byte_level(std::string_view bytes);

// ---- PCRE2 regex (regex.cpp) ----
struct Span {
  size_t begin, end;
};

// A compiled pattern with Oniguruma-like semantics (what tokenizers uses): Unicode classes
// (\p{L}, \s, \w), lookaround, `^`/`$` at line boundaries (Ruby syntax).
class Regex {
 public:
  Regex(const std::string& pattern, std::string_view source, std::string_view role);
  // Non-overlapping matches left to right; an empty match right after the previous match is
  // skipped, as Oniguruma's find_iter does. text must be valid UTF-8.
  void find_all(std::string_view text, std::vector<Span>& out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
  std::string source_;
};

// Literal, non-overlapping occurrences of `needle` (non-empty).
void find_literal(std::string_view text, std::string_view needle, std::vector<Span>& out);

// Either a String or a Regex pattern object from tokenizer.json ({"String": s} / {"Regex": r}).
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;  // null for a literal
  void find_all(std::string_view text, std::vector<Span>& out) const;
};
Pattern parse_pattern(const json::Value& v, std::string_view source, std::string_view role);

// ---- small JSON helpers for components (tokenizer.cpp) ----
// Type of a component object, or an error naming the role ("normalizer", ...).
const std::string& component_type(const json::Value& v, std::string_view source, std::string_view role);
bool get_bool(const json::Value& v, std::string_view key, bool def, std::string_view source, std::string_view role);
[[noreturn]] void unsupported(std::string_view source, std::string_view role, std::string_view type,
                              std::string_view supported);

// ---- normalizers (normalize.cpp) ----
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s) const = 0;
};
// v is the "normalizer" value; null gives nullptr.
std::unique_ptr<Normalizer> make_normalizer(const json::Value& v, std::string_view source);

// ---- pre-tokenizers (pretokenize.cpp) ----
// A piece of text on its way to the model. at_origin: it starts at offset 0 of the input, which
// Metaspace's prepend_scheme "first" asks about.
struct Piece {
  std::string text;
  bool at_origin = false;
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// Splits `in` at the given matches (sorted, non-overlapping spans) the way tokenizers'
// NormalizedString::split does; empty results are dropped. invert swaps matches and gaps.
void split_piece(const Piece& in, const std::vector<Span>& matches, SplitBehavior behavior, bool invert,
                 std::vector<Piece>& out);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Appends the pieces `in` splits into (possibly rewritten, e.g. byte-level) to out.
  virtual void pre_tokenize(const Piece& in, std::vector<Piece>& out) const = 0;
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json::Value& v, std::string_view source);

// ---- BPE model (bpe.cpp) ----
class Bpe {
 public:
  Bpe(const json::Value& model, std::string_view source);
  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;
  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }
  int32_t find(std::string_view token) const;  // -1 when absent

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges_;  // (left, right) -> (rank, merged)
  std::string unk_token_, prefix_, suffix_;
  bool has_unk_ = false, fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  int32_t byte_ids_[256];  // <0xAB> token ids for byte_fallback, -1 where absent
  // Words recur constantly in text; the cache makes encoding a few MB/s. Bounded so that a long
  // stream of unique words cannot grow it without limit.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// ---- decoders (decode.cpp) ----
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const json::Value& v, std::string_view source);

}  // namespace oomless::tok
