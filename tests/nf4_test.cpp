// NF4 storage against bitsandbytes, bit for bit (memcmp or SHA-256 of the bytes): the tables, 4-bit
// quantisation of float32 and bf16 tensors (odd sizes, a 2-D shape, blocksizes 64/128/256, ties, zero,
// constant and non-finite blocks), double quantisation with torch.mean's summation order, dequantisation
// of whole tensors, of any sub-range and of matrix rows; goldens from tools/golden/make_nf4.py in
// tests/golden/nf4. Then the transformers-saved 4-bit model in tests/golden/bnb4 (every linear loaded,
// dequantised rows equal to bitsandbytes', and our quantiser reproducing the file from the original
// float32 weights), and the quant_state parser's and loader's refusals.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "quant/bnb4.h"
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
    if (f32_bits(a[i]) != f32_bits(b[i]))
      return "index " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
}
void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  EXPECT_TRUE(same_bytes(got, want)) << what << ", first difference at " << first_diff(got, want);
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
      expect_bits(o.nested, g.get<float>(name + ".nested_absmax"), "nested absmax");
      EXPECT_EQ(f32_bits(o.offset), f32_bits(g.get<float>(name + ".offset")[0])) << o.offset;
      expect_bits(o.scales, g.get<float>(name + ".absmax_deq"), "dequantised absmax");
    } else {
      expect_bits(o.absmax, g.get<float>(name + ".absmax"), "absmax");
    }
    if (g.has(name + ".dequant")) expect_bits(o.dequant, g.get<float>(name + ".dequant"), "dequantised");
    EXPECT_EQ(sha(o.dequant), c.at("dequant_sha256").as_string()) << "dequantised float32";
    if (const json::Value* h = c.find("dequant_bf16_sha256")) {
      // bitsandbytes' own bf16 output is the float32 result rounded to nearest even.
      std::vector<uint16_t> b(o.dequant.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(o.dequant[i]);
      EXPECT_EQ(sha(b), h->as_string()) << "dequantised bf16";
    }
  }
}

// Blocks are quantised on the OpenMP threads: the same bytes for 1, 2 and 3 of them (odd length, a tail block).
TEST(Nf4, SameBytesForAnyThreadCount) {
  const int64_t n = 64 * 300 + 37;
  std::vector<float> w(static_cast<size_t>(n));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> d;
  for (float& x : w) x = d(rng);
  std::vector<std::vector<uint8_t>> packed;
  std::vector<std::vector<float>> absmax;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    packed.emplace_back(static_cast<size_t>((n + 1) / 2));
    absmax.emplace_back(static_cast<size_t>((n + 63) / 64));
    nf4::quantize(w.data(), n, 64, packed.back().data(), absmax.back().data());
  }
  omp_set_num_threads(saved);
  for (size_t k = 1; k < packed.size(); ++k) {
    EXPECT_EQ(packed[k], packed[0]) << k + 1 << " threads";
    EXPECT_EQ(absmax[k], absmax[0]) << k + 1 << " threads";
  }
}

