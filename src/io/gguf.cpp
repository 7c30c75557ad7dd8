// GGUF parsing: see gguf.h for the layout. Every read goes through Cursor, which checks the bytes that
// remain first; counts are checked against the smallest encoding of what they count before anything is
// reserved, so a lying header costs an error, not memory.
#include "io/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace oomless {

namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {"F32", 1, 4},       {"F16", 1, 2},      {"Q4_0", 32, 18},    {"Q4_1", 32, 20},   {nullptr, 0, 0},
    {nullptr, 0, 0},     {"Q5_0", 32, 22},   {"Q5_1", 32, 24},    {"Q8_0", 32, 34},
    // ggml's block_q8_1 is {f16 d, f16 s, i8 qs[32]}: 36 bytes. (gguf-py lists 40, an older layout;
    // Q8_1 is a matmul-activation type that files do not hold.)
    {"Q8_1", 32, 36},    {"Q2_K", 256, 84},  {"Q3_K", 256, 110},  {"Q4_K", 256, 144}, {"Q5_K", 256, 176},
    {"Q6_K", 256, 210},  {"Q8_K", 256, 292}, {"IQ2_XXS", 256, 66}, {"IQ2_XS", 256, 74}, {"IQ3_XXS", 256, 98},
    {"IQ1_S", 256, 50},  {"IQ4_NL", 32, 18}, {"IQ3_S", 256, 110}, {"IQ2_S", 256, 82},  {"IQ4_XS", 256, 136},
    {"I8", 1, 1},        {"I16", 1, 2},      {"I32", 1, 4},       {"I64", 1, 8},      {"F64", 1, 8},
    {"IQ1_M", 256, 56},  {"BF16", 1, 2},     {nullptr, 0, 0},     {nullptr, 0, 0},    {nullptr, 0, 0},
    {"TQ1_0", 256, 54},  {"TQ2_0", 256, 66}, {nullptr, 0, 0},     {nullptr, 0, 0},    {nullptr, 0, 0},
    {"MXFP4", 32, 17},   {"NVFP4", 64, 36},  {"Q1_0", 128, 18},
};

// Nested arrays are legal GGUF but nothing real nests deeper than two; the limit keeps recursion bounded.
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;
// Real files hold hundreds of keys and at most tens of thousands of tensors; the caps keep a lying
// header in a large file from making the parser allocate many times the file's size.
constexpr uint64_t kMaxEntries = uint64_t{1} << 20;
constexpr uint64_t kMaxNestedArray = uint64_t{1} << 16;

bool add_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_add_overflow(a, b, out); }

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t type) {
  if (type >= sizeof(kTypes) / sizeof(kTypes[0]) || kTypes[type].name == nullptr) return nullptr;
  return &kTypes[type];
}

std::string ggml_type_name(GgmlType t) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t));
  return info ? info->name : "unknown type " + std::to_string(static_cast<uint32_t>(t));
}

const char* gguf_value_type_name(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8: return "uint8";
    case GgufValueType::i8: return "int8";
    case GgufValueType::u16: return "uint16";
    case GgufValueType::i16: return "int16";
    case GgufValueType::u32: return "uint32";
    case GgufValueType::i32: return "int32";
    case GgufValueType::f32: return "float32";
    case GgufValueType::boolean: return "bool";
    case GgufValueType::string: return "string";
    case GgufValueType::array: return "array";
    case GgufValueType::u64: return "uint64";
    case GgufValueType::i64: return "int64";
    case GgufValueType::f64: return "float64";
  }
  return "unknown";
}

static bool type_is_int(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8: case GgufValueType::i8: case GgufValueType::u16: case GgufValueType::i16:
    case GgufValueType::u32: case GgufValueType::i32: case GgufValueType::u64: case GgufValueType::i64:
      return true;
    default: return false;
  }
}

bool GgufValue::is_int() const { return type_is_int(type); }
bool GgufValue::is_float() const { return type == GgufValueType::f32 || type == GgufValueType::f64; }
size_t GgufValue::array_size() const {
  return ints.size() + floats.size() + strings.size() + arrays.size();
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // checked at parse time
  return n;
}

// The bytes of one file: an mmap (unmapped on destruction) or an owned copy.
struct GgufFile::Storage {
  const uint8_t* data = nullptr;
  size_t size = 0;
  void* map = nullptr;
  std::vector<uint8_t> copy;
  ~Storage() {
    if (map) munmap(map, size);
  }
};

namespace {

struct Cursor {
  const uint8_t* base;
  uint64_t size;
  uint64_t pos = 0;
  const std::string& path;

  uint64_t left() const { return size - pos; }

