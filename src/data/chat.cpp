#include "data/chat.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "core/error.h"

namespace oomless {

namespace {

constexpr const char* kSupported =
    "supported: ChatML (<|im_start|>ROLE\\nCONTENT<|im_end|>, e.g. SmolLM2, Qwen2) and Llama 3 "
    "(<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>)";

bool contains(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

// A token as tokenizer_config.json writes it: a string or {"content": ...}.
std::string token_string(const json::Value* v) {
  if (!v) return {};
  if (v->is_string()) return v->as_string();
  if (v->is_object())
    if (const json::Value* c = v->find("content"); c && c->is_string()) return c->as_string();
  return {};
}

// A default system message written as a literal in a ChatML template: the text between
// "<|im_start|>system" + newline (a real newline or the escape \n inside a Jinja string) and the next
// "<|im_end|>", when that text holds no Jinja expression (Qwen2's templates also have
// '<|im_start|>system\n' + messages[0]['content'], which is not a default).
std::string chatml_default_system(std::string_view t) {
  constexpr std::string_view head = "<|im_start|>system";
  for (size_t at = t.find(head); at != std::string_view::npos; at = t.find(head, at + 1)) {
    size_t p = at + head.size();
    if (t.substr(p, 1) == "\n") p += 1;
    else if (t.substr(p, 2) == "\\n") p += 2;
    else continue;
    const size_t end = t.find("<|im_end|>", p);
    if (end == std::string_view::npos) continue;
    std::string_view text = t.substr(p, end - p);
    if (text.empty() || text.find_first_of("{}'\"+") != std::string_view::npos) continue;
    return std::string(text);
  }
  return {};
}

// Python's str.strip(), which Jinja's `trim` calls: strips code points for which str.isspace() holds.
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Decodes the code point starting at s[i] (the text is valid UTF-8: it came from the JSON parser).
uint32_t code_point_at(std::string_view s, size_t i, size_t* len) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4;
  uint32_t c = n == 1 ? b : n == 2 ? b & 0x1f : n == 3 ? b & 0x0f : b & 0x07;
  for (size_t k = 1; k < n && i + k < s.size(); ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  *len = n;
  return c;
}

std::string py_strip(std::string_view s) {
  size_t begin = 0, len = 0;
  while (begin < s.size() && py_space(code_point_at(s, begin, &len))) begin += len;
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    if (!py_space(code_point_at(s, start, &len))) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

struct Segment {
  std::string text;
  bool special;  // one special token, looked up by its string
  bool supervised;
};

}  // namespace

ChatTemplate ChatTemplate::from_config(const json::Value& config) {
  ChatTemplate ct;
  const json::Value* tv = config.is_object() ? config.find("chat_template") : nullptr;
  std::string t;
  if (tv && tv->is_string()) {
    t = tv->as_string();
  } else if (tv && tv->is_array()) {
    for (const json::Value& e : tv->as_array()) {
      const json::Value* name = e.find("name");
      const json::Value* body = e.find("template");
      if (!body || !body->is_string()) continue;
      if (t.empty() || (name && name->is_string() && name->as_string() == "default")) t = body->as_string();
    }
  }
  if (t.empty()) return ct;
  if (const std::string bos = token_string(config.find("bos_token")); !bos.empty()) ct.bos_ = bos;

  if (contains(t, "<|start_header_id|>") && contains(t, "<|end_header_id|>") && contains(t, "<|eot_id|>")) {
    if (contains(t, "Cutting Knowledge Date")) {
      ct.reason_ = std::string("the chat template is Llama 3.1-style (it adds a dated system prompt), which is not "
                               "rendered; ") + kSupported;
      return ct;
    }
    ct.kind_ = Kind::llama3;
  } else if (contains(t, "<|im_start|>") && contains(t, "<|im_end|>")) {
    if (contains(t, "<think>")) {
      ct.reason_ = std::string("the ChatML template rewrites assistant content (<think> reasoning blocks), which "
                               "is not rendered; ") + kSupported;
      return ct;
    }
    ct.kind_ = Kind::chatml;
    ct.default_system_ = chatml_default_system(t);
  } else {
    ct.reason_ = std::string("unknown chat template (neither ChatML nor Llama 3); ") + kSupported;
    return ct;
  }
  ct.reason_.clear();
  return ct;
}

const char* ChatTemplate::end_of_turn() const { return kind_ == Kind::llama3 ? "<|eot_id|>" : "<|im_end|>"; }

void ChatTemplate::render(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                          std::vector<int32_t>& ids, std::vector<uint8_t>& mask, bool add_generation_prompt) const {
  OOM_CHECK(kind_ != Kind::none, "[data] ", reason_);
  std::vector<Segment> segs;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    OOM_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "[data] chat role \"", m.role,
              "\" is not supported; use system, user or assistant");
    const bool sup = m.role == "assistant" && m.train;
    if (kind_ == Kind::chatml) {
      if (i == 0 && m.role != "system" && !default_system_.empty()) {
        segs.push_back({"<|im_start|>", true, false});
        segs.push_back({"system\n" + default_system_, false, false});
        segs.push_back({"<|im_end|>", true, false});
        segs.push_back({"\n", false, false});
      }
      segs.push_back({"<|im_start|>", true, false});
      segs.push_back({m.role + "\n", false, false});
      segs.push_back({m.content, false, sup});
      segs.push_back({"<|im_end|>", true, sup});
      segs.push_back({"\n", false, false});
    } else {
      if (i == 0) segs.push_back({bos_, true, false});
      segs.push_back({"<|start_header_id|>", true, false});
      segs.push_back({m.role, false, false});
      segs.push_back({"<|end_header_id|>", true, false});
      segs.push_back({"\n\n", false, false});
      segs.push_back({py_strip(m.content), false, sup});
      segs.push_back({"<|eot_id|>", true, sup});
    }
  }
  // The header of the assistant turn to be generated (add_generation_prompt in the templates).
  if (add_generation_prompt) {
    if (kind_ == Kind::chatml) {
      segs.push_back({"<|im_start|>", true, false});
      segs.push_back({"assistant\n", false, false});
    } else {
      if (messages.empty()) segs.push_back({bos_, true, false});
      segs.push_back({"<|start_header_id|>", true, false});
      segs.push_back({"assistant", false, false});
      segs.push_back({"<|end_header_id|>", true, false});
      segs.push_back({"\n\n", false, false});
    }
  }

