// The GGUF writer (oomless convert --out FILE.gguf): Q8_0 bit-identical to gguf-py's quantize
// (tests/golden/gguf/q8_0.json, tools/golden/make_gguf_q8.py), and a model written as GGUF reads back
// through oomless's GGUF reader as the same model: config, tokenizer ids, chat template, and the weights
// (bitwise in F32; the F16/BF16 rounding of each weight otherwise).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

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

// Q4_K as written reads back through ggml's dequantiser (ours is bit-identical to gguf-py's) within half
// of each sub-block's step (d x its 6-bit scale, read from the block), which is at most its range / 15 plus
// what the block's shared d and dmin cost; zeros come back exactly.
TEST(GgufExport, Q4_KReadsBackWithinHalfAStepOfEachSubBlock) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> x(256 * 12);
  for (float& v : x) v = nd(rng);
  std::fill(x.begin() + 256 * 8, x.begin() + 256 * 9, 0.0f);                 // zeros
  for (int i = 0; i < 256; ++i) x[256 * 9 + i] = i % 2 ? 0.5f : 0.0f;         // two levels
  for (int i = 0; i < 256; ++i) x[256 * 10 + i] = -std::abs(nd(rng)) * 10;    // negative only
  for (int i = 0; i < 256; ++i) x[256 * 11 + i] = nd(rng) * (i < 32 ? 100 : 1);  // one sub-block much wider
  std::vector<uint8_t> q(x.size() / 256 * 144);
  quantize_q4_k(x.data(), static_cast<int64_t>(x.size()), q.data());
  std::vector<float> y(x.size());
  dequantize(GgmlType::Q4_K, q.data(), static_cast<int64_t>(x.size()), y.data());
  double sq = 0, cnt = 0;
  for (size_t j = 0; j < x.size() / 32; ++j) {
    const uint8_t* blk = q.data() + (j / 8) * 144;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const int s = static_cast<int>(j % 8);
    const uint8_t* sc = blk + 4;
    const int ls = s < 4 ? sc[s] & 63 : (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
    const double step = static_cast<double>(f16_to_f32(dh)) * ls;
    float lo = 0, hi = 0;
    for (int l = 0; l < 32; ++l) lo = std::min(lo, x[j * 32 + l]), hi = std::max(hi, x[j * 32 + l]);
    for (int l = 0; l < 32; ++l) {
      const double e = std::abs(static_cast<double>(y[j * 32 + l]) - x[j * 32 + l]);
      ASSERT_LE(e, step / 2 * (1 + 1e-5) + 1e-9) << "sub-block " << j << " element " << l;
      if (j < 64) sq += (e / ((hi - lo) / 15.0)) * (e / ((hi - lo) / 15.0)), cnt += 1;
    }
  }
  EXPECT_LT(std::sqrt(sq / cnt), 0.5);  // normal blocks: RMS error under half the range / 15
  for (int i = 256 * 8; i < 256 * 9; ++i) ASSERT_EQ(y[static_cast<size_t>(i)], 0.0f);
}

struct Loaded {
  ModelSource src;
  std::unique_ptr<CpuMemory> mem = std::make_unique<CpuMemory>(size_t{1} << 32);
  std::unique_ptr<ParamSet> params;
  explicit Loaded(const std::string& spec) : src(open_model(spec)) {
    params = std::make_unique<ParamSet>(src.cfg, DType::f32, mem->device, Category::weights);
    src.load_weights(*make_ops("cpu"), *params);
  }
};

TEST(GgufExport, AModelReadsBackAsItself) {
  const fs::path dir = fs::path(testing::TempDir()) / "oomless_gguf_export";
  fs::remove_all(dir);
  fs::create_directories(dir);
  Loaded m("preset:micro");
  const std::string text = "In the beginning God created the heaven and the earth. <|im_start|>user\nHi<|im_end|>";
  for (const char* type : {"f32", "f16", "bf16", "q8_0", "q4_k"}) {
    SCOPED_TRACE(type);
    const std::string path = (dir / (std::string("micro-") + type + ".gguf")).string();
    save_gguf(*make_ops("cpu", &m.mem->device), path, m.src, *m.params, parse_gguf_type(type));
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
      const std::vector<float> wv = test::tensor_values<float>(want), rv = test::tensor_values<float>(got);
      const float* w = wv.data();
      const float* r = rv.data();
      const bool matrix = m.params->specs()[i].shape.size() == 2;
      double worst = 0;
      for (int64_t k = 0; k < want.numel(); ++k) {
        float expect = w[k];
        if (matrix && std::string(type) == "f16") expect = f16_to_f32(f32_to_f16(w[k]));
        if (matrix && std::string(type) == "bf16") expect = round_to_bf16(w[k]);
        if (matrix && (std::string(type) == "q8_0" || std::string(type) == "q4_k")) {  // micro's 64 columns: Q8_0
          worst = std::max(worst, static_cast<double>(std::fabs(r[k] - w[k])));
          continue;
        }
        ASSERT_EQ(r[k], expect) << m.params->specs()[i].name << " element " << k;
      }
      // Q8_0: within half a step of its block (max |x| / 127 / 2) of this preset's weights (|x| < 0.2).
      if (matrix && std::string(type) != "f32" && std::string(type) != "f16" && std::string(type) != "bf16") {
        EXPECT_LT(worst, 0.2 / 127 / 2 + 1e-6) << m.params->specs()[i].name;
      }
    }
  }
}

TEST(GgufExport, UnsupportedTypesAreNamed) {
  try {
    parse_gguf_type("q5_k");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use f32, f16, bf16, q8_0 or q4_k"), std::string::npos);
  }
}

}  // namespace
}  // namespace oomless
