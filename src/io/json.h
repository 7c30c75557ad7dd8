// JSON (RFC 8259) DOM for the files the ecosystem ships: config.json, tokenizer.json,
// tokenizer_config.json, safetensors headers, model.safetensors.index.json. Objects keep their keys in
// file order (tokenizer.json's vocab order matters to nobody, but error messages and round trips read
// better). Numbers that are integer literals fitting int64 are kept exactly; others as double.
// parse() never crashes on bad input: it throws oomless::Error "[json] SOURCE: line L, column C: what".
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace oomless::json {

class Value {
 public:
  enum class Kind { null, boolean, number, string, array, object };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;  // null
  static Value boolean(bool b);
  static Value number(double d);
  static Value integer(int64_t i);
  static Value string(std::string s);
  static Value array(Array a = {});
  static Value object(Object o = {});

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::null; }
  bool is_bool() const { return kind_ == Kind::boolean; }
  bool is_number() const { return kind_ == Kind::number; }
  bool is_integer() const { return kind_ == Kind::number && is_int_; }  // an integer literal within int64
  bool is_string() const { return kind_ == Kind::string; }
  bool is_array() const { return kind_ == Kind::array; }
  bool is_object() const { return kind_ == Kind::object; }

  // Typed access; a wrong kind throws "[json] expected WHAT, found KIND" (with `what` naming the key
  // or role when given, e.g. as_int("vocab_size")).
  bool as_bool(std::string_view what = {}) const;
  double as_number(std::string_view what = {}) const;
  int64_t as_int(std::string_view what = {}) const;  // integer literal, or a double with an exact integer value
  const std::string& as_string(std::string_view what = {}) const;
  const Array& as_array(std::string_view what = {}) const;
  const Object& as_object(std::string_view what = {}) const;

  // Object lookup: find returns nullptr when absent (or when this is not an object); at throws
  // "[json] missing key \"KEY\"". Linear for small objects, indexed for large ones (vocabularies).
  const Value* find(std::string_view key) const;
  const Value& at(std::string_view key) const;
  // Array element / object or array size.
  const Value& operator[](size_t i) const;
  size_t size() const;

  // Builders for writers (safetensors headers, config.json, JSON output of commands).
  Value& push_back(Value v);                   // array
  Value& set(std::string key, Value v);        // object: replaces an existing key or appends

  static const char* kind_name(Kind k);

  // Structural equality: same kinds, integers vs doubles kept apart, doubles compared with ==,
  // object keys compared in order.
  friend bool operator==(const Value& a, const Value& b);

 private:
  Kind kind_ = Kind::null;
  bool b_ = false;
  bool is_int_ = false;
  int64_t i_ = 0;
  double d_ = 0.0;
  std::string s_;
  std::shared_ptr<Array> a_;
  std::shared_ptr<Object> o_;
  // Key -> position for objects with more than 16 keys. Built as soon as an object grows past that
  // size (by parse, object() or set()) rather than on first lookup, so that a parsed document can be
  // read from several threads without locking. Copies share it; mutators copy on write.
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Index = std::unordered_map<std::string, size_t, KeyHash, std::equal_to<>>;
  std::shared_ptr<Index> index_;

  void own_array();
  void own_object();
  void build_index();
  friend class Parser;
};

// Parses a whole document (leading/trailing whitespace allowed, anything else after it is an error).
// `source` names the file in error messages. Nesting deeper than 512 is an error, not a stack overflow.
// Strings are validated as UTF-8 after unescaping (\uXXXX surrogate pairs combined; lone surrogates
// are an error). Duplicate keys in one object are an error (RFC 8259 leaves them undefined; every
// file we read comes from a map, so a duplicate means a corrupt or hand-edited file). "-0" is kept as
// the double -0.0; numbers beyond the double range are an error; ones below it become +-0. A leading
// UTF-8 byte order mark is skipped.
Value parse(std::string_view text, std::string_view source = "<json>");
// Reads and parses a file; errors name the path.
Value parse_file(const std::string& path);

// Serialises: indent < 0 gives one line without spaces; otherwise pretty-printed with that many spaces.
// Integers print exactly; doubles print with the shortest representation that round-trips, with ".0"
// added to integral ones so that they parse back as doubles; NaN/Inf are an error (JSON has none).
// Strings keep UTF-8 as is and escape '"', '\\' and control characters; invalid UTF-8 is an error.
std::string dump(const Value& v, int indent = -1);
// A JSON string literal (with quotes) for s; throws when s is not valid UTF-8.
std::string quote(std::string_view s);

}  // namespace oomless::json
