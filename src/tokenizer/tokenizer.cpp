// Tokenizer: loading tokenizer.json, added tokens, the encode pipeline, post-processing, decode.
#include "tokenizer/tokenizer.h"

#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless {

namespace tok {

const std::string& component_type(const json::Value& v, std::string_view source, std::string_view role) {
  if (!v.is_object()) fail("[tokenizer] ", source, ": ", role, " must be an object or null, found ", json::dump(v));
  const json::Value* t = v.find("type");
  if (!t || !t->is_string()) fail("[tokenizer] ", source, ": ", role, " has no string \"type\"");
  return t->as_string();
}

bool get_bool(const json::Value& v, std::string_view key, bool def, std::string_view source, std::string_view role) {
  const json::Value* f = v.find(key);
  if (!f || f->is_null()) return def;
  if (!f->is_bool()) fail("[tokenizer] ", source, ": ", role, " \"", key, "\" must be true or false, found ", json::dump(*f));
  return f->as_bool();
}

void unsupported(std::string_view source, std::string_view role, std::string_view type, std::string_view supported) {
  fail("[tokenizer] ", source, ": unsupported ", role, " type '", type, "'; supported: ", supported,
       " (convert the tokenizer or extend src/tokenizer)");
}

}  // namespace tok

namespace {

struct AddedToken {
  std::string content;
  // What decode() and id_to_token() show: tokenizers gives the normalized content for tokens marked
  // `normalized` (so that e.g. a byte-level decoder sees what encode matched), the content otherwise.
  std::string shown;
  int32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = true;
};

// Byte trie over added-token contents for leftmost-longest matching, as tokenizers' Aho-Corasick
// automaton (MatchKind::LeftmostLongest) finds them.
class Trie {
 public:
  void insert(std::string_view s, int token) {
    if (s.empty()) return;
    int node = 0;
    for (char c : s) {
      const uint64_t key = edge(node, c);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        terminal_.push_back(-1);
        it = edges_.emplace(key, static_cast<int>(terminal_.size()) - 1).first;
      }
      node = it->second;
    }
    // A repeated content keeps its first token, as the automaton reports the first pattern.
    if (terminal_[node] < 0) terminal_[node] = token;
    first_byte_[static_cast<uint8_t>(s[0])] = true;
  }
  bool empty() const { return terminal_.size() == 1; }
  // Longest token starting at text[i]: (token, length), or (-1, 0).
  std::pair<int, size_t> longest_at(std::string_view text, size_t i) const {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) return {-1, 0};
    int node = 0, best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < text.size(); ++k) {
      auto it = edges_.find(edge(node, text[k]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] >= 0) {
        best = terminal_[node];
        best_len = k + 1 - i;
      }
    }
    return {best, best_len};
  }

 private:
  static uint64_t edge(int node, char c) { return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c); }
  std::unordered_map<uint64_t, int> edges_;
  std::vector<int> terminal_{-1};
  bool first_byte_[256] = {};
};

// One step of the post-processor: the ids a TemplateProcessing "single" template puts before and
// after the sequence.
struct Template {
  std::vector<int32_t> before, after;
};

// A piece of the input between added tokens, or an added token (token >= 0, an index into added).
struct Segment {
  tok::Piece piece;
  int token = -1;
};

