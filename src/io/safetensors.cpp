// safetensors reading, validation and writing; see safetensors.h for the format.
//
// The header is parsed with the project's JSON parser and every number that later becomes a size or
// an offset is checked before use: shape products and byte sizes use overflow-checked arithmetic, so
// that a hostile header can never make a tensor's span leave the mapping.
#include "io/safetensors.h"

#include "backend/ops.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "io/json.h"

namespace oomless {

namespace {

// The reference implementation's limit; real headers are a few hundred KB at most.
constexpr uint64_t kMaxHeader = 100'000'000;

// rank: position in the reference implementation's dtype enum. Its writer orders tensors by
// descending rank, which puts wider types first and keeps every tensor aligned.
struct DtInfo {
  const char* name;
  int size;
  int rank;
  std::optional<DType> dtype;
};

constexpr DtInfo kDtypes[] = {
    {"BOOL", 1, 0, std::nullopt},         {"U8", 1, 4, DType::u8},
    {"I8", 1, 5, DType::i8},              {"F8_E5M2", 1, 6, DType::f8_e5m2},
    {"F8_E4M3", 1, 7, DType::f8_e4m3},    {"I16", 2, 9, std::nullopt},
    {"U16", 2, 10, std::nullopt},         {"F16", 2, 11, DType::f16},
    {"BF16", 2, 12, DType::bf16},         {"I32", 4, 13, DType::i32},
    {"U32", 4, 14, std::nullopt},         {"F32", 4, 15, DType::f32},
    {"F64", 8, 17, DType::f64},           {"I64", 8, 18, std::nullopt},
    {"U64", 8, 19, std::nullopt},
};

const DtInfo* dtype_info(std::string_view name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

const DtInfo* dtype_info(DType t) {
  for (const auto& d : kDtypes) {
    if (d.dtype == t) return &d;
  }
  return nullptr;
}

std::string shape_str(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

constexpr const char* kCorrupt = "; the file is truncated or corrupt — re-download it";

// A non-negative integer field of a header entry.
uint64_t header_uint(const json::Value& v, const std::string& file, const std::string& name, const char* field) {
  if (!v.is_integer() || v.as_int() < 0) {
    fail("[safetensors] ", file, ": tensor '", name, "': ", field, " must hold non-negative integers, found ",
         json::dump(v), kCorrupt);
  }
  return static_cast<uint64_t>(v.as_int());
}

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // checked at open: the product fits
  return n;
}

// ---- SafetensorsFile ----

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      map_size_(std::exchange(o.map_size_, 0)),
      tensors_(std::move(o.tensors_)),
      by_name_(std::move(o.by_name_)),
      metadata_(std::move(o.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    tensors_ = std::move(o.tensors_);
    by_name_ = std::move(o.by_name_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("[safetensors] ", path, ": cannot open the file (", errno_text(errno), "); check the path");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    if (S_ISDIR(st.st_mode)) fail("[safetensors] ", path, ": is a folder, not a .safetensors file");
    fail("[safetensors] ", path, ": not a regular file (", errno_text(err), ")");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail("[safetensors] ", path, ": the file is ", size, " bytes, too short for the 8-byte header length", kCorrupt);
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file open
  if (m == MAP_FAILED) fail("[safetensors] ", path, ": cannot map the file (", errno_text(map_err), ")");
  f.map_ = m;
  f.map_size_ = size;
  const auto* bytes = static_cast<const unsigned char*>(m);

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n < 2) fail("[safetensors] ", path, ": the header length is ", n, " bytes, too short for a JSON header", kCorrupt);
  if (n > kMaxHeader) {
    fail("[safetensors] ", path, ": the header length is ", n, " bytes, above the ", kMaxHeader,
         "-byte limit; this is not a safetensors file or it is corrupt");
  }
  if (n > size - 8) {
    fail("[safetensors] ", path, ": the header length is ", n, " bytes but only ", size - 8,
         " bytes follow the length field", kCorrupt);
  }
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = size - data_start;

  json::Value header;
  try {
    header = json::parse(std::string_view(reinterpret_cast<const char*>(bytes + 8), n), "header");
  } catch (const Error& e) {
    std::string_view msg = e.what();
    if (msg.starts_with("[json] ")) msg.remove_prefix(7);
    fail("[safetensors] ", path, ": the JSON header is malformed (", msg, ")", kCorrupt);
  }
  if (!header.is_object()) {
    fail("[safetensors] ", path, ": the header is a JSON ", json::Value::kind_name(header.kind()),
         ", not an object", kCorrupt);
  }

  for (const auto& member : header.as_object()) {
    // Plain references, not a structured binding: the lambda below captures the name.
    const std::string& name = member.first;
    const json::Value& entry = member.second;
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("[safetensors] ", path, ": __metadata__ is not an object", kCorrupt);
      for (const auto& [k, v] : entry.as_object()) {
        if (!v.is_string()) {
          fail("[safetensors] ", path, ": __metadata__ value for '", k, "' is a ",
               json::Value::kind_name(v.kind()), ", not a string", kCorrupt);
        }
        f.metadata_.emplace(k, v.as_string());
      }
      continue;
    }
    const auto prefix = [&] { return "[safetensors] " + path + ": tensor '" + name + "': "; };
    if (!entry.is_object()) fail(prefix(), "the entry is not an object", kCorrupt);
    const json::Value* dt = entry.find("dtype");
    const json::Value* shape = entry.find("shape");
    const json::Value* offs = entry.find("data_offsets");
    if (!dt || !dt->is_string()) fail(prefix(), "\"dtype\" is missing or not a string", kCorrupt);
    if (!shape || !shape->is_array()) fail(prefix(), "\"shape\" is missing or not an array", kCorrupt);
    if (!offs || !offs->is_array() || offs->size() != 2) {
      fail(prefix(), "\"data_offsets\" is missing or not an array of two integers", kCorrupt);
    }
    const DtInfo* info = dtype_info(dt->as_string());
    if (!info) {
      std::string known;
      for (const auto& d : kDtypes) known += std::string(known.empty() ? "" : ", ") + d.name;
      fail(prefix(), "unknown dtype \"", dt->as_string(), "\" (known: ", known,
           "); the file is corrupt or needs a newer reader");
    }

    StTensor t;
    t.name = name;
    t.dtype_name = info->name;
    t.dtype = info->dtype;
    t.file = path;
    uint64_t numel = 1;
    for (const auto& d : shape->as_array()) {
      const uint64_t dim = header_uint(d, path, name, "shape");
      if (__builtin_mul_overflow(numel, dim, &numel) || numel > static_cast<uint64_t>(INT64_MAX)) {
        fail(prefix(), "shape ", json::dump(*shape), " has more elements than fit in 64 bits", kCorrupt);
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(info->size), &nbytes)) {
      fail(prefix(), "shape ", json::dump(*shape), " x ", info->size, " bytes overflows 64 bits", kCorrupt);
    }
    const uint64_t begin = header_uint((*offs)[0], path, name, "data_offsets");
    const uint64_t end = header_uint((*offs)[1], path, name, "data_offsets");
    if (begin > end) fail(prefix(), "data_offsets [", begin, ", ", end, "] end before they begin", kCorrupt);
    if (end > data_size) {
      fail(prefix(), "data_offsets [", begin, ", ", end, "] exceed the data size ", data_size, kCorrupt);
    }
    if (end - begin != nbytes) {
      fail(prefix(), "data_offsets [", begin, ", ", end, "] span ", end - begin, " bytes but ", info->name, " ",
           shape_str(t.shape), " needs ", nbytes, kCorrupt);
    }
    t.nbytes = nbytes;
    t.offset = data_start + begin;
    t.data = bytes + t.offset;
    f.tensors_.push_back(std::move(t));
  }

  // File order; empty tensors first at equal offsets so that they never look like an overlap.
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const StTensor& a, const StTensor& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  const StTensor* last = nullptr;
  for (const auto& t : f.tensors_) {
    if (t.nbytes == 0) continue;
    if (last && t.offset < last->offset + last->nbytes) {
      fail("[safetensors] ", path, ": tensors '", last->name, "' [", last->offset - data_start, ", ",
           last->offset - data_start + last->nbytes, ") and '", t.name, "' [", t.offset - data_start, ", ",
           t.offset - data_start + t.nbytes, ") overlap", kCorrupt);
    }
    last = &t;
  }
  if (f.tensors_.size() > UINT32_MAX) fail("[safetensors] ", path, ": too many tensors");
  f.by_name_.resize(f.tensors_.size());
  for (size_t i = 0; i < f.by_name_.size(); ++i) f.by_name_[i] = static_cast<uint32_t>(i);
  std::sort(f.by_name_.begin(), f.by_name_.end(),
            [&](uint32_t a, uint32_t b) { return f.tensors_[a].name < f.tensors_[b].name; });
  return f;
}

const StTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [&](uint32_t i, std::string_view n) { return tensors_[i].name < n; });
  if (it == by_name_.end() || tensors_[*it].name != name) return nullptr;
  return &tensors_[*it];
}

// ---- SafetensorsSet ----

namespace {

namespace fs = std::filesystem;

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

SafetensorsSet SafetensorsSet::open(const std::string& dir_or_file) {
  SafetensorsSet set;
  std::error_code ec;
  const fs::path p(dir_or_file);
  const auto status = fs::status(p, ec);
  if (ec || !fs::exists(status)) {
    fail("[safetensors] ", dir_or_file, ": cannot access it (", ec ? ec.message() : "no such file or folder",
         "); give a model folder or a .safetensors file");
  }
  fs::path index_path;
  if (fs::is_directory(status)) {
    if (is_file(p / "model.safetensors")) {
      set.files_.push_back(SafetensorsFile::open((p / "model.safetensors").string()));
    } else if (is_file(p / "model.safetensors.index.json")) {
      index_path = p / "model.safetensors.index.json";
    } else {
      fail("[safetensors] ", dir_or_file, ": the folder holds neither model.safetensors nor "
           "model.safetensors.index.json; give the folder of a safetensors model or a .safetensors file");
    }
  } else if (dir_or_file.ends_with(".index.json")) {
    index_path = p;
  } else {
    set.files_.push_back(SafetensorsFile::open(dir_or_file));
  }

  // Index: weight_map lists each tensor's shard; the shards must hold exactly those tensors.
  std::map<std::string, std::string> listed;  // tensor -> shard file name
  if (!index_path.empty()) {
    const std::string ipath = index_path.string();
    json::Value index;
    try {
      index = json::parse_file(ipath);
    } catch (const Error& e) {
      fail("[safetensors] ", ipath, ": cannot read the index (", e.what(), "); re-download it");
    }
    const json::Value* wm = index.find("weight_map");
    if (!wm || !wm->is_object()) {
      fail("[safetensors] ", ipath, ": no \"weight_map\" object mapping tensor names to shard files; re-download it");
    }
    std::vector<std::string> shards;
    std::set<std::string> seen;
    for (const auto& [name, shard] : wm->as_object()) {
      if (!shard.is_string()) {
        fail("[safetensors] ", ipath, ": weight_map entry for '", name, "' is a ",
             json::Value::kind_name(shard.kind()), ", not a shard file name; re-download it");
      }
      const std::string& s = shard.as_string();
      const fs::path sp(s);
      bool escapes = s.empty() || sp.is_absolute();
      for (const auto& part : sp) escapes = escapes || part == "..";
      if (escapes) {
        fail("[safetensors] ", ipath, ": shard '", s, "' for tensor '", name,
             "' is not a file name inside the model folder; the index is corrupt — re-download it");
      }
      listed.emplace(name, s);
      if (seen.insert(s).second) shards.push_back(s);
    }
    std::sort(shards.begin(), shards.end());
    const fs::path dir = index_path.parent_path();
    for (const auto& s : shards) {
      const fs::path sp = dir / s;
      if (!is_file(sp)) {
        std::string example;
        for (const auto& [name, shard] : listed) {
          if (shard == s) {
            example = name;
            break;
          }
        }
        fail("[safetensors] ", ipath, ": shard '", s, "' (listed for tensor '", example, "') is missing from ",
             dir.string(), "; the download is incomplete — download every shard");
      }
      set.files_.push_back(SafetensorsFile::open(sp.string()));
    }
  }

  // files_ is complete, so pointers to its tensors stay valid (moving the vector keeps its buffer).
  for (const auto& f : set.files_) {
    for (const auto& t : f.tensors()) {
      const auto [it, inserted] = set.by_name_.emplace(t.name, &t);
      if (!inserted) {
        fail("[safetensors] tensor '", t.name, "' is in both ", it->second->file, " and ", f.path(),
             "; the shards come from different checkpoints — re-download the model");
      }
    }
  }
  if (!index_path.empty()) {
    const std::string ipath = index_path.string();
    const fs::path dir = index_path.parent_path();
    for (const auto& [name, shard] : listed) {
      const auto it = set.by_name_.find(name);
      const std::string want = (dir / shard).string();
      if (it == set.by_name_.end()) {
        fail("[safetensors] ", ipath, ": lists tensor '", name, "' in shard '", shard, "', but ", want,
             " has no such tensor; the shard and the index do not match — re-download them");
      }
      if (it->second->file != want) {
        fail("[safetensors] ", ipath, ": lists tensor '", name, "' in shard '", shard, "', but it is in ",
             it->second->file, "; the shards and the index do not match — re-download them");
      }
    }
    for (const auto& [name, t] : set.by_name_) {
      if (!listed.count(name)) {
        fail("[safetensors] ", t->file, ": holds tensor '", name, "', which ", ipath,
             " does not list; the shards and the index do not match — re-download them");
      }
    }
  }
  return set;
}

const StTensor* SafetensorsSet::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<const StTensor*> SafetensorsSet::all() const {
  std::vector<const StTensor*> out;
  out.reserve(by_name_.size());
  for (const auto& [name, t] : by_name_) out.push_back(t);
  return out;
}

// ---- read_as_f32 ----

void read_as_f32(const StTensor& t, std::span<const int64_t> expect_shape, float* out, std::string_view file) {
  const std::string_view where = file.empty() ? std::string_view(t.file) : file;
  if (!std::equal(t.shape.begin(), t.shape.end(), expect_shape.begin(), expect_shape.end())) {
    fail("[safetensors] ", where, ": tensor '", t.name, "': expected shape ", shape_str(expect_shape), ", found ",
         shape_str(t.shape), "; the checkpoint does not match the model config");
  }
  const bool readable = t.dtype == DType::f32 || t.dtype == DType::bf16 || t.dtype == DType::f16 ||
                        t.dtype == DType::f64;
  if (!readable) {
    fail("[safetensors] ", where, ": tensor '", t.name, "': dtype ", t.dtype_name,
         " cannot be read as float32 (F32, BF16, F16 and F64 can); convert the checkpoint to one of those");
  }
  const DType dt = *t.dtype;
  const int64_t n = t.numel();
  if (n == 0) return;
  const size_t esize = static_cast<size_t>(dtype_bits(dt) / 8);
  if (reinterpret_cast<uintptr_t>(t.data) % esize == 0) {
    convert(out, DType::f32, t.data, dt, n);
    return;
  }
  // Unaligned data (a writer that did not pad): convert through an aligned staging buffer.
  alignas(8) unsigned char stage[1 << 14];
  const int64_t chunk = static_cast<int64_t>(sizeof stage / esize);
  const auto* src = static_cast<const unsigned char*>(t.data);
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min(chunk, n - i);
    std::memcpy(stage, src + static_cast<size_t>(i) * esize, static_cast<size_t>(m) * esize);
    convert(out + i, DType::f32, stage, dt, m);
  }
}

// ---- write ----

namespace {

void write_all(int fd, const void* data, size_t n, const std::string& tmp) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : EIO;
      fail("[safetensors] ", tmp, ": cannot write (", errno_text(err), "); check free disk space and permissions");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

StWrite tensor_entry(Ops& ops, std::string name, const Tensor& t, bool as_bf16) {
  return tensor_entry(ops, std::move(name), t, as_bf16 && t.dtype == DType::f32 ? DType::bf16 : t.dtype);
}

StWrite tensor_entry(Ops& ops, std::string name, const Tensor& t, DType as) {
  StWrite w{std::move(name), as, std::vector<int64_t>(t.dims, t.dims + t.ndim), nullptr, {}};
  if (as != t.dtype) {
    OOM_CHECK(dtype_is_float(as) && dtype_is_float(t.dtype) && dtype_bits(as) % 8 == 0 && dtype_bits(t.dtype) % 8 == 0,
              "[safetensors] tensor '", w.name, "' cannot be written as ", dtype_name(as), " from ",
              dtype_name(t.dtype));
    // Bytes [offset, offset + n) of the converted tensor: its elements [offset / out, (offset + n) / out), read
    // from the source's and converted (the writer's pieces hold whole elements).
    w.read = [&ops, t, as](void* dst, size_t offset, size_t n) {
      const int64_t out = dtype_bytes(as, 1), in = dtype_bytes(t.dtype, 1);
      const int64_t e0 = static_cast<int64_t>(offset) / out, ne = static_cast<int64_t>(n) / out;
      std::vector<char> raw(static_cast<size_t>(ne * in));
      ops.download(raw.data(), Tensor(static_cast<char*>(t.data) + e0 * in, t.dtype, {ne}, t.tier));
      convert(dst, as, raw.data(), t.dtype, ne);
    };
  } else {
    w.read = [&ops, t](void* dst, size_t offset, size_t n) {
      ops.download(dst, Tensor(static_cast<char*>(t.data) + offset, DType::u8, {static_cast<int64_t>(n)}, t.tier));
    };
  }
  return w;
}

void write_safetensors_stream(const std::vector<StWrite>& tensors, const std::map<std::string, std::string>& metadata,
                              const std::function<void(const void*, size_t)>& sink, const std::string& path) {
  struct Item {
    const StWrite* w;
    const DtInfo* info;
    uint64_t nbytes;
  };
  std::vector<Item> items;
  std::set<std::string_view> names;
  for (const auto& w : tensors) {
    const DtInfo* info = dtype_info(w.dtype);
    if (!info) {
      fail("[safetensors] ", path, ": tensor '", w.name, "': dtype ", dtype_name(w.dtype),
           " has no safetensors form; write f32, f64, bf16, f16, i32, i8, u8, f8_e4m3 or f8_e5m2");
    }
    if (w.name == "__metadata__") fail("[safetensors] ", path, ": '__metadata__' is reserved, not a tensor name");
    if (!names.insert(w.name).second) fail("[safetensors] ", path, ": tensor name '", w.name, "' appears twice");
    uint64_t numel = 1;
    for (int64_t d : w.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
          numel > static_cast<uint64_t>(INT64_MAX)) {
        fail("[safetensors] ", path, ": tensor '", w.name, "': invalid shape ", shape_str(w.shape));
      }
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(info->size), &nbytes)) {
      fail("[safetensors] ", path, ": tensor '", w.name, "': shape ", shape_str(w.shape), " is too large");
    }
    if (nbytes > 0 && !w.data && !w.read) fail("[safetensors] ", path, ": tensor '", w.name, "' has no data");
    items.push_back({&w, info, nbytes});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.info->rank != b.info->rank ? a.info->rank > b.info->rank : a.w->name < b.w->name;
  });

  json::Value header = json::Value::object();
  if (!metadata.empty()) {
    json::Value md = json::Value::object();
    for (const auto& [k, v] : metadata) md.set(k, json::Value::string(v));
    header.set("__metadata__", std::move(md));
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    json::Value shape = json::Value::array();
    for (int64_t d : it.w->shape) shape.push_back(json::Value::integer(d));
    json::Value offs = json::Value::array();
    offs.push_back(json::Value::integer(static_cast<int64_t>(offset)));
    offset += it.nbytes;
    offs.push_back(json::Value::integer(static_cast<int64_t>(offset)));
    json::Value e = json::Value::object();
    e.set("dtype", json::Value::string(it.info->name));
    e.set("shape", std::move(shape));
    e.set("data_offsets", std::move(offs));
    header.set(it.w->name, std::move(e));
  }
  std::string text;
  try {
    text = json::dump(header);
  } catch (const Error& e) {
    fail("[safetensors] ", path, ": cannot write the header (", e.what(), "); tensor names and metadata must be UTF-8");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  sink(len, 8);
  sink(text.data(), text.size());
  std::vector<char> piece;
  for (const auto& it : items) {
    if (!it.nbytes) continue;
    if (it.w->data) {
      sink(it.w->data, it.nbytes);
      continue;
    }
    constexpr uint64_t kPiece = 4 << 20;
    piece.resize(static_cast<size_t>(std::min(kPiece, it.nbytes)));
    for (uint64_t o = 0; o < it.nbytes; o += kPiece) {
      const size_t n = static_cast<size_t>(std::min(kPiece, it.nbytes - o));
      it.w->read(piece.data(), static_cast<size_t>(o), n);
      sink(piece.data(), n);
    }
  }
}

void write_safetensors(const std::string& path, const std::vector<StWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("[safetensors] ", tmp, ": cannot create (", errno_text(errno), "); check the folder and permissions");
  try {
    write_safetensors_stream(tensors, metadata, [&](const void* d, size_t n) { write_all(fd, d, n, tmp); }, path);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("[safetensors] ", tmp, ": fsync failed (", errno_text(err), "); check the disk");
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("[safetensors] ", tmp, ": close failed (", errno_text(err), "); check the disk");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("[safetensors] ", path, ": cannot replace it with ", tmp, " (", errno_text(err), ")");
  }
  // Make the rename itself durable.
  const std::string dir = fs::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace oomless