  [[noreturn]] void bad(const std::string& what) const {
    fail("[gguf] ", path, ": ", what, " (at byte ", pos, " of ", size,
         "); the file is truncated or not a valid GGUF: re-download or re-convert it");
  }
  void need(uint64_t n, const char* what) const {
    if (n > left()) bad(std::string(what) + " needs " + std::to_string(n) + " bytes but only " +
                        std::to_string(left()) + " remain");
  }
  template <class T> T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    uint64_t n = get<uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(base + pos), n);
    pos += n;
    return s;
  }
};

uint64_t value_min_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8: case GgufValueType::i8: case GgufValueType::boolean: return 1;
    case GgufValueType::u16: case GgufValueType::i16: return 2;
    case GgufValueType::u32: case GgufValueType::i32: case GgufValueType::f32: return 4;
    case GgufValueType::u64: case GgufValueType::i64: case GgufValueType::f64: return 8;
    case GgufValueType::string: return 8;   // the length
    case GgufValueType::array: return 12;   // element type + count
  }
  return 1;
}

GgufValueType read_type(Cursor& c, const std::string& key) {
  uint32_t t = c.get<uint32_t>("a value type");
  if (t > static_cast<uint32_t>(GgufValueType::f64))
    c.bad("metadata \"" + key + "\" has unknown value type " + std::to_string(t) + " (known: 0..12)");
  return static_cast<GgufValueType>(t);
}

// Reads one scalar of type t into v's scalar fields.
void read_scalar(Cursor& c, GgufValueType t, GgufValue& v, const std::string& key) {
  switch (t) {
    case GgufValueType::u8: v.i = c.get<uint8_t>("a uint8"); break;
    case GgufValueType::i8: v.i = c.get<int8_t>("an int8"); break;
    case GgufValueType::u16: v.i = c.get<uint16_t>("a uint16"); break;
    case GgufValueType::i16: v.i = c.get<int16_t>("an int16"); break;
    case GgufValueType::u32: v.i = c.get<uint32_t>("a uint32"); break;
    case GgufValueType::i32: v.i = c.get<int32_t>("an int32"); break;
    case GgufValueType::u64: v.u = c.get<uint64_t>("a uint64"); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::i64: v.i = c.get<int64_t>("an int64"); break;
    case GgufValueType::f32: v.f = c.get<float>("a float32"); break;
    case GgufValueType::f64: v.f = c.get<double>("a float64"); break;
    case GgufValueType::boolean: {
      uint8_t b = c.get<uint8_t>("a bool");
      if (b > 1) c.bad("metadata \"" + key + "\" has bool byte " + std::to_string(b) + " (must be 0 or 1)");
      v.i = b;
      break;
    }
    case GgufValueType::string: v.s = c.str("a string"); break;
    case GgufValueType::array: break;  // handled by read_value
  }
  if (t != GgufValueType::u64 && type_is_int(t)) v.u = static_cast<uint64_t>(v.i);
}

void read_value(Cursor& c, GgufValueType t, GgufValue& v, const std::string& key, int depth) {
  v.type = t;
  if (t != GgufValueType::array) {
    read_scalar(c, t, v, key);
    return;
  }
  if (depth >= kMaxArrayDepth) c.bad("metadata \"" + key + "\" nests arrays deeper than " + std::to_string(kMaxArrayDepth));
  v.elem = read_type(c, key);
  uint64_t n = c.get<uint64_t>("an array length");
  if (n > c.left() / value_min_size(v.elem))
    c.bad("metadata \"" + key + "\" claims " + std::to_string(n) + " " + gguf_value_type_name(v.elem) +
          " elements, more than the bytes that remain can hold");
  if (v.elem == GgufValueType::array && n > kMaxNestedArray)
    c.bad("metadata \"" + key + "\" holds " + std::to_string(n) + " nested arrays (at most " +
          std::to_string(kMaxNestedArray) + " are supported)");
  if (v.elem == GgufValueType::string) {
    v.strings.reserve(n);
    for (uint64_t k = 0; k < n; ++k) v.strings.push_back(c.str("an array string"));
  } else if (v.elem == GgufValueType::array) {
    v.arrays.resize(n);
    // Each element is itself {u32 element type, u64 count, elements}; no per-element value type.
    for (uint64_t k = 0; k < n; ++k) read_value(c, GgufValueType::array, v.arrays[k], key, depth + 1);
  } else if (v.elem == GgufValueType::f32 || v.elem == GgufValueType::f64) {
    v.floats.resize(n);
    GgufValue tmp;
    for (uint64_t k = 0; k < n; ++k) {
      read_scalar(c, v.elem, tmp, key);
      v.floats[k] = tmp.f;
    }
  } else {
    v.ints.resize(n);
    GgufValue tmp;
    for (uint64_t k = 0; k < n; ++k) {
      read_scalar(c, v.elem, tmp, key);
      v.ints[k] = tmp.i;
    }
  }
}

}  // namespace

