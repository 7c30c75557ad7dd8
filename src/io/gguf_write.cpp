// The GGUF writer (io/gguf.h): version 3, the layout the reader documents, and Q8_0 as gguf-py quantises.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <filesystem>

#include "core/dtype.h"
#include "core/error.h"
#include "io/gguf.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {
GgufValue scalar_value(GgufValueType t, int64_t i, double f) {
  GgufValue x;
  x.type = t;
  x.i = i;
  x.f = f;
  return x;
}
}  // namespace

GgufValue gguf_u32(uint32_t v) { return scalar_value(GgufValueType::u32, v, 0); }
GgufValue gguf_i32(int32_t v) { return scalar_value(GgufValueType::i32, v, 0); }
GgufValue gguf_f32(float v) { return scalar_value(GgufValueType::f32, 0, v); }
GgufValue gguf_bool(bool v) { return scalar_value(GgufValueType::boolean, v, 0); }
GgufValue gguf_str(std::string v) {
  GgufValue x;
  x.type = GgufValueType::string;
  x.s = std::move(v);
  return x;
}
GgufValue gguf_str_array(std::vector<std::string> v) {
  GgufValue x;
  x.type = GgufValueType::array;
  x.elem = GgufValueType::string;
  x.strings = std::move(v);
  return x;
}
GgufValue gguf_i32_array(std::vector<int64_t> v) {
  GgufValue x;
  x.type = GgufValueType::array;
  x.elem = GgufValueType::i32;
  x.ints = std::move(v);
  return x;
}
GgufValue gguf_f32_array(std::vector<double> v) {
  GgufValue x;
  x.type = GgufValueType::array;
  x.elem = GgufValueType::f32;
  x.floats = std::move(v);
  return x;
}

namespace {

constexpr uint64_t kAlign = 32;

class Out {
 public:
  Out(const std::string& path, const std::string& tmp) : path_(path), tmp_(tmp) {
    fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    OOM_CHECK(fd_ >= 0, "[gguf] cannot write ", tmp, ": ", std::strerror(errno));
  }
  ~Out() {
    if (fd_ >= 0) ::close(fd_);
  }
  void bytes(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd_, c, n);
      if (w < 0 && errno == EINTR) continue;
      OOM_CHECK(w > 0, "[gguf] writing ", path_, " failed: ", std::strerror(errno),
                errno == ENOSPC ? " (the disk is full: free space or write elsewhere)" : "");
      c += w;
      n -= static_cast<size_t>(w);
      pos_ += static_cast<uint64_t>(w);
    }
  }
  template <class T> void pod(T v) { bytes(&v, sizeof v); }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void pad() {
    static const char zeros[kAlign] = {};
    if (pos_ % kAlign) bytes(zeros, kAlign - pos_ % kAlign);
  }
  uint64_t pos() const { return pos_; }
  void finish() {
    OOM_CHECK(::fsync(fd_) == 0, "[gguf] fsync of ", tmp_, " failed: ", std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
    std::error_code ec;
    fs::rename(tmp_, path_, ec);
    OOM_CHECK(!ec, "[gguf] cannot rename ", tmp_, " to ", path_, ": ", ec.message());
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t pos_ = 0;
};

void scalar(Out& o, GgufValueType t, int64_t i, double f, const std::string& s) {
  switch (t) {
    case GgufValueType::u8: o.pod<uint8_t>(static_cast<uint8_t>(i)); break;
    case GgufValueType::i8: o.pod<int8_t>(static_cast<int8_t>(i)); break;
    case GgufValueType::u16: o.pod<uint16_t>(static_cast<uint16_t>(i)); break;
    case GgufValueType::i16: o.pod<int16_t>(static_cast<int16_t>(i)); break;
    case GgufValueType::u32: o.pod<uint32_t>(static_cast<uint32_t>(i)); break;
    case GgufValueType::i32: o.pod<int32_t>(static_cast<int32_t>(i)); break;
    case GgufValueType::f32: o.pod<float>(static_cast<float>(f)); break;
    case GgufValueType::boolean: o.pod<uint8_t>(i ? 1 : 0); break;
    case GgufValueType::string: o.str(s); break;
    case GgufValueType::u64: o.pod<uint64_t>(static_cast<uint64_t>(i)); break;
    case GgufValueType::i64: o.pod<int64_t>(i); break;
    case GgufValueType::f64: o.pod<double>(f); break;
    case GgufValueType::array: fail("[gguf] nested arrays are not written");
  }
}

void value(Out& o, const GgufValue& v) {
  o.pod<uint32_t>(static_cast<uint32_t>(v.type));
  if (v.type != GgufValueType::array) return scalar(o, v.type, v.i, v.f, v.s);
  o.pod<uint32_t>(static_cast<uint32_t>(v.elem));
  const size_t n = v.elem == GgufValueType::string ? v.strings.size()
                   : (v.elem == GgufValueType::f32 || v.elem == GgufValueType::f64) ? v.floats.size()
                                                                                    : v.ints.size();
  o.pod<uint64_t>(n);
  for (size_t k = 0; k < n; ++k) {
    if (v.elem == GgufValueType::string) scalar(o, v.elem, 0, 0, v.strings[k]);
    else if (v.elem == GgufValueType::f32 || v.elem == GgufValueType::f64) scalar(o, v.elem, 0, v.floats[k], {});
    else scalar(o, v.elem, v.ints[k], 0, {});
  }
}

uint64_t tensor_bytes(const GgufWriteTensor& t) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t.type));
  OOM_CHECK(info, "[gguf] tensor ", t.name, ": unknown type");
  int64_t n = 1;
  for (int64_t d : t.ne) n *= d;
  OOM_CHECK(!t.ne.empty() && t.ne[0] % info->block_size == 0, "[gguf] tensor ", t.name, ": ", t.ne.empty() ? 0 : t.ne[0],
            " columns are not a multiple of ", info->name, "'s block of ", info->block_size);
  return static_cast<uint64_t>(n / info->block_size * info->type_size);
}

}  // namespace

