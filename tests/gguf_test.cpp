// GGUF reader: files written by gguf-py read back exactly, every ggml block format dequantises
// bit-identically to gguf-py (tests/golden/gguf/blocks.gguf, made by tools/golden/gguf_blocks.py), and
// each kind of malformed file is refused with an error that names the problem.
#include <gtest/gtest.h>

#include "memory/allocator.h"
#include "backend/ops.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"
#include "io/gguf_model.h"
#include "memory/arena.h"
#include "model/quant_base.h"

namespace oomless {
namespace {

std::string golden(const std::string& rel) {
  std::string here = __FILE__;
  return here.substr(0, here.find_last_of('/')) + "/golden/gguf/" + rel;
}

// Builds GGUF bytes by hand, so that tests can break exactly one thing.
struct Builder {
  std::vector<uint8_t> b;
  template <class T> Builder& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  Builder& str(const std::string& s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Builder& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    return put<uint32_t>(version).put<uint64_t>(n_tensors).put<uint64_t>(n_kv);
  }
  Builder& kv_u32(const std::string& k, uint32_t v) { return str(k).put<uint32_t>(4).put<uint32_t>(v); }
  Builder& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name).put<uint32_t>(static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) put<uint64_t>(d);
    return put<uint32_t>(type).put<uint64_t>(offset);
  }
  Builder& pad(size_t align = 32) {
    while (b.size() % align) b.push_back(0);
    return *this;
  }
  Builder& zeros(size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

// Expects from_bytes to throw an oomless::Error whose message contains `what`.
void expect_refused(const std::vector<uint8_t>& bytes, const std::string& what) {
  try {
    GgufFile::from_bytes(bytes.data(), bytes.size(), "crafted.gguf");
    ADD_FAILURE() << "accepted a file that should fail with \"" << what << "\"";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[gguf] crafted.gguf"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << "message: " << msg << "\nwanted: " << what;
  }
}

// A minimal valid file: one F32 tensor of 8 elements and one key.
Builder valid_file() {
  Builder f;
  f.header(1, 1).kv_u32("general.alignment", 32).tensor("w", {8}, 0, 0).pad().zeros(32);
  return f;
}

TEST(Gguf, MinimalCraftedFileIsRead) {
  Builder f = valid_file();
  GgufFile g = GgufFile::from_bytes(f.b.data(), f.b.size());
  ASSERT_EQ(g.tensors().size(), 1u);
  EXPECT_EQ(g.tensors()[0].nbytes, 32u);
  EXPECT_EQ(g.data_offset() % 32, 0u);
  EXPECT_EQ(g.get_int("general.alignment"), 32);
}

TEST(Gguf, RefusesBadMagic) {
  Builder f = valid_file();
  f.b[0] = 'X';
  expect_refused(f.b, "not a GGUF file");
  expect_refused({'G', 'G'}, "not a GGUF file");
}

TEST(Gguf, RefusesUnsupportedVersion) {
  for (uint32_t v : {1u, 4u}) {
    Builder f;
    f.header(0, 0, v);
    expect_refused(f.b, "unsupported GGUF version " + std::to_string(v));
  }
  Builder be;
  be.header(0, 0, 0x03000000u);
  expect_refused(be.b, "big-endian");
}

TEST(Gguf, AcceptsVersion2) {
  Builder f;
  f.header(0, 1, 2).kv_u32("a", 7);
  EXPECT_EQ(GgufFile::from_bytes(f.b.data(), f.b.size()).get_int("a"), 7);
}

TEST(Gguf, RefusesAbsurdCounts) {
  Builder kv;
  kv.header(0, 1000).kv_u32("a", 1);
  expect_refused(kv.b, "1000 metadata entries");
  Builder t;
  t.header(uint64_t{1} << 40, 0);
  expect_refused(t.b, "tensors, more than the file can hold");
}

TEST(Gguf, RefusesStringsAndArraysPastTheEnd) {
  Builder key;
  key.header(0, 1).put<uint64_t>(1000).zeros(14);
  expect_refused(key.b, "a metadata key needs 1000 bytes");
  Builder val;
  val.header(0, 1).str("s").put<uint32_t>(8).put<uint64_t>(uint64_t{1} << 62);
  expect_refused(val.b, "a string needs");
  Builder arr;
  arr.header(0, 1).str("a").put<uint32_t>(9).put<uint32_t>(5).put<uint64_t>(1000).put<int32_t>(1);
  expect_refused(arr.b, "claims 1000 int32 elements");
  Builder sarr;  // an array of strings whose last string runs out
  sarr.header(0, 1).str("a").put<uint32_t>(9).put<uint32_t>(8).put<uint64_t>(2).str("ok").put<uint64_t>(50).zeros(3);
  expect_refused(sarr.b, "an array string needs 50 bytes");
  Builder ty;
  ty.header(0, 1).str("a").put<uint32_t>(13).zeros(8);
  expect_refused(ty.b, "unknown value type 13");
  Builder nest;  // arrays nested past the limit
  nest.header(0, 1).str("a").put<uint32_t>(9);
  for (int k = 0; k < 20; ++k) nest.put<uint32_t>(9).put<uint64_t>(1);
  nest.put<uint32_t>(4).put<uint64_t>(0);
  expect_refused(nest.b, "nests arrays deeper");
}

TEST(Gguf, RefusesDuplicateKeysAndTensors) {
  Builder k;
  k.header(0, 2).kv_u32("a", 1).kv_u32("a", 2);
  expect_refused(k.b, "\"a\" appears twice");
  Builder t;
  t.header(2, 0).tensor("w", {8}, 0, 0).tensor("w", {8}, 0, 32).pad().zeros(64);
  expect_refused(t.b, "\"w\" appears twice");
}

TEST(Gguf, RefusesTooManyDims) {
  Builder f;
  f.header(1, 0).tensor("w", {1, 1, 1, 1, 1}, 0, 0).pad().zeros(32);
  expect_refused(f.b, "5 dimensions");
}

TEST(Gguf, RefusesElementCountOverflow) {
  Builder f;
  f.header(1, 0).tensor("w", {uint64_t{1} << 32, uint64_t{1} << 32}, 0, 0).pad();
  expect_refused(f.b, "more elements than 64 bits");
  Builder neg;
  neg.header(1, 0).tensor("w", {~uint64_t{0}}, 0, 0).pad();
  expect_refused(neg.b, "negative dimension");
  Builder bytes;  // numel fits, bytes do not
  bytes.header(1, 0).tensor("w", {uint64_t{1} << 62}, 0, 0).pad();
  expect_refused(bytes.b, "larger than 64 bits");
}

TEST(Gguf, RefusesUnknownType) {
  for (uint32_t t : {4u, 31u, 99u}) {
    Builder f;
    f.header(1, 0).tensor("w", {32}, t, 0).pad().zeros(128);
    expect_refused(f.b, "unknown ggml type " + std::to_string(t));
  }
}

TEST(Gguf, RefusesDataOutsideTheFile) {
  Builder f;
  f.header(1, 0).tensor("w", {8}, 0, 0).pad().zeros(31);
  expect_refused(f.b, "lies outside the file");
  Builder far;
  far.header(1, 0).tensor("w", {8}, 0, ~uint64_t{31}).pad().zeros(32);
  expect_refused(far.b, "lies outside the file");
}

TEST(Gguf, RefusesOverlappingTensors) {
  Builder f;
  f.header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).pad().zeros(64);
  expect_refused(f.b, "\"a\" and \"b\" overlap");
}

TEST(Gguf, RefusesPartialBlocksAndMisalignment) {
  Builder f;
  f.header(1, 0).tensor("w", {48}, 8 /* Q8_0 */, 0).pad().zeros(64);
  expect_refused(f.b, "not a multiple of Q8_0's block size 32");
  Builder a;
  a.header(1, 0).tensor("w", {8}, 0, 16).pad().zeros(64);
  expect_refused(a.b, "not a multiple of the alignment");
  Builder al;
  al.header(0, 1).kv_u32("general.alignment", 24);
  expect_refused(al.b, "not a power of two");
}

TEST(Gguf, CustomAlignmentPlacesData) {
  Builder f;
  f.header(1, 1).kv_u32("general.alignment", 64).tensor("w", {4}, 0, 0).pad(64);
  const size_t start = f.b.size();
  for (float v : {1.f, 2.f, 3.f, 4.f}) f.put<float>(v);
  GgufFile g = GgufFile::from_bytes(f.b.data(), f.b.size());
  EXPECT_EQ(g.alignment(), 64u);
  EXPECT_EQ(g.data_offset(), start);
  float out[4];
  dequantize(GgmlType::F32, g.tensor("w")->data, 4, out);
  EXPECT_EQ(out[3], 4.f);
}

TEST(Gguf, TypedGettersNameTheKeyAndFile) {
  Builder f = valid_file();
  GgufFile g = GgufFile::from_bytes(f.b.data(), f.b.size(), "x.gguf");
  try {
    g.get_string("general.alignment");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.gguf: metadata \"general.alignment\" is uint32, expected a string"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(g.get_int("nope"), Error);
}

TEST(Gguf, DequantizeRefusesUnsupportedTypesAndPartialBlocks) {
  std::vector<uint8_t> src(1024);
  std::vector<float> dst(1024);
  try {
    dequantize(GgmlType::IQ2_XXS, src.data(), 256, dst.data());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("IQ2_XXS is not supported"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dequantize(GgmlType::Q4_K, src.data(), 255, dst.data()), Error);
  EXPECT_THROW(dequantize(GgmlType::Q8_0, src.data(), 33, dst.data()), Error);
}

bool same_bits(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

// Every block of every supported type equals gguf-py's dequantisation bit for bit.
TEST(Gguf, DequantizeMatchesGgufPyBitExactly) {
  GgufFile g = GgufFile::open(golden("blocks.gguf"));
  const char* types[] = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
  for (const char* name : types) {
    const GgufTensor* raw = g.tensor(std::string(name) + ".raw");
    const GgufTensor* ref = g.tensor(std::string(name) + ".f32");
    ASSERT_TRUE(raw && ref) << name;
    ASSERT_EQ(ggml_type_name(raw->type), name);
    ASSERT_EQ(ref->type, GgmlType::F32);
    ASSERT_EQ(raw->numel(), ref->numel());
    const int64_t n = raw->numel();
    std::vector<float> got(n), want(n);
    dequantize(raw->type, raw->data, n, got.data());
    std::memcpy(want.data(), ref->data, n * 4);
    const int64_t block = ggml_type_info(static_cast<uint32_t>(raw->type))->block_size;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!same_bits(got[i], want[i]) && bad++ < 5)
        ADD_FAILURE() << name << " block " << i / block << " element " << i % block << ": got " << got[i]
                      << ", gguf-py " << want[i];
    }
    EXPECT_EQ(bad, 0) << name;
  }
}

// A projection kept in GGUF blocks (QuantBase): any span of a row the GEMM asks for (starting inside a
// block, ending inside one, or whole blocks) holds the values of the whole tensor's dequantisation, for
// the 32-element formats (with and without their vector forms) and a K format.
TEST(Gguf, QuantisedRowSpansEqualTheWholeDequantisation) {
  DeviceAccess inside;  // the row readers called directly, as the GEMM calls them
  GgufFile g = GgufFile::open(golden("blocks.gguf"));
  ModelConfig cfg;
  cfg.L = 1, cfg.E = 256, cfg.F = 64, cfg.H = 4, cfg.Hkv = 4, cfg.D = 64, cfg.V = 16;
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  const int64_t rows = cfg.E, cols = cfg.H * cfg.D;
  for (const char* type : {"Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K"}) {
    SCOPED_TRACE(type);
    const GgufTensor* raw = g.tensor(std::string(type) + ".raw");
    ASSERT_TRUE(raw);
    const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(raw->type));
    const size_t bytes = static_cast<size_t>(rows * cols / ti->block_size * ti->type_size);
    std::vector<uint8_t> data(bytes);
    for (size_t i = 0; i < bytes; ++i) data[i] = raw->data[i % raw->nbytes];  // the golden blocks, repeated
    GgufTensor t;
    t.name = "blk.0.attn_output.weight", t.ne = {cols, rows}, t.type = raw->type, t.data = data.data(), t.nbytes = bytes;
    GgufHfTensor h;
    h.hf_name = name, h.shape = {rows, cols}, h.src = &t;
    CpuMemory mem(size_t{1} << 28);
    ParamSet slot(cfg, DType::f32, mem.device, Category::weights, [&](const ParamSpec& s) { return s.name != name; });
    QuantBase qb(*make_ops("cpu", &mem.device), {h}, slot, mem.device);
    const Tensor& w = *slot.find(name);
    ASSERT_TRUE(w.quant);
    std::vector<float> whole(static_cast<size_t>(rows * cols));
    dequantize(raw->type, data.data(), rows * cols, whole.data());
    for (int64_t r = 0; r < rows; r += 37)
      for (int64_t col = 0; col < cols; col += 5)
        for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{32}, int64_t{33}, int64_t{64}, int64_t{100}, cols - col}) {
          if (col + n > cols) continue;
          std::vector<float> got(static_cast<size_t>(n));
          w.quant->dequant_row(*w.quant, r, col, n, got.data());
          ASSERT_EQ(std::memcmp(got.data(), whole.data() + r * cols + col, static_cast<size_t>(n) * 4), 0)
              << "row " << r << " col " << col << " n " << n;
        }
  }
}

// Q8_K has no gguf-py dequantiser: check its layout directly (f32 d, then 256 int8, then bsums).
TEST(Gguf, DequantizeQ8K) {
  std::vector<uint8_t> b(292, 0);
  const float d = 0.375f;
  std::memcpy(b.data(), &d, 4);
  for (int j = 0; j < 256; ++j) b[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 128));
  std::vector<float> y(256);
  dequantize(GgmlType::Q8_K, b.data(), 256, y.data());
  for (int j = 0; j < 256; ++j) ASSERT_EQ(y[j], d * static_cast<float>(j - 128)) << j;
}

}  // namespace
}  // namespace oomless
