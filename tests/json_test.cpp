// JSON parser and writer: valid documents of every kind, each escape, surrogate pairs, UTF-8 checks,
// numbers at the int64/double edges, the depth limit, error positions, dump() round trips and lookup
// in big objects.
#include "io/json.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "core/error.h"

namespace oomless::json {
namespace {

// The message of the Error that parse throws, or "" when it does not throw.
std::string parse_error(std::string_view text) {
  try {
    parse(text, "t.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Json, ParsesEveryKind) {
  const Value v = parse(R"( {"a": null, "b": true, "c": false, "d": 12, "e": -1.5, "f": "x",
                             "g": [1, [2, []], {}], "h": {"i": {"j": "k"}}} )",
                        "t.json");
  ASSERT_TRUE(v.is_object());
  EXPECT_EQ(v.size(), 8u);
  EXPECT_TRUE(v.at("a").is_null());
  EXPECT_TRUE(v.at("b").as_bool());
  EXPECT_FALSE(v.at("c").as_bool());
  EXPECT_TRUE(v.at("d").is_integer());
  EXPECT_EQ(v.at("d").as_int(), 12);
  EXPECT_FALSE(v.at("e").is_integer());
  EXPECT_EQ(v.at("e").as_number(), -1.5);
  EXPECT_EQ(v.at("f").as_string(), "x");
  EXPECT_EQ(v.at("g").size(), 3u);
  EXPECT_EQ(v.at("g")[1][0].as_int(), 2);
  EXPECT_EQ(v.at("g")[1][1].size(), 0u);
  EXPECT_TRUE(v.at("g")[2].is_object());
  EXPECT_EQ(v.at("h").at("i").at("j").as_string(), "k");
  // Keys stay in file order.
  const auto& o = v.as_object();
  EXPECT_EQ(o[0].first, "a");
  EXPECT_EQ(o[7].first, "h");
  // Scalars at the top level are documents too.
  EXPECT_EQ(parse("7").as_int(), 7);
  EXPECT_EQ(parse("\"s\"").as_string(), "s");
  EXPECT_TRUE(parse(" null\r\n\t").is_null());
  EXPECT_TRUE(parse("\xEF\xBB\xBF{}").is_object());  // byte order mark skipped
}

TEST(Json, TypedAccessErrorsNameTheKey) {
  const Value v = parse(R"({"n": "x", "f": 1.5, "big": 1e19})");
  try {
    (void)v.at("n").as_int("vocab_size");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("string"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)v.at("f").as_int(), Error);
  EXPECT_THROW((void)v.at("big").as_int(), Error);
  EXPECT_EQ(parse("2.0").as_int(), 2);  // a double with an integral value is accepted
  EXPECT_THROW((void)v.as_array(), Error);
  EXPECT_THROW((void)v.at("missing"), Error);
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_EQ(v.at("n").find("x"), nullptr);  // not an object
  EXPECT_THROW((void)v[0], Error);
  EXPECT_THROW((void)parse("[1]")[1], Error);
  EXPECT_THROW((void)parse("1").size(), Error);
}

TEST(Json, EveryEscape) {
  const Value v = parse(R"("\" \\ \/ \b \f \n \r \t \u0041 \u00e9 \u20AC \u0000")");
  static const char kWant[] = "\" \\ / \b \f \n \r \t A \xC3\xA9 \xE2\x82\xAC \0";
  EXPECT_EQ(v.as_string(), std::string(kWant, sizeof kWant - 1));
  for (const char* bad : {R"("\a")", R"("\x41")", R"("\u12")", R"("\u12G4")", R"("\U0041")", R"("\)"}) {
    EXPECT_NE(parse_error(bad), "") << bad;
  }
  EXPECT_NE(parse_error(R"("\q")").find("invalid escape"), std::string::npos);
}

TEST(Json, SurrogatePairs) {
  // U+1F600 = D83D DE00; U+10FFFF = DBFF DFFF; U+10000 = D800 DC00.
  EXPECT_EQ(parse(R"("\ud83d\ude00")").as_string(), "\xF0\x9F\x98\x80");
  EXPECT_EQ(parse(R"("\uDBFF\uDFFF")").as_string(), "\xF4\x8F\xBF\xBF");
  EXPECT_EQ(parse(R"("a\uD800\uDC00b")").as_string(), "a\xF0\x90\x80\x80" "b");
  EXPECT_NE(parse_error(R"("\ud83d")").find("surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ud83dx")").find("surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ud83d\u0041")").find("surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ud83d\ud83d")").find("surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ude00")").find("surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ude00\ud83d")").find("surrogate"), std::string::npos);
}

TEST(Json, RawUtf8IsValidated) {
  EXPECT_EQ(parse("\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"").as_string(), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  EXPECT_EQ(parse("\"\xF4\x8F\xBF\xBF\"").as_string(), "\xF4\x8F\xBF\xBF");  // U+10FFFF
  const char* bad[] = {
      "\"\x80\"",              // lone continuation byte
      "\"\xC3\"",              // truncated sequence
      "\"\xC3(\"",             // bad continuation
      "\"\xC0\xAF\"",          // overlong '/'
      "\"\xE0\x80\xAF\"",      // overlong, 3 bytes
      "\"\xF0\x80\x80\xAF\"",  // overlong, 4 bytes
      "\"\xED\xA0\x80\"",      // UTF-16 surrogate D800 as UTF-8
      "\"\xF4\x90\x80\x80\"",  // above U+10FFFF
      "\"\xF5\x80\x80\x80\"",  // invalid lead byte
      "\"\xFF\"",
  };
  for (const char* b : bad) EXPECT_NE(parse_error(b).find("UTF-8"), std::string::npos) << b;
  // Control characters must be escaped.
  EXPECT_NE(parse_error("\"a\nb\"").find("control character U+000A"), std::string::npos);
  EXPECT_NE(parse_error(std::string_view("\"a\0b\"", 5)).find("control character"), std::string::npos);
}

TEST(Json, Numbers) {
  EXPECT_EQ(parse("9223372036854775807").as_int(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(parse("-9223372036854775808").as_int(), std::numeric_limits<int64_t>::min());
  EXPECT_TRUE(parse("-9223372036854775808").is_integer());
  // Beyond int64: a double.
  const Value big = parse("9223372036854775808");
  EXPECT_FALSE(big.is_integer());
  EXPECT_EQ(big.as_number(), 9223372036854775808.0);
  EXPECT_EQ(parse("-18446744073709551617").as_number(), -18446744073709551617.0);
  EXPECT_EQ(parse("0").as_int(), 0);
  const Value nz = parse("-0");
  EXPECT_FALSE(nz.is_integer());
  EXPECT_TRUE(std::signbit(nz.as_number()));
  EXPECT_TRUE(std::signbit(parse("-0.0").as_number()));
  EXPECT_EQ(parse("1e3").as_number(), 1000.0);
  EXPECT_FALSE(parse("1e3").is_integer());
  EXPECT_EQ(parse("1E+3").as_number(), 1000.0);
  EXPECT_EQ(parse("25e-1").as_number(), 2.5);
  EXPECT_EQ(parse("-0.000123").as_number(), -0.000123);
  EXPECT_EQ(parse("0.1").as_number(), 0.1);
  EXPECT_EQ(parse("1.7976931348623157e308").as_number(), std::numeric_limits<double>::max());
  EXPECT_EQ(parse("4.9406564584124654e-324").as_number(), std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(parse("1e-400").as_number(), 0.0);  // underflow gives zero, as strtod does
  EXPECT_TRUE(std::signbit(parse("-1e-400").as_number()));
  EXPECT_EQ(parse("1e-5").as_number(), 1e-5);
  EXPECT_NE(parse_error("1e400").find("beyond the range"), std::string::npos);
  EXPECT_NE(parse_error("-1e400").find("beyond the range"), std::string::npos);
  for (const char* bad : {"01", "-01", "1.", ".5", "+1", "-", "1e", "1e+", "0x10", "1.e5", "Infinity", "NaN",
                          "- 1", "1 2", "--1"}) {
    EXPECT_NE(parse_error(bad), "") << bad;
  }
  EXPECT_NE(parse_error("01").find("leading zeros"), std::string::npos);
}

TEST(Json, InvalidDocuments) {
  for (const char* bad : {"", "   ", "{", "[", "[1,]", "[1 2]", "{\"a\"}", "{\"a\":}", "{\"a\":1,}", "{a:1}",
                          "{'a':1}", "[1]]", "{\"a\":1}x", "tru", "nul", "truex", "\"abc", "[\"a\",",
                          "{\"a\" 1}", "{1:2}", "/* c */ 1", "[1,,2]"}) {
    EXPECT_NE(parse_error(bad), "") << bad;
  }
  EXPECT_NE(parse_error(R"({"a":1,"a":2})").find("duplicate key \"a\""), std::string::npos);
}

TEST(Json, ErrorsNameSourceLineAndColumn) {
  EXPECT_EQ(parse_error("{\n  \"a\": 1,\n  \"b\": x\n}"),
            "[json] t.json: line 3, column 8: unexpected 'x', expected a value");
  EXPECT_EQ(parse_error("[1, 2"), "[json] t.json: line 1, column 6: unexpected end of input, expected ',' or ']' in an array");
  // Columns count characters, not bytes: "é" is one column.
  EXPECT_EQ(parse_error("[\"\xC3\xA9\", ?]"), "[json] t.json: line 1, column 7: unexpected '?', expected a value");
  EXPECT_EQ(parse_error("{\"k\": 1,\n \"k\": 2}"), "[json] t.json: line 2, column 2: duplicate key \"k\" in an object");
  EXPECT_EQ(parse_error("\"\\ud800\""),
            "[json] t.json: line 1, column 2: high surrogate \\ud800 is not followed by a low surrogate "
            "\\uDC00-\\uDFFF");
}

TEST(Json, DepthLimit) {
  const auto nested = [](int n) { return std::string(static_cast<size_t>(n), '[') + std::string(static_cast<size_t>(n), ']'); };
  EXPECT_NO_THROW(parse(nested(512)));
  EXPECT_NE(parse_error(nested(513)).find("deeper than 512"), std::string::npos);
  std::string objs;
  for (int i = 0; i < 512; ++i) objs += "{\"a\":";
  objs += "1" + std::string(512, '}');
  EXPECT_NO_THROW(parse(objs));
  EXPECT_NE(parse_error("{\"a\":" + objs + "}").find("deeper than 512"), std::string::npos);
  // Far deeper input fails cleanly too (no stack overflow).
  EXPECT_NE(parse_error(std::string(1000000, '[')).find("deeper than 512"), std::string::npos);
}

TEST(Json, DumpFormats) {
  Value o = Value::object();
  o.set("i", Value::integer(-9223372036854775807 - 1));
  o.set("d", Value::number(0.1));
  o.set("w", Value::number(3.0));
  o.set("nz", Value::number(-0.0));
  o.set("e", Value::number(1e300));
  o.set("s", Value::string("q\"b\\s/\b\f\n\r\t\x01\x1f\x7f \xE2\x82\xAC"));
  Value a = Value::array();
  a.push_back(Value());
  a.push_back(Value::boolean(true));
  a.push_back(Value::array());
  a.push_back(Value::object());
  o.set("a", a);
  EXPECT_EQ(dump(o),
            "{\"i\":-9223372036854775808,\"d\":0.1,\"w\":3.0,\"nz\":-0.0,\"e\":1e+300,"
            "\"s\":\"q\\\"b\\\\s/\\b\\f\\n\\r\\t\\u0001\\u001f\x7f \xE2\x82\xAC\","
            "\"a\":[null,true,[],{}]}");
  EXPECT_EQ(dump(parse(R"({"a":[1,{"b":2}],"c":{}})"), 2), "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": {}\n}");
  EXPECT_THROW(dump(Value::number(std::nan(""))), Error);
  EXPECT_THROW(dump(Value::number(INFINITY)), Error);
  EXPECT_THROW(quote("\xC3"), Error);  // not UTF-8
  EXPECT_EQ(quote("a\"b"), "\"a\\\"b\"");
}

TEST(Json, RoundTrip) {
  const char* docs[] = {
      R"({"model_type":"llama","vocab_size":128256,"rope_theta":500000.0,"rms_norm_eps":1e-05,
          "eps":1.0000000000000002,"tiny":5e-324,"max":1.7976931348623157e308,"neg":-0,"big":18446744073709551616,
          "arch":["LlamaForCausalLM"],"x":null,"t":true,"u":"\u00e9\ud83d\ude00\u0001","nested":{"a":[[],[{}]]}})",
      "[0.1, 0.2, 0.30000000000000004, 1e21, 1e-7, 123456789012345678, -5, 2.5e-310, 2.0, 100.0]",
      "\"\\u2028\\u2029\"",
  };
  for (const char* d : docs) {
    const Value v = parse(d);
    for (int indent : {-1, 0, 2}) {
      const std::string s = dump(v, indent);
      const Value back = parse(s);
      EXPECT_TRUE(back == v) << s;
      EXPECT_EQ(dump(back, indent), s);
    }
  }
  // Doubles keep every bit, integers stay integers, -0 keeps its sign.
  const Value v = parse(dump(parse(docs[0])));
  EXPECT_EQ(v.at("eps").as_number(), 1.0000000000000002);
  EXPECT_EQ(v.at("tiny").as_number(), 5e-324);
  EXPECT_TRUE(v.at("vocab_size").is_integer());
  EXPECT_FALSE(v.at("rope_theta").is_integer());
  EXPECT_TRUE(std::signbit(v.at("neg").as_number()));
  EXPECT_FALSE(parse("[1]") == parse("[1.0]"));
  EXPECT_FALSE(parse(R"({"a":1,"b":2})") == parse(R"({"b":2,"a":1})"));
}

TEST(Json, BigObjectLookup) {
  // A vocabulary-sized object: every key found, absent keys not, and lookups stay fast.
  constexpr int kN = 150000;
  std::string text = "{";
  for (int i = 0; i < kN; ++i) {
    if (i) text += ',';
    text += "\"tok" + std::to_string(i) + "\":" + std::to_string(i);
  }
  text += "}";
  const Value v = parse(text, "vocab.json");
  ASSERT_EQ(v.size(), static_cast<size_t>(kN));
  for (int i = 0; i < kN; ++i) ASSERT_EQ(v.at("tok" + std::to_string(i)).as_int(), i);
  EXPECT_EQ(v.find("tok150000"), nullptr);
  EXPECT_EQ(v.find(""), nullptr);
  // A duplicate far past the index threshold is still caught.
  text.back() = ',';
  text += "\"tok77\":1}";
  EXPECT_NE(parse_error(text).find("duplicate key \"tok77\""), std::string::npos);
}

TEST(Json, BuildersAndCopies) {
  Value o = Value::object();
  for (int i = 0; i < 40; ++i) o.set("k" + std::to_string(i), Value::integer(i));
  o.set("k3", Value::string("replaced"));  // replaces in place, past the index threshold
  EXPECT_EQ(o.size(), 40u);
  EXPECT_EQ(o.at("k3").as_string(), "replaced");
  EXPECT_EQ(o.as_object()[3].first, "k3");
  EXPECT_EQ(o.at("k39").as_int(), 39);
  // Copies do not see later changes to the original.
  const Value copy = o;
  o.set("k0", Value::integer(-1));
  o.set("new", Value());
  EXPECT_EQ(copy.at("k0").as_int(), 0);
  EXPECT_EQ(copy.find("new"), nullptr);
  EXPECT_EQ(o.at("k0").as_int(), -1);
  Value a = Value::array({Value::integer(1)});
  const Value acopy = a;
  a.push_back(Value::integer(2));
  EXPECT_EQ(acopy.size(), 1u);
  EXPECT_EQ(a.size(), 2u);
  // object() with many keys indexes them; the first of duplicates wins, as the linear search does.
  Value::Object members;
  for (int i = 0; i < 20; ++i) members.emplace_back("x" + std::to_string(i % 19), Value::integer(i));
  const Value big = Value::object(std::move(members));
  EXPECT_EQ(big.at("x0").as_int(), 0);
  EXPECT_THROW(Value::integer(1).set("a", Value()), Error);
  EXPECT_THROW(Value::object().push_back(Value()), Error);
}

TEST(Json, ParseFile) {
  const std::string path = testing::TempDir() + "/json_test_config.json";
  {
    std::ofstream f(path, std::ios::binary);
    f << "{\"hidden_size\": 4096,\n \"bad\": }";
  }
  try {
    parse_file(path);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[json] " + path + ": line 2, column 9: unexpected '}', expected a value");
  }
  {
    std::ofstream f(path, std::ios::binary);
    f << "{\"hidden_size\": 4096}";
  }
  EXPECT_EQ(parse_file(path).at("hidden_size").as_int(), 4096);
  std::remove(path.c_str());
  const std::string missing = testing::TempDir() + "/no_such_dir/config.json";
  try {
    parse_file(missing);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_file(testing::TempDir()), Error);  // a directory cannot be read
}

}  // namespace
}  // namespace oomless::json
