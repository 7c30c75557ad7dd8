// libFuzzer target for the tokenizer. The first byte picks the mode, the rest is the payload:
//   0: the payload is a tokenizer.json; loading may fail with oomless::Error, never crash. A file that
//      loads must then encode and decode a fixed text.
//   1: the payload is text for a fixed byte-level tokenizer (regex split, added tokens with
//      lstrip/rstrip, no normalizer, so decode(encode(x)) == x must hold for valid UTF-8);
//      invalid UTF-8 must be an Error.
//   2: the same text through a fixed Metaspace + byte_fallback tokenizer (SentencePiece style).
//   3: the payload is a list of int32 ids to decode with both fixed tokenizers.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/json.h"
#include "tokenizer/detail.h"
#include "tokenizer/tokenizer.h"

namespace {

using oomless::Tokenizer;
namespace json = oomless::json;

// Byte-level BPE: the 256 byte symbols, a few merges, added tokens with every matching option.
std::string byte_level_doc() {
  std::string vocab;
  int id = 0;
  for (int b = 0; b < 256; ++b) vocab += (b ? "," : "") + json::quote(oomless::tok::byte_to_utf8(static_cast<uint8_t>(b))) + ":" + std::to_string(id++);
  const char* merged[] = {"\xC4\xA0t", "he", "\xC4\xA0the", "in", ("\xC4\xA0" "a"), "an", "and"};
  for (const char* m : merged) vocab += "," + json::quote(m) + ":" + std::to_string(id++);
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
      {"id": 300, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 301, "content": "<L>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false, "special": false},
      {"id": 302, "content": "<R>", "single_word": true, "lstrip": false, "rstrip": true, "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [300], "tokens": ["<|endoftext|>"]}}},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
      "vocab": {)" + vocab + R"(}, "merges": [["\u0120", "t"], ["h", "e"], ["\u0120t", "he"], ["i", "n"], ["\u0120", "a"], ["a", "n"], ["an", "d"]]}})";
}

// SentencePiece style: NFKC, Metaspace, byte_fallback with an unk token, the Llama decoder chain.
std::string metaspace_doc() {
  std::string vocab = R"("<unk>": 0, "<s>": 1, "</s>": 2)";
  int id = 3;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab += ",\"" + std::string(name) + "\":" + std::to_string(id++);
  }
  for (const char* t : {"\xE2\x96\x81", "a", "b", "c", "\xE2\x96\x81" "a", "ab", "\xE2\x96\x81" "ab"})
    vocab += "," + json::quote(t) + ":" + std::to_string(id++);
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
      {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Strip", "strip_left": false, "strip_right": true}]},
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": true},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
      "vocab": {)" + vocab + R"(}, "merges": ["\u2581 a", "a b", "\u2581a b"]}})";
}

const Tokenizer& byte_level() {
  static const Tokenizer t = Tokenizer::from_json(json::parse(byte_level_doc()), "fuzz:byte_level");
  return t;
}

const Tokenizer& metaspace() {
  static const Tokenizer t = Tokenizer::from_json(json::parse(metaspace_doc()), "fuzz:metaspace");
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int mode = data[0] % 4;
  const std::string payload(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (mode) {
      case 0: {
        const Tokenizer t = Tokenizer::from_json(json::parse(payload, "fuzz"), "fuzz");
        const auto ids = t.encode("Hello <s> w\xC3\xB6rld 123 it's\n\n  done<|endoftext|>");
        t.decode(ids, false);
        t.decode(ids, true);
        (void)t.vocab_size();
        break;
      }
      case 1: {
        const auto ids = byte_level().encode(payload, false);
        // Byte-level BPE without a normalizer loses nothing: the text must come back exactly, unless
        // an lstrip/rstrip token swallowed whitespace next to it.
        const bool strips = payload.find("<L>") != std::string::npos || payload.find("<R>") != std::string::npos;
        if (!strips && byte_level().decode(ids) != payload) std::abort();
        byte_level().encode(payload, true);
        break;
      }
      case 2: {
        const auto ids = metaspace().encode(payload);
        metaspace().decode(ids, false);
        metaspace().decode(ids, true);
        break;
      }
      default: {
        std::vector<int32_t> ids(payload.size() / 4);
        if (!ids.empty()) std::memcpy(ids.data(), payload.data(), ids.size() * 4);
        for (int32_t& id : ids) id %= 400;  // mostly real ids, some negative ones
        byte_level().decode(ids, false);
        metaspace().decode(ids, true);
        break;
      }
    }
  } catch (const oomless::Error&) {
    // Rejected input: the expected outcome for bad files and invalid UTF-8.
  }
  return 0;
}
