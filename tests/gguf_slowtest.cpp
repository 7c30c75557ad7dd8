// The real SmolLM2-135M-Instruct Q4_1 GGUF, when OOMLESS_SMOLLM2_GGUF names it: config, every tensor
// dequantised, values checked against gguf-py + transformers (tests/golden/gguf/smollm2_ref.json, made by
// tools/golden/gguf_smollm2.py), and the tokenizer against tests/golden/tokenizers/smollm2/tokenizer.json.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "io/gguf_model.h"
#include "io/json.h"

namespace oomless {
namespace {

std::string golden(const std::string& rel) {
  std::string here = __FILE__;
  return here.substr(0, here.find_last_of('/')) + "/golden/" + rel;
}

const char* model_path() { return std::getenv("OOMLESS_SMOLLM2_GGUF"); }

#define NEED_MODEL()                                                                                   \
  if (!model_path()) GTEST_SKIP() << "set OOMLESS_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf to run"

TEST(GgufSmolLM2, Config) {
  NEED_MODEL();
  GgufFile f = GgufFile::open(model_path());
  json::Value c = gguf_config_json(f);
  EXPECT_EQ(c.at("num_hidden_layers").as_int(), 30);
  EXPECT_EQ(c.at("hidden_size").as_int(), 576);
  EXPECT_EQ(c.at("intermediate_size").as_int(), 1536);
  EXPECT_EQ(c.at("num_attention_heads").as_int(), 9);
  EXPECT_EQ(c.at("num_key_value_heads").as_int(), 3);
  EXPECT_EQ(c.at("vocab_size").as_int(), 49152);
  EXPECT_TRUE(c.at("tie_word_embeddings").as_bool());
  json::Value want = json::parse_file(golden("gguf/smollm2_ref.json")).at("config");
  for (const auto& [k, v] : want.as_object()) {
    const json::Value* g = c.find(k);
    ASSERT_TRUE(g) << k;
    EXPECT_EQ(json::dump(*g), json::dump(v)) << k;
  }
}

TEST(GgufSmolLM2, EveryTensorDequantisesAndMatchesGgufPy) {
  NEED_MODEL();
  GgufFile f = GgufFile::open(model_path());
  std::vector<GgufHfTensor> ts = gguf_hf_tensors(f);
  EXPECT_EQ(ts.size(), 1u + 30u * 9u + 1u);  // embeddings, 9 per layer, final norm (tied head)
  json::Value want = json::parse_file(golden("gguf/smollm2_ref.json")).at("tensors");
  std::vector<float> buf;
  size_t checked = 0;
  for (const GgufHfTensor& t : ts) {
    buf.resize(static_cast<size_t>(t.src->numel()));
    gguf_read_f32(t, buf.data());
    for (float v : buf) ASSERT_TRUE(std::isfinite(v)) << t.hf_name;
    const json::Value* w = want.find(t.src->name);
    if (!w) continue;
    ++checked;
    EXPECT_EQ(ggml_type_name(t.src->type), w->at("type").as_string());
    for (size_t i = 0; i < w->at("index").size(); ++i) {
      const int64_t idx = w->at("index")[i].as_int();
      EXPECT_EQ(buf[idx], static_cast<float>(w->at("value")[i].as_number())) << t.hf_name << "[" << idx << "]";
    }
    double sum = 0;
    for (float v : buf) sum += v;
    const double s = w->at("sum").as_number();
    EXPECT_NEAR(sum, s, 1e-9 * (1 + std::fabs(s))) << t.hf_name;
  }
  EXPECT_EQ(checked, want.size());
}

TEST(GgufSmolLM2, TokenizerMatchesTransformers) {
  NEED_MODEL();
  GgufFile f = GgufFile::open(model_path());
  const std::string got = json::dump(gguf_tokenizer_json(f));
  const json::Value want = json::parse_file(golden("tokenizers/smollm2/tokenizer.json"));
  // Same serialisation up to key order: compare the canonical dumps of both after a round trip
  // through a key-sorted copy.
  std::function<json::Value(const json::Value&)> canon = [&](const json::Value& v) -> json::Value {
    if (v.is_object()) {
      std::vector<std::pair<std::string, json::Value>> kv;
      for (const auto& [k, x] : v.as_object()) kv.emplace_back(k, canon(x));
      std::sort(kv.begin(), kv.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      return json::Value::object(std::move(kv));
    }
    if (v.is_array()) {
      json::Value a = json::Value::array();
      for (size_t i = 0; i < v.size(); ++i) a.push_back(canon(v[i]));
      return a;
    }
    return v;
  };
  EXPECT_TRUE(json::dump(canon(json::parse(got))) == json::dump(canon(want)));
}

}  // namespace
}  // namespace oomless
