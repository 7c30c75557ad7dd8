#include "data/dataset.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "core/error.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

constexpr size_t kChunk = 1 << 20;  // bytes read at a time while indexing

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Length of the longest prefix of s[0, n) made of whole valid UTF-8 sequences (the tokenizer's rules:
// no overlongs, surrogates or code points past U+10FFFF). *bad is set when the byte there starts an
// invalid sequence; otherwise the rest is an incomplete sequence that the next chunk may complete.
size_t utf8_prefix(const unsigned char* s, size_t n, bool* bad) {
  *bad = false;
  size_t i = 0;
  while (i < n) {
    const unsigned b = s[i];
    if (b < 0x80) { ++i; continue; }
    size_t len;
    unsigned lo = 0x80, hi = 0xbf;
    if (b >= 0xc2 && b <= 0xdf) len = 2;
    else if (b == 0xe0) len = 3, lo = 0xa0;
    else if (b == 0xed) len = 3, hi = 0x9f;
    else if (b >= 0xe1 && b <= 0xef) len = 3;
    else if (b == 0xf0) len = 4, lo = 0x90;
    else if (b >= 0xf1 && b <= 0xf3) len = 4;
    else if (b == 0xf4) len = 4, hi = 0x8f;
    else { *bad = true; return i; }
    for (size_t k = 1; k < len; ++k) {
      if (i + k >= n) return i;
      const unsigned c = s[i + k];
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xbf)) { *bad = true; return i; }
    }
    i += len;
  }
  return i;
}

// Parses one line of a .ids file; returns false (with *why) on a malformed or out-of-range id.
bool parse_ids_line(std::string_view line, int64_t vocab, std::vector<int32_t>* out, std::string* why) {
  const char* p = line.data();
  const char* end = p + line.size();
  while (p < end) {
    if (*p == ' ' || *p == '\t' || *p == '\r' || *p == ',') { ++p; continue; }
    const char* tok_end = p;
    while (tok_end < end && !std::strchr(" \t\r,", *tok_end)) ++tok_end;
    int64_t v = 0;
    auto [q, ec] = std::from_chars(p, tok_end, v);
    if (ec != std::errc() || q != tok_end) {
      *why = "'" + std::string(p, tok_end) +
             "' is not a decimal token id; a .ids file holds whole numbers separated by spaces, one document per line";
      return false;
    }
    if (v < 0 || v >= vocab) {
      *why = "token id " + std::to_string(v) + " is outside the model's vocabulary [0, " + std::to_string(vocab) + ")";
      return false;
    }
    if (out) out->push_back(static_cast<int32_t>(v));
    p = tok_end;
  }
  return true;
}

bool blank(std::string_view s) { return s.find_first_not_of(" \t\r") == std::string_view::npos; }

std::vector<uint32_t> in_file_order(int64_t n) {
  std::vector<uint32_t> o(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) o[static_cast<size_t>(i)] = static_cast<uint32_t>(i);
  return o;
}

constexpr const char* kJsonlShape =
    "each line of a .jsonl file is {\"text\": \"...\"}, {\"messages\": [{\"role\": \"system\"|\"user\"|"
    "\"assistant\", \"content\": \"...\"}, ...]} or {\"prompt\": ..., \"completion\": ...} (two strings, or two "
    "lists of messages)";

void parse_messages(const json::Value& m, const std::string& where, const char* key, bool train,
                    std::vector<ChatMessage>* msgs) {
  parse_chat_messages(m, where, key, train, kJsonlShape, msgs);
}

