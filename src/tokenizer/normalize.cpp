// Normalizers: Unicode normal forms (utf8proc), Lowercase, Prepend, Replace, Strip, Sequence.
// Each rewrites one piece of text; tokenizers applies them to every piece left between added tokens.
#include <utf8proc.h>

#include <cstdlib>

#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless::tok {
namespace {

class UnicodeForm : public Normalizer {
 public:
  UnicodeForm(utf8proc_option_t options, std::string name) : options_(options), name_(std::move(name)) {}
  void normalize(std::string& s) const override {
    if (s.empty()) return;
    // Pure ASCII is invariant under every normal form; skipping it keeps the common case cheap.
    bool ascii = true;
    for (char c : s) ascii &= static_cast<unsigned char>(c) < 0x80;
    if (ascii) return;
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                            static_cast<utf8proc_ssize_t>(s.size()), &out, options_);
    if (n < 0) fail("[tokenizer] ", name_, " normalization failed: ", utf8proc_errmsg(n));
    s.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    std::free(out);
  }

 private:
  utf8proc_option_t options_;
  std::string name_;
};

class Lowercase : public Normalizer {
 public:
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    size_t i = 0;
    while (i < s.size()) {
      const char32_t c = next_char(s, i);
      if (c < 0x80) {
        out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
      } else if (c == 0x130) {
        // Rust's char::to_lowercase uses the full mapping: U+0130 becomes "i" + combining dot above,
        // the one unconditional multi-character lowercase mapping; utf8proc only knows simple ones.
        out += "i\xCC\x87";
      } else {
        append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
      }
    }
    s = std::move(out);
  }
};

class Prepend : public Normalizer {
 public:
  explicit Prepend(std::string p) : prepend_(std::move(p)) {}
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class Replace : public Normalizer {
 public:
  Replace(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& s) const override {
    std::vector<Span> m;
    pattern_.find_all(s, m);
    if (m.empty()) return;
    std::string out;
    out.reserve(s.size());
    size_t prev = 0;
    for (const Span& sp : m) {
      out.append(s, prev, sp.begin - prev);
      out += content_;
      prev = sp.end;
    }
    out.append(s, prev, std::string::npos);
    s = std::move(out);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class Strip : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& s) const override {
    size_t b = 0, e = s.size();
    if (left_) {
      while (b < e) {
        size_t i = b;
        if (!is_whitespace(next_char(s, i))) break;
        b = i;
      }
    }
    if (right_) {
      while (e > b) {
        size_t start = e - 1;
        while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        size_t i = start;
        if (!is_whitespace(next_char(s, i))) break;
        e = start;
      }
    }
    s = s.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class Sequence : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(std::string& s) const override {
    for (const auto& n : steps_) {
      if (s.empty()) return;
      n->normalize(s);
    }
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

const char* kSupported = "NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Sequence";

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json::Value& v, std::string_view source) {
  if (v.is_null()) return nullptr;
  const std::string& type = component_type(v, source, "normalizer");
  const auto str = [&](std::string_view key) -> std::string {
    const json::Value* f = v.find(key);
    if (!f || !f->is_string())
      fail("[tokenizer] ", source, ": normalizer ", type, " needs a string \"", key, "\"");
    return f->as_string();
  };
  if (type == "NFC") return std::make_unique<UnicodeForm>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE), "NFC");
  if (type == "NFD") return std::make_unique<UnicodeForm>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE), "NFD");
  if (type == "NFKC")
    return std::make_unique<UnicodeForm>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT), "NFKC");
  if (type == "NFKD")
    return std::make_unique<UnicodeForm>(utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT), "NFKD");
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "Prepend") return std::make_unique<Prepend>(str("prepend"));
  if (type == "Replace") {
    const json::Value* p = v.find("pattern");
    if (!p) fail("[tokenizer] ", source, ": normalizer Replace needs a \"pattern\"");
    return std::make_unique<Replace>(parse_pattern(*p, source, "normalizer Replace"), str("content"));
  }
  if (type == "Strip")
    return std::make_unique<Strip>(get_bool(v, "strip_left", true, source, "normalizer Strip"),
                                   get_bool(v, "strip_right", true, source, "normalizer Strip"));
  if (type == "Sequence") {
    const json::Value* list = v.find("normalizers");
    if (!list || !list->is_array()) fail("[tokenizer] ", source, ": normalizer Sequence needs a \"normalizers\" array");
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < list->size(); ++i)
      if (auto n = make_normalizer((*list)[i], source)) steps.push_back(std::move(n));
    return std::make_unique<Sequence>(std::move(steps));
  }
  unsupported(source, "normalizer", type, kSupported);
}

}  // namespace oomless::tok