  // transformers encodes the whole rendered string, in which special tokens are split out first; so the
  // text between two special tokens is encoded as one piece (a header and the content after it can merge
  // across their boundary). Within a piece, a token belongs to the segment in which the ids of the whole
  // piece stop agreeing with the ids of the text before that segment: a token straddling a boundary goes
  // to the later segment, which is how the golden mask counts a token overlapping assistant content.
  ids.clear();
  mask.clear();
  for (size_t i = 0; i < segs.size();) {
    if (segs[i].special) {
      const auto id = tok.token_to_id(segs[i].text);
      OOM_CHECK(id.has_value(), "[data] the chat template uses ", segs[i].text,
                " but the tokenizer has no such token; the tokenizer and tokenizer_config.json do not match");
      ids.push_back(*id);
      mask.push_back(segs[i].supervised);
      ++i;
      continue;
    }
    size_t j = i;
    std::string piece;
    std::vector<size_t> bounds;  // byte offset in `piece` where each segment starts
    for (; j < segs.size() && !segs[j].special; ++j) {
      bounds.push_back(piece.size());
      piece += segs[j].text;
    }
    const std::vector<int32_t> all = tok.encode(piece, false);
    std::vector<size_t> first(bounds.size(), 0);  // index into `all` of each segment's first token
    for (size_t k = 1; k < bounds.size(); ++k) {
      const std::vector<int32_t> before = tok.encode(std::string_view(piece).substr(0, bounds[k]), false);
      size_t common = 0;
      while (common < before.size() && common < all.size() && before[common] == all[common]) ++common;
      first[k] = std::max(first[k - 1], common);
    }
    for (size_t t = 0; t < all.size(); ++t) {
      size_t k = bounds.size() - 1;
      while (k > 0 && t < first[k]) --k;
      ids.push_back(all[t]);
      mask.push_back(segs[i + k].supervised);
    }
    i = j;
  }
}

void parse_chat_messages(const json::Value& m, const std::string& where, const char* key, bool train,
                         const std::string& hint, std::vector<ChatMessage>* out) {
  OOM_CHECK(m.is_array() && m.size() > 0, "[data] ", where, ": \"", key, "\" must be a non-empty array; ", hint);
  for (size_t i = 0; i < m.size(); ++i) {
    const json::Value& e = m[i];
    const json::Value* role = e.is_object() ? e.find("role") : nullptr;
    const json::Value* content = e.is_object() ? e.find("content") : nullptr;
    OOM_CHECK(role && role->is_string() && content && content->is_string(), "[data] ", where, ": ", key, " message ",
              i, " needs string \"role\" and \"content\"; ", hint);
    const std::string& r = role->as_string();
    OOM_CHECK(r == "system" || r == "user" || r == "assistant", "[data] ", where, ": ", key, " message ", i,
              " has role \"", r, "\"; the roles are system, user and assistant");
    out->push_back({r, content->as_string(), train});
  }
}

std::vector<ChatMessage> read_first_conversation(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  OOM_CHECK(f, "[data] cannot open ", path, ": ", std::strerror(errno));
  std::string line;
  for (int ch; (ch = std::fgetc(f)) != EOF && ch != '\n';) line += static_cast<char>(ch);
  std::fclose(f);
  const std::string where = path + ":1";
  const json::Value v = json::parse(line, where);
  const char* hint = "the first line must be {\"messages\": [{\"role\", \"content\"}, ...]} or {\"prompt\": [...], "
                     "\"completion\": [...]}";
  const json::Value* m = v.is_object() ? v.find("messages") : nullptr;
  const json::Value* p = v.is_object() ? v.find("prompt") : nullptr;
  std::vector<ChatMessage> conv;
  if (m) {
    parse_chat_messages(*m, where, "messages", true, hint, &conv);
  } else {
    OOM_CHECK(p && p->is_array(), "[data] ", where, " is not a conversation; ", hint);
    parse_chat_messages(*p, where, "prompt", false, hint, &conv);
    if (const json::Value* c = v.find("completion"); c && c->is_array())
      parse_chat_messages(*c, where, "completion", true, hint, &conv);
  }
  return conv;
}

}  // namespace oomless