// The line as a document: kind 't' (text in *text), 'c' (conversation in *msgs), 'p' (a prompt in *text
// and its completion in *completion: only the completion is supervised) or 0 (skipped: empty text).
// {"prompt", "completion"} as lists of messages is a conversation whose prompt messages are not
// supervised (TRL's conversational prompt-completion). Errors name the location and the problem.
char parse_jsonl_line(const std::string& line, const std::string& where, std::string* text,
                      std::vector<ChatMessage>* msgs, std::string* completion) {
  json::Value v;
  try {
    v = json::parse(line, where);
  } catch (const Error& e) {
    fail("[data] ", where, ": not valid JSON (", e.what(), "); ", kJsonlShape);
  }
  OOM_CHECK(v.is_object(), "[data] ", where, ": a JSON ", json::Value::kind_name(v.kind()), " is not a document; ",
            kJsonlShape);
  const json::Value* t = v.find("text");
  const json::Value* m = v.find("messages");
  const json::Value* p = v.find("prompt");
  const json::Value* c = v.find("completion");
  OOM_CHECK((p != nullptr) == (c != nullptr), "[data] ", where, ": \"", p ? "prompt" : "completion", "\" without \"",
            p ? "completion" : "prompt", "\"; ", kJsonlShape);
  const int shapes = (t != nullptr) + (m != nullptr) + (p != nullptr);
  OOM_CHECK(shapes == 1, "[data] ", where, ": ",
            shapes == 0 ? "neither \"text\", \"messages\" nor \"prompt\"/\"completion\""
                        : "more than one of \"text\", \"messages\" and \"prompt\"/\"completion\"",
            "; ", kJsonlShape);
  if (t) {
    OOM_CHECK(t->is_string(), "[data] ", where, ": \"text\" is a ", json::Value::kind_name(t->kind()),
              ", not a string; ", kJsonlShape);
    if (t->as_string().empty()) return 0;
    *text = t->as_string();
    return 't';
  }
  msgs->clear();
  if (m) {
    parse_messages(*m, where, "messages", true, msgs);
    return 'c';
  }
  if (p->is_string() && c->is_string()) {
    OOM_CHECK(!c->as_string().empty(), "[data] ", where, ": \"completion\" is empty: there is nothing to train on");
    *text = p->as_string();
    *completion = c->as_string();
    return 'p';
  }
  OOM_CHECK(p->is_array() && c->is_array(), "[data] ", where, ": \"prompt\" and \"completion\" must both be strings "
            "or both be lists of messages; ", kJsonlShape);
  parse_messages(*p, where, "prompt", false, msgs);
  parse_messages(*c, where, "completion", true, msgs);
  return 'c';
}

}  // namespace

Dataset::Dataset(const DatasetOptions& opt, const Tokenizer* tok, const json::Value& tokenizer_config)
    : opt_(opt), tok_(tok), chat_(ChatTemplate::from_config(tokenizer_config)) {
  OOM_CHECK(opt_.T > 0, "[data] sequence length T must be positive, got ", opt_.T);
  OOM_CHECK(!opt_.paths.empty(), "[data] no data given; pass --data with files or folders");
  OOM_CHECK(opt_.text_piece_bytes > 0, "[data] text_piece_bytes must be positive");
  if (opt_.vocab <= 0) opt_.vocab = tok_ ? tok_->vocab_size() : std::numeric_limits<int32_t>::max();
  OOM_CHECK(opt_.eos_id >= 0 && opt_.eos_id < opt_.vocab, "[data] end-of-sequence id ", opt_.eos_id,
            " is outside the vocabulary [0, ", opt_.vocab, ")");

  for (const std::string& p : opt_.paths) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    OOM_CHECK(!ec && fs::exists(st), "[data] ", p, " does not exist");
    std::vector<std::string> found;
    if (fs::is_directory(st)) {
      for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::recursive_directory_iterator();
           it.increment(ec)) {
        const std::string s = it->path().string();
        if (it->is_regular_file() && (ends_with(s, ".txt") || ends_with(s, ".ids") || ends_with(s, ".jsonl")))
          found.push_back(s);
      }
      OOM_CHECK(!ec, "[data] cannot list ", p, ": ", ec.message());
      OOM_CHECK(!found.empty(), "[data] folder ", p, " holds no .txt, .ids or .jsonl files");
      std::sort(found.begin(), found.end());
    } else {
      found.push_back(p);
    }
    for (std::string& s : found) {
      OOM_CHECK(!ends_with(s, ".json"), "[data] ", s, ": a .json file is not read (as text it would train on its "
                "JSON syntax); write one document per line as JSON Lines (.jsonl), e.g. python3 -c \"import json,"
                "sys; [print(json.dumps(x)) for x in json.load(open(sys.argv[1]))]\" ", s, " > data.jsonl");
      const FileKind k = ends_with(s, ".ids") ? FileKind::ids : ends_with(s, ".jsonl") ? FileKind::jsonl : FileKind::text;
      OOM_CHECK(k == FileKind::ids || tok_, "[data] ", s,
                " needs a tokenizer (only .ids files can be read without one); give a model with tokenizer.json");
      const uint64_t size = fs::file_size(s, ec);
      OOM_CHECK(!ec, "[data] cannot read ", s, ": ", ec.message());
      files_.push_back({std::move(s), k, size});
    }
  }
  OOM_CHECK(files_.size() < std::numeric_limits<uint32_t>::max(), "[data] too many files");
  for (uint32_t fi = 0; fi < files_.size(); ++fi) index_file(fi);
  OOM_CHECK(!docs_.empty(), "[data] the data (", opt_.paths.front(), opt_.paths.size() > 1 ? ", ..." : "",
            ") holds no documents: every file is empty or blank");
  OOM_CHECK(docs_.size() < std::numeric_limits<uint32_t>::max(), "[data] more than 2^32 documents");
}

