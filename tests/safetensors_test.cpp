// safetensors: write/read round trips for every dtype we write (0-d and empty tensors too), byte-for-
// byte agreement with the reference Python writer, reading a Python-written file with every dtype,
// sharded folders with an index, each kind of corrupt file, and read_as_f32.
//
// tests/data/safetensors/*.safetensors were written by the reference library (safetensors 0.8,
// torch 2.x) with:
//   t = {"f32": torch.tensor([[1.5, -2.25, 3.0], [0.1, 1e-8, -0.0]], dtype=torch.float32),
//        "bf16": torch.tensor([1.0, -2.5, 0.15625, 65280.0], dtype=torch.bfloat16),
//        "f16": torch.tensor([0.5, -65504.0, 2.0**-14, 2.0**-24], dtype=torch.float16),
//        "f64": torch.tensor(3.141592653589793, dtype=torch.float64),
//        "i32": torch.tensor([-2147483648, 7, 2147483647], dtype=torch.int32),
//        "i8": torch.tensor([-128, 127], dtype=torch.int8),
//        "e4m3": torch.tensor([448.0, -2.0**-9], dtype=torch.float8_e4m3fn),
//        "e5m2": torch.tensor([57344.0, -1.5], dtype=torch.float8_e5m2),
//        "empty": torch.zeros((0, 4), dtype=torch.float32)}
//   save_file(t, "python_written.safetensors", metadata={"format": "pt"})
//   t.update({"i64": torch.tensor([-1, 2**40], dtype=torch.int64), "u8": torch.tensor([0, 255], dtype=torch.uint8),
//             "bool": torch.tensor([True, False]), "i16": torch.tensor([-32768, 5], dtype=torch.int16)})
//   save_file(t, "python_written_all_dtypes.safetensors", metadata={"format": "pt"})
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"
#include "util/harness.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

fs::path data_dir() { return fs::path(test::source_path("tests/data/safetensors")); }

// A fresh folder per test under the test temp dir.
fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / ("safetensors_test_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary);
  f << bytes;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return s;
}

// A file with the given header text (unpadded) and data buffer.
std::string st_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// The message of the Error that fn throws, or "" when it does not throw.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string open_error(const fs::path& p) {
  return error_of([&] { SafetensorsFile::open(p.string()); });
}

template <class T>
std::vector<T> bytes_as(const StTensor& t) {
  std::vector<T> v(t.nbytes / sizeof(T));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

// The tensors of python_written.safetensors, as our writer's input.
struct Sample {
  std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.1f, 1e-8f, -0.0f};
  std::vector<uint16_t> bf16 = {f32_to_bf16(1.0f), f32_to_bf16(-2.5f), f32_to_bf16(0.15625f), f32_to_bf16(65280.0f)};
  std::vector<uint16_t> f16 = {f32_to_f16(0.5f), f32_to_f16(-65504.0f), f32_to_f16(std::ldexp(1.0f, -14)),
                               f32_to_f16(std::ldexp(1.0f, -24))};
  double f64 = 3.141592653589793;
  std::vector<int32_t> i32 = {INT32_MIN, 7, INT32_MAX};
  std::vector<int8_t> i8 = {-128, 127};
  std::vector<uint8_t> e4m3 = {f32_to_f8e4m3(448.0f), f32_to_f8e4m3(-std::ldexp(1.0f, -9))};
  std::vector<uint8_t> e5m2 = {f32_to_f8e5m2(57344.0f), f32_to_f8e5m2(-1.5f)};

  std::vector<StWrite> writes() const {
    return {
        {"f32", DType::f32, {2, 3}, f32.data()},     {"bf16", DType::bf16, {4}, bf16.data()},
        {"f16", DType::f16, {4}, f16.data()},        {"f64", DType::f64, {}, &f64},
        {"i32", DType::i32, {3}, i32.data()},        {"i8", DType::i8, {2}, i8.data()},
        {"e4m3", DType::f8_e4m3, {2}, e4m3.data()},  {"e5m2", DType::f8_e5m2, {2}, e5m2.data()},
        {"empty", DType::f32, {0, 4}, nullptr},
    };
  }
};

