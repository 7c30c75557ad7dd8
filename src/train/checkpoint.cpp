// Crash-safe checkpoint folders: see checkpoint.h for the protocol. The order of the steps is what makes
// a crash harmless: every byte of the new folder is fsynced while it still has a hidden name, the folder
// appears under its real name in one rename, and older folders are removed only after that rename is
// durable. Removals rename a folder to a hidden name first, so a crash halfway through a removal leaves
// a hidden leftover rather than a half-deleted checkpoint under a real name.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "io/json.h"

namespace oomless {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4 section 6.2).

namespace {

constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

namespace {

void block_portable(uint32_t* h_, const uint8_t* p) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t)
    w[t] = uint32_t(p[4 * t]) << 24 | uint32_t(p[4 * t + 1]) << 16 | uint32_t(p[4 * t + 2]) << 8 | p[4 * t + 3];
  for (int t = 16; t < 64; ++t) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int t = 0; t < 64; ++t) {
    uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[t] + w[t];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

#if defined(__x86_64__)
// The same compression on SHA-NI. The state lives as (A, B, E, F) and (C, D, G, H), the word order
// sha256rnds2 takes; each sha256rnds2 runs two rounds on two words of message + constants, and
// sha256msg1 / sha256msg2 extend the message schedule four words at a time:
//   W[t..t+3] = msg2(msg1(W[t-16..t-13], W[t-12..t-9]) + W[t-7..t-4], W[t-4..t-1]).
__attribute__((target("sha,ssse3,sse4.1"))) void blocks_sha_ni(uint32_t* h, const uint8_t* p, size_t n) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);  // big-endian words
  // Lanes listed from lane 0 up.
  __m128i t = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)), 0xB1);      // B A D C
  __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4)), 0x1B);  // H G F E
  __m128i s0 = _mm_alignr_epi8(t, s1, 8);  // F E B A
  s1 = _mm_blend_epi16(s1, t, 0xF0);      // H G D C
  for (; n > 0; --n, p += 64) {
    const __m128i abef = s0, cdgh = s1;
    __m128i w[4];
    for (int i = 0; i < 16; ++i) {
      __m128i x;
      if (i < 4) {
        x = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)), bswap);
      } else {
        x = _mm_add_epi32(_mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]), _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
        x = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
      }
      w[i & 3] = x;
      __m128i m = _mm_add_epi32(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kK + 4 * i)));
      s1 = _mm_sha256rnds2_epu32(s1, s0, m);
      s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(m, 0x0E));
    }
    s0 = _mm_add_epi32(s0, abef);
    s1 = _mm_add_epi32(s1, cdgh);
  }
  t = _mm_shuffle_epi32(s0, 0x1B);   // A B E F
  s1 = _mm_shuffle_epi32(s1, 0xB1);  // G H C D
  s0 = _mm_blend_epi16(t, s1, 0xF0); // A B C D
  s1 = _mm_alignr_epi8(s1, t, 8);    // E F G H
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), s0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), s1);
}

bool cpu_has_sha_ni() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 29))) return false;  // SHA
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & (1u << 9)) && (c & (1u << 19));  // SSSE3, SSE4.1
}
#else
bool cpu_has_sha_ni() { return false; }
#endif

bool g_sha_ni = cpu_has_sha_ni();

}  // namespace

bool sha256_sha_ni() { return g_sha_ni; }
void set_sha256_sha_ni(bool on) {
  OOM_CHECK(!on || cpu_has_sha_ni(), "[checkpoint] this CPU has no SHA extensions");
  g_sha_ni = on;
}

void Sha256::blocks(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  if (g_sha_ni) return blocks_sha_ni(h_, p, n);
#endif
  for (; n > 0; --n, p += 64) block_portable(h_, p);
}

void Sha256::update(const void* data, size_t n) {
  auto p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buf_len_ > 0) {
    size_t take = std::min(n, size_t(64) - buf_len_);
    std::memcpy(buf_ + buf_len_, p, take);
    buf_len_ += take;
    p += take;
    n -= take;
    if (buf_len_ < 64) return;
    blocks(buf_, 1);
    buf_len_ = 0;
  }
  blocks(p, n / 64);
  p += n / 64 * 64;
  n %= 64;
  if (n > 0) std::memcpy(buf_, p, n);
  buf_len_ = n;
}

