// A Hugging Face `tokenizer.json` tokenizer that reproduces the `tokenizers` library id for id.
//
// Pipeline of tokenizers' encode(), which this follows step by step:
//   1. added tokens are split out of the raw text (longest match first); those marked `normalized`
//      are then matched again on the normalized text of the remaining pieces;
//   2. each remaining piece is normalized (NFC, Lowercase, Prepend, Replace, ...);
//   3. the pre-tokenizer splits pieces into words (ByteLevel, Split, Metaspace, Digits, ...);
//   4. the BPE model turns each word into ids;
//   5. with add_special_tokens the post-processor adds e.g. <|begin_of_text|>.
// Decoding maps ids to token strings, drops special tokens when asked, and runs the decoder chain.
//
// Only what Llama/Qwen/Mistral/SmolLM-family files use is supported; anything else in a file is an
// error naming the component and what is supported, never a silent difference in ids.
//
// A Tokenizer is cheap to copy (the loaded state is shared and immutable) and encode/decode may be
// called from several threads at once.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/json.h"

namespace oomless {

class Tokenizer {
 public:
  // Errors ("[tokenizer] SOURCE: ...") for unreadable files, malformed JSON, unsupported components,
  // and inconsistent vocabularies (e.g. a merge whose parts are not in the vocab).
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  static Tokenizer from_json(const json::Value& doc, std::string_view source);

  // Text must be valid UTF-8 (tokenizers takes a Rust &str, which cannot hold anything else): invalid
  // input is an error naming the byte offset, not a silent replacement.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Ids without a token (e.g. the padding rows of an embedding bigger than the vocabulary) are
  // skipped, as tokenizers does, so decoding model samples never fails.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // max id + 1 over the vocab and the added tokens
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // error for an id without a token
  bool is_special(int32_t id) const;          // an added token marked special

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace oomless
