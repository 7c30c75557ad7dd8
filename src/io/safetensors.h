// The safetensors checkpoint format: read (memory-mapped, validated) and write.
//
// File layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str} (optional), NAME: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
// then the data buffer; offsets are relative to its start (byte 8 + N).
//
// Opening checks everything that could make a later read go out of bounds or misread: the header
// length and JSON, each entry's fields and dtype, shape products without overflow, offsets inside the
// data buffer, each tensor's byte size against numel x dtype size, and that no two tensors overlap
// (holes between tensors are allowed). Every error is an oomless::Error "[safetensors] FILE: ...".
//
// Tensor data pointers point into the read-only mapping and live as long as the SafetensorsFile.
// They are aligned to the element size when the writer aligned them (ours and the reference writer
// pad the header to 8 bytes and place larger dtypes first); read_as_f32 does not rely on it.
// A file truncated by another process while mapped would fault on access: do not rewrite
// checkpoints in place while they are being read (write_safetensors replaces files atomically).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace oomless {

struct StTensor {
  std::string name;
  // The file's dtype string: "F32", "F64", "BF16", "F16", "I64", "I32", "I16", "I8", "U64", "U32",
  // "U16", "U8", "BOOL", "F8_E4M3", "F8_E5M2".
  std::string dtype_name;
  std::optional<DType> dtype;  // set for F32, F64, BF16, F16, I32, I8, F8_E4M3, F8_E5M2
  std::vector<int64_t> shape;  // empty for a 0-d (scalar) tensor
  const void* data = nullptr;  // into the mapping; may be unaligned for files from other writers
  uint64_t nbytes = 0;
  uint64_t offset = 0;  // of the data in the file (not in the data buffer)
  std::string file;     // the path of the file holding it, for error messages

  int64_t numel() const;
};

// One .safetensors file, memory-mapped read-only. Move-only.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // In file order (ascending data offset), which is the order to read them in.
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const StTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<StTensor> tensors_;
  std::vector<uint32_t> by_name_;  // indices into tensors_, sorted by name
  std::map<std::string, std::string> metadata_;
};

// A model's weights: a folder holding model.safetensors, or model.safetensors.index.json
// ({"weight_map": {tensor name: shard file}}) and its shards; or the path of a single .safetensors
// file or of an index file. Tensor names must be unique across shards, and the index must match the
// shards exactly (every listed tensor in its shard, no unlisted tensors), else open throws.
class SafetensorsSet {
 public:
  static SafetensorsSet open(const std::string& dir_or_file);

  const StTensor* find(std::string_view name) const;
  // Every tensor, sorted by name.
  std::vector<const StTensor*> all() const;
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, const StTensor*, std::less<>> by_name_;
};

// Reads a F32, BF16, F16 or F64 tensor as float32 into out (numel floats), after checking that its
// shape is expect_shape: the error names the file (t.file unless `file` is given), the tensor, and the
// expected and found shapes. F64 values round to nearest; out of range values become +-inf.
void read_as_f32(const StTensor& t, std::span<const int64_t> expect_shape, float* out, std::string_view file = {});

struct StWrite {
  std::string name;
  DType dtype;                  // f32, f64, bf16, f16, i32, i8, f8_e4m3 or f8_e5m2
  std::vector<int64_t> shape;   // empty for a 0-d tensor
  const void* data = nullptr;   // numel elements; may be null when numel is 0 or `read` is given
  // Instead of data: fills dst with the tensor's bytes [offset, offset + n), called in order over the
  // tensor in pieces of at most a few MiB (a tensor streamed from disk, never whole in memory).
  std::function<void(void* dst, size_t offset, size_t n)> read = {};
};

class Ops;
// A tensor of the engine's memory as an entry read through `ops` (downloaded in the writer's pieces, never
// read on the host where it lies); with as_bf16 an f32 tensor is written as bf16 (rounded to nearest even).
StWrite tensor_entry(Ops& ops, std::string name, const Tensor& t, bool as_bf16 = false);
// The same written in dtype `as` (any float dtype from any float dtype, converted piece by piece as `convert`
// does; as its own dtype, its bytes).
StWrite tensor_entry(Ops& ops, std::string name, const Tensor& t, DType as);

// Writes a .safetensors file that the reference (Python/Rust) library reads and writes identically:
// tensors ordered by dtype size (largest first, so every tensor is aligned) then by name, a compact
// JSON header padded with spaces to a multiple of 8 bytes, metadata (if any) as "__metadata__".
// Atomic: writes PATH.tmp, fsyncs it, renames it over PATH and fsyncs the folder, so a crash leaves
// either the old file or the new one.
void write_safetensors(const std::string& path, const std::vector<StWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same bytes handed to `sink` in order (checkpoints write them to their own fds); `path` names the
// destination in error messages.
void write_safetensors_stream(const std::vector<StWrite>& tensors, const std::map<std::string, std::string>& metadata,
                              const std::function<void(const void*, size_t)>& sink, const std::string& path);


}  // namespace oomless
