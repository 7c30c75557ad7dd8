// Decoders: each rewrites the list of token strings; the final text is their concatenation.
// Semantics follow tokenizers' decode_chain for each type, including how invalid bytes become U+FFFD.
#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless::tok {
namespace {

constexpr const char* kReplacementChar = "\xEF\xBF\xBD";

// Byte-level tokens back to bytes, all tokens at once: one token may hold half of a character.
class ByteLevel : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      const size_t mark = bytes.size();
      size_t i = 0;
      bool mapped = true;
      while (i < t.size()) {
        const int b = char_to_byte(next_char(t, i));
        if (b < 0) {
          mapped = false;
          break;
        }
        bytes += static_cast<char>(b);
      }
      // A token outside the byte alphabet (an added token such as "<|im_start|>") is kept as is.
      if (!mapped) {
        bytes.resize(mark);
        bytes += t;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class Metaspace : public Decoder {
 public:
  Metaspace(std::string replacement, bool strip_first) : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t k = 0; k < tokens.size(); ++k) {
      std::string out;
      const std::string& t = tokens[k];
      size_t i = 0;
      while (i < t.size()) {
        const size_t b = i;
        next_char(t, i);
        if (t.compare(b, i - b, replacement_) == 0) {
          // In the first token every marker goes, not only a leading one, as in tokenizers.
          if (!(k == 0 && strip_first_)) out += ' ';
        } else {
          out.append(t, b, i - b);
        }
      }
      tokens[k] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class Replace : public Decoder {
 public:
  Replace(Pattern p, std::string content) : pattern_(std::move(p)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<Span> m;
    for (std::string& t : tokens) {
      m.clear();
      pattern_.find_all(t, m);
      if (m.empty()) continue;
      std::string out;
      size_t prev = 0;
      for (const Span& s : m) {
        out.append(t, prev, s.begin - prev);
        out += content_;
        prev = s.end;
      }
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  Pattern pattern_;
  std::string content_;
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// "<0xAB>" -> 0xAB; -1 otherwise. Parsed like Rust's u8::from_str_radix(.., 16), which also takes a
// leading '+' ("<0x+A>").
int byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  if (t[3] == '+') return hex_digit(t[4]);
  const int hi = hex_digit(t[3]), lo = hex_digit(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// Runs of <0xAB> tokens become the text they encode; a run that is not valid UTF-8 becomes one
// U+FFFD per byte.
class ByteFallback : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    size_t run_len = 0;
    const auto flush = [&] {
      if (run_len == 0) return;
      if (invalid_utf8_offset(run) == std::string::npos) {
        out.push_back(run);
      } else {
        for (size_t k = 0; k < run_len; ++k) out.emplace_back(kReplacementChar);
      }
      run.clear();
      run_len = 0;
    };
    for (std::string& t : tokens) {
      const int b = byte_token(t);
      if (b >= 0) {
        run += static_cast<char>(b);
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class Fuse : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from every token.
class Strip : public Decoder {
 public:
  Strip(std::string content, size_t start, size_t stop) : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    const size_t n = content_.size();
    for (std::string& t : tokens) {
      size_t b = 0, e = t.size();
      for (size_t k = 0; k < start_ && b + n <= e && t.compare(b, n, content_) == 0; ++k) b += n;
      for (size_t k = 0; k < stop_ && e >= b + n && t.compare(e - n, n, content_) == 0; ++k) e -= n;
      t = t.substr(b, e - b);
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

class Sequence : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& d : steps_) d->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

const char* kSupported = "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence";

std::string one_char(const json::Value& v, std::string_view key, std::string_view source, std::string_view role) {
  const json::Value* f = v.find(key);
  if (!f || !f->is_string()) fail("[tokenizer] ", source, ": ", role, " needs a string \"", key, "\"");
  const std::string& s = f->as_string();
  size_t i = 0;
  if (s.empty() || (next_char(s, i), i != s.size()))
    fail("[tokenizer] ", source, ": ", role, " \"", key, "\" must be one character, found ", json::quote(s));
  return s;
}

size_t count(const json::Value& v, std::string_view key, std::string_view source) {
  const json::Value* f = v.find(key);
  if (!f || f->is_null()) return 0;
  if (!f->is_integer() || f->as_int() < 0)
    fail("[tokenizer] ", source, ": decoder Strip \"", key, "\" must be a non-negative integer");
  return static_cast<size_t>(f->as_int());
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json::Value& v, std::string_view source) {
  if (v.is_null()) return nullptr;
  const std::string& type = component_type(v, source, "decoder");
  const std::string role = "decoder " + type;
  if (type == "ByteLevel") return std::make_unique<ByteLevel>();
  if (type == "Metaspace") {
    const json::Value* r = v.find("replacement");
    const std::string replacement = r ? one_char(v, "replacement", source, role) : "\xE2\x96\x81";
    bool strip_first = get_bool(v, "add_prefix_space", true, source, role);
    if (const json::Value* ps = v.find("prepend_scheme"); ps && !ps->is_null())
      strip_first = ps->as_string("Metaspace prepend_scheme") != "never";
    return std::make_unique<Metaspace>(replacement, strip_first);
  }
  if (type == "Replace") {
    const json::Value* p = v.find("pattern");
    if (!p) fail("[tokenizer] ", source, ": decoder Replace needs a \"pattern\"");
    const json::Value* c = v.find("content");
    if (!c || !c->is_string()) fail("[tokenizer] ", source, ": decoder Replace needs a string \"content\"");
    return std::make_unique<Replace>(parse_pattern(*p, source, role), c->as_string());
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallback>();
  if (type == "Fuse") return std::make_unique<Fuse>();
  if (type == "Strip") return std::make_unique<Strip>(one_char(v, "content", source, role), count(v, "start", source),
                                                     count(v, "stop", source));
  if (type == "Sequence") {
    const json::Value* list = v.find("decoders");
    if (!list || !list->is_array()) fail("[tokenizer] ", source, ": decoder Sequence needs a \"decoders\" array");
    std::vector<std::unique_ptr<Decoder>> steps;
    for (size_t i = 0; i < list->size(); ++i)
      if (auto d = make_decoder((*list)[i], source)) steps.push_back(std::move(d));
    return std::make_unique<Sequence>(std::move(steps));
  }
  unsupported(source, "decoder", type, kSupported);
}

}  // namespace oomless::tok