TEST(Safetensors, RoundTripEveryDtype) {
  const fs::path dir = temp_dir("roundtrip");
  const Sample s;
  const auto writes = s.writes();
  const std::string path = (dir / "m.safetensors").string();
  write_safetensors(path, writes, {{"format", "pt"}, {"note", "\xC3\xA9"}});
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata().size(), 2u);
  EXPECT_EQ(f.metadata().at("note"), "\xC3\xA9");
  ASSERT_EQ(f.tensors().size(), writes.size());
  const char* names[] = {"f32", "bf16", "f16", "f64", "i32", "i8", "e4m3", "e5m2", "empty"};
  const char* file_names[] = {"F32", "BF16", "F16", "F64", "I32", "I8", "F8_E4M3", "F8_E5M2", "F32"};
  for (size_t i = 0; i < writes.size(); ++i) {
    const StTensor* t = f.find(names[i]);
    ASSERT_NE(t, nullptr) << names[i];
    EXPECT_EQ(t->name, names[i]);
    EXPECT_EQ(t->dtype_name, file_names[i]);
    EXPECT_EQ(t->dtype, writes[i].dtype);
    EXPECT_EQ(t->shape, writes[i].shape);
    EXPECT_EQ(t->file, path);
    EXPECT_EQ(static_cast<int64_t>(t->nbytes), dtype_bytes(writes[i].dtype, t->numel()));
    if (t->nbytes) {
      EXPECT_EQ(std::memcmp(t->data, writes[i].data, t->nbytes), 0) << names[i];
    }
    // The writer places wider types first, so every tensor is aligned to its element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % static_cast<uintptr_t>(dtype_bits(*t->dtype) / 8), 0u);
  }
  EXPECT_EQ(f.find("f64")->numel(), 1);
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_EQ(f.find("nope"), nullptr);
  // tensors() is in file order.
  for (size_t i = 1; i < f.tensors().size(); ++i) EXPECT_LE(f.tensors()[i - 1].offset, f.tensors()[i].offset);

  // The header is padded to 8 bytes with spaces.
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');

  // No tensors at all is a valid file too; rewriting replaces the old file.
  write_safetensors(path, {});
  EXPECT_TRUE(SafetensorsFile::open(path).tensors().empty());
  EXPECT_EQ(read_bytes(path), le64(8) + "{}      ");
}

TEST(Safetensors, WriterMatchesThePythonWriterByteForByte) {
  const fs::path data = data_dir();
  ASSERT_FALSE(data.empty()) << "tests/data/safetensors not found above " << fs::current_path()
                             << "; set OOMLESS_SOURCE_DIR to the source tree";
  const fs::path dir = temp_dir("python_bytes");
  const Sample s;
  write_safetensors((dir / "ours.safetensors").string(), s.writes(), {{"format", "pt"}});
  const std::string ours = read_bytes(dir / "ours.safetensors");
  const std::string theirs = read_bytes(data / "python_written.safetensors");
  ASSERT_FALSE(theirs.empty());
  EXPECT_EQ(ours, theirs);
}