TEST(Nf4, DequantiseRangeAnyStart) {
  Golden g;
  for (const char* name : {"f32_1000_bs64_dq", "f32_65_bs128", "bf16_37x130_bs64"}) {
    SCOPED_TRACE(name);
    const Ours o = run_case(g, g.info.at("cases").at(name));
    const int64_t n = static_cast<int64_t>(o.dequant.size());
    const int64_t bs = g.info.at("cases").at(name).at("blocksize").as_int();
    const std::vector<int64_t> starts = {0, 1, 2, 31, 63, 64, n / 2 + 1, n - 1}, counts = {0, 1, 2, 3, 64, 129, n};
    for (int64_t start : starts) {
      for (int64_t count : counts) {
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

// ---- the transformers-saved checkpoint ----

std::string bnb4_dir() { return test::source_path("tests/golden/bnb4/llama_gqa_untied"); }

TEST(Bnb4, EveryLinearOfTheSavedModelDequantisesAsBitsandbytes) {
  const SafetensorsFile f = SafetensorsFile::open(bnb4_dir() + "/model.safetensors");
  const SafetensorsFile golden = SafetensorsFile::open(bnb4_dir() + "/golden.safetensors");
  const SafetensorsFile orig =
      SafetensorsFile::open(test::source_path("tests/golden/models/llama_gqa_untied/model.safetensors"));
  const std::string suffix = ".weight.quant_state.bitsandbytes__nf4";
  int linears = 0;
  for (const StTensor& t : f.tensors()) {
    if (t.name.size() < suffix.size() || t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix)) continue;
    const std::string prefix = t.name.substr(0, t.name.size() - suffix.size());
    SCOPED_TRACE(prefix);
    ++linears;
    ASSERT_TRUE(is_bnb4_weight(f, prefix));
    const Matrix m = load_bnb4_weight(f, prefix);
    EXPECT_TRUE(m.double_quant());
    EXPECT_EQ(m.blocksize, 64);
    const StTensor* want = golden.find("deq." + prefix + ".weight");
    ASSERT_TRUE(want);
    ASSERT_EQ(want->shape, (std::vector<int64_t>{m.rows, m.cols}));
    std::vector<float> out(static_cast<size_t>(m.numel()));
    nf4::dequantize_rows(m, 0, m.rows, out.data());
    EXPECT_EQ(std::memcmp(out.data(), want->data, want->nbytes), 0);
    for (int64_t r0 = 0; r0 < m.rows; r0 += 3) {  // row ranges that start mid-block
      const int64_t nr = std::min<int64_t>(2, m.rows - r0);
      std::vector<float> part(static_cast<size_t>(nr * m.cols));
      nf4::dequantize_rows(m, r0, nr, part.data());
      EXPECT_EQ(std::memcmp(part.data(), out.data() + r0 * m.cols, part.size() * 4), 0) << "row " << r0;
    }
    // Quantising the original float32 weight reproduces the file's bytes.
    std::vector<float> w(static_cast<size_t>(m.numel()));
    read_as_f32(*orig.find(prefix + ".weight"), std::vector<int64_t>{m.rows, m.cols}, w.data());
    std::vector<float> mem(nf4::storage_bytes(m) / 4 + 1);
    const Matrix q = nf4::quantize_matrix(w.data(), m.rows, m.cols, 64, true, mem.data(), mem.size() * 4);
    EXPECT_EQ(std::memcmp(q.packed, m.packed, static_cast<size_t>(nf4::packed_bytes(m.numel()))), 0);
    EXPECT_EQ(std::memcmp(q.absmax_codes, m.absmax_codes, static_cast<size_t>(m.blocks())), 0);
    const size_t nested_bytes = 4 * static_cast<size_t>(nf4::num_blocks(m.blocks(), 256));
    EXPECT_EQ(std::memcmp(q.nested_absmax, m.nested_absmax, nested_bytes), 0);
    EXPECT_EQ(f32_bits(q.offset), f32_bits(m.offset));
  }
  EXPECT_EQ(linears, 14);
  EXPECT_FALSE(is_bnb4_weight(f, "lm_head"));  // transformers keeps the head in float32
  const json::Value cfg = json::parse_file(bnb4_dir() + "/config.json");
  EXPECT_EQ(cfg.at("quantization_config").at("quant_method").as_string(), "bitsandbytes");
}

// ---- refusals ----

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "accepted; wanted an error with \"" << parts.back() << "\"";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nwanted: " << p;
  }
}

const char* kGoodState = R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [32, 32], )"
                         R"("nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5335139632225037})";

TEST(Bnb4, ParsesTheQuantState) {
  const Bnb4QuantState qs = parse_bnb4_quant_state(kGoodState, "w");
  EXPECT_EQ(qs.quant_type, "nf4");
  EXPECT_EQ(qs.blocksize, 64);
  EXPECT_EQ(qs.shape, (std::vector<int64_t>{32, 32}));
  EXPECT_TRUE(qs.nested);
  EXPECT_EQ(qs.nested_blocksize, 256);
  EXPECT_EQ(qs.nested_offset, 0.5335139632225037f);
  const Bnb4QuantState plain =
      parse_bnb4_quant_state(R"({"quant_type": "nf4", "blocksize": 128, "dtype": "bfloat16", "shape": [3, 5]})", "w");
  EXPECT_FALSE(plain.nested);
  EXPECT_EQ(plain.numel(), 15);
}

// A quant state with the given fields (JSON text, spliced as is).
std::string state(const std::string& type, const std::string& bs, const std::string& dtype,
                  const std::string& shape, const std::string& more = "") {
  return R"({"quant_type": )" + type + R"(, "blocksize": )" + bs + R"(, "dtype": )" + dtype +
         R"(, "shape": )" + shape + more + "}";
}

