// NF4 on real weights, when OOMLESS_SMOLLM2_GGUF names SmolLM2-135M-Instruct.Q4_1.gguf: a few tensors
// dequantised from the GGUF (bit-identical to gguf-py), quantised at blocksize 64 plain and with double
// quantisation (torch.mean's order for 1 and 2 threads: the token embedding has 442368 scales, past
// torch's parallel threshold), and dequantised again; every result's SHA-256 equals bitsandbytes'
// (tests/golden/nf4/smollm2.json, made by tools/golden/make_nf4.py --gguf).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/gguf.h"
#include "io/json.h"
#include "quant/nf4.h"
#include "train/checkpoint.h"
#include "util/harness.h"

namespace oomless {
namespace {

const char* model_path() { return std::getenv("OOMLESS_SMOLLM2_GGUF"); }

template <class T> std::string sha(const std::vector<T>& v) { return sha256_hex(v.data(), v.size() * sizeof(T)); }

TEST(Nf4SmolLM2, RealTensorsQuantiseAsBitsandbytes) {
  if (!model_path()) GTEST_SKIP() << "set OOMLESS_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf to run";
  const GgufFile f = GgufFile::open(model_path());
  const json::Value want = json::parse_file(test::source_path("tests/golden/nf4/smollm2.json"));
  const int64_t bs = want.at("blocksize").as_int();
  ASSERT_GE(want.at("tensors").size(), 4u);
  for (const auto& [name, w] : want.at("tensors").as_object()) {
    SCOPED_TRACE(name);
    const GgufTensor* t = f.tensor(name);
    ASSERT_TRUE(t);
    const int64_t n = t->numel(), nb = nf4::num_blocks(n, bs);
    ASSERT_EQ(n, w.at("n").as_int());
    EXPECT_EQ(ggml_type_name(t->type), w.at("type").as_string());
    std::vector<float> x(static_cast<size_t>(n));
    dequantize(t->type, t->data, n, x.data());
    ASSERT_EQ(sha(x), w.at("f32_sha256").as_string()) << "the float32 weights differ from gguf-py's";

    std::vector<uint8_t> packed(static_cast<size_t>(nf4::packed_bytes(n)));
    std::vector<float> absmax(static_cast<size_t>(nb)), out(static_cast<size_t>(n));
    nf4::quantize(x.data(), n, bs, packed.data(), absmax.data());
    const json::Value& plain = w.at("plain");
    EXPECT_EQ(sha(packed), plain.at("packed_sha256").as_string());
    EXPECT_EQ(sha(absmax), plain.at("absmax_sha256").as_string());
    nf4::dequantize(packed.data(), absmax.data(), n, bs, out.data());
    EXPECT_EQ(sha(out), plain.at("dequant_sha256").as_string());

    for (int threads : {1, 2}) {
      SCOPED_TRACE("torch threads " + std::to_string(threads));
      const json::Value& dq = w.at("dq_t" + std::to_string(threads));
      std::vector<uint8_t> codes(static_cast<size_t>(nb));
      std::vector<float> nested(static_cast<size_t>(nf4::num_blocks(nb, 256))), scales(static_cast<size_t>(nb));
      const float offset = nf4::double_quantize(absmax.data(), nb, 256, codes.data(), nested.data(), threads);
      EXPECT_EQ(sha(packed), dq.at("packed_sha256").as_string());
      EXPECT_EQ(sha(codes), dq.at("absmax_codes_sha256").as_string());
      EXPECT_EQ(sha(nested), dq.at("nested_absmax_sha256").as_string());
      EXPECT_EQ(f32_bits(offset), f32_bits(static_cast<float>(dq.at("offset").as_number()))) << offset;
      nf4::dequantize_absmax(codes.data(), nested.data(), 256, offset, 0, nb, scales.data());
      nf4::dequantize(packed.data(), scales.data(), n, bs, out.data());
      EXPECT_EQ(sha(out), dq.at("dequant_sha256").as_string());
    }
  }
}

}  // namespace
}  // namespace oomless
