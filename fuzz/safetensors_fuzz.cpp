// Opens arbitrary bytes as a .safetensors file and reads every tensor that read_as_f32 accepts.
// Rejection must be an oomless::Error; an accepted file must never lead to a read outside the file.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"

using namespace oomless;

namespace {

// An in-memory file (memfd) reachable by path, so that the fuzzer does not touch the disk; a temp
// file where memfd is unavailable (the caller unlinks it).
int make_file(std::string& path, bool& temp) {
  int fd = static_cast<int>(::memfd_create("safetensors_fuzz", MFD_CLOEXEC));
  temp = fd < 0;
  if (!temp) {
    path = "/proc/self/fd/" + std::to_string(fd);
    return fd;
  }
  char tmpl[] = "/tmp/safetensors_fuzz_XXXXXX";
  fd = ::mkstemp(tmpl);
  if (fd < 0) std::abort();
  path = tmpl;
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string path;
  bool temp = false;
  const int fd = make_file(path, temp);
  for (size_t done = 0; done < size;) {
    const ssize_t w = ::write(fd, data + done, size - done);
    if (w <= 0) std::abort();
    done += static_cast<size_t>(w);
  }
  try {
    const SafetensorsFile f = SafetensorsFile::open(path);
    std::vector<float> buf;
    for (const auto& t : f.tensors()) {
      if (f.find(t.name) != &t) __builtin_trap();
      const bool readable = t.dtype == DType::f32 || t.dtype == DType::bf16 || t.dtype == DType::f16 ||
                            t.dtype == DType::f64;
      if (!readable) continue;
      buf.assign(static_cast<size_t>(t.numel()), 0.0f);
      read_as_f32(t, t.shape, buf.data());
    }
    for (const auto& t : f.tensors()) {
      // A wrong expected shape must be refused before anything is written to the output.
      std::vector<int64_t> wrong = t.shape;
      wrong.push_back(1);
      try {
        read_as_f32(t, wrong, nullptr);
        __builtin_trap();
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  ::close(fd);
  if (temp) ::unlink(path.c_str());
  return 0;
}
