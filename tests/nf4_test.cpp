// NF4 storage against bitsandbytes, bit for bit (memcmp or SHA-256 of the bytes): the tables, 4-bit
// quantisation of float32 and bf16 tensors (odd sizes, a 2-D shape, blocksizes 64/128/256, ties, zero,
// constant and non-finite blocks), double quantisation with torch.mean's summation order, dequantisation
// of whole tensors, of any sub-range and of matrix rows; goldens from tools/golden/make_nf4.py in
// tests/golden/nf4.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "quant/nf4.h"
#include "quant/torch_sum.h"
#include "train/checkpoint.h"
#include "util/harness.h"

namespace oomless {
namespace {

using nf4::Matrix;

struct Golden {
  SafetensorsFile f = SafetensorsFile::open(test::source_path("tests/golden/nf4/nf4.safetensors"));
  json::Value info = json::parse(f.metadata().at("golden"), "nf4.safetensors metadata");

  const StTensor& t(const std::string& name) const {
    const StTensor* p = f.find(name);
    OOM_CHECK(p, "golden tensor ", name, " missing");
    return *p;
  }
  template <class T> std::vector<T> get(const std::string& name) const {
    const StTensor& x = t(name);
    std::vector<T> v(x.nbytes / sizeof(T));
    std::memcpy(v.data(), x.data, x.nbytes);
    return v;
  }
  bool has(const std::string& name) const { return f.find(name) != nullptr; }
};

template <class T> bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
template <class T> std::string sha(const std::vector<T>& v) { return sha256_hex(v.data(), v.size() * sizeof(T)); }

// The first index where two float vectors differ bitwise, for messages.
std::string first_diff(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (f32_bits(a[i]) != f32_bits(b[i])) return "index " + std::to_string(i) + ": " + std::to_string(a[i]) +
                                                  " vs " + std::to_string(b[i]);
  return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
}

TEST(Nf4, TablesAreBitsandbytes) {
  Golden g;
  EXPECT_TRUE(same_bytes(g.get<float>("nf4_code"), std::vector<float>(nf4::kCode, nf4::kCode + 16)));
  EXPECT_TRUE(same_bytes(g.get<float>("dynamic_map"), std::vector<float>(nf4::kDynamicMap, nf4::kDynamicMap + 256)));
}

// What one golden case gives when oomless quantises its input.
struct Ours {
  std::vector<uint8_t> packed;
  std::vector<float> absmax;  // plain scales
  std::vector<uint8_t> codes;
  std::vector<float> nested;
  float offset = 0;
  std::vector<float> scales;  // what dequantisation uses: absmax, or the double-quantised absmax
  std::vector<float> dequant;
};

Ours run_case(const Golden& g, const json::Value& c) {
  const int64_t n = c.at("n").as_int(), bs = c.at("blocksize").as_int(), nb = nf4::num_blocks(n, bs);
  const std::string input = c.at("input").as_string();
  Ours o;
  o.packed.assign(static_cast<size_t>(nf4::packed_bytes(n)), 0xAA);
  o.absmax.assign(static_cast<size_t>(nb), -1.0f);
  if (c.at("dtype").as_string() == "bfloat16") {
    const std::vector<uint16_t> w = g.get<uint16_t>(input);
    nf4::quantize(w.data(), n, bs, o.packed.data(), o.absmax.data());
  } else {
    const std::vector<float> w = g.get<float>(input);
    nf4::quantize(w.data(), n, bs, o.packed.data(), o.absmax.data());
  }
  o.scales = o.absmax;
  if (c.at("double_quant").as_bool()) {
    o.codes.assign(static_cast<size_t>(nb), 0);
    o.nested.assign(static_cast<size_t>(nf4::num_blocks(nb, 256)), 0);
    o.offset = nf4::double_quantize(o.absmax.data(), nb, 256, o.codes.data(), o.nested.data());
    nf4::dequantize_absmax(o.codes.data(), o.nested.data(), 256, o.offset, 0, nb, o.scales.data());
  }
  o.dequant.assign(static_cast<size_t>(n), 0);
  nf4::dequantize(o.packed.data(), o.scales.data(), n, bs, o.dequant.data());
  return o;
}

TEST(Nf4, QuantiseAndDequantiseMatchBitsandbytes) {
  Golden g;
  const json::Value& cases = g.info.at("cases");
  ASSERT_GE(cases.size(), 50u);
  for (const auto& [name, c] : cases.as_object()) {
    SCOPED_TRACE(name);
    const Ours o = run_case(g, c);
    EXPECT_TRUE(same_bytes(o.packed, g.get<uint8_t>(name + ".packed"))) << "packed codes";
    if (c.at("double_quant").as_bool()) {
      EXPECT_TRUE(same_bytes(o.codes, g.get<uint8_t>(name + ".absmax_codes"))) << "absmax codes";
      EXPECT_TRUE(same_bytes(o.nested, g.get<float>(name + ".nested_absmax"))) << first_diff(o.nested, g.get<float>(name + ".nested_absmax"));
      EXPECT_EQ(f32_bits(o.offset), f32_bits(g.get<float>(name + ".offset")[0])) << o.offset;
      EXPECT_TRUE(same_bytes(o.scales, g.get<float>(name + ".absmax_deq"))) << first_diff(o.scales, g.get<float>(name + ".absmax_deq"));
    } else {
      EXPECT_TRUE(same_bytes(o.absmax, g.get<float>(name + ".absmax"))) << first_diff(o.absmax, g.get<float>(name + ".absmax"));
    }
    if (g.has(name + ".dequant")) {
      EXPECT_TRUE(same_bytes(o.dequant, g.get<float>(name + ".dequant"))) << first_diff(o.dequant, g.get<float>(name + ".dequant"));
    }
    EXPECT_EQ(sha(o.dequant), c.at("dequant_sha256").as_string()) << "dequantised float32";
    if (const json::Value* h = c.find("dequant_bf16_sha256")) {
      // bitsandbytes' own bf16 output is the float32 result rounded to nearest even.
      std::vector<uint16_t> b(o.dequant.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(o.dequant[i]);
      EXPECT_EQ(sha(b), h->as_string()) << "dequantised bf16";
    }
  }
}

TEST(Nf4, DequantiseRangeAnyStart) {
  Golden g;
  for (const char* name : {"f32_1000_bs64_dq", "f32_65_bs128", "bf16_37x130_bs64"}) {
    SCOPED_TRACE(name);
    const Ours o = run_case(g, g.info.at("cases").at(name));
    const int64_t n = static_cast<int64_t>(o.dequant.size());
    const int64_t bs = g.info.at("cases").at(name).at("blocksize").as_int();
    for (int64_t start : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{31}, int64_t{63}, int64_t{64}, n / 2 + 1, n - 1}) {
      for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{64}, int64_t{129}, n}) {
        if (start >= n) continue;
        count = std::min(count, n - start);
        std::vector<float> out(static_cast<size_t>(count + 2), 12345.0f);  // a guard element each side
        nf4::dequantize_range(o.packed.data(), o.scales.data(), bs, start, count, out.data() + 1);
        EXPECT_EQ(out.front(), 12345.0f);
        EXPECT_EQ(out.back(), 12345.0f);
        EXPECT_EQ(std::memcmp(out.data() + 1, o.dequant.data() + start, sizeof(float) * count), 0)
            << "start " << start << " count " << count;
      }
    }
  }
}