TEST(Safetensors, ReadsThePythonWrittenFileExactly) {
  const fs::path data = data_dir();
  ASSERT_FALSE(data.empty());
  const SafetensorsFile f = SafetensorsFile::open((data / "python_written_all_dtypes.safetensors").string());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.tensors().size(), 13u);
  const Sample s;
  EXPECT_EQ(bytes_as<float>(*f.find("f32")), s.f32);
  EXPECT_EQ(bytes_as<uint16_t>(*f.find("bf16")), s.bf16);
  EXPECT_EQ(bytes_as<uint16_t>(*f.find("f16")), s.f16);
  EXPECT_EQ(bytes_as<double>(*f.find("f64")), std::vector<double>{s.f64});
  EXPECT_TRUE(f.find("f64")->shape.empty());
  EXPECT_EQ(bytes_as<int32_t>(*f.find("i32")), s.i32);
  EXPECT_EQ(bytes_as<int8_t>(*f.find("i8")), s.i8);
  EXPECT_EQ(bytes_as<uint8_t>(*f.find("e4m3")), s.e4m3);
  EXPECT_EQ(bytes_as<uint8_t>(*f.find("e5m2")), s.e5m2);
  EXPECT_EQ(f.find("empty")->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(f.find("empty")->nbytes, 0u);
  EXPECT_EQ(bytes_as<int64_t>(*f.find("i64")), (std::vector<int64_t>{-1, int64_t{1} << 40}));
  EXPECT_EQ(bytes_as<uint8_t>(*f.find("u8")), (std::vector<uint8_t>{0, 255}));
  EXPECT_EQ(bytes_as<uint8_t>(*f.find("bool")), (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(bytes_as<int16_t>(*f.find("i16")), (std::vector<int16_t>{-32768, 5}));
  EXPECT_EQ(f.find("u8")->dtype, DType::u8);  // optimizer codes, bitsandbytes' 4-bit weights
  for (const char* n : {"i64", "bool", "i16"}) EXPECT_FALSE(f.find(n)->dtype.has_value()) << n;
  EXPECT_EQ(f.find("bool")->dtype_name, "BOOL");

  float out[6];
  const int64_t shape23[] = {2, 3};
  read_as_f32(*f.find("f32"), shape23, out);
  EXPECT_EQ(std::vector<float>(out, out + 6), s.f32);
  const int64_t shape4[] = {4};
  read_as_f32(*f.find("bf16"), shape4, out);
  EXPECT_EQ(std::vector<float>(out, out + 4), (std::vector<float>{1.0f, -2.5f, 0.15625f, 65280.0f}));
  read_as_f32(*f.find("f16"), shape4, out);
  EXPECT_EQ(std::vector<float>(out, out + 4),
            (std::vector<float>{0.5f, -65504.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -24)}));
  read_as_f32(*f.find("f64"), {}, out);
  EXPECT_EQ(out[0], 3.1415927f);
}

TEST(Safetensors, ZeroSizeTensorsHolesAndUnalignedData) {
  const fs::path dir = temp_dir("zero");
  // Empty tensors anywhere (even inside another's range), a hole between tensors, an odd-length
  // header so that the data is unaligned, and trailing bytes after the last tensor.
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("z0":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]},)"
                             R"("z1":{"dtype":"F16","shape":[3,0,2],"data_offsets":[4,4]},)"
                             R"("b":{"dtype":"F64","shape":[1],"data_offsets":[12,20]}})";
  ASSERT_NE(header.size() % 8, 0u);
  std::string data(24, '\0');
  const float a[2] = {1.25f, -3.5f};
  const double b = -0.75;
  std::memcpy(data.data(), a, 8);
  std::memcpy(data.data() + 12, &b, 8);
  write_bytes(dir / "z.safetensors", st_file(header, data));
  const SafetensorsFile f = SafetensorsFile::open((dir / "z.safetensors").string());
  ASSERT_EQ(f.tensors().size(), 4u);
  float out[2] = {0, 0};
  const int64_t s2[] = {2};
  read_as_f32(*f.find("a"), s2, out);
  EXPECT_EQ(out[0], 1.25f);
  EXPECT_EQ(out[1], -3.5f);
  const int64_t s1[] = {1};
  read_as_f32(*f.find("b"), s1, out);
  EXPECT_EQ(out[0], -0.75f);
  const int64_t s302[] = {3, 0, 2};
  read_as_f32(*f.find("z1"), s302, nullptr);  // nothing to read
  EXPECT_EQ(f.find("z1")->numel(), 0);
}