Dataset::~Dataset() = default;

FILE* Dataset::open(uint32_t fi) {
  if (fp_ && fp_file_ == fi) return fp_.get();
  fp_.reset(std::fopen(files_[fi].path.c_str(), "rb"));
  OOM_CHECK(fp_, "[data] cannot open ", files_[fi].path, ": ", std::strerror(errno));
  fp_file_ = fi;
  return fp_.get();
}

void Dataset::index_file(uint32_t fi) {
  const File& f = files_[fi];
  if (f.kind != FileKind::text) return index_lines(fi);
  // A text file is one document; check it is UTF-8 now so that encoding it later cannot fail.
  FILE* fp = open(fi);
  OOM_CHECK(std::fseek(fp, 0, SEEK_SET) == 0, "[data] cannot seek in ", f.path);
  std::vector<unsigned char> buf(kChunk + 4);
  size_t have = 0;  // bytes of an incomplete sequence carried from the previous chunk
  uint64_t done = 0;
  for (;;) {
    const size_t n = std::fread(buf.data() + have, 1, kChunk, fp);
    OOM_CHECK(!std::ferror(fp), "[data] reading ", f.path, " failed: ", std::strerror(errno));
    const size_t total = have + n;
    bool bad = false;
    const size_t ok = utf8_prefix(buf.data(), total, &bad);
    OOM_CHECK(!bad && (n > 0 || ok == total), "[data] ", f.path, ": byte ", done + ok,
              " is not valid UTF-8; text files must be UTF-8 (convert it, e.g. with iconv)");
    if (n == 0) break;
    std::memmove(buf.data(), buf.data() + ok, total - ok);
    have = total - ok;
    done += ok;
  }
  if (f.size > 0) docs_.push_back({0, fi, 1});
}

void Dataset::index_lines(uint32_t fi) {
  const File& f = files_[fi];
  FILE* fp = open(fi);
  OOM_CHECK(std::fseek(fp, 0, SEEK_SET) == 0, "[data] cannot seek in ", f.path);
  std::vector<char> buf(kChunk);
  std::string line;
  uint64_t line_start = 0, pos = 0, lineno = 1;
  bool checked_chat = false;
  std::string text, completion;
  std::vector<ChatMessage> msgs;
  auto finish = [&] {
    const std::string where = f.path + ":" + std::to_string(lineno);
    bool is_doc = false;
    if (f.kind == FileKind::ids) {
      std::string why;
      OOM_CHECK(parse_ids_line(line, opt_.vocab, nullptr, &why), "[data] ", where, ": ", why);
      is_doc = line.find_first_not_of(" \t\r,") != std::string::npos;  // a line of separators only holds no id
    } else if (!blank(line)) {
      const char k = parse_jsonl_line(line, where, &text, &msgs, &completion);
      if (k == 'c') {
        OOM_CHECK(chat_.kind() != ChatTemplate::Kind::none, "[data] ", where, ": a conversation needs the model's chat template, but ",
                  chat_.unsupported_reason());
        if (!checked_chat) {
          // Rendering once checks that the tokenizer has the template's special tokens.
          std::vector<int32_t> ids;
          std::vector<uint8_t> mask;
          try {
            chat_.render(msgs, *tok_, ids, mask);
          } catch (const Error& e) {
            fail("[data] ", where, ": ", e.what());
          }
          checked_chat = true;
        }
      }
      is_doc = k != 0;
    }
    OOM_CHECK(lineno <= std::numeric_limits<uint32_t>::max(), "[data] ", f.path, ": more than 2^32 lines");
    if (is_doc) docs_.push_back({line_start, fi, static_cast<uint32_t>(lineno)});
    line.clear();
  };
  for (;;) {
    const size_t n = std::fread(buf.data(), 1, buf.size(), fp);
    OOM_CHECK(!std::ferror(fp), "[data] reading ", f.path, " failed: ", std::strerror(errno));
    if (n == 0) break;
    size_t i = 0;
    while (i < n) {
      const char* nl = static_cast<const char*>(std::memchr(buf.data() + i, '\n', n - i));
      const size_t stop = nl ? static_cast<size_t>(nl - buf.data()) : n;
      line.append(buf.data() + i, stop - i);
      pos += stop - i;
      i = stop;
      if (nl) {
        finish();
        ++i, ++pos, ++lineno;
        line_start = pos;
      }
    }
  }
  if (!line.empty()) finish();
}