void write_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
                const std::vector<GgufWriteTensor>& tensors) {
  const std::string tmp = path + ".tmp";
  Out o(path, tmp);
  try {
    o.bytes("GGUF", 4);
    o.pod<uint32_t>(3);
    o.pod<uint64_t>(tensors.size());
    o.pod<uint64_t>(metadata.size());
    for (const auto& [k, v] : metadata) {
      o.str(k);
      value(o, v);
    }
    uint64_t offset = 0;
    std::vector<uint64_t> sizes;
    for (const GgufWriteTensor& t : tensors) {
      o.str(t.name);
      o.pod<uint32_t>(static_cast<uint32_t>(t.ne.size()));
      for (int64_t d : t.ne) o.pod<uint64_t>(static_cast<uint64_t>(d));
      o.pod<uint32_t>(static_cast<uint32_t>(t.type));
      o.pod<uint64_t>(offset);
      sizes.push_back(tensor_bytes(t));
      offset += (sizes.back() + kAlign - 1) / kAlign * kAlign;
    }
    o.pad();
    std::vector<uint8_t> buf;
    for (size_t i = 0; i < tensors.size(); ++i) {
      buf.assign(static_cast<size_t>(sizes[i]), 0);
      tensors[i].fill(buf.data());
      o.bytes(buf.data(), buf.size());
      o.pad();
    }
    o.finish();
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
}

void quantize_q8_0(const float* x, int64_t n, uint8_t* out) {
  OOM_CHECK(n % 32 == 0, "[gguf] Q8_0 needs a multiple of 32 values, got ", n);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    uint8_t* blk = out + b * 34;
    const uint16_t h = f32_to_f16(d);
    std::memcpy(blk, &h, 2);
    for (int j = 0; j < 32; ++j) {
      const float q = v[j] * id;
      blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(q)));  // half away from zero
    }
  }
}

void quantize_q4_k(const float* x, int64_t n, uint8_t* out) {
  OOM_CHECK(n % 256 == 0, "[gguf] Q4_K needs a multiple of 256 values, got ", n);
  for (int64_t b = 0; b < n / 256; ++b) {
    const float* v = x + b * 256;
    float lo[8], hi[8];
    for (int j = 0; j < 8; ++j) {
      lo[j] = 0.0f, hi[j] = 0.0f;  // the range holds 0, as ggml's does (mins are >= 0)
      for (int l = 0; l < 32; ++l) lo[j] = std::min(lo[j], v[j * 32 + l]), hi[j] = std::max(hi[j], v[j * 32 + l]);
    }
    // Mins rounded up and scales rounded up, so that every value's code lies in 0..15 without clamping:
    // the error is at most half the sub-block's step d * sc.
    float mmax = 0.0f;
    for (int j = 0; j < 8; ++j) mmax = std::max(mmax, -lo[j]);
    const uint16_t mh = f32_to_f16(mmax / 63.0f);
    const float dmin = f16_to_f32(mh);
    int lm[8];
    float m1[8], smax = 0.0f;
    for (int j = 0; j < 8; ++j) {
      lm[j] = dmin > 0 ? std::min(63, static_cast<int>(std::ceil(-lo[j] / dmin))) : 0;
      m1[j] = dmin * static_cast<float>(lm[j]);
      smax = std::max(smax, (hi[j] + m1[j]) / 15.0f);
    }
    uint16_t dh = f32_to_f16(smax / 63.0f);
    if (f16_to_f32(dh) * 63.0f < smax) ++dh;  // the next f16 up, so that 63 steps still cover the widest
    const float d = f16_to_f32(dh);
    uint8_t* blk = out + b * 144;
    std::memcpy(blk, &dh, 2);
    std::memcpy(blk + 2, &mh, 2);
    uint8_t* sc = blk + 4;
    std::memset(sc, 0, 12);
    uint8_t L[256];
    for (int j = 0; j < 8; ++j) {
      const int ls = d > 0 ? std::clamp(static_cast<int>(std::ceil((hi[j] + m1[j]) / 15.0f / d)), 0, 63) : 0;
      // ggml's packing (the inverse of get_scale_min_k4).
      if (j < 4) {
        sc[j] = static_cast<uint8_t>(ls), sc[j + 4] = static_cast<uint8_t>(lm[j]);
      } else {
        sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm[j] & 0xF) << 4));
        sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
        sc[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
      }
      const float d1 = d * static_cast<float>(ls);
      for (int l = 0; l < 32; ++l) {
        const float q = d1 > 0 ? std::round((v[j * 32 + l] + m1[j]) / d1) : 0.0f;
        L[j * 32 + l] = static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
      }
    }
    uint8_t* qs = blk + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) qs[c * 32 + l] = static_cast<uint8_t>(L[c * 64 + l] | (L[c * 64 + 32 + l] << 4));
  }
}

}  // namespace oomless
