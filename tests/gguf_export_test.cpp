// The GGUF writer (oomless convert --out FILE.gguf): Q8_0 bit-identical to gguf-py's quantize
// (tests/golden/gguf/q8_0.json, tools/golden/make_gguf_q8.py), and a model written as GGUF reads back
// through oomless's GGUF reader as the same model: config, tokenizer ids, chat template, and the weights
// (bitwise in F32; the F16/BF16 rounding of each weight otherwise).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/dtype.h"
#include "io/gguf.h"
#include "io/json.h"
#include "memory/arena.h"
#include "model/gguf_export.h"
#include "model/load.h"
#include "model/params.h"
#include "util/harness.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

TEST(GgufExport, Q8_0IsGgufPysQuantize) {
  const json::Value g = json::parse_file(test::source_path("tests/golden/gguf/q8_0.json"));
  std::vector<float> x;
  for (const json::Value& b : g.at("input_f32_bits").as_array()) {
    const uint32_t u = static_cast<uint32_t>(b.as_int());
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  std::vector<uint8_t> q(x.size() / 32 * 34);
  quantize_q8_0(x.data(), static_cast<int64_t>(x.size()), q.data());
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (uint8_t b : q) hex += kHex[b >> 4], hex += kHex[b & 15];
  EXPECT_EQ(hex, g.at("q8_0_hex").as_string());
}

struct Loaded {
  ModelSource src;
  std::unique_ptr<CpuMemory> mem = std::make_unique<CpuMemory>(size_t{1} << 32);
  std::unique_ptr<ParamSet> params;
  explicit Loaded(const std::string& spec) : src(open_model(spec)) {
    params = std::make_unique<ParamSet>(src.cfg, DType::f32, mem->device, Category::weights);
    src.load_weights(*params);
  }
};

TEST(GgufExport, AModelReadsBackAsItself) {
  const fs::path dir = fs::path(testing::TempDir()) / "oomless_gguf_export";
  fs::remove_all(dir);
  fs::create_directories(dir);
  Loaded m("preset:micro");
  const std::string text = "In the beginning God created the heaven and the earth. <|im_start|>user\nHi<|im_end|>";
  for (const char* type : {"f32", "f16", "bf16", "q8_0"}) {
    SCOPED_TRACE(type);
    const std::string path = (dir / (std::string("micro-") + type + ".gguf")).string();
    save_gguf(path, m.src, *m.params, parse_gguf_type(type));
    Loaded g(path);
    EXPECT_EQ(g.src.kind, "gguf");
    const ModelConfig &a = m.src.cfg, &b = g.src.cfg;
    EXPECT_EQ(b.arch, a.arch);
    EXPECT_EQ(std::tie(b.L, b.E, b.F, b.H, b.Hkv, b.D, b.V, b.tied, b.max_position),
              std::tie(a.L, a.E, a.F, a.H, a.Hkv, a.D, a.V, a.tied, a.max_position));
    EXPECT_EQ(b.rope.theta, a.rope.theta);
    EXPECT_EQ(static_cast<float>(b.rms_eps), static_cast<float>(a.rms_eps));
    EXPECT_EQ(b.bos_id, a.bos_id);
    EXPECT_EQ(b.eos_id, a.eos_id);
    EXPECT_EQ(g.src.require_tokenizer().encode(text, true), m.src.require_tokenizer().encode(text, true));
    EXPECT_EQ(g.src.tokenizer_config.at("chat_template").as_string(), m.src.tokenizer_config.at("chat_template").as_string());
    ASSERT_EQ(g.params->specs().size(), m.params->specs().size());
    for (size_t i = 0; i < m.params->specs().size(); ++i) {
      const Tensor& want = m.params->tensors()[i];
      const Tensor& got = g.params->tensors()[i];
      ASSERT_EQ(got.numel(), want.numel()) << m.params->specs()[i].name;
      const float* w = static_cast<const float*>(want.data);
      const float* r = static_cast<const float*>(got.data);
      const bool matrix = m.params->specs()[i].shape.size() == 2;
      double worst = 0;
      for (int64_t k = 0; k < want.numel(); ++k) {
        float expect = w[k];
        if (matrix && std::string(type) == "f16") expect = f16_to_f32(f32_to_f16(w[k]));
        if (matrix && std::string(type) == "bf16") expect = round_to_bf16(w[k]);
        if (matrix && std::string(type) == "q8_0") {
          worst = std::max(worst, static_cast<double>(std::fabs(r[k] - w[k])));
          continue;
        }
        ASSERT_EQ(r[k], expect) << m.params->specs()[i].name << " element " << k;
      }
      // Q8_0: within half a step of its block (max |x| / 127 / 2) of this preset's weights (|x| < 0.2).
      if (matrix && std::string(type) == "q8_0") EXPECT_LT(worst, 0.2 / 127 / 2 + 1e-6) << m.params->specs()[i].name;
    }
  }
}

TEST(GgufExport, UnsupportedTypesAreNamed) {
  try {
    parse_gguf_type("q4_k");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use f32, f16, bf16 or q8_0"), std::string::npos);
  }
}

}  // namespace
}  // namespace oomless
