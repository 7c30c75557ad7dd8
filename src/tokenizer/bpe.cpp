// The BPE model: a word is split into characters (or <0xAB> byte tokens, or unk), then adjacent pairs
// are merged lowest rank first until no merge applies. The merge loop is tokenizers' Word::merge_all:
// a min-heap of (rank, position), stale entries skipped when popped, so ties and the order of
// overlapping merges come out exactly as there.
#include <cstdio>
#include <queue>

#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless::tok {
namespace {

constexpr size_t kCacheCapacity = 100000;  // distinct words kept
constexpr size_t kCacheMaxWord = 256;       // longer words are rare and not worth keeping (bytes)

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

std::string optional_string(const json::Value& model, std::string_view key, std::string_view source) {
  const json::Value* v = model.find(key);
  if (!v || v->is_null()) return {};
  if (!v->is_string()) fail("[tokenizer] ", source, ": model.", key, " must be a string or null");
  return v->as_string();
}

}  // namespace

Bpe::Bpe(const json::Value& model, std::string_view source) {
  const json::Value* vocab = model.find("vocab");
  if (!vocab || !vocab->is_object())
    fail("[tokenizer] ", source, ": model has no \"vocab\" object; a BPE tokenizer.json needs model.vocab");
  const json::Value* merges = model.find("merges");
  if (!merges || !merges->is_array())
    fail("[tokenizer] ", source, ": model has no \"merges\" array; a BPE tokenizer.json needs model.merges");
  if (const json::Value* d = model.find("dropout"); d && !d->is_null()) {
    if (!d->is_number() || d->as_number() != 0.0)
      fail("[tokenizer] ", source, ": model.dropout ", json::dump(*d),
           " is not supported (random merges are for training the tokenizer); set it to null");
  }

  vocab_.reserve(vocab->size() * 2);
  for (const auto& [token, idv] : vocab->as_object()) {
    if (!idv.is_integer() || idv.as_int() < 0 || idv.as_int() > INT32_MAX)
      fail("[tokenizer] ", source, ": vocab entry ", json::quote(token), " has id ", json::dump(idv),
           "; ids must be integers in [0, 2^31)");
    vocab_[token] = static_cast<int32_t>(idv.as_int());
  }

  unk_token_ = optional_string(model, "unk_token", source);
  has_unk_ = model.find("unk_token") && !model.at("unk_token").is_null();
  prefix_ = optional_string(model, "continuing_subword_prefix", source);
  suffix_ = optional_string(model, "end_of_word_suffix", source);
  fuse_unk_ = get_bool(model, "fuse_unk", false, source, "model");
  byte_fallback_ = get_bool(model, "byte_fallback", false, source, "model");
  ignore_merges_ = get_bool(model, "ignore_merges", false, source, "model");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    byte_ids_[b] = find(name);
  }

  const auto id_of = [&](const std::string& t, size_t rank) {
    const int32_t id = find(t);
    if (id < 0)
      fail("[tokenizer] ", source, ": merge ", rank, " uses ", json::quote(t),
           ", which is not in the vocab; the file is inconsistent");
    return id;
  };
  merges_.reserve(merges->size() * 2);
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const json::Value& m = (*merges)[rank];
    std::string a, b;
    if (m.is_string()) {
      // Legacy form "a b": tokens never contain a space in this form, so exactly one separates them.
      const std::string& s = m.as_string();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail("[tokenizer] ", source, ": merge ", rank, " ", json::quote(s),
             " is malformed; expected \"left right\" with one space, or [\"left\", \"right\"]");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].as_string();
      b = m[1].as_string();
    } else {
      fail("[tokenizer] ", source, ": merge ", rank, " is malformed (", json::dump(m),
           "); expected \"left right\" or [\"left\", \"right\"]");
    }
    const int32_t ia = id_of(a, rank), ib = id_of(b, rank);
    // With a continuing-subword prefix the right part's prefix disappears in the merged token.
    if (!prefix_.empty() && b.compare(0, prefix_.size(), prefix_) == 0) b.erase(0, prefix_.size());
    const int32_t merged = id_of(a + b, rank);
    // A repeated pair keeps its last rank, as a map built by insertion does in tokenizers.
    merges_[pair_key(ia, ib)] = {static_cast<uint32_t>(rank), merged};
  }
}

int32_t Bpe::find(std::string_view token) const {
  // The vocab is keyed by std::string; nearly all tokens fit the small-string buffer, so the
  // temporary key does not allocate.
  auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    // Llama 3: a word that is itself a token is emitted whole, whatever the merges would do.
    const int32_t id = find(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWord;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::move(key), std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

void Bpe::merge_word(std::string_view w, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int prev, next;
    bool removed;
  };
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  const auto add = [&](int32_t id) {
    const int n = static_cast<int>(sym.size());
    sym.push_back({id, n - 1, n + 1, false});
  };

  // Initial symbols: one per character, or its bytes, or unk (fused runs when fuse_unk).
  int32_t unk_id = -1;
  bool pending_unk = false;
  std::string s;
  size_t i = 0;
  while (i < w.size()) {
    const size_t b = i;
    next_char(w, i);
    s.clear();
    if (b != 0) s += prefix_;
    s.append(w.substr(b, i - b));
    if (i == w.size()) s += suffix_;
    const int32_t id = find(s);
    if (id >= 0) {
      if (pending_unk) add(unk_id);
      pending_unk = false;
      add(id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : s) all &= byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // A pending unk stays pending across byte tokens, as in tokenizers.
        for (char c : s) add(byte_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (!has_unk_) continue;  // no unk token: the character is dropped, as tokenizers does
    if (unk_id < 0) {
      unk_id = find(unk_token_);
      if (unk_id < 0)
        fail("[tokenizer] unk_token ", json::quote(unk_token_),
             " is not in the vocab, but the text needs it; the tokenizer file is inconsistent");
    }
    if (pending_unk && !fuse_unk_) add(unk_id);
    pending_unk = true;
  }
  if (pending_unk) add(unk_id);
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Merge {
    uint32_t rank;
    int pos;
    int32_t new_id;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Merge, std::vector<Merge>, std::greater<Merge>> queue;
  const auto lookup = [&](int32_t a, int32_t b) -> const std::pair<uint32_t, int32_t>* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t k = 0; k + 1 < sym.size(); ++k)
    if (auto m = lookup(sym[k].id, sym[k + 1].id)) queue.push({m->first, static_cast<int>(k), m->second});

  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (cur.removed || cur.next < 0) continue;
    const int next_pos = cur.next;
    // Skip entries made stale by an earlier merge of either symbol.
    auto m = lookup(cur.id, sym[next_pos].id);
    if (!m || m->second != top.new_id) continue;
    cur.id = top.new_id;
    cur.next = sym[next_pos].next;
    sym[next_pos].removed = true;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0)
      if (auto pm = lookup(sym[cur.prev].id, cur.id)) queue.push({pm->first, cur.prev, pm->second});
    if (cur.next >= 0)
      if (auto nm = lookup(cur.id, sym[cur.next].id)) queue.push({nm->first, top.pos, nm->second});
  }
  for (const Symbol& x : sym)
    if (!x.removed) out.push_back(x.id);
}

}  // namespace oomless::tok