std::array<uint8_t, 32> Sha256::digest() {
  // Padding: 0x80, zeros up to 56 mod 64, then the message length in bits, big-endian.
  const uint64_t bits = total_ * 8;
  uint8_t pad[72] = {0x80};
  size_t pad_len = (buf_len_ < 56 ? 56 : 120) - buf_len_;
  for (int i = 0; i < 8; ++i) pad[pad_len + i] = uint8_t(bits >> (56 - 8 * i));
  update(pad, pad_len + 8);
  std::array<uint8_t, 32> out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = uint8_t(h_[i] >> (24 - 8 * j));
  return out;
}

std::string Sha256::hex_digest() {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : digest()) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

std::string sha256_hex(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.hex_digest();
}

// ---------------------------------------------------------------------------------------------------
// File helpers.

namespace {

constexpr size_t kBlock = size_t(1) << 20;  // read size for hashing: large enough to stream at disk speed

std::string errno_text(int err) {
  const char* name = err == ENOSPC ? " (ENOSPC)" : err == EDQUOT ? " (EDQUOT)" : err == EIO ? " (EIO)" : "";
  return std::string(std::strerror(err)) + name;
}

std::string join(const std::string& dir, const std::string& name) {
  if (!dir.empty() && dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

// Closes on scope exit when still open (error paths); the normal path closes explicitly and checks.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd& operator=(Fd&&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void close_checked(Fd& f, const std::string& path) {
  int fd = std::exchange(f.fd, -1);
  // close() may report a deferred write error (NFS and some FUSE filesystems do); EINTR leaves the fd
  // closed on Linux, so it is not retried.
  if (::close(fd) != 0 && errno != EINTR)
    fail("[checkpoint] ", path, ": close failed: ", errno_text(errno), "; check the disk and the output folder");
}

void fsync_fd(int fd, const std::string& path) {
  if (::fsync(fd) != 0)
    fail("[checkpoint] ", path, ": fsync failed: ", errno_text(errno),
         "; the data may not be on disk: free space or check the disk, or point --out elsewhere");
}

void fsync_dir(const std::string& path) {
  Fd d(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd < 0) fail("[checkpoint] ", path, ": cannot open the folder to fsync it: ", errno_text(errno));
  fsync_fd(d.fd, path);
  close_checked(d, path);
}

// "checkpoint-123" -> 123; nullopt for anything else (leading signs, non-digits, overflow).
std::optional<int64_t> parse_step(std::string_view digits) {
  if (digits.empty() || digits.front() < '0' || digits.front() > '9') return std::nullopt;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || p != digits.data() + digits.size()) return std::nullopt;
  return v;
}

std::optional<int64_t> checkpoint_step(std::string_view name) {
  constexpr std::string_view prefix = "checkpoint-";
  if (!name.starts_with(prefix)) return std::nullopt;
  return parse_step(name.substr(prefix.size()));
}

// Hidden folders that a save creates and removes again: .checkpoint-STEP.tmp (being built, or the old
// folder swapped out of its place), .checkpoint-STEP.old (set aside where the filesystem cannot swap)
// and .checkpoint-STEP.del (being pruned). Anything else in OUT is left alone.
bool is_leftover(std::string_view name) {
  constexpr std::string_view prefix = ".checkpoint-";
  if (!name.starts_with(prefix) || name.size() < prefix.size() + 4) return false;
  std::string_view suffix = name.substr(name.size() - 4);
  if (suffix != ".tmp" && suffix != ".old" && suffix != ".del") return false;
  return parse_step(name.substr(prefix.size(), name.size() - prefix.size() - 4)).has_value();
}

// A file name that stays inside the checkpoint folder. Dot files are refused too: they could collide
// with the hidden names above, and nothing a trainer saves needs one.
bool plain_name(const std::string& name) {
  return !name.empty() && name.front() != '.' && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

struct Listing {
  std::vector<std::pair<int64_t, std::string>> checkpoints;  // (step, name)
  std::vector<std::string> leftovers;
};

// Lists OUT; a missing OUT lists as empty.
Listing list_out(const std::string& out_dir) {
  Listing l;
  std::error_code ec;
  fs::directory_iterator it(out_dir, ec);
  if (ec == std::errc::no_such_file_or_directory) return l;
  if (ec) fail("[checkpoint] ", out_dir, ": cannot list the output folder: ", ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (auto s = checkpoint_step(name)) l.checkpoints.emplace_back(*s, name);
    else if (is_leftover(name)) l.leftovers.push_back(name);
  }
  if (ec) fail("[checkpoint] ", out_dir, ": cannot list the output folder: ", ec.message());
  std::sort(l.checkpoints.begin(), l.checkpoints.end(), std::greater<>());  // newest first
  std::sort(l.leftovers.begin(), l.leftovers.end());
  return l;
}

void remove_tree(const std::string& path, const std::string& what_to_do) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) fail("[checkpoint] ", path, ": cannot remove: ", ec.message(), "; ", what_to_do);
}