GgufFile GgufFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("[gguf] ", path, ": cannot open: ", std::strerror(errno), "; check the path");
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("[gguf] ", path, ": not a regular file; pass the path of a .gguf file");
  }
  auto storage = std::make_shared<Storage>();
  storage->size = static_cast<size_t>(st.st_size);
  if (storage->size > 0) {
    void* m = mmap(nullptr, storage->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail("[gguf] ", path, ": mmap failed: ", std::strerror(e));
    }
    storage->map = m;
    storage->data = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  return parse(std::move(storage), path);
}

GgufFile GgufFile::from_bytes(const void* data, size_t n, const std::string& name) {
  auto storage = std::make_shared<Storage>();
  storage->copy.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  storage->data = storage->copy.data();
  storage->size = n;
  return parse(std::move(storage), name);
}

GgufFile GgufFile::parse(std::shared_ptr<const Storage> storage, const std::string& path) {
  GgufFile f;
  f.storage_ = storage;
  f.path_ = path;
  Cursor c{storage->data, storage->size, 0, f.path_};

  if (c.size < 4 || std::memcmp(c.base, "GGUF", 4) != 0)
    fail("[gguf] ", path, ": not a GGUF file (the first 4 bytes are not \"GGUF\"); pass a .gguf model file");
  c.pos = 4;
  f.version_ = c.get<uint32_t>("the version");
  if (f.version_ != 2 && f.version_ != 3) {
    // A big-endian GGUF reads as a byte-swapped small version.
    const uint32_t v = f.version_;
    const uint32_t swapped = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
    if (swapped == 2 || swapped == 3)
      fail("[gguf] ", path, ": big-endian GGUF is not supported; convert the model on a little-endian machine");
    fail("[gguf] ", path, ": unsupported GGUF version ", v,
         " (supported: 2 and 3; version 1 files predate 64-bit counts): re-convert with a current llama.cpp");
  }
  const uint64_t n_tensors = c.get<uint64_t>("the tensor count");
  const uint64_t n_kv = c.get<uint64_t>("the metadata count");
  // Smallest encodings: a key/value pair is key length (8) + type (4) + a one-byte value; a tensor info
  // is name length (8) + n_dims (4) + type (4) + offset (8).
  if (n_kv > c.left() / 13)
    c.bad("the header claims " + std::to_string(n_kv) + " metadata entries, more than the file can hold");
  if (n_tensors > c.left() / 24)
    c.bad("the header claims " + std::to_string(n_tensors) + " tensors, more than the file can hold");

  if (n_kv > kMaxEntries || n_tensors > kMaxEntries)
    c.bad("the header claims " + std::to_string(n_kv) + " metadata entries and " + std::to_string(n_tensors) +
          " tensors (at most " + std::to_string(kMaxEntries) + " of each are supported)");
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.str("a metadata key");
    GgufValueType t = read_type(c, key);
    GgufValue v;
    read_value(c, t, v, key, 0);
    if (!f.kv_index_.emplace(key, f.kv_.size()).second)
      c.bad("metadata key \"" + key + "\" appears twice");
    f.kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const GgufValue* a = f.find("general.alignment")) {
    if (a->type != GgufValueType::u32)
      fail("[gguf] ", path, ": general.alignment has type ", gguf_value_type_name(a->type),
           " (must be uint32); the file was written by a broken converter");
    if (a->i == 0 || (a->i & (a->i - 1)) != 0)
      fail("[gguf] ", path, ": general.alignment = ", a->i, " is not a power of two; the file is corrupt");
    f.alignment_ = static_cast<uint64_t>(a->i);
  }

  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    t.name = c.str("a tensor name");
    const uint32_t n_dims = c.get<uint32_t>("a tensor's n_dims");
    if (n_dims > kMaxDims)
      c.bad("tensor \"" + t.name + "\" has " + std::to_string(n_dims) + " dimensions (at most 4 are allowed)");
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = c.get<uint64_t>("a tensor dimension");
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        c.bad("tensor \"" + t.name + "\" has a negative dimension");
      t.ne.push_back(static_cast<int64_t>(ne));
      if (__builtin_mul_overflow(numel, static_cast<int64_t>(ne), &numel))
        c.bad("tensor \"" + t.name + "\" has more elements than 64 bits can count");
    }
    const uint32_t type = c.get<uint32_t>("a tensor type");
    const GgmlTypeInfo* info = ggml_type_info(type);
    if (!info)
      c.bad("tensor \"" + t.name + "\" has unknown ggml type " + std::to_string(type) +
            "; the file may need a newer reader");
    t.type = static_cast<GgmlType>(type);
    t.offset = c.get<uint64_t>("a tensor offset");
    // ggml requires whole blocks in every row; rows are ne[0] long.
    const int64_t row = t.ne.empty() ? 1 : t.ne[0];
    if (row % info->block_size != 0)
      c.bad("tensor \"" + t.name + "\" has rows of " + std::to_string(row) + " elements, not a multiple of " +
            info->name + "'s block size " + std::to_string(info->block_size));
    int64_t nbytes = 0;
    if (__builtin_mul_overflow(numel / info->block_size, info->type_size, &nbytes))
      c.bad("tensor \"" + t.name + "\" is larger than 64 bits can count");
    t.nbytes = static_cast<uint64_t>(nbytes);
    if (t.offset % f.alignment_ != 0)
      c.bad("tensor \"" + t.name + "\" has offset " + std::to_string(t.offset) + ", not a multiple of the alignment " +
            std::to_string(f.alignment_));
    if (!f.tensor_index_.emplace(t.name, f.tensors_.size()).second)
      c.bad("tensor \"" + t.name + "\" appears twice");
    f.tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment (it may be past the end when there
  // is no tensor data at all).
  uint64_t start = c.pos;
  const uint64_t rem = start % f.alignment_;
  if (rem != 0 && add_overflows(start, f.alignment_ - rem, &start))
    fail("[gguf] ", path, ": data section offset overflows; the file is corrupt");
  f.data_offset_ = start;
  const uint64_t data_size = start <= c.size ? c.size - start : 0;

  std::vector<size_t> order(f.tensors_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return f.tensors_[a].offset < f.tensors_[b].offset;
  });
  uint64_t prev_end = 0;
  const GgufTensor* prev = nullptr;
  for (size_t k : order) {
    GgufTensor& t = f.tensors_[k];
    uint64_t end = 0;
    if (add_overflows(t.offset, t.nbytes, &end) || end > data_size)
      fail("[gguf] ", path, ": tensor \"", t.name, "\" (", t.nbytes, " bytes at data offset ", t.offset,
           ") lies outside the file's ", data_size, " bytes of tensor data; the file is truncated: re-download it");
    if (prev && t.nbytes > 0 && t.offset < prev_end)
      fail("[gguf] ", path, ": tensors \"", prev->name, "\" and \"", t.name,
           "\" overlap in the data section; the file is corrupt");
    t.data = t.nbytes > 0 ? c.base + start + t.offset : nullptr;
    if (t.nbytes > 0) {
      prev_end = end;
      prev = &t;
    }
  }
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensor* GgufFile::tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue& GgufFile::require(std::string_view key, const char* want) const {
  const GgufValue* v = find(key);
  if (!v) fail("[gguf] ", path_, ": metadata key \"", key, "\" is missing (wanted ", want, ")");
  return *v;
}