TEST(Bnb4, RefusesBadQuantStates) {
  auto refuses = [](const std::string& text, const std::string& what) {
    expect_error([&] { parse_bnb4_quant_state(text, "f.safetensors: k"); }, {"[bnb4] f.safetensors: k: ", what});
  };
  const std::string nf4 = "\"nf4\"", f32 = "\"float32\"", sq = "[4, 4]";
  auto nested = [&](const std::string& bs, const std::string& dtype, const std::string& offset) {
    return state(nf4, "64", f32, sq, R"(, "nested_blocksize": )" + bs + R"(, "nested_dtype": )" + dtype +
                                         R"(, "nested_offset": )" + offset);
  };
  refuses("{\"quant_type\": ", "not valid JSON");
  refuses("[1, 2]", "must be a JSON object");
  refuses(state("\"fp4\"", "64", f32, sq), "fp4 is not supported, only nf4");
  refuses(state("\"int4\"", "64", f32, sq), "unknown quant_type \"int4\"");
  refuses(state(nf4, "48", f32, sq), "blocksize 48 is not one of");
  refuses(state(nf4, "\"64\"", f32, sq), "\"blocksize\" must be an integer");
  refuses(R"({"quant_type": "nf4", "dtype": "float32", "shape": [4, 4]})", "missing key \"blocksize\"");
  refuses(state(nf4, "64", "\"float64\"", sq), "dtype \"float64\" is not one of");
  refuses(state(nf4, "64", f32, "[]"), "non-empty array");
  refuses(state(nf4, "64", f32, "[4, 0]"), "dimensions >= 1");
  refuses(state(nf4, "64", f32, "[1048576, 1048577]"), "fewer than 2^40");
  refuses(state(nf4, "64", f32, sq, R"(, "colour": "red")"), "unknown key \"colour\"");
  refuses(state(nf4, "64", f32, sq, R"(, "nested_blocksize": 256, "nested_dtype": "float32")"),
          "missing key \"nested_offset\"");
  refuses(nested("256", "\"float16\"", "0.1"), "nested_dtype \"float16\"");
  refuses(nested("100", f32, "0.1"), "nested_blocksize 100");
  refuses(nested("256", f32, "1e300"), "not a finite float32");
  EXPECT_NO_THROW(parse_bnb4_quant_state(nested("256", f32, "0.1"), "k"));
}

// A .safetensors file written byte by byte, so that any dtype (U8 included) and any header can be used.
struct RawTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
std::string write_raw(const std::string& file, const std::vector<RawTensor>& ts) {
  json::Value h = json::Value::object();
  std::vector<uint8_t> data;
  for (const RawTensor& t : ts) {
    json::Value e = json::Value::object();
    e.set("dtype", json::Value::string(t.dtype));
    json::Value s = json::Value::array();
    for (int64_t d : t.shape) s.push_back(json::Value::integer(d));
    e.set("shape", s);
    json::Value off = json::Value::array();
    off.push_back(json::Value::integer(static_cast<int64_t>(data.size())));
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
    off.push_back(json::Value::integer(static_cast<int64_t>(data.size())));
    e.set("data_offsets", off);
    h.set(t.name, e);
  }
  std::string header = json::dump(h);
  while (header.size() % 8) header += ' ';
  const std::string path = testing::TempDir() + std::to_string(::getpid()) + "_" + file;
  std::ofstream o(path, std::ios::binary);
  const uint64_t len = header.size();
  o.write(reinterpret_cast<const char*>(&len), 8);
  o.write(header.data(), static_cast<std::streamsize>(header.size()));
  o.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  return path;
}

// Writes the tensors, maps the file and removes it (the mapping stays valid), so no test leaves files behind.
SafetensorsFile open_raw(const std::string& file, const std::vector<RawTensor>& ts, std::string* path_out = nullptr) {
  const std::string path = write_raw(file, ts);
  SafetensorsFile f = SafetensorsFile::open(path);
  std::remove(path.c_str());
  if (path_out) *path_out = path;
  return f;
}

template <class T> std::vector<uint8_t> bytes_of(const T* p, size_t n) {
  std::vector<uint8_t> b(n * sizeof(T));
  std::memcpy(b.data(), p, b.size());
  return b;
}

// A valid plain (not double-quantised) 4 x 20 weight, blocksize 32: 80 codes, 3 blocks.
std::vector<RawTensor> plain_weight(const std::string& state) {
  std::vector<float> absmax = {0.5f, 0.25f, 1.0f};
  return {{"p.weight", "U8", {40, 1}, std::vector<uint8_t>(40, 0x7F)},
          {"p.weight.absmax", "F32", {3}, bytes_of(absmax.data(), 3)},
          {"p.weight.quant_map", "F32", {16}, bytes_of(nf4::kCode, 16)},
          {"p.weight.quant_state.bitsandbytes__nf4", "U8", {static_cast<int64_t>(state.size())},
           std::vector<uint8_t>(state.begin(), state.end())}};
}
const std::string kPlainState = R"({"quant_type": "nf4", "blocksize": 32, "dtype": "float32", "shape": [4, 20]})";

