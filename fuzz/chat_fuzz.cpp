// libFuzzer target for the chat input of the training data pipeline: a .jsonl file of {"text"} and
// {"messages": [...]} records (data/dataset.h), each conversation rendered with a chat template
// (data/chat.h); the same bytes may also be read as the pipeline's other sources, a .txt document or an
// .ids file. The first byte picks the setting, the rest is the file:
//   bits 0-1  0: the bundled tokenizer and its tokenizer_config.json (ChatML, what preset:micro/tiny use);
//             1: ChatML with a default system message written in the template (SmolLM2's style);
//             2: Llama 3 (BOS, headers, content trimmed);
//             3: the file's first line is the tokenizer_config.json (ChatTemplate::from_config fuzzed),
//                the other lines are the data.
//             1-3 use a small byte-level tokenizer that has the special tokens of both families.
//   bit 2     T = 33 instead of 8.
//   bit 3     after a few sequences, the cursor is saved and a second Dataset restored from it must give
//             the same next sequence (exact resume).
//   bits 4-5  the file: 0 and 3 .jsonl; 1 .txt, encoded in pieces of 16 bytes (text_piece_bytes), whose ids
//             must be those of the whole document (both tokenizers are byte-level: dataset.h's "Memory");
//             2 .ids.
//   bits 6-7  --truncation of conversations longer than a sequence: 0 and 3 split, 1 drop, 2 error (then
//             next() may refuse such a conversation, and drop may find nothing left: those errors only).
// Rejection must be an oomless::Error from the constructor, and no file may stay open after it. Once a
// Dataset is built, next() must not fail (the constructor validates every document), every id must be in
// the vocabulary and every supervised target must be the next token.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "io/json.h"
#include "model/load.h"
#include "tokenizer/detail.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace oomless;

[[noreturn]] void bug(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "chat_fuzz: %s %s\n", what, detail.c_str());
  std::abort();
}

// Byte-level BPE (the 256 byte symbols and a few merges) with the special tokens of ChatML and Llama 3,
// split by Llama 3's pre-tokenizer regex; add_special_tokens puts <|begin_of_text|> first.
std::string small_doc() {
  std::string vocab;
  int id = 0;
  for (int b = 0; b < 256; ++b)
    vocab += (b ? "," : "") + json::quote(tok::byte_to_utf8(static_cast<uint8_t>(b))) + ":" + std::to_string(id++);
  const char* merges[][2] = {{"\xC4\xA0", "t"}, {"h", "e"}, {"\xC4\xA0t", "he"}, {"i", "n"}, {"u", "s"},
                             {"e", "r"}, {"us", "er"}, {"s", "s"}, {"a", "ss"}, {"i", "s"}, {"is", "t"},
                             {"n", "t"}, {"a", "nt"}, {"ass", "ist"}, {"assist", "ant"}, {"\xC4\x8A", "\xC4\x8A"}};
  std::string merge_list;
  for (const auto& m : merges) {
    vocab += "," + json::quote(std::string(m[0]) + m[1]) + ":" + std::to_string(id++);
    merge_list += std::string(merge_list.empty() ? "" : ",") + "[" + json::quote(m[0]) + "," + json::quote(m[1]) + "]";
  }
  std::string added;
  int aid = 300;
  for (const char* s : {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|im_start|>", "<|im_end|>"}) {
    if (aid > 300) added += ",";
    added += R"({"id": )" + std::to_string(aid++) + R"(, "content": )" + json::quote(s) +
             R"(, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})";
  }
  return R"({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [)" + added + R"(],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [300], "tokens": ["<|begin_of_text|>"]}}},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
      "vocab": {)" + vocab + R"(}, "merges": [)" + merge_list + R"(]}})";
}

const Tokenizer& small() {
  static const Tokenizer t = Tokenizer::from_json(json::parse(small_doc()), "fuzz:small");
  return t;
}

json::Value config_with(const std::string& chat_template, const char* bos) {
  json::Value c = json::Value::object();
  c.set("chat_template", json::Value::string(chat_template));
  if (bos) c.set("bos_token", json::Value::string(bos));
  return c;
}

const json::Value& chatml_default_system() {
  static const json::Value c = config_with(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
      "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}",
      nullptr);
  return c;
}

const json::Value& llama3() {
  static const json::Value c = config_with(
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
      "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
      "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}",
      "<|begin_of_text|>");
  return c;
}

const json::Value& bundled_config() {
  static const json::Value c = bundled_tokenizer_config();
  return c;
}

// The data file (EXT: jsonl, txt or ids), rewritten for every input; one per process, so that parallel
// jobs do not collide, removed at exit.
struct DataFiles {
  const std::string base =
      (std::filesystem::temp_directory_path() / ("oomless_chat_fuzz_" + std::to_string(::getpid()))).string();
  ~DataFiles() {
    for (const char* e : {"jsonl", "txt", "ids"}) std::remove((base + "." + e).c_str());
  }
};

std::string data_path(const char* ext) {
  static const DataFiles files;
  return files.base + "." + ext;
}

void write_file(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(text.data(), 1, text.size(), f) != text.size() || std::fclose(f) != 0)
    bug("cannot write", path);
}