TEST(Safetensors, MoveKeepsTensorsValid) {
  const fs::path dir = temp_dir("move");
  const float x[3] = {1, 2, 3};
  write_safetensors((dir / "m.safetensors").string(), {{"x", DType::f32, {3}, x}});
  SafetensorsFile a = SafetensorsFile::open((dir / "m.safetensors").string());
  const void* data = a.find("x")->data;
  SafetensorsFile b = std::move(a);
  EXPECT_EQ(b.find("x")->data, data);
  EXPECT_EQ(std::memcmp(b.find("x")->data, x, 12), 0);
  SafetensorsFile c = SafetensorsFile::open((dir / "m.safetensors").string());
  c = std::move(b);
  EXPECT_EQ(std::memcmp(c.find("x")->data, x, 12), 0);
}

TEST(Safetensors, CorruptFilesNameTheFileAndTheProblem) {
  const fs::path dir = temp_dir("corrupt");
  const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    const char* name;
    std::string bytes;
    const char* problem;
  };
  const std::string d8(8, '\0');
  const std::vector<Case> cases = {
      {"empty", "", "0 bytes, too short"},
      {"seven_bytes", std::string(7, '\0'), "7 bytes, too short"},
      {"header_len_zero", le64(0), "header length is 0 bytes"},
      {"header_len_huge", le64(uint64_t{1} << 40) + "{}", "above the 100000000-byte limit"},
      {"header_len_max", le64(UINT64_MAX) + "{}", "above the 100000000-byte limit"},
      {"truncated_header", le64(100) + R"({"a":{"dtype")", "header length is 100 bytes but only 13 bytes follow"},
      {"bad_json", st_file(R"({"a":{"dtype":"F32",}})", ""), "JSON header is malformed"},
      {"bad_json_utf8", st_file("{\"\xFF\":1}", ""), "invalid UTF-8"},
      {"trailing_garbage", st_file("{} x", ""), "JSON header is malformed"},
      {"header_array", st_file("[1,2]", ""), "header is a JSON array, not an object"},
      {"entry_not_object", st_file(R"({"a":[1]})", d8), "tensor 'a': the entry is not an object"},
      {"no_dtype", st_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", d8), "tensor 'a': \"dtype\" is missing"},
      {"dtype_number", st_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8), "\"dtype\" is missing or not a string"},
      {"no_shape", st_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", d8), "tensor 'a': \"shape\" is missing"},
      {"shape_string", st_file(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8), "\"shape\" is missing or not an array"},
      {"no_offsets", st_file(R"({"a":{"dtype":"F32","shape":[2]}})", d8), "\"data_offsets\" is missing"},
      {"three_offsets", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", d8), "\"data_offsets\" is missing or not an array of two"},
      {"offset_string", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}})", d8), "data_offsets must hold non-negative integers"},
      {"negative_offset", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", d8), "data_offsets must hold non-negative integers"},
      {"negative_dim", st_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8), "shape must hold non-negative integers, found -2"},
      {"float_dim", st_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", d8), "shape must hold non-negative integers"},
      {"huge_dim", st_file(R"({"a":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}})", d8), "shape must hold non-negative integers"},
      {"unknown_dtype", st_file(R"({"a":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", d8), "unknown dtype \"F128\""},
      {"shape_overflow", st_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8), "more elements than fit in 64 bits"},
      {"shape_overflow_zero", st_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,8]}})", d8), "more elements than fit in 64 bits"},
      {"bytes_overflow", st_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", d8), "overflows 64 bits"},
      {"begin_after_end", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8), "data_offsets [8, 0] end before they begin"},
      {"beyond_data", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", d8), "data_offsets [4, 12] exceed the data size 8"},
      {"beyond_data_huge", st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,0]}})", d8), "data_offsets must hold non-negative integers"},
      {"size_mismatch", st_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8), "span 8 bytes but F32 [3] needs 12"},
      {"overlap", st_file(R"({"a":)" + ok_entry + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8), "tensors 'a' [0, 8) and 'b' [4, 8) overlap"},
      {"same_range", st_file(R"({"a":)" + ok_entry + R"(,"b":)" + ok_entry + "}", d8), "overlap"},
      {"metadata_not_object", st_file(R"({"__metadata__":[],"a":)" + ok_entry + "}", d8), "__metadata__ is not an object"},
      {"metadata_number", st_file(R"({"__metadata__":{"format":1}})", ""), "__metadata__ value for 'format' is a number"},
      {"duplicate_name", st_file(R"({"a":)" + ok_entry + R"(,"a":)" + ok_entry + "}", d8), "duplicate key \"a\""},
  };
  for (const auto& c : cases) {
    const fs::path p = dir / (std::string(c.name) + ".safetensors");
    write_bytes(p, c.bytes);
    const std::string msg = open_error(p);
    EXPECT_NE(msg.find("[safetensors] " + p.string() + ": "), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.problem), std::string::npos) << c.name << ": " << msg;
  }
  // Sanity: the valid variant of the entry used above opens.
  write_bytes(dir / "ok.safetensors", st_file(R"({"a":)" + ok_entry + "}", d8));
  EXPECT_EQ(open_error(dir / "ok.safetensors"), "");

  EXPECT_NE(open_error(dir / "missing.safetensors").find("No such file"), std::string::npos);
  EXPECT_NE(open_error(dir).find("is a folder"), std::string::npos);
  EXPECT_EQ(open_error(dir / "beyond_data.safetensors"),
            "[safetensors] " + (dir / "beyond_data.safetensors").string() +
                ": tensor 'a': data_offsets [4, 12] exceed the data size 8; the file is truncated or corrupt — "
                "re-download it");
}

