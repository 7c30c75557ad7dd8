// Shared by the spill file and offloader tests: a scratch folder on a disk-backed filesystem (the spill
// file refuses tmpfs, which /tmp may be), a scoped environment variable, random bytes and error text.
#pragma once
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace oomless::test {

namespace fs = std::filesystem;

inline constexpr long kTmpfsMagic = 0x01021994, kRamfsMagic = 0x858458f6;

inline bool in_ram(const std::string& dir) {
  struct statfs s {};
  return ::statfs(dir.c_str(), &s) == 0 && (s.f_type == kTmpfsMagic || s.f_type == kRamfsMagic);
}

// A fresh folder on a disk-backed filesystem (a spill file refuses tmpfs, which /tmp may be), removed
// at the end of the test. OOMLESS_TEST_SPILL_DIR picks the parent; empty path when none qualifies.
struct Scratch {
  std::string path;
  Scratch() {
    std::vector<std::string> parents;
    if (const char* e = std::getenv("OOMLESS_TEST_SPILL_DIR")) parents.push_back(e);
    parents.insert(parents.end(), {"/var/tmp", testing::TempDir(), fs::current_path().string()});
    for (const std::string& p : parents) {
      if (p.empty() || in_ram(p) || ::access(p.c_str(), W_OK | X_OK) != 0) continue;
      std::string tmpl = (fs::path(p) / "oomless_spill_test_XXXXXX").string();
      if (::mkdtemp(tmpl.data())) {
        path = tmpl;
        return;
      }
    }
  }
  ~Scratch() {
    if (path.empty()) return;
    ::chmod(path.c_str(), 0700);
    std::error_code ignore;
    fs::remove_all(path, ignore);
  }
};

#define NEED_SCRATCH(s) \
  if ((s).path.empty()) GTEST_SKIP() << "no writable disk-backed folder: set OOMLESS_TEST_SPILL_DIR"

// Sets an environment variable for one scope and restores what was there.
struct EnvGuard {
  std::string name;
  std::optional<std::string> old;
  EnvGuard(const char* n, const std::string& value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    ::setenv(n, value.c_str(), 1);
  }
  ~EnvGuard() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

inline std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace oomless::test
