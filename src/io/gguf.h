// GGUF (llama.cpp's single-file model format), versions 2 and 3, read from a read-only mmap.
//
// Layout (all little-endian):
//   "GGUF" | u32 version | u64 n_tensors | u64 n_kv
//   n_kv x   { string key | u32 value type | value }
//   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset }
//   padding to `general.alignment` (default 32) | tensor data (offsets are relative to here)
// A string is u64 length + bytes (no terminator); an array is u32 element type + u64 count + elements.
// ne[0] is the fastest-varying dimension, so the PyTorch/HF shape is ne reversed.
//
// Every count, length and offset comes from the file, so each is checked against the bytes that remain
// before anything is allocated or read: a bad file gives oomless::Error "[gguf] PATH: what", never a
// crash or a huge allocation.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/q8_act.h"

namespace oomless {

// ggml tensor types, numbered as in ggml.h (gaps are types ggml removed).
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

struct GgmlTypeInfo {
  const char* name;    // "Q4_K"
  int64_t block_size;  // elements per block (1 for plain types)
  int64_t type_size;   // bytes per block
};
// nullptr for a number that is not a ggml type.
const GgmlTypeInfo* ggml_type_info(uint32_t type);
// "Q4_K", or "unknown type 77".
std::string ggml_type_name(GgmlType t);
// True when dequantize() handles the type.
bool ggml_can_dequantize(GgmlType t);

// Dequantises n elements (a multiple of the type's block size) of type t at src to float32.
// Handles F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K;
// others throw an error naming the type. src needs no alignment. Each element is computed with the same
// float operations, in the same order, as ggml's reference dequantisers (and gguf-py's), so results are
// bit-identical to theirs.
void dequantize(GgmlType t, const void* src, int64_t n, float* dst);
// The loop dequantize() runs for a type: `blocks` consecutive blocks at src (one element each for F32, F16,
// BF16, F64) into dst, no checks, the same bits (the fastest form this CPU has); nullptr for a type without
// a dequantiser. For callers that decode many short runs (rows of a quantised matrix).
using GgmlBlockDecoder = void (*)(const uint8_t* src, int64_t blocks, float* dst);
GgmlBlockDecoder ggml_block_decoder(GgmlType t);
// The one-row product's kernel for a type, where this CPU has one (Q4_0, Q4_1, Q8_0 with AVX2 + FMA + F16C):
// acc[8 i + l] += a[k] * x_i[k] over the k < 32 * blocks with k mod 8 = l, ascending, one fused multiply-add
// each, x_i the elements of the blocks at rows[i] (i < g <= 8) as the decoder gives them, taken from the
// blocks in registers, each row's line `ahead` bytes further prefetched. nullptr where there is none.
using GgmlRowDot = void (*)(const uint8_t* const* rows, int g, int64_t blocks, const float* a, float* acc,
                            int64_t ahead);
GgmlRowDot ggml_row_dot(GgmlType t);
// The one-row product's integer kernel for a type (Q4_0, Q4_1, Q8_0) with the activation row quantised to
// 8 bits (core/q8_act.h): out[i] = the product of the first `blocks` blocks at rows[i] (i < g <= 8) with
// a's, in the order of operations io/gguf_q8dot.cpp states (integer lanes, one fused multiply-add a block,
// the offset term apart; Q4_0 and Q4_1 four rows at a time, each row's line `ahead` bytes further
// prefetched; Q8_0 one row at a time, streamed as it is, without). Its AVX512-VNNI and AVX2
// forms and the plain one give the same bits. nullptr without AVX2 + FMA + F16C (or under
// OOMLESS_ISA=generic); OOMLESS_ISA=avx2 keeps the AVX2 form on a CPU with VNNI.
using GgmlRowDotQ8 = void (*)(const uint8_t* const* rows, int g, int64_t blocks, const Q8Act& a, float* out,
                              int64_t ahead);
GgmlRowDotQ8 ggml_row_dot_q8(GgmlType t);
// The form ggml_row_dot_q8 gives here: "avx512-vnni", "avx2" or "none".
const char* ggml_row_dot_q8_form();
// The plain form, one row (tests compare the vector forms with it); NaN for another type.
float ggml_row_dot_q8_scalar(GgmlType t, const uint8_t* row, int64_t blocks, const Q8Act& a);

enum class GgufValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};
const char* gguf_value_type_name(GgufValueType t);