char32_t char_before(std::string_view s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return tok::next_char(s, b);
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::Bpe> model;
  std::unique_ptr<tok::Decoder> decoder;
  std::vector<Template> post;

  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;     // content -> id
  std::unordered_map<int32_t, size_t> added_by_id;         // id -> index in added
  std::unordered_set<std::string> special_contents;
  Trie raw_trie, normalized_trie;  // tokens matched on the raw / on the normalized text

  std::unordered_map<int32_t, std::string> model_tokens;  // id -> token
  int64_t vocab_size = 0;

  // tokenizers' AddedVocabulary::find_matches: split `text` at the added tokens of `trie`, with the
  // single_word / lstrip / rstrip rules. Pieces keep at_origin when they start the input.
  void split_added(const tok::Piece& in, const Trie& trie, std::vector<Segment>& out) const {
    const std::string& s = in.text;
    if (trie.empty()) {
      out.push_back({in, -1});
      return;
    }
    size_t start_offset = 0, i = 0;
    while (i < s.size()) {
      auto [token, len] = trie.longest_at(s, i);
      if (token < 0) {
        ++i;
        continue;
      }
      const AddedToken& t = added[static_cast<size_t>(token)];
      size_t start = i, stop = i + len;
      i = stop;  // the automaton resumes after the match whatever the rules below decide
      if (t.single_word) {
        const bool start_space = start == 0 || !tok::is_word_char(char_before(s, start));
        size_t k = stop;
        const bool stop_space = stop == s.size() || !tok::is_word_char(tok::next_char(s, k));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t b = start;
        while (b > 0) {
          size_t p = b - 1;
          while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
          size_t q = p;
          if (!tok::is_whitespace(tok::next_char(s, q))) break;
          b = p;
        }
        start = std::max(b, start_offset);
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          size_t q = stop;
          if (!tok::is_whitespace(tok::next_char(s, q))) break;
          stop = q;
        }
      }
      start = std::max(start, start_offset);
      if (start_offset < start)
        out.push_back({{s.substr(start_offset, start - start_offset), in.at_origin && start_offset == 0}, -1});
      out.push_back({{s.substr(start, stop - start), false}, token});
      start_offset = stop;
      i = std::max(i, stop);
    }
    if (start_offset < s.size())
      out.push_back({{s.substr(start_offset), in.at_origin && start_offset == 0}, -1});
  }
};

Tokenizer Tokenizer::from_file(const std::string& path) {
  json::Value doc;
  try {
    doc = json::parse_file(path);
  } catch (const Error& e) {
    fail("[tokenizer] ", path, ": cannot load: ", e.what());
  }
  return from_json(doc, path);
}

namespace {

void load(Tokenizer::Impl& t, const json::Value& doc) {
  const std::string& src = t.source;
  if (!doc.is_object()) fail("[tokenizer] ", src, ": the document must be a JSON object (a tokenizer.json)");
  for (const char* key : {"truncation", "padding"}) {
    const json::Value* v = doc.find(key);
    if (v && !v->is_null())
      fail("[tokenizer] ", src, ": \"", key, "\" is set; truncation and padding are not supported here (the "
           "training pipeline packs sequences itself); set it to null");
  }
  const json::Value* model = doc.find("model");
  if (!model || !model->is_object()) fail("[tokenizer] ", src, ": no \"model\" object; is this a tokenizer.json?");
  if (model->find("type")) {
    const std::string& type = tok::component_type(*model, src, "model");
    if (type != "BPE") tok::unsupported(src, "model", type, "BPE");
  } else if (!model->find("merges")) {
    fail("[tokenizer] ", src, ": model has neither \"type\" nor \"merges\"; only BPE models are supported");
  }
  t.model = std::make_unique<tok::Bpe>(*model, src);
  const json::Value null;
  const auto get = [&](const char* key) -> const json::Value& {
    const json::Value* v = doc.find(key);
    return v ? *v : null;
  };
  t.normalizer = tok::make_normalizer(get("normalizer"), src);
  t.pre_tokenizer = tok::make_pre_tokenizer(get("pre_tokenizer"), src);
  t.decoder = tok::make_decoder(get("decoder"), src);

  for (const auto& [token, id] : t.model->vocab()) {
    t.model_tokens.emplace(id, token);
    t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t{id} + 1);
  }