TEST(Safetensors, ReadAsF32ConvertsAndChecksTheShape) {
  const fs::path dir = temp_dir("read");
  const std::vector<float> want = {0.0f, -1.0f, 3.140625f, 1e-3f, -65504.0f, 0.5f};
  std::vector<uint16_t> bf(6), h(6);
  std::vector<double> d(6);
  std::vector<int32_t> ints(6, 7);
  convert(bf.data(), DType::bf16, want.data(), DType::f32, 6);
  convert(h.data(), DType::f16, want.data(), DType::f32, 6);
  for (size_t i = 0; i < 6; ++i) d[i] = want[i];
  const double d_exact = 0.1;  // rounds to the nearest float
  const std::string path = (dir / "r.safetensors").string();
  write_safetensors(path, {{"f32", DType::f32, {2, 3}, want.data()},
                           {"bf16", DType::bf16, {2, 3}, bf.data()},
                           {"f16", DType::f16, {2, 3}, h.data()},
                           {"f64", DType::f64, {2, 3}, d.data()},
                           {"f64s", DType::f64, {}, &d_exact},
                           {"i32", DType::i32, {2, 3}, ints.data()}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  const int64_t shape[] = {2, 3};
  for (const char* n : {"f32", "bf16", "f16", "f64"}) {
    std::vector<float> out(6, NAN);
    read_as_f32(*f.find(n), shape, out.data());
    for (size_t i = 0; i < 6; ++i) {
      const float expect = std::string(n) == "bf16" ? bf16_to_f32(bf[i]) : std::string(n) == "f16" ? f16_to_f32(h[i]) : want[i];
      EXPECT_EQ(out[i], expect) << n << " " << i;
    }
  }
  float one = 0;
  read_as_f32(*f.find("f64s"), {}, &one);
  EXPECT_EQ(one, 0.1f);

  const int64_t wrong[] = {3, 2};
  EXPECT_EQ(error_of([&] { read_as_f32(*f.find("f32"), wrong, nullptr); }),
            "[safetensors] " + path + ": tensor 'f32': expected shape [3, 2], found [2, 3]; the checkpoint does not "
            "match the model config");
  const int64_t flat[] = {6};
  EXPECT_NE(error_of([&] { read_as_f32(*f.find("bf16"), flat, nullptr); }).find("expected shape [6], found [2, 3]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_as_f32(*f.find("f64s"), flat, nullptr, "other.safetensors"); })
                .find("[safetensors] other.safetensors: tensor 'f64s': expected shape [6], found []"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_as_f32(*f.find("i32"), shape, nullptr); }).find("dtype I32 cannot be read as float32"),
            std::string::npos);
}

TEST(Safetensors, WriterRejectsBadInput) {
  const fs::path dir = temp_dir("write_bad");
  const std::string path = (dir / "w.safetensors").string();
  const float x[2] = {1, 2};
  const auto err = [&](const std::vector<StWrite>& t) { return error_of([&] { write_safetensors(path, t); }); };
  EXPECT_NE(err({{"a", DType::f32, {2}, x}, {"a", DType::f32, {2}, x}}).find("'a' appears twice"), std::string::npos);
  EXPECT_NE(err({{"__metadata__", DType::f32, {2}, x}}).find("reserved"), std::string::npos);
  EXPECT_NE(err({{"a", DType::f32, {-2}, x}}).find("invalid shape [-2]"), std::string::npos);
  EXPECT_NE(err({{"a", DType::f32, {INT64_MAX, 2}, x}}).find("invalid shape"), std::string::npos);
  EXPECT_NE(err({{"a", DType::nf4, {2}, x}}).find("nf4 has no safetensors form"), std::string::npos);
  EXPECT_NE(err({{"a", DType::f32, {2}, nullptr}}).find("has no data"), std::string::npos);
  EXPECT_NE(err({{"\xFF", DType::f32, {2}, x}}).find("UTF-8"), std::string::npos);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const std::string nodir = (dir / "no_such_dir" / "w.safetensors").string();
  EXPECT_NE(error_of([&] { write_safetensors(nodir, {{"a", DType::f32, {2}, x}}); }).find(nodir + ".tmp: cannot create"),
            std::string::npos);
}

// A sharded model: two shards and an index.
struct Sharded {
  fs::path dir;
  float a[2] = {1, 2}, b[3] = {3, 4, 5}, c[1] = {6};

  explicit Sharded(const std::string& name) : dir(temp_dir(name)) {
    write_safetensors((dir / "model-00001-of-00002.safetensors").string(),
                      {{"a", DType::f32, {2}, a}, {"b", DType::f32, {3}, b}});
    write_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"c", DType::f32, {1}, c}});
    index(R"({"metadata":{"total_size":24},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
          R"("b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})");
  }
  void index(const std::string& text) const { write_bytes(dir / "model.safetensors.index.json", text); }
  std::string set_error() const {
    return error_of([&] { SafetensorsSet::open(dir.string()); });
  }
};