std::string Dataset::read_range(const File& f, uint64_t offset, uint64_t max_bytes, bool to_eol) {
  FILE* fp = open(static_cast<uint32_t>(&f - files_.data()));
  OOM_CHECK(std::fseek(fp, static_cast<long>(offset), SEEK_SET) == 0, "[data] cannot seek in ", f.path);
  std::string s;
  if (to_eol) {
    char b[1 << 14];
    for (;;) {
      if (!std::fgets(b, sizeof b, fp)) break;
      const size_t n = std::strlen(b);
      if (n > 0 && b[n - 1] == '\n') { s.append(b, n - 1); break; }
      s.append(b, n);
    }
  } else {
    s.resize(max_bytes);
    s.resize(std::fread(s.data(), 1, max_bytes, fp));
  }
  OOM_CHECK(!std::ferror(fp), "[data] reading ", f.path, " failed: ", std::strerror(errno));
  return s;
}

void Dataset::load() {
  const Doc& d = docs_[order_[pos_]];
  const File& f = files_[d.file];
  const std::string where = f.path + ":" + std::to_string(d.line);
  buf_.clear();
  sup_.clear();
  drop_ = false;
  bool eos_supervised = true, structured = false;
  if (f.kind == FileKind::text) {
    const uint64_t piece_bytes = static_cast<uint64_t>(opt_.text_piece_bytes);
    OOM_CHECK(piece_ < f.size, "[data] ", f.path, " is shorter than when it was indexed; do not change data during a run");
    std::string s;
    if (f.size - piece_ <= piece_bytes) {
      s = read_range(f, piece_, f.size - piece_, false);
    } else {
      // Cut after the last "\n" that sits between two printable ASCII characters: the byte-level
      // pre-tokenizers always split there, so encoding the pieces gives the ids of the whole document.
      // (After a run of whitespace they would not: "\n\n" + "1" pre-tokenizes as "\n", "\n", "1", but a
      // piece ending in "\n\n" keeps the run whole.)
      auto printable = [](char c) { return c >= 0x21 && c <= 0x7e; };
      auto is_cut = [&](const std::string& b, size_t p) {
        return p >= 2 && b[p - 1] == '\n' && printable(b[p - 2]) && printable(b[p]);
      };
      auto cut_in = [&](const std::string& b, size_t from, size_t to) -> size_t {
        for (size_t p = to; p > from; --p)
          if (is_cut(b, p)) return p;
        return 0;
      };
      s = read_range(f, piece_, piece_bytes + 1, false);
      size_t cut = cut_in(s, 0, std::min<size_t>(piece_bytes, s.size() - 1));
      // No cut point in the first piece_bytes: read on to the first one (or the end of the file).
      while (cut == 0 && piece_ + s.size() < f.size) {
        const size_t before = s.size();
        s += read_range(f, piece_ + before, piece_bytes, false);
        if (s.size() == before) break;
        for (size_t p = before - 1; p + 1 < s.size() && cut == 0; ++p)
          if (is_cut(s, p)) cut = p;
      }
      if (cut > 0) s.resize(cut);
    }
    OOM_CHECK(piece_ + s.size() <= f.size && !s.empty(), "[data] ", f.path,
              " changed since it was indexed; do not change data during a run");
    next_piece_ = piece_ + s.size();
    buf_ = tok_->encode(s, piece_ == 0);
    sup_.assign(buf_.size(), 1);
    if (next_piece_ < f.size) return;  // EOS only after the last piece
  } else {
    const std::string line = read_range(f, d.offset, 0, true);
    if (f.kind == FileKind::ids) {
      std::string why;
      OOM_CHECK(parse_ids_line(line, opt_.vocab, &buf_, &why) && !buf_.empty(), "[data] ", where,
                " changed since it was indexed; do not change data during a run");
      sup_.assign(buf_.size(), 1);
    } else {
      std::string text, completion;
      std::vector<ChatMessage> msgs;
      const char k = parse_jsonl_line(line, where, &text, &msgs, &completion);
      if (k == 't') {
        buf_ = tok_->encode(text, true);
        sup_.assign(buf_.size(), 1);
      } else if (k == 'p') {
        structured = true;
        // The prompt and the completion encoded apart (the prompt with the tokenizer's BOS); only the
        // completion and the EOS after it are supervised.
        buf_ = tok_->encode(text, true);
        sup_.assign(buf_.size(), 0);
        const std::vector<int32_t> comp = tok_->encode(completion, false);
        buf_.insert(buf_.end(), comp.begin(), comp.end());
        sup_.resize(buf_.size(), 1);
      } else {
        OOM_CHECK(k == 'c', "[data] ", where, " changed since it was indexed; do not change data during a run");
        chat_.render(msgs, *tok_, buf_, sup_);
        eos_supervised = false;  // the end-of-turn token already taught the model to stop
        structured = true;
      }
    }
    next_piece_ = 0;
  }
  buf_.push_back(opt_.eos_id);
  sup_.push_back(eos_supervised);
  // A conversation (or prompt-completion pair) longer than a sequence: the --truncation rule. Split, its
  // later pieces train without the start of their prompt in view.
  if (structured && static_cast<int64_t>(buf_.size()) > opt_.T + 1) {
    ++long_docs_;
    OOM_CHECK(opt_.truncation != Truncation::error, "[data] ", where, ": the conversation is ", buf_.size(),
              " tokens with its EOS, longer than a sequence (--seq ", opt_.T, " + 1); use a larger --seq, or "
              "--truncation split (train it in pieces) or drop (skip such conversations)");
    drop_ = opt_.truncation == Truncation::drop;
  }
}