  // Added tokens.
  const json::Value& added = get("added_tokens");
  if (!added.is_null() && !added.is_array()) fail("[tokenizer] ", src, ": \"added_tokens\" must be an array");
  for (size_t k = 0; !added.is_null() && k < added.size(); ++k) {
    const json::Value& a = added[k];
    const std::string role = "added_tokens[" + std::to_string(k) + "]";
    if (!a.is_object()) fail("[tokenizer] ", src, ": ", role, " must be an object");
    const json::Value* content = a.find("content");
    const json::Value* id = a.find("id");
    if (!content || !content->is_string() || !id || !id->is_integer() || id->as_int() < 0 || id->as_int() > INT32_MAX)
      fail("[tokenizer] ", src, ": ", role, " needs a string \"content\" and an integer \"id\" in [0, 2^31)");
    AddedToken tok{content->as_string(), content->as_string(), static_cast<int32_t>(id->as_int())};
    tok.special = tok::get_bool(a, "special", false, src, role);
    tok.single_word = tok::get_bool(a, "single_word", false, src, role);
    tok.lstrip = tok::get_bool(a, "lstrip", false, src, role);
    tok.rstrip = tok::get_bool(a, "rstrip", false, src, role);
    tok.normalized = tok::get_bool(a, "normalized", !tok.special, src, role);
    if (tok.content.empty()) continue;  // tokenizers ignores empty added tokens
    if (tok.special) t.special_contents.insert(tok.content);
    t.added_ids[tok.content] = tok.id;
    t.added_by_id[tok.id] = t.added.size();
    t.vocab_size = std::max<int64_t>(t.vocab_size, int64_t{tok.id} + 1);
    t.added.push_back(std::move(tok));
  }
  // Tokens marked `normalized` are matched against normalized text, so their content is normalized
  // too (tokenizers does the same when it builds its automaton).
  for (size_t k = 0; k < t.added.size(); ++k) {
    const AddedToken& a = t.added[k];
    if (!a.normalized) {
      t.raw_trie.insert(a.content, static_cast<int>(k));
    } else {
      std::string c = a.content;
      if (t.normalizer) t.normalizer->normalize(c);
      t.normalized_trie.insert(c, static_cast<int>(k));
      t.added[k].shown = c;
    }
  }

  // Post-processor.
  const auto add_processor = [&](const json::Value& p, auto& self) -> void {
    if (p.is_null()) return;
    const std::string& type = tok::component_type(p, src, "post_processor");
    if (type == "ByteLevel") return;  // only trims offsets; ids are unchanged
    if (type == "Sequence") {
      const json::Value* list = p.find("processors");
      if (!list || !list->is_array()) fail("[tokenizer] ", src, ": post_processor Sequence needs a \"processors\" array");
      for (size_t i = 0; i < list->size(); ++i) self((*list)[i], self);
      return;
    }
    if (type != "TemplateProcessing")
      tok::unsupported(src, "post_processor", type, "TemplateProcessing, ByteLevel, Sequence");
    const json::Value* single = p.find("single");
    const json::Value* specials = p.find("special_tokens");
    if (!single || !single->is_array())
      fail("[tokenizer] ", src, ": post_processor TemplateProcessing needs a \"single\" array");
    Template tpl;
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json::Value& piece = (*single)[i];
      if (const json::Value* seq = piece.is_object() ? piece.find("Sequence") : nullptr) {
        const json::Value* sid = seq->find("id");
        if (seen_sequence || !sid || !sid->is_string() || sid->as_string() != "A")
          fail("[tokenizer] ", src, ": post_processor TemplateProcessing single template must hold sequence A once");
        seen_sequence = true;
      } else if (const json::Value* sp = piece.is_object() ? piece.find("SpecialToken") : nullptr) {
        const json::Value* name = sp->find("id");
        if (!name || !name->is_string()) fail("[tokenizer] ", src, ": TemplateProcessing SpecialToken needs a string \"id\"");
        const json::Value* entry = specials && specials->is_object() ? specials->find(name->as_string()) : nullptr;
        const json::Value* ids = entry && entry->is_object() ? entry->find("ids") : nullptr;
        if (!ids || !ids->is_array())
          fail("[tokenizer] ", src, ": TemplateProcessing special token ", json::quote(name->as_string()),
               " is not in \"special_tokens\" with an \"ids\" array");
        for (size_t j = 0; j < ids->size(); ++j) {
          const json::Value& idv = (*ids)[j];
          if (!idv.is_integer() || idv.as_int() < 0 || idv.as_int() > INT32_MAX)
            fail("[tokenizer] ", src, ": TemplateProcessing special token ids must be integers in [0, 2^31)");
          (seen_sequence ? tpl.after : tpl.before).push_back(static_cast<int32_t>(idv.as_int()));
        }
      } else {
        fail("[tokenizer] ", src, ": TemplateProcessing piece ", json::dump(piece),
             " is neither {\"Sequence\": ...} nor {\"SpecialToken\": ...}");
      }
    }
    if (!seen_sequence) fail("[tokenizer] ", src, ": post_processor TemplateProcessing single template lacks sequence A");
    t.post.push_back(std::move(tpl));
  };
  add_processor(get("post_processor"), add_processor);
}

}  // namespace