TEST(SafetensorsSet, ShardedFolderWithIndex) {
  const Sharded m("sharded");
  const SafetensorsSet set = SafetensorsSet::open(m.dir.string());
  EXPECT_EQ(set.files().size(), 2u);
  const auto all = set.all();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0]->name, "a");
  EXPECT_EQ(all[2]->name, "c");
  ASSERT_NE(set.find("c"), nullptr);
  EXPECT_EQ(set.find("c")->file, (m.dir / "model-00002-of-00002.safetensors").string());
  EXPECT_EQ(std::memcmp(set.find("b")->data, m.b, 12), 0);
  EXPECT_EQ(set.find("d"), nullptr);
  // The index file itself may be given, and the set may be moved.
  SafetensorsSet moved = SafetensorsSet::open((m.dir / "model.safetensors.index.json").string());
  const SafetensorsSet set2 = std::move(moved);
  EXPECT_EQ(std::memcmp(set2.find("a")->data, m.a, 8), 0);
}

TEST(SafetensorsSet, SingleFileAndFolder) {
  const fs::path dir = temp_dir("single");
  const float x[2] = {1, 2};
  write_safetensors((dir / "model.safetensors").string(), {{"x", DType::f32, {2}, x}});
  EXPECT_NE(SafetensorsSet::open(dir.string()).find("x"), nullptr);
  EXPECT_NE(SafetensorsSet::open((dir / "model.safetensors").string()).find("x"), nullptr);
  const fs::path empty = temp_dir("empty_folder");
  EXPECT_NE(error_of([&] { SafetensorsSet::open(empty.string()); }).find("neither model.safetensors nor"),
            std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsSet::open((empty / "nope").string()); }).find("cannot access"),
            std::string::npos);
}