// Streams fd from offset 0 through SHA-256; returns (bytes, hex).
std::pair<uint64_t, std::string> hash_fd(int fd, const std::string& path) {
  std::unique_ptr<uint8_t[]> buf(new uint8_t[kBlock]);
  Sha256 h;
  uint64_t off = 0;
  for (;;) {
    ssize_t r = ::pread(fd, buf.get(), kBlock, off_t(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail("[checkpoint] ", path, ": read failed: ", errno_text(errno), "; check the disk");
    }
    if (r == 0) break;
    h.update(buf.get(), size_t(r));
    off += uint64_t(r);
  }
  return {off, h.hex_digest()};
}

// ---------------------------------------------------------------------------------------------------
// Write path and test hooks.

struct SaveContext {
  bool active = false;
  int64_t fault_after = -1;  // OOMLESS_FAULT_ENOSPC_AFTER, or -1
  uint64_t written = 0;      // bytes written by this save so far
  int fd = -1;               // the file being written, for error messages
  std::string path;
};
thread_local SaveContext t_save;

bool verify(const std::string& path, std::string* why, bool hash);  // under "Verify and find"

int64_t env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return -1;
  auto s = parse_step(v);
  return s ? *s : -1;
}

// Ends the context on every exit from save_checkpoint.
struct SaveScope {
  SaveScope() {
    t_save = SaveContext{};
    t_save.active = true;
    t_save.fault_after = env_int("OOMLESS_FAULT_ENOSPC_AFTER");
  }
  ~SaveScope() { t_save = SaveContext{}; }
};

}  // namespace

void checkpoint_write(int fd, const void* data, size_t n) {
  auto p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    size_t want = n - done;
    ssize_t r;
    if (t_save.active && t_save.fault_after >= 0 && t_save.written + want > uint64_t(t_save.fault_after)) {
      // The fault hook: write up to the limit (a short write), then fail as a full disk would.
      want = size_t(uint64_t(t_save.fault_after) - std::min<uint64_t>(t_save.written, t_save.fault_after));
      if (want == 0) {
        r = -1;
        errno = ENOSPC;
      } else {
        r = ::write(fd, p + done, want);
      }
    } else {
      r = ::write(fd, p + done, want);
    }
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      // write() returning 0 for a non-empty buffer has no meaning for files; treat it as a full disk
      // rather than loop forever.
      int err = r == 0 ? ENOSPC : errno;
      std::string path = t_save.active && t_save.fd == fd ? t_save.path : "fd " + std::to_string(fd);
      off_t pos = ::lseek(fd, 0, SEEK_CUR);
      uint64_t so_far = pos >= 0 ? uint64_t(pos) : uint64_t(done);
      if (err == ENOSPC || err == EDQUOT)
        fail("[checkpoint] ", path, ": ", err == ENOSPC ? "no space left on device" : "disk quota exceeded",
             err == ENOSPC ? " (ENOSPC)" : " (EDQUOT)", " after writing ", so_far,
             " bytes; free space or point --out elsewhere");
      fail("[checkpoint] ", path, ": write failed after ", so_far, " bytes: ", errno_text(err),
           "; check the disk, or point --out elsewhere");
    }
    done += size_t(r);
    if (t_save.active) t_save.written += uint64_t(r);
  }
}

