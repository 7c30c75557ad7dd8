// JSON DOM, parser and writer (RFC 8259).
//
// The parser is recursive descent over the bytes with an explicit depth limit, so hostile input
// can cost time linear in its size but never a stack overflow. Line and column of an error are
// computed only when an error is thrown (columns count UTF-8 characters, from 1).
// Number text is converted with std::from_chars, which ignores the C locale's decimal point; the
// rare out-of-range doubles go through strtod_l in the "C" locale to tell overflow (an error) from
// underflow (a denormal or zero, as every JSON reader gives).
#include "io/json.h"

#include <fcntl.h>
#include <locale.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace oomless::json {

namespace {

constexpr int kMaxDepth = 512;
constexpr size_t kIndexAbove = 16;  // objects with more keys than this get a key index

const char* kind_article(Value::Kind k) {
  switch (k) {
    case Value::Kind::null: return "null";
    case Value::Kind::boolean: return "a boolean";
    case Value::Kind::number: return "a number";
    case Value::Kind::string: return "a string";
    case Value::Kind::array: return "an array";
    case Value::Kind::object: return "an object";
  }
  return "?";
}

[[noreturn]] void wrong_kind(std::string_view what, const char* expected, Value::Kind found) {
  if (what.empty()) fail("[json] expected ", expected, ", found ", kind_article(found));
  fail("[json] expected ", expected, " for \"", what, "\", found ", kind_article(found));
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is not valid (overlong forms,
// UTF-16 surrogates encoded as UTF-8 and code points above U+10FFFF are invalid, RFC 3629).
size_t utf8_seq_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t left = s.size() - i;
  if (c < 0x80) return 1;
  const auto cont = [&](size_t k) { return (b(k) & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && cont(i + 1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || !cont(i + 1) || !cont(i + 2)) return 0;
    if (c == 0xE0 && b(i + 1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(i + 1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || !cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    if (c == 0xF0 && b(i + 1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(i + 1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string describe_byte(unsigned char c) {
  char buf[16];
  if (c >= 0x21 && c < 0x7F) {
    std::snprintf(buf, sizeof buf, "'%c'", c);
  } else {
    std::snprintf(buf, sizeof buf, "byte 0x%02X", c);
  }
  return buf;
}

locale_t c_locale() {
  static const locale_t loc = newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(nullptr));
  return loc;
}

}  // namespace

class Parser {
 public:
  Parser(std::string_view text, std::string_view source) : t_(text), src_(source) {}

  Value document() {
    if (t_.substr(0, 3) == "\xEF\xBB\xBF") p_ = 3;
    skip_ws();
    if (p_ == t_.size()) error(p_, "the document is empty");
    Value v = value(0);
    skip_ws();
    if (p_ != t_.size()) error(p_, "unexpected ", describe_byte(byte()), " after the end of the document");
    return v;
  }

 private:
  std::string_view t_;
  std::string_view src_;
  size_t p_ = 0;

  template <class... Args>
  [[noreturn]] void error(size_t at, const Args&... what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < at && i < t_.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(t_[i]);
      if (c == '\n') {
        ++line;
        col = 1;
      } else if ((c & 0xC0) != 0x80) {
        ++col;
      }
    }
    fail("[json] ", src_, ": line ", line, ", column ", col, ": ", what...);
  }

  unsigned char byte() const { return static_cast<unsigned char>(t_[p_]); }

  void skip_ws() {
    while (p_ < t_.size()) {
      const char c = t_[p_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++p_;
    }
  }

  [[noreturn]] void unexpected(const char* expected) const {
    if (p_ >= t_.size()) error(p_, "unexpected end of input, expected ", expected);
    error(p_, "unexpected ", describe_byte(byte()), ", expected ", expected);
  }

  void literal(std::string_view word) {
    if (t_.substr(p_, word.size()) != word) unexpected("a value");
    p_ += word.size();
  }

  Value value(int depth) {
    if (p_ >= t_.size()) unexpected("a value");
    switch (t_[p_]) {
      case '{': return object(depth + 1);
      case '[': return array(depth + 1);
      case '"': return Value::string(string());
      case 't': literal("true"); return Value::boolean(true);
      case 'f': literal("false"); return Value::boolean(false);
      case 'n': literal("null"); return Value();
      default: break;
    }
    if (t_[p_] == '-' || (t_[p_] >= '0' && t_[p_] <= '9')) return number();
    unexpected("a value");
  }

  void check_depth(int depth) const {
    if (depth > kMaxDepth) error(p_, "arrays and objects nest deeper than ", kMaxDepth, " levels");
  }

  Value array(int depth) {
    check_depth(depth);
    ++p_;  // '['
    Value::Array items;
    skip_ws();
    if (p_ < t_.size() && t_[p_] == ']') {
      ++p_;
      return Value::array(std::move(items));
    }
    for (;;) {
      skip_ws();
      items.push_back(value(depth));
      skip_ws();
      if (p_ < t_.size() && t_[p_] == ',') {
        ++p_;
        continue;
      }
      if (p_ < t_.size() && t_[p_] == ']') {
        ++p_;
        return Value::array(std::move(items));
      }
      unexpected("',' or ']' in an array");
    }
  }

  Value object(int depth) {
    check_depth(depth);
    ++p_;  // '{'
    Value out;
    out.kind_ = Value::Kind::object;
    out.o_ = std::make_shared<Value::Object>();
    Value::Object& members = *out.o_;
    std::shared_ptr<Value::Index> index;
    skip_ws();
    if (p_ < t_.size() && t_[p_] == '}') {
      ++p_;
      return out;
    }
    for (;;) {
      skip_ws();
      if (p_ >= t_.size() || t_[p_] != '"') unexpected("a string key in an object");
      const size_t key_at = p_;
      std::string key = string();
      bool duplicate = false;
      if (index) {
        duplicate = !index->emplace(key, members.size()).second;
      } else {
        for (const auto& m : members) duplicate = duplicate || m.first == key;
      }
      if (duplicate) error(key_at, "duplicate key ", quote(key), " in an object");
      skip_ws();
      if (p_ >= t_.size() || t_[p_] != ':') unexpected("':' after an object key");
      ++p_;
      skip_ws();
      members.emplace_back(std::move(key), value(depth));
      if (!index && members.size() > kIndexAbove) {
        index = std::make_shared<Value::Index>();
        index->reserve(members.size() * 2);
        for (size_t i = 0; i < members.size(); ++i) index->emplace(members[i].first, i);
      }
      skip_ws();
      if (p_ < t_.size() && t_[p_] == ',') {
        ++p_;
        continue;
      }
      if (p_ < t_.size() && t_[p_] == '}') {
        ++p_;
        out.index_ = std::move(index);
        return out;
      }
      unexpected("',' or '}' in an object");
    }
  }

  uint32_t hex4(size_t at) {
    if (t_.size() - at < 4) error(at, "\\u needs four hex digits");
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = t_[at + k];
      uint32_t d;
      if (c >= '0' && c <= '9') {
        d = static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        d = static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        d = static_cast<uint32_t>(c - 'A' + 10);
      } else {
        error(at + k, "\\u needs four hex digits, found ", describe_byte(static_cast<unsigned char>(c)));
      }
      v = v * 16 + d;
    }
    return v;
  }

  std::string string() {
    ++p_;  // opening quote
    std::string out;
    for (;;) {
      // Copy the run of plain bytes in one go; most strings have no escapes.
      const size_t run = p_;
      while (p_ < t_.size()) {
        const unsigned char c = byte();
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++p_;
      }
      out.append(t_.data() + run, p_ - run);
      if (p_ >= t_.size()) error(p_, "unterminated string (end of input before the closing '\"')");
      const unsigned char c = byte();
      if (c == '"') {
        ++p_;
        return out;
      }
      if (c < 0x20) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "%04X", c);
        error(p_, "control character U+", hex, " inside a string; it must be escaped");
      }
      if (c >= 0x80) {
        const size_t n = utf8_seq_len(t_, p_);
        if (n == 0) error(p_, "invalid UTF-8 (", describe_byte(c), ") inside a string");
        out.append(t_.data() + p_, n);
        p_ += n;
        continue;
      }
      escape(out);
    }
  }

  void escape(std::string& out) {
    const size_t at = p_;
    if (p_ + 1 >= t_.size()) error(p_, "unterminated string (end of input after '\\')");
    const char e = t_[p_ + 1];
    p_ += 2;
    switch (e) {
      case '"': out += '"'; return;
      case '\\': out += '\\'; return;
      case '/': out += '/'; return;
      case 'b': out += '\b'; return;
      case 'f': out += '\f'; return;
      case 'n': out += '\n'; return;
      case 'r': out += '\r'; return;
      case 't': out += '\t'; return;
      case 'u': break;
      default: error(at, "invalid escape \\", e == '\0' ? std::string("\\0") : std::string(1, e),
                     " (valid: \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
    }
    uint32_t cp = hex4(p_);
    p_ += 4;
    if (cp >= 0xDC00 && cp <= 0xDFFF) error(at, "lone low surrogate \\u", t_.substr(at + 2, 4), " in a string");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (t_.substr(p_, 2) != "\\u") {
        error(at, "high surrogate \\u", t_.substr(at + 2, 4), " is not followed by a low surrogate \\uDC00-\\uDFFF");
      }
      const uint32_t lo = hex4(p_ + 2);
      if (lo < 0xDC00 || lo > 0xDFFF) {
        error(at, "high surrogate \\u", t_.substr(at + 2, 4), " is followed by \\u", t_.substr(p_ + 2, 4),
              ", not by a low surrogate \\uDC00-\\uDFFF");
      }
      p_ += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    append_utf8(out, cp);
  }

  Value number() {
    const size_t start = p_;
    const auto digit = [&] { return p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9'; };
    if (t_[p_] == '-') ++p_;
    if (!digit()) unexpected("a digit after '-'");
    if (t_[p_] == '0') {
      ++p_;
      if (digit()) error(start, "numbers may not have leading zeros");
    } else {
      while (digit()) ++p_;
    }
    bool integral = true;
    if (p_ < t_.size() && t_[p_] == '.') {
      integral = false;
      ++p_;
      if (!digit()) unexpected("a digit after the decimal point");
      while (digit()) ++p_;
    }
    if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
      integral = false;
      ++p_;
      if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
      if (!digit()) unexpected("a digit in the exponent");
      while (digit()) ++p_;
    }
    const char* first = t_.data() + start;
    const char* last = t_.data() + p_;
    const bool negative_zero = last - first == 2 && first[0] == '-' && first[1] == '0';
    if (integral && !negative_zero) {
      int64_t i = 0;
      const auto r = std::from_chars(first, last, i);
      if (r.ec == std::errc() && r.ptr == last) return Value::integer(i);
    }
    double d = 0;
    const auto r = std::from_chars(first, last, d);
    if (r.ec == std::errc::result_out_of_range) {
      const std::string copy(first, last);
      d = strtod_l(copy.c_str(), nullptr, c_locale());
      if (std::isinf(d)) error(start, "number ", copy, " is beyond the range of a double");
    } else if (r.ec != std::errc() || r.ptr != last) {
      error(start, "malformed number");
    }
    return Value::number(d);
  }
};

// ---- Value ----

Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::boolean;
  v.b_ = b;
  return v;
}

Value Value::number(double d) {
  Value v;
  v.kind_ = Kind::number;
  v.d_ = d;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::number;
  v.is_int_ = true;
  v.i_ = i;
  v.d_ = static_cast<double>(i);
  return v;
}

Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::string;
  v.s_ = std::move(s);
  return v;
}

Value Value::array(Array a) {
  Value v;
  v.kind_ = Kind::array;
  v.a_ = std::make_shared<Array>(std::move(a));
  return v;
}

Value Value::object(Object o) {
  Value v;
  v.kind_ = Kind::object;
  v.o_ = std::make_shared<Object>(std::move(o));
  if (v.o_->size() > kIndexAbove) v.build_index();
  return v;
}

void Value::build_index() {
  auto idx = std::make_shared<Index>();
  idx->reserve(o_->size());
  // emplace keeps the first of duplicate keys, which is what the linear search finds too.
  for (size_t i = 0; i < o_->size(); ++i) idx->emplace((*o_)[i].first, i);
  index_ = std::move(idx);
}

const char* Value::kind_name(Kind k) {
  switch (k) {
    case Kind::null: return "null";
    case Kind::boolean: return "boolean";
    case Kind::number: return "number";
    case Kind::string: return "string";
    case Kind::array: return "array";
    case Kind::object: return "object";
  }
  return "?";
}

bool Value::as_bool(std::string_view what) const {
  if (kind_ != Kind::boolean) wrong_kind(what, "a boolean", kind_);
  return b_;
}

double Value::as_number(std::string_view what) const {
  if (kind_ != Kind::number) wrong_kind(what, "a number", kind_);
  return d_;
}

int64_t Value::as_int(std::string_view what) const {
  if (kind_ != Kind::number) wrong_kind(what, "an integer", kind_);
  if (is_int_) return i_;
  // 2^63 is exact as a double; every double in [-2^63, 2^63) with no fraction fits int64.
  if (std::trunc(d_) == d_ && d_ >= -9223372036854775808.0 && d_ < 9223372036854775808.0) {
    return static_cast<int64_t>(d_);
  }
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, d_);
  const std::string text(buf, r.ptr);
  if (what.empty()) fail("[json] expected an integer, found ", text);
  fail("[json] expected an integer for \"", what, "\", found ", text);
}

const std::string& Value::as_string(std::string_view what) const {
  if (kind_ != Kind::string) wrong_kind(what, "a string", kind_);
  return s_;
}

const Value::Array& Value::as_array(std::string_view what) const {
  if (kind_ != Kind::array) wrong_kind(what, "an array", kind_);
  return *a_;
}

const Value::Object& Value::as_object(std::string_view what) const {
  if (kind_ != Kind::object) wrong_kind(what, "an object", kind_);
  return *o_;
}

const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::object) return nullptr;
  if (index_) {
    const auto it = index_->find(key);
    return it == index_->end() ? nullptr : &(*o_)[it->second].second;
  }
  for (const auto& m : *o_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

const Value& Value::at(std::string_view key) const {
  if (kind_ != Kind::object) fail("[json] looking up key \"", key, "\" in ", kind_article(kind_), ", not an object");
  const Value* v = find(key);
  if (!v) fail("[json] missing key \"", key, "\"");
  return *v;
}

const Value& Value::operator[](size_t i) const {
  if (kind_ != Kind::array) fail("[json] indexing [", i, "] into ", kind_article(kind_), ", not an array");
  if (i >= a_->size()) fail("[json] index ", i, " is out of range for an array of ", a_->size());
  return (*a_)[i];
}

size_t Value::size() const {
  if (kind_ == Kind::array) return a_->size();
  if (kind_ == Kind::object) return o_->size();
  fail("[json] size of ", kind_article(kind_), ": only arrays and objects have one");
}

// Copies share their containers; a mutator first takes a private copy when the container is shared,
// so that changing one Value never changes another.
void Value::own_array() {
  if (a_.use_count() > 1) a_ = std::make_shared<Array>(*a_);
}

void Value::own_object() {
  if (o_.use_count() > 1) {
    o_ = std::make_shared<Object>(*o_);
    if (index_) index_ = std::make_shared<Index>(*index_);
  }
}

Value& Value::push_back(Value v) {
  if (kind_ != Kind::array) fail("[json] push_back on ", kind_article(kind_), ", not an array");
  own_array();
  a_->push_back(std::move(v));
  return a_->back();
}

Value& Value::set(std::string key, Value v) {
  if (kind_ != Kind::object) fail("[json] set(\"", key, "\") on ", kind_article(kind_), ", not an object");
  own_object();
  if (index_) {
    const auto it = index_->find(key);
    if (it != index_->end()) return (*o_)[it->second].second = std::move(v);
    index_->emplace(key, o_->size());
  } else {
    for (auto& m : *o_) {
      if (m.first == key) return m.second = std::move(v);
    }
  }
  o_->emplace_back(std::move(key), std::move(v));
  if (!index_ && o_->size() > kIndexAbove) build_index();
  return o_->back().second;
}

bool operator==(const Value& a, const Value& b) {
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case Value::Kind::null: return true;
    case Value::Kind::boolean: return a.b_ == b.b_;
    case Value::Kind::number:
      if (a.is_int_ != b.is_int_) return false;
      return a.is_int_ ? a.i_ == b.i_ : a.d_ == b.d_;
    case Value::Kind::string: return a.s_ == b.s_;
    case Value::Kind::array: return a.a_ == b.a_ || *a.a_ == *b.a_;
    case Value::Kind::object: return a.o_ == b.o_ || *a.o_ == *b.o_;
  }
  return false;
}

// ---- parse ----

Value parse(std::string_view text, std::string_view source) { return Parser(text, source).document(); }

Value parse_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("[json] ", path, ": cannot open the file (", std::strerror(errno), "); check the path");
  std::string text;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) text.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail("[json] ", path, ": cannot read the file (", std::strerror(err), "); check the path");
    }
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return parse(text, path);
}