TEST(Bnb4, LoadsAHandWrittenPlainWeight) {
  const SafetensorsFile f = open_raw("bnb4_plain.safetensors", plain_weight(kPlainState));
  const Matrix m = load_bnb4_weight(f, "p");
  EXPECT_FALSE(m.double_quant());
  std::vector<float> out(80);
  nf4::dequantize_rows(m, 0, 4, out.data());
  for (int i = 0; i < 80; ++i) {  // codes 7 (0.0) and 15 (1.0) alternate; blocks of 32 scaled 0.5, 0.25, 1
    const float scale = i < 32 ? 0.5f : i < 64 ? 0.25f : 1.0f;
    EXPECT_EQ(out[i], (i % 2 ? nf4::kCode[15] : 0.0f) * scale) << i;
  }
}

TEST(Bnb4, RefusesInconsistentTensors) {
  auto refuses = [](std::vector<RawTensor> ts, const std::string& what, const std::string& prefix = "p") {
    std::string path;
    const SafetensorsFile f = open_raw("bnb4_bad.safetensors", ts, &path);
    expect_error([&] { load_bnb4_weight(f, prefix); }, {"[bnb4] " + path, what});
  };
  refuses(plain_weight(kPlainState), "q_proj is not a bitsandbytes 4-bit weight", "q_proj");
  auto ts = plain_weight(kPlainState);
  ts[3].name = "p.weight.quant_state.bitsandbytes__fp4";
  refuses(ts, "fp4 is not supported, only nf4");
  refuses(plain_weight("{oops"), "p.weight.quant_state.bitsandbytes__nf4: the quant state is not valid JSON");
  ts = plain_weight(kPlainState), ts[0].shape = {39, 1}, ts[0].bytes.resize(39);
  refuses(ts, "p.weight: shape [39, 1], expected [40, 1]");
  ts = plain_weight(kPlainState), ts[0].dtype = "I8";
  refuses(ts, "p.weight: dtype I8, expected U8");
  ts = plain_weight(kPlainState), ts[1].shape = {2}, ts[1].bytes.resize(8);
  refuses(ts, "p.weight.absmax: shape [2], expected [3] (the block scales)");
  ts = plain_weight(kPlainState), ts[1].dtype = "U8", ts[1].bytes.resize(3);
  refuses(ts, "p.weight.absmax: dtype U8, expected F32");
  ts = plain_weight(kPlainState), ts[2].bytes[5] ^= 1;
  refuses(ts, "p.weight.quant_map: entry 1 is");
  ts = plain_weight(kPlainState), ts.erase(ts.begin() + 2);
  refuses(ts, "p.weight.quant_map is missing");
  refuses(plain_weight(R"({"quant_type": "nf4", "blocksize": 32, "dtype": "float32", "shape": [80]})"), "is not 2-D");
  // Double quantisation: the nested tensors must come with the nested keys and the other way round.
  const std::string nested = R"({"quant_type": "nf4", "blocksize": 32, "dtype": "float32", "shape": [4, 20], )"
                             R"("nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5})";
  ts = plain_weight(nested);
  refuses(ts, "p.weight.nested_absmax is missing");
  ts.push_back({"p.weight.nested_absmax", "F32", {1}, std::vector<uint8_t>(4, 0)});
  ts.push_back({"p.weight.nested_quant_map", "F32", {256}, bytes_of(nf4::kDynamicMap, 256)});
  refuses(ts, "p.weight.absmax: dtype F32, expected U8 (the 8-bit codes");
  ts[1] = {"p.weight.absmax", "U8", {3}, {1, 2, 3}};
  EXPECT_NO_THROW(load_bnb4_weight(open_raw("bnb4_dq.safetensors", ts), "p"));
  ts[5].bytes[0] ^= 1;
  refuses(ts, "p.weight.nested_quant_map: entry 0 is");
  ts = plain_weight(kPlainState);
  ts.push_back({"p.weight.nested_absmax", "F32", {1}, std::vector<uint8_t>(4, 0)});
  refuses(ts, "has nested_absmax/nested_quant_map but its quant state has no nested_* keys");
}

}  // namespace
}  // namespace oomless