std::string sha256_file_hex(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) fail("[checkpoint] ", path, ": cannot open: ", errno_text(errno));
  return hash_fd(f.fd, path).second;
}

// ---------------------------------------------------------------------------------------------------
// Save.

std::string save_checkpoint(const std::string& out_dir, int64_t step, const std::vector<CheckpointFile>& files,
                            const SaveOptions& opt) {
  const std::string final_name = "checkpoint-" + std::to_string(step);
  if (step < 0) fail("[checkpoint] ", join(out_dir, final_name), ": the step must be >= 0");
  if (opt.keep < 0) fail("[checkpoint] ", out_dir, ": keep = ", opt.keep, " is negative; use 0 to keep all");
  for (size_t i = 0; i < files.size(); ++i) {
    const CheckpointFile& f = files[i];
    if (!plain_name(f.name) || f.name == "manifest.json")
      fail("[checkpoint] ", join(out_dir, final_name), ": file name \"", f.name,
           "\" is not allowed (empty, containing '/', starting with '.', or manifest.json); "
           "name each file with a plain name inside the checkpoint folder");
    for (size_t j = 0; j < i; ++j)
      if (files[j].name == f.name)
        fail("[checkpoint] ", join(out_dir, final_name), ": file \"", f.name, "\" is listed twice");
    if (f.write && !f.bytes.empty())
      fail("[checkpoint] ", join(out_dir, final_name), ": file \"", f.name,
           "\" has both bytes and a write function; give exactly one");
  }

  const int64_t crash_at = env_int("OOMLESS_CRASH_AT");
  auto step_done = [&](int k) {
    if (k == crash_at) _exit(86);
  };
  SaveScope scope;

  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) {
    fs::create_directories(out_dir, ec);
    if (ec || !fs::is_directory(out_dir))
      fail("[checkpoint] ", out_dir, ": cannot create the output folder",
           ec ? ": " + ec.message() : std::string(" (a file of that name exists)"),
           "; point --out at a writable folder");
  }

  const std::string tmp = join(out_dir, "." + final_name + ".tmp");
  const std::string final_path = join(out_dir, final_name);
  bool renamed = false;
  try {
    // 1. A fresh tmp folder; leftovers of interrupted saves go first (there is one saver per OUT).
    Listing before = list_out(out_dir);
    for (const std::string& name : before.leftovers)
      remove_tree(join(out_dir, name), "remove it by hand or make the output folder writable");
    if (::mkdir(tmp.c_str(), 0755) != 0)
      fail("[checkpoint] ", tmp, ": cannot create: ", errno_text(errno),
           "; make the output folder writable or point --out elsewhere");
    step_done(1);

    // 2. Write every file, keeping the fds open so that fsync reports errors of these very writes.
    std::vector<Fd> fds;
    fds.reserve(files.size());
    for (const CheckpointFile& f : files) {
      const std::string path = join(tmp, f.name);
      fds.emplace_back(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (fds.back().fd < 0) fail("[checkpoint] ", path, ": cannot create: ", errno_text(errno));
      t_save.fd = fds.back().fd;
      t_save.path = path;
      try {
        if (f.write) f.write(fds.back().fd);
        else checkpoint_write(fds.back().fd, f.bytes.data(), f.bytes.size());
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        fail("[checkpoint] ", path, ": writing failed: ", e.what());
      }
      t_save.fd = -1;
    }
    step_done(2);

    // 3. fsync, then hash what the file holds: the manifest describes the bytes on disk, however the
    // write function produced them.
    json::Value listed = json::Value::object();
    for (size_t i = 0; i < files.size(); ++i) {
      const std::string path = join(tmp, files[i].name);
      fsync_fd(fds[i].fd, path);
      auto [bytes, hex] = hash_fd(fds[i].fd, path);
      close_checked(fds[i], path);
      json::Value entry = json::Value::object();
      entry.set("bytes", json::Value::integer(int64_t(bytes)));
      entry.set("sha256", json::Value::string(hex));
      listed.set(files[i].name, std::move(entry));
    }
    step_done(3);

    // 4-5. The manifest, last of the files: a folder with a manifest had every other file fsynced first.
    json::Value manifest = json::Value::object();
    manifest.set("step", json::Value::integer(step));
    manifest.set("files", std::move(listed));
    const std::string text = json::dump(manifest, 2) + "\n";
    const std::string mpath = join(tmp, "manifest.json");
    Fd m(::open(mpath.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (m.fd < 0) fail("[checkpoint] ", mpath, ": cannot create: ", errno_text(errno));
    t_save.fd = m.fd;
    t_save.path = mpath;
    checkpoint_write(m.fd, text.data(), text.size());
    t_save.fd = -1;
    step_done(4);
    fsync_fd(m.fd, mpath);
    close_checked(m, mpath);
    step_done(5);

    // 6. The folder's entries (the file names) must be durable before the folder gets its real name.
    fsync_dir(tmp);
    step_done(6);

    // 7. Into place. An existing checkpoint of this step is swapped with the new folder in one atomic
    // exchange, so the name always points at a complete checkpoint; the old one, now under the tmp name,
    // is removed after step 8. Filesystems without the exchange get the old folder renamed aside first,
    // which leaves a moment with no folder of this step (older checkpoints still serve).
    struct stat st;
    if (::lstat(final_path.c_str(), &st) == 0) {
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) != 0) {
        if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
          fail("[checkpoint] ", final_path, ": cannot replace with ", tmp, ": ", errno_text(errno));
        const std::string aside = join(out_dir, "." + final_name + ".old");
        if (::rename(final_path.c_str(), aside.c_str()) != 0)
          fail("[checkpoint] ", final_path, ": cannot move aside to ", aside, ": ", errno_text(errno));
        if (::rename(tmp.c_str(), final_path.c_str()) != 0)
          fail("[checkpoint] ", tmp, ": cannot rename to ", final_path, ": ", errno_text(errno));
      }
    } else if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
      fail("[checkpoint] ", tmp, ": cannot rename to ", final_path, ": ", errno_text(errno));
    }
    renamed = true;
    step_done(7);
  } catch (const std::exception& e) {
    // Before the rename nothing under a real name was touched; remove the partial folder (best effort:
    // what cannot be removed now is removed by the next save).
    if (renamed) throw;
    t_save.fd = -1;
    std::error_code ignore;
    fs::remove_all(tmp, ignore);
    bool others = false;
    try {
      others = !list_out(out_dir).checkpoints.empty();
    } catch (const Error&) {
    }
    const char* note = others ? "; the previous checkpoint is intact" : "; no checkpoint was saved";
    if (dynamic_cast<const Error*>(&e)) fail(e.what(), note);
    fail("[checkpoint] ", tmp, ": ", e.what(), note);
  }

  // 8. The rename itself must be durable before anything older is removed.
  fsync_dir(out_dir);
  step_done(8);

  // 9. Remove the swapped-out old folder, then prune. Folders go to a hidden name first (one fsync
  // covers all the renames), so a crash mid-removal leaves no half-deleted checkpoint-N behind.
  const std::string after = "; " + final_path + " was saved; remove the old folder by hand or fix permissions";
  std::vector<std::string> doomed;
  Listing now = list_out(out_dir);
  for (const std::string& name : now.leftovers) doomed.push_back(join(out_dir, name));
  if (opt.keep > 0) {
    int kept = 1;  // this checkpoint
    for (const auto& [s, name] : now.checkpoints) {
      if (s >= step) continue;  // never this one, nor newer ones (see the header)
      const std::string path = join(out_dir, name);
      std::string why;
      if (kept < opt.keep && verify(path, &why, /*hash=*/false)) {
        ++kept;
        continue;
      }
      const std::string hidden = join(out_dir, "." + name + ".del");
      if (::rename(path.c_str(), hidden.c_str()) != 0)
        fail("[checkpoint] ", path, ": cannot rename to ", hidden, " to prune it: ", errno_text(errno), after);
      doomed.push_back(hidden);
    }
    if (!doomed.empty()) fsync_dir(out_dir);
  }
  for (const std::string& path : doomed) remove_tree(path, after.substr(2));
  step_done(9);
  return final_path;
}

