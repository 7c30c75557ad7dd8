// tokenizer.json from a GGUF's tokenizer.ggml.* metadata, shaped as transformers builds it
// (integrations/gguf/gguf_tokenizer_mapping.py):
//   "gpt2"  byte-level BPE (GPT2Tokenizer): tokens not already spelled in the byte alphabet are
//           respelled byte by byte; a split regex is added for the `tokenizer.ggml.pre` values it knows.
//   "llama" sentencepiece-style BPE (LlamaTokenizer): Metaspace, byte fallback; merges from the file, or
//           rebuilt from the vocabulary and scores as transformers' generate_merges does.
// Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens, and
// the bos/eos/unk/pad tokens are special too. The post-processor adds BOS/EOS as the file asks.
#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "io/gguf_model.h"

namespace oomless {

namespace {

constexpr int64_t kControl = 3, kUserDefined = 4;

// Decodes UTF-8 into code points; false when s is not valid UTF-8.
bool utf8_decode(std::string_view s, std::vector<uint32_t>* out) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (int k = 1; k < len; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    out->push_back(cp);
    i += len;
  }
  return true;
}

void utf8_append(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// GPT-2's byte alphabet: printable bytes stand for themselves, the other 68 map to U+0100.. in order.
struct ByteAlphabet {
  uint32_t cp[256];
  std::vector<bool> is_letter = std::vector<bool>(0x144, false);
  ByteAlphabet() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      cp[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      is_letter[cp[b]] = true;
    }
  }
  bool spelled(const std::vector<uint32_t>& cps) const {
    for (uint32_t c : cps)
      if (c >= is_letter.size() || !is_letter[c]) return false;
    return true;
  }
  std::string respell(std::string_view s) const {
    std::string out;
    for (char ch : s) utf8_append(out, cp[static_cast<uint8_t>(ch)]);
    return out;
  }
};

// Split regexes transformers installs for known `tokenizer.ggml.pre` values.
constexpr const char* kLlama3Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";

const char* split_for_pre(const std::string& pre) {
  for (const char* p : {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                        "jina-v5-nano", "dbrx", "smaug-bpe"})
    if (pre == p) return kLlama3Split;
  for (const char* p : {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"})
    if (pre == p) return kQwen2Split;
  return nullptr;
}

using J = json::Value;

J obj(std::initializer_list<std::pair<const char*, J>> kv) {
  J o = J::object();
  for (const auto& [k, v] : kv) o.set(k, v);
  return o;
}

J byte_level(bool add_prefix_space, bool use_regex) {
  return obj({{"type", J::string("ByteLevel")}, {"add_prefix_space", J::boolean(add_prefix_space)},
              {"trim_offsets", J::boolean(true)}, {"use_regex", J::boolean(use_regex)}});
}

struct Merge {
  std::string left, right;
  double score;
  size_t len_left, len_right;  // in code points, as Python's len()
};

}  // namespace

json::Value gguf_tokenizer_json(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2" && model != "llama")
    fail("[gguf] ", f.path(), ": tokenizer model \"", model,
         "\" is not supported (supported: gpt2, llama); use the model's own tokenizer.json");
  const bool bpe_bytes = model == "gpt2";
  const std::vector<std::string>& tokens = f.get_string_array("tokenizer.ggml.tokens");
  const size_t V = tokens.size();
  const std::vector<int64_t>* types = f.has("tokenizer.ggml.token_type") ? &f.get_int_array("tokenizer.ggml.token_type") : nullptr;
  if (types && types->size() != V)
    fail("[gguf] ", f.path(), ": tokenizer.ggml.token_type has ", types->size(), " entries for ", V, " tokens");
  static const ByteAlphabet alphabet;

  // Vocabulary: spelled as the model matches it. Later duplicates take the id, as a Python dict does.
  std::vector<std::string> spelled(V);
  std::vector<size_t> cp_len(V);
  std::vector<bool> in_alphabet(V, true);
  std::vector<uint32_t> cps;
  for (size_t i = 0; i < V; ++i) {
    if (!utf8_decode(tokens[i], &cps))
      fail("[gguf] ", f.path(), ": token ", i, " is not valid UTF-8; the vocabulary is corrupt");
    if (bpe_bytes) {
      in_alphabet[i] = alphabet.spelled(cps);
      spelled[i] = in_alphabet[i] ? tokens[i] : alphabet.respell(tokens[i]);
    } else {
      spelled[i] = tokens[i];
    }
    cp_len[i] = cps.size();
  }
  std::unordered_map<std::string_view, size_t> id_of;  // token -> last id
  std::vector<size_t> first_order;                      // ids whose token appears first there
  for (size_t i = 0; i < V; ++i) {
    auto [it, fresh] = id_of.emplace(spelled[i], i);
    if (fresh) first_order.push_back(i);
    else it->second = i;
  }
  J::Object vocab;
  vocab.reserve(first_order.size());
  for (size_t i : first_order) vocab.emplace_back(spelled[i], J::integer(static_cast<int64_t>(id_of[spelled[i]])));

  // Merges: from the file ("a b"), or rebuilt from scores (generate_merges): every split of every token
  // into two vocabulary pieces, per token ordered by the pieces' ids, then all stably sorted by
  // (score, left length, right length), descending.
  J merges = J::array();
  if (f.has("tokenizer.ggml.merges")) {
    for (const std::string& m : f.get_string_array("tokenizer.ggml.merges")) {
      const size_t sp = m.find(' ');
      if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos)
        fail("[gguf] ", f.path(), ": merge \"", m, "\" is not two tokens separated by one space");
      merges.push_back(J::array({J::string(m.substr(0, sp)), J::string(m.substr(sp + 1))}));
    }
  } else if (!bpe_bytes) {
    const std::vector<double>& scores = f.get_float_array("tokenizer.ggml.scores");
    if (scores.size() != V)
      fail("[gguf] ", f.path(), ": tokenizer.ggml.scores has ", scores.size(), " entries for ", V, " tokens");
    std::vector<Merge> all;
    for (size_t i : first_order) {
      const std::string& tok = spelled[i];
      // Python's dict(zip(tokens, scores)) keeps the last score of a repeated token.
      const double raw = scores[id_of[tok]];
      const double score = std::isnan(raw) ? -INFINITY : raw;  // NaN has no order; sort it last
      std::vector<Merge> local;
      utf8_decode(tok, &cps);
      size_t byte = 0;
      for (size_t k = 1; k < cps.size(); ++k) {
        byte += cps[k - 1] < 0x80 ? 1 : cps[k - 1] < 0x800 ? 2 : cps[k - 1] < 0x10000 ? 3 : 4;
        const std::string_view l(tok.data(), byte), r(tok.data() + byte, tok.size() - byte);
        if (id_of.count(l) && id_of.count(r)) local.push_back({std::string(l), std::string(r), score, k, cps.size() - k});
      }
      std::stable_sort(local.begin(), local.end(), [&](const Merge& a, const Merge& b) {
        const size_t al = id_of[a.left], bl = id_of[b.left];
        return al != bl ? al < bl : id_of[a.right] < id_of[b.right];
      });
      all.insert(all.end(), local.begin(), local.end());
    }
    std::stable_sort(all.begin(), all.end(), [](const Merge& a, const Merge& b) {
      if (a.score != b.score) return a.score > b.score;
      if (a.len_left != b.len_left) return a.len_left > b.len_left;
      return a.len_right > b.len_right;
    });
    for (const Merge& m : all) merges.push_back(J::array({J::string(m.left), J::string(m.right)}));
  }

  const GgufTokenizerConfig tc = gguf_tokenizer_config(f);

  // Added tokens, in id order: control tokens (special; for byte-level only those spelled in the byte
  // alphabet, since llama.cpp mislabels some), the bos/eos/unk/pad tokens (special), user-defined tokens
  // (not special).
  std::vector<int> added(V, 0);  // 0 none, 1 special, 2 plain
  for (size_t i = 0; types && i < V; ++i) {
    if ((*types)[i] == kControl && in_alphabet[i]) added[i] = 1;
  }
  for (const auto& id : {tc.bos, tc.eos, tc.unk, tc.pad})
    if (id) added[*id] = 1;
  for (size_t i = 0; types && i < V; ++i)
    if ((*types)[i] == kUserDefined && added[i] == 0 && id_of.count(tokens[i])) added[i] = 2;
  J added_tokens = J::array();
  for (size_t i = 0; i < V; ++i) {
    if (!added[i]) continue;
    // An added token's id is the vocabulary's id for its text.
    const auto it = id_of.find(spelled[i]);
    if (it == id_of.end() || it->second != i) continue;  // a duplicate; the later id stands for it
    added_tokens.push_back(obj({{"id", J::integer(static_cast<int64_t>(i))}, {"content", J::string(tokens[i])},
                                {"single_word", J::boolean(false)}, {"lstrip", J::boolean(false)},
                                {"rstrip", J::boolean(false)}, {"normalized", J::boolean(false)},
                                {"special", J::boolean(added[i] == 1)}}));
  }

  // Post-processor: "[bos:0] $A:0 [eos:0]" and for pairs "... [bos:1] $B:1 [eos:1]".
  const bool add_bos = tc.add_bos && tc.bos, add_eos = tc.add_eos && tc.eos;
  auto special = [](const std::string& t, int type_id) {
    return obj({{"SpecialToken", obj({{"id", J::string(t)}, {"type_id", J::integer(type_id)}})}});
  };
  auto sequence = [](const char* id, int type_id) {
    return obj({{"Sequence", obj({{"id", J::string(id)}, {"type_id", J::integer(type_id)}})}});
  };
  J single = J::array(), pair = J::array(), specials = J::object();
  const std::string bos = tc.bos ? tokens[*tc.bos] : "", eos = tc.eos ? tokens[*tc.eos] : "";
  if (add_bos) single.push_back(special(bos, 0));
  single.push_back(sequence("A", 0));
  if (add_eos) single.push_back(special(eos, 0));
  for (size_t k = 0; k < single.size(); ++k) pair.push_back(single[k]);
  if (add_bos) pair.push_back(special(bos, 1));
  pair.push_back(sequence("B", 1));
  if (add_eos) pair.push_back(special(eos, 1));
  auto special_entry = [&](const std::string& t, int32_t id) {
    specials.set(t, obj({{"id", J::string(t)}, {"ids", J::array({J::integer(id)})},
                         {"tokens", J::array({J::string(t)})}}));
  };
  if (add_bos) special_entry(bos, *tc.bos);
  if (add_eos) special_entry(eos, *tc.eos);
  J post = obj({{"type", J::string("TemplateProcessing")}, {"single", single}, {"pair", pair},
                {"special_tokens", specials}});

  J pre, decoder, bpe;
  if (bpe_bytes) {
    const std::string pre_name = f.has("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "";
    if (const char* split = split_for_pre(pre_name)) {
      J split_pre = obj({{"type", J::string("Split")}, {"pattern", obj({{"Regex", J::string(split)}})},
                         {"behavior", J::string("Isolated")}, {"invert", J::boolean(false)}});
      pre = obj({{"type", J::string("Sequence")},
                 {"pretokenizers", J::array({split_pre, byte_level(false, false)})}});
    } else {
      pre = byte_level(false, true);
    }
    decoder = byte_level(true, true);
    bpe = obj({{"type", J::string("BPE")}, {"dropout", J()}, {"unk_token", J()},
               {"continuing_subword_prefix", J::string("")}, {"end_of_word_suffix", J::string("")},
               {"fuse_unk", J::boolean(false)}, {"byte_fallback", J::boolean(false)},
               {"ignore_merges", J::boolean(false)}});
  } else {
    pre = obj({{"type", J::string("Metaspace")}, {"replacement", J::string("\xe2\x96\x81")},
               {"prepend_scheme", J::string("first")}, {"split", J::boolean(false)}});
    decoder = obj({{"type", J::string("Sequence")},
                   {"decoders",
                    J::array({obj({{"type", J::string("Replace")}, {"pattern", obj({{"String", J::string("\xe2\x96\x81")}})},
                                   {"content", J::string(" ")}}),
                              obj({{"type", J::string("ByteFallback")}}), obj({{"type", J::string("Fuse")}}),
                              obj({{"type", J::string("Strip")}, {"content", J::string(" ")}, {"start", J::integer(1)},
                                   {"stop", J::integer(0)}})})}});
    bpe = obj({{"type", J::string("BPE")}, {"dropout", J()}, {"unk_token", J()},
               {"continuing_subword_prefix", J()}, {"end_of_word_suffix", J()}, {"fuse_unk", J::boolean(true)},
               {"byte_fallback", J::boolean(true)}, {"ignore_merges", J::boolean(false)}});
  }
  bpe.set("vocab", J::object(std::move(vocab)));
  bpe.set("merges", merges);

  return obj({{"version", J::string("1.0")}, {"truncation", J()}, {"padding", J()},
              {"added_tokens", added_tokens}, {"normalizer", J()}, {"pre_tokenizer", pre},
              {"post_processor", post}, {"decoder", decoder}, {"model", bpe}});
}

}  // namespace oomless