Truncation parse_truncation(std::string_view s) {
  if (s == "split") return Truncation::split;
  if (s == "drop") return Truncation::drop;
  if (s == "error") return Truncation::error;
  fail("[data] --truncation ", s, " is not supported; use split, drop or error");
}

std::vector<uint32_t> Dataset::order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<uint32_t> o(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(i);
  std::mt19937_64 rng(seed + static_cast<uint64_t>(epoch));
  // rng() % (i + 1) is biased by at most (i + 1) / 2^64, far below anything a training run can see.
  for (int64_t i = n - 1; i > 0; --i) std::swap(o[i], o[rng() % static_cast<uint64_t>(i + 1)]);
  return o;
}

void Dataset::advance() {
  move_on();
  load_kept();
}

void Dataset::load_kept() {
  for (int64_t dropped = 0;; ++dropped) {
    load();
    if (!drop_) return;
    OOM_CHECK(dropped < documents(), "[data] every conversation is longer than a sequence of ", opt_.T,
              " tokens, so --truncation drop leaves nothing; use a larger --seq or --truncation split");
    move_on();
  }
}

void Dataset::move_on() {
  const File& f = files_[docs_[order_[pos_]].file];
  if (f.kind == FileKind::text && next_piece_ < f.size) {
    piece_ = next_piece_;
  } else {
    piece_ = 0;
    if (++pos_ == documents()) {
      pos_ = 0;
      ++epoch_;
      order_ = opt_.shuffle ? order(documents(), opt_.seed, epoch_) : in_file_order(documents());
    }
  }
  offset_ = 0;
}

int64_t Dataset::next(int32_t* ids, int32_t* targets) {
  if (!loaded_) {
    order_ = opt_.shuffle ? order(documents(), opt_.seed, epoch_) : in_file_order(documents());
    load_kept();
    loaded_ = true;
  }
  auto take = [&](bool* sup) {
    while (offset_ == buf_.size()) advance();
    *sup = sup_[offset_];
    return buf_[offset_++];
  };
  bool sup = false;
  int32_t prev = has_carry_ ? carry_ : take(&sup);
  int64_t ep = -1;
  for (int64_t t = 0; t < opt_.T; ++t) {
    const int32_t id = take(&sup);
    if (t == 0) ep = epoch_;
    ids[t] = prev;
    targets[t] = sup ? id : -100;
    prev = id;
  }
  carry_ = prev;
  has_carry_ = true;
  return ep;
}