TEST(Nf4, MatrixRowsCopiesAndStorage) {
  Golden g;
  const std::vector<float> w = g.get<float>("input.f32_37x130");
  for (bool dq : {false, true}) {
    for (int64_t bs : {64, 128}) {
      SCOPED_TRACE(std::string(dq ? "double quant" : "plain") + " bs " + std::to_string(bs));
      const std::string name = "f32_37x130_bs" + std::to_string(bs) + (dq ? "_dq" : "");
      const Ours o = run_case(g, g.info.at("cases").at(name));
      std::vector<float> mem(nf4::storage_bytes(37, 130, bs, dq) / 4 + 1);
      const Matrix m = nf4::quantize_matrix(w.data(), 37, 130, bs, dq, mem.data(), mem.size() * 4);
      EXPECT_EQ(m.double_quant(), dq);
      EXPECT_EQ(std::memcmp(m.packed, o.packed.data(), o.packed.size()), 0);
      // Every row range, against the whole dequantised tensor (itself checked against bitsandbytes).
      for (int64_t r0 : {0, 1, 7, 36}) {
        for (int64_t nr : {1, 2, 5, 37}) {
          if (r0 + nr > 37) continue;
          std::vector<float> out(static_cast<size_t>(nr * 130));
          nf4::dequantize_rows(m, r0, nr, out.data());
          EXPECT_EQ(std::memcmp(out.data(), o.dequant.data() + r0 * 130, out.size() * 4), 0) << r0 << "+" << nr;
        }
      }
      // A copy into other memory dequantises the same.
      std::vector<float> mem2(nf4::storage_bytes(m) / 4 + 1);
      const Matrix c = nf4::copy_to(m, mem2.data(), mem2.size() * 4);
      std::vector<float> a(37 * 130), b(37 * 130);
      nf4::dequantize_rows(m, 0, 37, a.data());
      nf4::dequantize_rows(c, 0, 37, b.data());
      EXPECT_TRUE(same_bytes(a, b));
      EXPECT_THROW(nf4::copy_to(m, mem2.data(), nf4::storage_bytes(m) - 1), Error);
      EXPECT_THROW(nf4::dequantize_rows(m, 30, 8, b.data()), Error);
    }
  }
}

TEST(Nf4, TorchMeanOrder) {
  Golden g;
  const std::vector<int32_t> ns = g.get<int32_t>("torch_mean.n"), ts = g.get<int32_t>("torch_mean.threads");
  const std::vector<float> vs = g.get<float>("torch_mean.value");
  ASSERT_EQ(ns.size(), vs.size());
  std::vector<float> x;
  for (size_t k = 0; k < ns.size(); ++k) {
    x.resize(static_cast<size_t>(ns[k]));
    for (uint64_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(static_cast<double>((i * 2654435761ull) & 0xffffffffull) / 4294967296.0);
    const float m = torch_mean_f32(x.data(), ns[k], ts[k]);
    EXPECT_EQ(f32_bits(m), f32_bits(vs[k])) << "n " << ns[k] << " threads " << ts[k] << ": " << m << " vs " << vs[k];
  }
}

}  // namespace
}  // namespace oomless