// One metadata value. Scalars: integers and bool in `i` (a u64 above INT64_MAX is kept in `u` too, and
// `i` then holds the same bits), floats in `f`, strings in `s`. Arrays: `elem` is the element type and
// exactly one of ints / floats / strings / arrays holds the elements (u64 elements above INT64_MAX keep
// their bit pattern in ints).
struct GgufValue {
  GgufValueType type = GgufValueType::u8;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  GgufValueType elem = GgufValueType::u8;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  std::vector<GgufValue> arrays;

  bool is_int() const;    // any integer type (not bool)
  bool is_float() const;  // f32 / f64
  bool is_array() const { return type == GgufValueType::array; }
  size_t array_size() const;
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> ne;  // ne[0] fastest; the HF shape is ne reversed
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;      // from the start of the data section
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  int64_t numel() const;
};

class GgufFile {
 public:
  // Maps the file read-only and parses header, metadata and tensor infos; tensor data stays mapped.
  static GgufFile open(const std::string& path);
  // Parses a copy of the given bytes (fuzzing, tests); `name` stands for the path in messages.
  static GgufFile from_bytes(const void* data, size_t n, const std::string& name = "<memory>");

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the data section

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: missing keys and wrong types throw errors that name the key and the file.
  std::string get_string(std::string_view key) const;
  int64_t get_int(std::string_view key) const;     // any integer type
  double get_float(std::string_view key) const;    // f32/f64, or an integer
  bool get_bool(std::string_view key) const;
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  const std::vector<int64_t>& get_int_array(std::string_view key) const;
  const std::vector<double>& get_float_array(std::string_view key) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* tensor(std::string_view name) const;

 private:
  struct Storage;
  static GgufFile parse(std::shared_ptr<const Storage> storage, const std::string& path);
  const GgufValue& require(std::string_view key, const char* want) const;

  std::shared_ptr<const Storage> storage_;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// ---------------------------------------------------------------------------------------------------------
// Writing (oomless convert --out FILE.gguf): version 3, alignment 32, metadata in the given order, then the
// tensor infos and the data, each tensor's bytes produced when it is written (a model is never held twice).

// Metadata values for the writer.
GgufValue gguf_u32(uint32_t v);
GgufValue gguf_i32(int32_t v);
GgufValue gguf_f32(float v);
GgufValue gguf_bool(bool v);
GgufValue gguf_str(std::string v);
GgufValue gguf_str_array(std::vector<std::string> v);
GgufValue gguf_i32_array(std::vector<int64_t> v);
GgufValue gguf_f32_array(std::vector<double> v);

struct GgufWriteTensor {
  std::string name;
  std::vector<int64_t> ne;   // ne[0] fastest (the HF shape reversed)
  GgmlType type = GgmlType::F32;
  // Writes exactly the tensor's bytes (numel / block size x type size) into out.
  std::function<void(uint8_t* out)> fill;
};

// Writes PATH atomically (a temporary file fsynced, then renamed). Errors name the path.
void write_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
                const std::vector<GgufWriteTensor>& tensors);

// n float32 values (a multiple of 32) as Q8_0 blocks, bit-identical to gguf-py's quantize (and ggml's
// reference): per 32 values d = max|x| / 127 stored as f16, q = round-half-away(x / d) as int8.
void quantize_q8_0(const float* x, int64_t n, uint8_t* out);
// n float32 values (a multiple of 256) as Q4_K blocks that ggml's dequantiser reads: per 32 values a 6-bit
// scale and min (of the block's d and dmin, f16) rounded up so that the sub-block's range is covered, and
// 4-bit codes rounded to nearest: every value within half its sub-block's step d * scale. A direct min/max
// quantiser, not llama.cpp's iterative search (whose error is somewhat smaller).
void quantize_q4_k(const float* x, int64_t n, uint8_t* out);

}  // namespace oomless