json::Value Dataset::state() const {
  json::Value s = json::Value::object();
  s.set("epoch", json::Value::integer(epoch_));
  s.set("doc", json::Value::integer(pos_));
  s.set("piece", json::Value::integer(static_cast<int64_t>(piece_)));
  s.set("offset", json::Value::integer(static_cast<int64_t>(offset_)));
  s.set("carry", has_carry_ ? json::Value::integer(carry_) : json::Value());
  s.set("documents", json::Value::integer(documents()));
  // A string: a uint64 seed does not fit JSON's exact integers in every reader.
  s.set("seed", json::Value::string(std::to_string(opt_.seed)));
  return s;
}

void Dataset::restore(const json::Value& s) {
  int64_t epoch = 0, pos = 0, piece = 0, offset = 0, docs = 0;
  std::string seed;
  const json::Value* carry = nullptr;
  try {
    epoch = s.at("epoch").as_int("epoch");
    pos = s.at("doc").as_int("doc");
    piece = s.at("piece").as_int("piece");
    offset = s.at("offset").as_int("offset");
    docs = s.at("documents").as_int("documents");
    seed = s.at("seed").as_string("seed");
    carry = &s.at("carry");
    if (!carry->is_null()) carry->as_int("carry");
  } catch (const Error& e) {
    fail("[data] malformed data cursor in the resume state (", e.what(), ")");
  }
  OOM_CHECK(docs == documents() && seed == std::to_string(opt_.seed), "[data] the resume state was saved for ",
            docs, " documents with seed ", seed, ", but this run has ", documents(), " documents with seed ",
            opt_.seed, "; resume with the same --data and --seed");
  OOM_CHECK(epoch >= 0 && pos >= 0 && pos < documents() && piece >= 0 && offset >= 0,
            "[data] data cursor out of range in the resume state");
  epoch_ = epoch;
  pos_ = pos;
  piece_ = static_cast<uint64_t>(piece);
  has_carry_ = !carry->is_null();
  carry_ = has_carry_ ? static_cast<int32_t>(carry->as_int()) : 0;
  order_ = opt_.shuffle ? order(documents(), opt_.seed, epoch_) : in_file_order(documents());
  load_kept();
  loaded_ = true;
  OOM_CHECK(static_cast<uint64_t>(offset) <= buf_.size(), "[data] data cursor out of range in the resume state");
  offset_ = static_cast<size_t>(offset);
}

std::string dump_line(int64_t step, const std::vector<std::vector<int32_t>>& seqs,
                      const std::vector<std::vector<int32_t>>& targets) {
  auto rows = [](const std::vector<std::vector<int32_t>>& v) {
    json::Value out = json::Value::array();
    for (const auto& seq : v) {
      json::Value row = json::Value::array();
      for (int32_t id : seq) row.push_back(json::Value::integer(id));
      out.push_back(std::move(row));
    }
    return out;
  };
  json::Value line = json::Value::object();
  line.set("step", json::Value::integer(step));
  line.set("ids", rows(seqs));
  line.set("targets", rows(targets));
  return json::dump(line);
}

int64_t Sequences::supervised() const {
  int64_t n = 0;
  for (const auto& tg : targets)
    for (int32_t t : tg) n += t >= 0;
  return n;
}

bool reads_as_documents(const std::string& path) {
  std::error_code ec;
  return ends_with(path, ".jsonl") || ends_with(path, ".json") || fs::is_directory(path, ec);
}

Sequences document_sequences(DatasetOptions opt, const Tokenizer* tok, const json::Value& tokenizer_config,
                             int64_t max_sequences) {
  opt.shuffle = false;
  Dataset d(opt, tok, tokenizer_config);
  Sequences s;
  std::vector<int32_t> ids(static_cast<size_t>(opt.T)), tg(static_cast<size_t>(opt.T));
  while ((max_sequences <= 0 || static_cast<int64_t>(s.ids.size()) < max_sequences) && d.next(ids.data(), tg.data()) == 0) {
    s.ids.push_back(ids);
    s.targets.push_back(tg);
  }
  return s;
}

}  // namespace oomless