TEST(SafetensorsSet, IndexMismatches) {
  const Sharded m("mismatch");
  const std::string index = (m.dir / "model.safetensors.index.json").string();
  const std::string shard1 = (m.dir / "model-00001-of-00002.safetensors").string();
  const std::string shard2 = (m.dir / "model-00002-of-00002.safetensors").string();

  m.index(R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors",)"
          R"("c":"model-00003-of-00003.safetensors"}})");
  EXPECT_NE(m.set_error().find(index + ": shard 'model-00003-of-00003.safetensors' (listed for tensor 'c') is missing"),
            std::string::npos)
      << m.set_error();

  m.index(R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors",)"
          R"("c":"model-00002-of-00002.safetensors","d":"model-00002-of-00002.safetensors"}})");
  EXPECT_NE(m.set_error().find(index + ": lists tensor 'd' in shard 'model-00002-of-00002.safetensors', but " +
                               shard2 + " has no such tensor"),
            std::string::npos)
      << m.set_error();

  m.index(R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors",)"
          R"("c":"model-00002-of-00002.safetensors"}})");
  EXPECT_NE(m.set_error().find("lists tensor 'b' in shard 'model-00002-of-00002.safetensors', but it is in " + shard1),
            std::string::npos)
      << m.set_error();

  m.index(R"({"weight_map":{"a":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})");
  EXPECT_NE(m.set_error().find(shard1 + ": holds tensor 'b', which " + index + " does not list"), std::string::npos)
      << m.set_error();

  m.index(R"({"weight_map":{"a":"../model-00001-of-00002.safetensors"}})");
  EXPECT_NE(m.set_error().find("is not a file name inside the model folder"), std::string::npos) << m.set_error();
  m.index(R"({"weight_map":{"a":"/etc/passwd"}})");
  EXPECT_NE(m.set_error().find("is not a file name inside the model folder"), std::string::npos) << m.set_error();
  m.index(R"({"weight_map":{"a":1}})");
  EXPECT_NE(m.set_error().find("weight_map entry for 'a' is a number"), std::string::npos) << m.set_error();
  m.index(R"({"metadata":{}})");
  EXPECT_NE(m.set_error().find(index + ": no \"weight_map\" object"), std::string::npos) << m.set_error();
  m.index(R"({"weight_map":{"a":"x",}})");
  EXPECT_NE(m.set_error().find(index + ": cannot read the index ([json] " + index + ": line 1, column 24"),
            std::string::npos)
      << m.set_error();

  // The same tensor in two shards.
  write_safetensors(shard2, {{"c", DType::f32, {1}, m.c}, {"a", DType::f32, {2}, m.a}});
  m.index(R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors",)"
          R"("c":"model-00002-of-00002.safetensors"}})");
  EXPECT_NE(m.set_error().find("tensor 'a' is in both " + shard1 + " and " + shard2), std::string::npos)
      << m.set_error();

  // A corrupt shard names the shard.
  write_bytes(shard2, "abc");
  EXPECT_NE(m.set_error().find("[safetensors] " + shard2 + ": the file is 3 bytes"), std::string::npos)
      << m.set_error();
}

}  // namespace
}  // namespace oomless