// ---- dump ----

namespace {

void quote_into(std::string& out, std::string_view s) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = utf8_seq_len(s, i);
      if (n == 0) {
        fail("[json] cannot write a string that is not valid UTF-8 (", describe_byte(c), " at byte ", i,
             "); JSON text must be UTF-8");
      }
      out.append(s.data() + i, n);
      i += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "\\u%04x", c);
          out += hex;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += '"';
}

void newline(std::string& out, int indent, int level) {
  if (indent < 0) return;
  out += '\n';
  out.append(static_cast<size_t>(indent) * static_cast<size_t>(level), ' ');
}

void dump_into(std::string& out, const Value& v, int indent, int level) {
  switch (v.kind()) {
    case Value::Kind::null: out += "null"; return;
    case Value::Kind::boolean: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::string: quote_into(out, v.as_string()); return;
    case Value::Kind::number: {
      char buf[40];
      if (v.is_integer()) {
        const auto r = std::to_chars(buf, buf + sizeof buf, v.as_int());
        out.append(buf, r.ptr);
        return;
      }
      const double d = v.as_number();
      if (!std::isfinite(d)) fail("[json] cannot write ", d, ": JSON has no NaN or infinity");
      const auto r = std::to_chars(buf, buf + sizeof buf, d);
      const std::string_view text(buf, static_cast<size_t>(r.ptr - buf));
      out += text;
      // Keep it a double when read back: "1" would come back as the integer 1.
      if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
      return;
    }
    case Value::Kind::array: {
      const auto& a = v.as_array();
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, level + 1);
        dump_into(out, a[i], indent, level + 1);
      }
      if (!a.empty()) newline(out, indent, level);
      out += ']';
      return;
    }
    case Value::Kind::object: {
      const auto& o = v.as_object();
      out += '{';
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, level + 1);
        quote_into(out, o[i].first);
        out += indent < 0 ? ":" : ": ";
        dump_into(out, o[i].second, indent, level + 1);
      }
      if (!o.empty()) newline(out, indent, level);
      out += '}';
      return;
    }
  }
}

}  // namespace

std::string dump(const Value& v, int indent) {
  std::string out;
  dump_into(out, v, indent, 0);
  return out;
}

std::string quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  quote_into(out, s);
  return out;
}

}  // namespace oomless::json