struct Sequence {
  std::vector<int32_t> ids, targets;
  bool operator==(const Sequence&) const = default;
};

// The next sequence, checked; nullopt when the truncation rule refused the data (the only error allowed).
std::optional<Sequence> next_checked(Dataset& ds, int64_t T, int64_t vocab, Truncation tr) {
  Sequence s{std::vector<int32_t>(T), std::vector<int32_t>(T)};
  try {
    ds.next(s.ids.data(), s.targets.data());
  } catch (const Error& e) {
    const std::string w = e.what();
    if ((tr == Truncation::error && w.find("longer than a sequence") != std::string::npos) ||
        (tr == Truncation::drop && w.find("every conversation is longer") != std::string::npos))
      return std::nullopt;
    bug("next() failed on data the constructor accepted:", e.what());
  }
  for (int64_t t = 0; t < T; ++t) {
    if (s.ids[t] < 0 || s.ids[t] >= vocab) bug("id outside the vocabulary:", std::to_string(s.ids[t]));
    const int32_t y = s.targets[t];
    if (y != -100 && (y < 0 || y >= vocab)) bug("target outside the vocabulary:", std::to_string(y));
    if (y != -100 && t + 1 < T && y != s.ids[t + 1]) bug("a supervised target is not the next token");
  }
  return s;
}

// Builds the Dataset (rejection is an Error) and, when it is accepted, draws the first epoch's sequences.
// whole_text: the file is that one text document, whose stream (its ids and EOS, once per epoch) the
// sequences' ids must follow.
void exercise(const DatasetOptions& opt, const Tokenizer& tok, const json::Value& config, bool resume,
              const std::string* whole_text) {
  const int64_t vocab = tok.vocab_size();
  std::unique_ptr<Dataset> ds;
  try {
    ds = std::make_unique<Dataset>(opt, &tok, config);
  } catch (const Error&) {
    return;  // rejected data: the expected outcome for broken records
  }
  std::vector<int32_t> stream;
  if (whole_text) {
    stream = tok.encode(*whole_text, true);
    stream.push_back(opt.eos_id);
  }
  // Every document of the first epoch (bounded, so that one input stays fast).
  for (int64_t n = 0; n < 256 && ds->epoch() == 0; ++n) {
    const std::optional<Sequence> got = next_checked(*ds, opt.T, vocab, opt.truncation);
    if (!got) return;
    const Sequence& s = *got;
    for (int64_t t = 0; whole_text && t < opt.T; ++t)
      if (s.ids[t] != stream[(n * opt.T + t) % stream.size()])
        bug("a text document read in pieces gives other ids than the whole document, at stream position",
            std::to_string(n * opt.T + t));
  }
  if (!resume) return;
  const json::Value state = ds->state();
  const std::optional<Sequence> expected = next_checked(*ds, opt.T, vocab, opt.truncation);
  if (!expected) return;
  Dataset again(opt, &tok, config);
  try {
    again.restore(json::parse(json::dump(state), "fuzz state"));
  } catch (const Error& e) {
    bug("restore() refused the state of the same data:", e.what());
  }
  if (!(next_checked(again, opt.T, vocab, opt.truncation) == expected)) bug("a restored cursor gives a different sequence");
}

// The lowest file descriptor not in use: it grows when a descriptor leaks.
int lowest_free_fd() {
  const int fd = ::dup(2);
  ::close(fd);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const Tokenizer& tok = (mode & 3) == 0 ? bundled_tokenizer() : small();
  json::Value config;
  switch (mode & 3) {
    case 0: config = bundled_config(); break;
    case 1: config = chatml_default_system(); break;
    case 2: config = llama3(); break;
    default: {
      const size_t nl = text.find('\n');
      try {
        config = json::parse(std::string_view(text).substr(0, nl), "fuzz tokenizer_config");
      } catch (const Error&) {
        return 0;
      }
      text = nl == std::string::npos ? std::string() : text.substr(nl + 1);
      // Detection never throws; an unknown template is Kind::none with a reason.
      const ChatTemplate ct = ChatTemplate::from_config(config);
      if (ct.kind() == ChatTemplate::Kind::none && ct.unsupported_reason().empty()) bug("Kind::none without a reason");
    }
  }
  const int kind = (mode >> 4) & 3;
  const std::string path = data_path(kind == 1 ? "txt" : kind == 2 ? "ids" : "jsonl");
  write_file(path, text);

  DatasetOptions opt;
  opt.paths = {path};
  opt.T = (mode & 4) ? 33 : 8;
  if (kind == 1) opt.text_piece_bytes = 16;
  opt.seed = 1;
  const int tr = (mode >> 6) & 3;
  opt.truncation = tr == 1 ? Truncation::drop : tr == 2 ? Truncation::error : Truncation::split;
  opt.eos_id = *tok.token_to_id((mode & 3) == 0 ? "<|endoftext|>" : "<|end_of_text|>");
  const int fd = lowest_free_fd();
  exercise(opt, tok, config, mode & 8, kind == 1 ? &text : nullptr);
  if (lowest_free_fd() != fd) bug("a file descriptor was left open");
  return 0;
}