static std::string describe(const GgufValue& v) {
  if (v.is_array()) return std::string("array of ") + gguf_value_type_name(v.elem);
  return gguf_value_type_name(v.type);
}

std::string GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = require(key, "a string");
  if (v.type != GgufValueType::string)
    fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected a string");
  return v.s;
}

int64_t GgufFile::get_int(std::string_view key) const {
  const GgufValue& v = require(key, "an integer");
  if (!v.is_int()) fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected an integer");
  if (v.type == GgufValueType::u64 && v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    fail("[gguf] ", path_, ": metadata \"", key, "\" = ", v.u, " does not fit a signed 64-bit integer");
  return v.i;
}

double GgufFile::get_float(std::string_view key) const {
  const GgufValue& v = require(key, "a number");
  if (v.is_float()) return v.f;
  if (v.is_int()) return v.type == GgufValueType::u64 ? static_cast<double>(v.u) : static_cast<double>(v.i);
  fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected a number");
}

bool GgufFile::get_bool(std::string_view key) const {
  const GgufValue& v = require(key, "a bool");
  if (v.type != GgufValueType::boolean)
    fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected a bool");
  return v.i != 0;
}

const std::vector<std::string>& GgufFile::get_string_array(std::string_view key) const {
  const GgufValue& v = require(key, "an array of strings");
  if (!v.is_array() || v.elem != GgufValueType::string)
    fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected an array of strings");
  return v.strings;
}

const std::vector<int64_t>& GgufFile::get_int_array(std::string_view key) const {
  const GgufValue& v = require(key, "an array of integers");
  if (!v.is_array() || !(type_is_int(v.elem) || v.elem == GgufValueType::boolean))
    fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected an array of integers");
  return v.ints;
}

const std::vector<double>& GgufFile::get_float_array(std::string_view key) const {
  const GgufValue& v = require(key, "an array of floats");
  if (!v.is_array() || (v.elem != GgufValueType::f32 && v.elem != GgufValueType::f64))
    fail("[gguf] ", path_, ": metadata \"", key, "\" is ", describe(v), ", expected an array of floats");
  return v.floats;
}

}  // namespace oomless