// ---------------------------------------------------------------------------------------------------
// Verify and find.

namespace {

// The manifest and the sizes always; the checksums when `hash` (pruning skips them: hashing every kept
// checkpoint at every save would read gigabytes for a decision that sizes make well enough).
bool verify(const std::string& path, std::string* why, bool hash) {
  std::string sink;
  std::string& reason = why ? *why : sink;
  reason.clear();
  const std::string mpath = join(path, "manifest.json");
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    reason = "not a folder";
    return false;
  }
  if (::stat(mpath.c_str(), &st) != 0) {
    reason = "manifest.json: missing";
    return false;
  }
  struct Entry {
    std::string name;
    int64_t bytes;
    std::string sha;
  };
  std::vector<Entry> entries;
  try {
    json::Value m = json::parse_file(mpath);
    int64_t step = m.at("step").as_int("step");
    auto folder_step = checkpoint_step(fs::path(path).filename().string());
    if (folder_step && *folder_step != step) {
      reason = "manifest.json: step " + std::to_string(step) + " does not match the folder name";
      return false;
    }
    for (const auto& [name, v] : m.at("files").as_object("files")) {
      Entry e{name, v.at("bytes").as_int("bytes"), v.at("sha256").as_string("sha256")};
      // A manifest is data from disk: a name must not lead outside the folder.
      if (!plain_name(name) || name == "manifest.json") {
        reason = "manifest.json: file name \"" + name + "\" is not allowed";
        return false;
      }
      if (e.bytes < 0 || e.sha.size() != 64) {
        reason = "manifest.json: bad entry for " + name;
        return false;
      }
      entries.push_back(std::move(e));
    }
  } catch (const Error& e) {
    reason = std::string("manifest.json: ") + e.what();
    return false;
  }
  // Sizes first: cheap, and they catch truncation without hashing gigabytes.
  for (const Entry& e : entries) {
    if (::stat(join(path, e.name).c_str(), &st) != 0) {
      reason = e.name + ": missing";
      return false;
    }
    if (!S_ISREG(st.st_mode)) {
      reason = e.name + ": not a regular file";
      return false;
    }
    if (int64_t(st.st_size) != e.bytes) {
      reason = e.name + ": " + std::to_string(int64_t(st.st_size)) + " bytes, the manifest says " +
               std::to_string(e.bytes);
      return false;
    }
  }
  for (const Entry& e : entries) {
    if (!hash) break;
    try {
      if (sha256_file_hex(join(path, e.name)) != e.sha) {
        reason = e.name + ": checksum mismatch";
        return false;
      }
    } catch (const Error& err) {
      reason = e.name + ": " + err.what();
      return false;
    }
  }
  return true;
}

}  // namespace

bool verify_checkpoint(const std::string& path, std::string* why) { return verify(path, why, true); }

std::optional<FoundCheckpoint> find_latest_checkpoint(const std::string& out_dir,
                                                      const std::function<void(const std::string&)>& warn) {
  Listing l = list_out(out_dir);
  auto say = [&](const std::string& s) {
    if (warn) warn(s);
  };
  for (const std::string& name : l.leftovers)
    say(join(out_dir, name) + " is left over from an interrupted save; ignored (the next save removes it)");
  std::vector<std::string> failed;  // "checkpoint-20 is incomplete or corrupt (why)"
  std::optional<FoundCheckpoint> found;
  for (const auto& [step, name] : l.checkpoints) {
    std::string why;
    const std::string path = join(out_dir, name);
    if (verify_checkpoint(path, &why)) {
      found = FoundCheckpoint{path, step};
      break;
    }
    failed.push_back(name + " is incomplete or corrupt (" + why + ")");
  }
  for (const std::string& f : failed)
    say(f + (found ? "; using " + fs::path(found->path).filename().string() : "; no older checkpoint verifies"));
  return found;
}

}  // namespace oomless
