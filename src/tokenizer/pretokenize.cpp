// Pre-tokenizers: split normalized text into the words the model sees. Every splitter reduces to
// "find matches, then keep/merge/drop them by a SplitBehavior", which is how tokenizers defines them,
// so one split_piece() carries the semantics for all of them.
#include <algorithm>

#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless::tok {

void split_piece(const Piece& in, const std::vector<Span>& matches, SplitBehavior behavior, bool invert,
                 std::vector<Piece>& out) {
  struct Part {
    size_t begin, end;
    bool is_match;
  };
  // Matches and the gaps between them cover the text, in order.
  std::vector<Part> parts;
  parts.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (const Span& m : matches) {
    if (prev != m.begin) parts.push_back({prev, m.begin, invert});
    parts.push_back({m.begin, m.end, !invert});
    prev = m.end;
  }
  if (prev != in.text.size()) parts.push_back({prev, in.text.size(), invert});

  struct Keep {
    size_t begin, end;
    bool remove;
  };
  std::vector<Keep> keep;
  keep.reserve(parts.size());
  switch (behavior) {
    case SplitBehavior::isolated:
      for (const Part& p : parts) keep.push_back({p.begin, p.end, false});
      break;
    case SplitBehavior::removed:
      for (const Part& p : parts) keep.push_back({p.begin, p.end, p.is_match});
      break;
    case SplitBehavior::contiguous: {
      bool prev_match = false;
      for (const Part& p : parts) {
        if (p.is_match == prev_match && !keep.empty()) {
          keep.back().end = p.end;
        } else {
          keep.push_back({p.begin, p.end, false});
        }
        prev_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::merged_with_previous: {
      bool prev_match = false;
      for (const Part& p : parts) {
        if (p.is_match && !prev_match && !keep.empty()) {
          keep.back().end = p.end;
        } else {
          keep.push_back({p.begin, p.end, false});
        }
        prev_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      // Same as merged_with_previous, walking from the end.
      bool prev_match = false;
      for (size_t k = parts.size(); k-- > 0;) {
        const Part& p = parts[k];
        if (p.is_match && !prev_match && !keep.empty()) {
          keep.back().begin = p.begin;
        } else {
          keep.push_back({p.begin, p.end, false});
        }
        prev_match = p.is_match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
    }
  }
  for (const Keep& k : keep) {
    if (k.remove || k.begin == k.end) continue;
    out.push_back({in.text.substr(k.begin, k.end - k.begin), in.at_origin && k.begin == 0});
  }
}

namespace {

// Each character satisfying pred is a match of its own, as for tokenizers' char patterns.
template <class Pred>
void char_matches(std::string_view s, Pred pred, std::vector<Span>& out) {
  size_t i = 0;
  while (i < s.size()) {
    const size_t b = i;
    if (pred(next_char(s, i))) out.push_back({b, i});
  }
}

SplitBehavior parse_behavior(const json::Value& v, std::string_view key, SplitBehavior def, std::string_view source,
                             std::string_view role) {
  const json::Value* b = v.find(key);
  if (!b || b->is_null()) return def;
  const std::string s = b->is_string() ? b->as_string() : json::dump(*b);
  if (s == "Removed") return SplitBehavior::removed;
  if (s == "Isolated") return SplitBehavior::isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (s == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (s == "Contiguous") return SplitBehavior::contiguous;
  fail("[tokenizer] ", source, ": ", role, " has unknown behavior ", json::quote(s),
       "; expected Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous");
}

// GPT-2's pre-tokenization regex, as the ByteLevel pre-tokenizer hard-codes it.
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevel : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex, std::string_view source)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {
    if (use_regex_) regex_ = std::make_unique<Regex>(kGpt2Pattern, source, "pre_tokenizer ByteLevel");
  }
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    Piece p = in;
    if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
    const size_t first = out.size();
    if (use_regex_) {
      std::vector<Span> m;
      regex_->find_all(p.text, m);
      split_piece(p, m, SplitBehavior::isolated, false, out);
    } else {
      out.push_back(std::move(p));
    }
    for (size_t k = first; k < out.size(); ++k) out[k].text = bytes_to_byte_level(out[k].text);
  }

 private:
  bool add_prefix_space_, use_regex_;
  std::unique_ptr<Regex> regex_;
};

class Split : public PreTokenizer {
 public:
  Split(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Span> m;
    pattern_.find_all(in.text, m);
    split_piece(in, m, behavior_, invert_, out);
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class Digits : public PreTokenizer {
 public:
  explicit Digits(bool individual) : individual_(individual) {}
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Span> m;
    char_matches(in.text, is_numeric, m);
    split_piece(in, m, individual_ ? SplitBehavior::isolated : SplitBehavior::contiguous, false, out);
  }

 private:
  bool individual_;
};

enum class PrependScheme { always, first, never };

class Metaspace : public PreTokenizer {
 public:
  Metaspace(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    Piece p{std::string(), in.at_origin};
    p.text.reserve(in.text.size() + replacement_.size());
    for (char c : in.text) {
      if (c == ' ') {
        p.text += replacement_;
      } else {
        p.text += c;
      }
    }
    const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
    if (!starts && (scheme_ == PrependScheme::always || (scheme_ == PrependScheme::first && in.at_origin)))
      p.text.insert(0, replacement_);
    if (!split_) {
      out.push_back(std::move(p));
      return;
    }
    std::vector<Span> m;
    find_literal(p.text, replacement_, m);
    split_piece(p, m, SplitBehavior::merged_with_next, false, out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

// Whitespace: the regex \w+|[^\w\s]+ keeps runs of word characters and runs of other non-space
// characters; everything else is dropped.
class Whitespace : public PreTokenizer {
 public:
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Span> m;
    const std::string& s = in.text;
    size_t i = 0;
    int run = 0;  // 0 none, 1 word, 2 other
    size_t run_begin = 0;
    while (i <= s.size()) {
      const size_t b = i;
      int cls = 0;
      if (i < s.size()) {
        const char32_t c = next_char(s, i);
        cls = is_word_char(c) ? 1 : is_whitespace(c) ? 0 : 2;
      } else {
        ++i;
      }
      if (cls != run) {
        if (run != 0) m.push_back({run_begin, b});
        run = cls;
        run_begin = b;
      }
    }
    split_piece(in, m, SplitBehavior::removed, true, out);
  }
};

class WhitespaceSplit : public PreTokenizer {
 public:
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Span> m;
    char_matches(in.text, is_whitespace, m);
    split_piece(in, m, SplitBehavior::removed, false, out);
  }
};

class Punctuation : public PreTokenizer {
 public:
  explicit Punctuation(SplitBehavior b) : behavior_(b) {}
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Span> m;
    char_matches(in.text, is_punctuation, m);
    split_piece(in, m, behavior_, false, out);
  }

 private:
  SplitBehavior behavior_;
};

class Sequence : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(const Piece& in, std::vector<Piece>& out) const override {
    std::vector<Piece> cur{in}, next;
    for (const auto& step : steps_) {
      next.clear();
      for (const Piece& p : cur) step->pre_tokenize(p, next);
      std::swap(cur, next);
    }
    for (Piece& p : cur) out.push_back(std::move(p));
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

const char* kSupported = "ByteLevel, Split, Digits, Metaspace, Whitespace, WhitespaceSplit, Punctuation, Sequence";

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json::Value& v, std::string_view source) {
  if (v.is_null()) return nullptr;
  const std::string& type = component_type(v, source, "pre_tokenizer");
  const std::string role = "pre_tokenizer " + type;
  if (type == "ByteLevel")
    return std::make_unique<ByteLevel>(get_bool(v, "add_prefix_space", true, source, role),
                                       get_bool(v, "use_regex", true, source, role), source);
  if (type == "Split") {
    const json::Value* p = v.find("pattern");
    if (!p) fail("[tokenizer] ", source, ": pre_tokenizer Split needs a \"pattern\"");
    const json::Value* b = v.find("behavior");
    if (!b) fail("[tokenizer] ", source, ": pre_tokenizer Split needs a \"behavior\"");
    return std::make_unique<Split>(parse_pattern(*p, source, role),
                                   parse_behavior(v, "behavior", SplitBehavior::isolated, source, role),
                                   get_bool(v, "invert", false, source, role));
  }
  if (type == "Digits") return std::make_unique<Digits>(get_bool(v, "individual_digits", false, source, role));
  if (type == "Metaspace") {
    std::string replacement = "\xE2\x96\x81";  // U+2581, SentencePiece's word marker
    if (const json::Value* r = v.find("replacement")) {
      const std::string& s = r->as_string("Metaspace replacement");
      size_t i = 0;
      if (s.empty() || (next_char(s, i), i != s.size()))
        fail("[tokenizer] ", source, ": pre_tokenizer Metaspace replacement must be one character, found ",
             json::quote(s));
      replacement = s;
    }
    PrependScheme scheme = get_bool(v, "add_prefix_space", true, source, role) ? PrependScheme::always
                                                                                : PrependScheme::never;
    if (const json::Value* ps = v.find("prepend_scheme"); ps && !ps->is_null()) {
      const std::string& s = ps->as_string("Metaspace prepend_scheme");
      if (s == "always") {
        scheme = PrependScheme::always;
      } else if (s == "first") {
        scheme = PrependScheme::first;
      } else if (s == "never") {
        scheme = PrependScheme::never;
      } else {
        fail("[tokenizer] ", source, ": pre_tokenizer Metaspace prepend_scheme ", json::quote(s),
             " is not one of always, first, never");
      }
    }
    return std::make_unique<Metaspace>(replacement, scheme, get_bool(v, "split", true, source, role));
  }
  if (type == "Whitespace") return std::make_unique<Whitespace>();
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplit>();
  if (type == "Punctuation")
    return std::make_unique<Punctuation>(parse_behavior(v, "behavior", SplitBehavior::isolated, source, role));
  if (type == "Sequence") {
    const json::Value* list = v.find("pretokenizers");
    if (!list || !list->is_array())
      fail("[tokenizer] ", source, ": pre_tokenizer Sequence needs a \"pretokenizers\" array");
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < list->size(); ++i)
      if (auto p = make_pre_tokenizer((*list)[i], source)) steps.push_back(std::move(p));
    return std::make_unique<Sequence>(std::move(steps));
  }
  unsupported(source, "pre_tokenizer", type, kSupported);
}

}  // namespace oomless::tok
