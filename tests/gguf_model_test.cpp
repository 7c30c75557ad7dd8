// GGUF -> Hugging Face mapping on tests/golden/gguf/small.gguf and spm.gguf (tools/golden/gguf_small.py):
// metadata of every GGUF value type, the config transformers derives, HF tensor names/shapes/values with
// llama.cpp's Q/K permutation undone, and tokenizer.json compared structurally with transformers' own.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"
#include "io/gguf_model.h"
#include "io/json.h"

namespace oomless {
namespace {

std::string golden(const std::string& rel) {
  std::string here = __FILE__;
  return here.substr(0, here.find_last_of('/')) + "/golden/gguf/" + rel;
}

// First structural difference between two JSON values ("" when equal). Object key order is ignored;
// numbers compare as doubles.
std::string json_diff(const json::Value& a, const json::Value& b, const std::string& path) {
  if (a.is_number() && b.is_number())
    return a.as_number() == b.as_number() ? "" : path + ": " + json::dump(a) + " vs " + json::dump(b);
  if (a.kind() != b.kind()) return path + ": " + json::dump(a).substr(0, 80) + " vs " + json::dump(b).substr(0, 80);
  if (a.is_object()) {
    if (a.size() != b.size()) return path + ": " + std::to_string(a.size()) + " keys vs " + std::to_string(b.size());
    for (const auto& [k, v] : a.as_object()) {
      const json::Value* w = b.find(k);
      if (!w) return path + "." + k + ": missing on the right";
      std::string d = json_diff(v, *w, path + "." + k);
      if (!d.empty()) return d;
    }
    return "";
  }
  if (a.is_array()) {
    if (a.size() != b.size()) return path + ": " + std::to_string(a.size()) + " items vs " + std::to_string(b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      std::string d = json_diff(a[i], b[i], path + "[" + std::to_string(i) + "]");
      if (!d.empty()) return d;
    }
    return "";
  }
  return json::dump(a) == json::dump(b) ? "" : path + ": " + json::dump(a) + " vs " + json::dump(b);
}

TEST(GgufModel, ReadsEveryMetadataType) {
  GgufFile f = GgufFile::open(golden("small.gguf"));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_int("test.u8"), 250);
  EXPECT_EQ(f.get_int("test.i8"), -100);
  EXPECT_EQ(f.get_int("test.u16"), 65000);
  EXPECT_EQ(f.get_int("test.i16"), -32000);
  EXPECT_EQ(f.get_int("test.u32"), 4000000000);
  EXPECT_EQ(f.get_int("test.i32"), -2000000000);
  EXPECT_EQ(f.find("test.u64")->u, 18000000000000000000ull);
  EXPECT_THROW(f.get_int("test.u64"), Error);  // does not fit int64
  EXPECT_EQ(f.get_int("test.i64"), -9000000000000000000ll);
  EXPECT_EQ(f.get_float("test.f32"), 0.15625);
  EXPECT_EQ(f.get_float("test.f64"), -2.5e-300);
  EXPECT_TRUE(f.get_bool("test.bool"));
  EXPECT_EQ(f.get_string("test.string"), "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac");
  EXPECT_EQ(f.get_int_array("test.arr_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f.get_float_array("test.arr_f32"), (std::vector<double>{0.5, -1.25}));
  EXPECT_EQ(f.get_string_array("test.arr_str"), (std::vector<std::string>{"a", "", "\xe6\x97\xa5\xe6\x9c\xac"}));
  EXPECT_EQ(f.get_int_array("test.arr_bool"), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(static_cast<uint64_t>(f.get_int_array("test.arr_u64")[1]), 18000000000000000000ull);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 265u);
  ASSERT_EQ(f.tensors().size(), 11u);
  const GgufTensor* q = f.tensor("blk.0.attn_q.weight");
  ASSERT_TRUE(q);
  EXPECT_EQ(q->type, GgmlType::F16);
  EXPECT_EQ(q->ne, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(f.tensor("blk.0.ffn_down.weight")->ne, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f.tensor("blk.0.ffn_down.weight")->type, GgmlType::Q5_1);
}

TEST(GgufModel, NestedArraysAreRead) {
  GgufFile f = GgufFile::open(golden("../../../fuzz/corpus/gguf/seed1.gguf"));
  const GgufValue* v = f.find("test.arr_nested");
  ASSERT_TRUE(v && v->is_array());
  ASSERT_EQ(v->elem, GgufValueType::array);
  ASSERT_EQ(v->arrays.size(), 2u);
  EXPECT_EQ(v->arrays[0].ints, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(v->arrays[1].ints, (std::vector<int64_t>{3}));
}

TEST(GgufModel, ConfigMatchesTransformers) {
  GgufFile f = GgufFile::open(golden("small.gguf"));
  json::Value got = gguf_config_json(f);
  json::Value want = json::parse_file(golden("small.expected.json")).at("config");
  for (const auto& [k, v] : want.as_object()) {
    const json::Value* g = got.find(k);
    ASSERT_TRUE(g) << "missing " << k;
    EXPECT_EQ(json_diff(*g, v, k), "");
  }
  EXPECT_EQ(got.at("architectures")[0].as_string(), "LlamaForCausalLM");
  EXPECT_EQ(got.size(), want.size() + 1) << json::dump(got);
}

// The HF weights small.gguf was made from (see tools/golden/gguf_small.py), exact in F16 / Q8_0.
float hf_q(int r, int c) { return static_cast<float>((r * 32 + c) % 509 - 254) / 128.0f; }
float hf_k(int r, int c) {
  const int q = c == 0 ? 127 : (r * 7 + c * 13) % 255 - 127;
  return static_cast<float>(q) * std::ldexp(1.0f, -(6 + r % 4));
}

TEST(GgufModel, TensorsMatchTransformersAndUnpermute) {
  GgufFile f = GgufFile::open(golden("small.gguf"));
  json::Value want = json::parse_file(golden("small.expected.json")).at("tensors");
  std::vector<GgufHfTensor> ts = gguf_hf_tensors(f);
  ASSERT_EQ(ts.size(), 11u);
  const std::pair<const char*, const char*> names[] = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"},
      {"blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"},
      {"blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"},
      {"blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"},
      {"blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"},
      {"blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"},
      {"blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"},
      {"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
      {"blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"},
      {"output_norm.weight", "model.norm.weight"},
  };
  for (const auto& [g, h] : names) {
    const GgufHfTensor* t = nullptr;
    for (const auto& x : ts)
      if (x.src->name == g) t = &x;
    ASSERT_TRUE(t) << g;
    EXPECT_EQ(t->hf_name, h);
    const json::Value& w = want.at(g);
    std::vector<int64_t> shape;
    for (size_t i = 0; i < w.at("shape").size(); ++i) shape.push_back(w.at("shape")[i].as_int());
    EXPECT_EQ(t->shape, shape) << g;
    int64_t n = 1;
    for (int64_t d : t->shape) n *= d;
    std::vector<float> v(n);
    gguf_read_f32(*t, v.data());
    double sum = 0, wsum = 0;
    for (int64_t i = 0; i < n; ++i) {
      sum += v[i];
      wsum += static_cast<double>(v[i]) * static_cast<double>(i % 97 + 1);
    }
    const double s = w.at("sum").as_number(), ws = w.at("wsum").as_number();
    EXPECT_NEAR(sum, s, 1e-9 * (1 + std::fabs(s))) << g;
    EXPECT_NEAR(wsum, ws, 1e-9 * (1 + std::fabs(ws))) << g;
    EXPECT_EQ(v[0], static_cast<float>(w.at("first").as_number())) << g;
    EXPECT_EQ(v[n - 1], static_cast<float>(w.at("last").as_number())) << g;
  }
  for (const auto& t : ts) {
    if (t.hf_name.find("q_proj") != std::string::npos) {
      EXPECT_EQ(t.unpermute_heads, 4);
      std::vector<float> v(32 * 32);
      gguf_read_f32(t, v.data());
      for (int r = 0; r < 32; ++r)
        for (int c = 0; c < 32; ++c) ASSERT_EQ(v[r * 32 + c], hf_q(r, c)) << "q row " << r << " col " << c;
    }
    if (t.hf_name.find("k_proj") != std::string::npos) {
      EXPECT_EQ(t.unpermute_heads, 2);
      std::vector<float> v(16 * 32);
      gguf_read_f32(t, v.data());
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 32; ++c) ASSERT_EQ(v[r * 32 + c], hf_k(r, c)) << "k row " << r << " col " << c;
    }
  }
}

TEST(GgufModel, TokenizerJsonMatchesTransformers) {
  for (const char* stem : {"small", "spm"}) {
    GgufFile f = GgufFile::open(golden(std::string(stem) + ".gguf"));
    json::Value got = gguf_tokenizer_json(f);
    json::Value want = json::parse_file(golden(std::string(stem) + ".tokenizer.json"));
    EXPECT_EQ(json_diff(got, want, stem), "");
  }
}

TEST(GgufModel, TokenizerConfig) {
  GgufTokenizerConfig c = gguf_tokenizer_config(GgufFile::open(golden("small.gguf")));
  EXPECT_EQ(c.bos, 1);
  EXPECT_EQ(c.eos, 2);
  EXPECT_EQ(c.pad, 2);
  EXPECT_FALSE(c.unk.has_value());
  EXPECT_FALSE(c.add_bos);
  EXPECT_FALSE(c.add_eos);
  EXPECT_NE(c.chat_template.find("messages"), std::string::npos);
  GgufTokenizerConfig s = gguf_tokenizer_config(GgufFile::open(golden("spm.gguf")));
  EXPECT_TRUE(s.add_bos);
  EXPECT_EQ(s.unk, 0);
}

// An empty Q projection whose shape names 2^60 rows reads at once (found by fuzz/gguf_fuzz.cpp: the
// un-permutation walked every row, copying nothing).
TEST(GgufModel, EmptyPermutedTensorReadsAtOnce) {
  GgufTensor src;
  src.ne = {0, int64_t{1} << 60};
  GgufHfTensor t;
  t.hf_name = "model.layers.0.self_attn.q_proj.weight";
  t.shape = {int64_t{1} << 60, 0};
  t.src = &src;
  t.unpermute_heads = 4;
  gguf_read_f32(t, nullptr);
}

TEST(GgufModel, UnknownArchitectureIsNamed) {
  GgufFile f = GgufFile::open(golden("blocks.gguf"));  // architecture "oomless-golden"
  try {
    gguf_config_json(f);
    ADD_FAILURE();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"oomless-golden\" is not supported"), std::string::npos) << m;
    EXPECT_NE(m.find("llama, mistral, qwen2, qwen3"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace oomless
