// PCRE2 behind the patterns of tokenizer.json. tokenizers compiles them with Oniguruma (Ruby syntax);
// PCRE2 with UTF + UCP agrees on what these files use: \p{L}, \p{N}, \s, (?i:...), lookahead (?!\S),
// possessive and counted repeats. MULTILINE gives Ruby's line-anchored ^ and $.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/detail.h"

namespace oomless::tok {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Match data sized for the pattern with the most groups we have met; one per thread so that
// concurrent encode() calls share nothing mutable.
// A JIT stack of up to 1 MiB: the default 32 KiB can run out on long runs of one character class.
struct MatchData {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchData() {
    md = pcre2_match_data_create(64, nullptr);
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
    if (ctx && stack) pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~MatchData() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
  }
};

}  // namespace

Regex::Regex(const std::string& pattern, std::string_view source, std::string_view role)
    : pattern_(pattern), source_(source) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_offset, nullptr);
  if (!code)
    fail("[tokenizer] ", source, ": ", role, " regex ", json::quote(pattern), " does not compile at offset ",
         err_offset, ": ", pcre2_message(err), "; fix the pattern or report the file");
  // JIT makes the GPT-2-style splitters several times faster; without it (no JIT on this CPU)
  // matching still works through the interpreter.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto c = std::make_shared<Code>();
  c->code = code;
  code_ = std::move(c);
}

void Regex::find_all(std::string_view text, std::vector<Span>& out) const {
  thread_local MatchData data;
  if (!data.md) fail("[tokenizer] out of memory for regex match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (start <= text.size()) {
    const int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.md, data.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0)
      fail("[tokenizer] ", source_, ": regex ", json::quote(pattern_), " failed while matching: ",
           pcre2_message(rc), "; the pattern is too costly for this input");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
    const size_t b = ov[0], e = ov[1];
    if (b == e && have_last && last_end == e) {
      // An empty match touching the previous match: step one character and search again.
      if (start >= text.size()) return;
      size_t i = start;
      next_char(text, i);
      start = i;
      continue;
    }
    out.push_back({b, e});
    have_last = true;
    last_end = e;
    start = e;
  }
}

void find_literal(std::string_view text, std::string_view needle, std::vector<Span>& out) {
  size_t pos = 0;
  while ((pos = text.find(needle, pos)) != std::string_view::npos) {
    out.push_back({pos, pos + needle.size()});
    pos += needle.size();
  }
}

void Pattern::find_all(std::string_view text, std::vector<Span>& out) const {
  if (regex) {
    regex->find_all(text, out);
  } else {
    find_literal(text, literal, out);
  }
}

Pattern parse_pattern(const json::Value& v, std::string_view source, std::string_view role) {
  Pattern p;
  const json::Value* s = v.is_object() ? v.find("String") : nullptr;
  const json::Value* r = v.is_object() ? v.find("Regex") : nullptr;
  if (s && s->is_string()) {
    p.literal = s->as_string();
    if (p.literal.empty()) fail("[tokenizer] ", source, ": ", role, " has an empty String pattern; it would match everywhere");
  } else if (r && r->is_string()) {
    p.regex = std::make_shared<const Regex>(r->as_string(), source, role);
  } else {
    fail("[tokenizer] ", source, ": ", role, " pattern must be {\"String\": ...} or {\"Regex\": ...}, found ",
         json::dump(v));
  }
  return p;
}

}  // namespace oomless::tok