Tokenizer Tokenizer::from_json(const json::Value& doc, std::string_view source) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  try {
    load(*impl, doc);
  } catch (const Error& e) {
    // Accessor errors from the JSON layer do not know the file; say which one it was.
    const std::string_view what = e.what();
    if (what.starts_with("[tokenizer]")) throw;
    fail("[tokenizer] ", source, ": ", what);
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  if (const size_t bad = tok::invalid_utf8_offset(text); bad != std::string_view::npos)
    fail("[tokenizer] encode: the text is not valid UTF-8 at byte offset ", bad,
         "; decode or clean the input before tokenizing");

  // 1. Added tokens on the raw text; 2. normalize the rest and match the normalized added tokens.
  std::vector<Segment> raw, segments;
  t.split_added(tok::Piece{std::string(text), true}, t.raw_trie, raw);
  for (Segment& s : raw) {
    if (s.token >= 0) {
      segments.push_back(std::move(s));
      continue;
    }
    if (t.normalizer) t.normalizer->normalize(s.piece.text);
    if (s.piece.text.empty()) continue;
    t.split_added(s.piece, t.normalized_trie, segments);
  }

  // 3. Pre-tokenize and 4. run the model on every word.
  std::vector<int32_t> ids;
  std::vector<tok::Piece> words;
  for (const Segment& s : segments) {
    if (s.token >= 0) {
      ids.push_back(t.added[static_cast<size_t>(s.token)].id);
      continue;
    }
    if (s.piece.text.empty()) continue;
    words.clear();
    if (t.pre_tokenizer) {
      t.pre_tokenizer->pre_tokenize(s.piece, words);
    } else {
      words.push_back(s.piece);
    }
    for (const tok::Piece& w : words) t.model->tokenize(w.text, ids);
  }

  // 5. Post-processor.
  if (add_special_tokens) {
    for (const Template& tpl : t.post) {
      ids.insert(ids.begin(), tpl.before.begin(), tpl.before.end());
      ids.insert(ids.end(), tpl.after.begin(), tpl.after.end());
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* token = nullptr;
    if (auto a = t.added_by_id.find(id); a != t.added_by_id.end()) {
      token = &t.added[a->second].shown;
    } else if (auto m = t.model_tokens.find(id); m != t.model_tokens.end()) {
      token = &m->second;
    }
    if (!token) continue;
    if (skip_special_tokens && t.special_contents.count(*token)) continue;
    tokens.push_back(*token);
  }
  if (!t.decoder) {
    std::string out;
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (k) out += ' ';
      out += tokens[k];
    }
    return out;
  }
  t.decoder->decode_chain(tokens);
  std::string out;
  for (const std::string& s : tokens) out += s;
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto a = impl_->added_ids.find(key); a != impl_->added_ids.end()) return a->second;
  const int32_t id = impl_->model->find(token);
  if (id >= 0) return id;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (auto a = impl_->added_by_id.find(id); a != impl_->added_by_id.end()) return impl_->added[a->second].shown;
  if (auto m = impl_->model_tokens.find(id); m != impl_->model_tokens.end()) return m->second;
  fail("[tokenizer] ", impl_->source, ": id ", id, " has no token (vocab size ", impl_->vocab_size,
       "); check the id comes from this tokenizer");
}

bool Tokenizer::is_special(int32_t id) const {
  auto a = impl_->added_by_id.find(id);
  return a != impl_->added_by_id.end() && impl_->added[a->second].special;
}

}  // namespace oomless
