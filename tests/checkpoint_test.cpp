// Checkpoint folders: SHA-256 against the FIPS 180-4 / NIST test vectors, save/find round trips,
// pruning by number, corrupt and incomplete folders skipped with a warning, a crash after every step of
// the save (in a forked child) leaving a usable folder, a full disk (the test fault hook, /dev/full),
// writes interrupted by signals, and refused inputs.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "io/json.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

// A fresh folder per test (named with the process id, so that two builds running the tests at once do
// not meet), removed again at the end of the test.
struct Scratch {
  std::string path;
  explicit Scratch(const std::string& name)
      : path((fs::path(testing::TempDir()) / ("checkpoint_test_" + std::to_string(::getpid()) + "_" + name)).string()) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Scratch() {
    std::error_code ignore;
    fs::remove_all(path, ignore);
  }
};

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// Deterministic bytes that differ with the seed; larger than the 1 MiB hashing block so that
// verification crosses block boundaries.
constexpr size_t kBig = (size_t(5) << 19) + 7;
constexpr size_t kSmall = 100003;  // for the tests that save dozens of times
std::string payload(uint32_t seed, size_t n = kBig) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (char& c : s) {
    x = x * 1664525u + 1013904223u;
    c = char(x >> 24);
  }
  return s;
}

// The files a trainer saves: a large one written through the fd, a small one as bytes.
std::vector<CheckpointFile> files_for(uint32_t seed, size_t big_bytes = kBig) {
  std::string big = payload(seed, big_bytes);
  CheckpointFile model{"model.safetensors", "", [big](int fd) {
                         // In pieces, as a streaming writer would.
                         for (size_t off = 0; off < big.size(); off += 300000)
                           checkpoint_write(fd, big.data() + off, std::min<size_t>(300000, big.size() - off));
                       }};
  CheckpointFile state{"trainer_state.json", "{\"seed\": " + std::to_string(seed) + "}", {}};
  return {model, state};
}

void expect_holds(const std::string& path, uint32_t seed, size_t big_bytes = kBig) {
  EXPECT_EQ(read_all(path + "/model.safetensors"), payload(seed, big_bytes)) << path;
  EXPECT_EQ(read_all(path + "/trainer_state.json"), "{\"seed\": " + std::to_string(seed) + "}") << path;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---------------------------------------------------------------------------------------------------

// The vectors on every implementation this CPU runs (portable, and SHA-NI where it has the extensions).
class Sha256Paths : public testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam() && !sha256_sha_ni()) GTEST_SKIP() << "this CPU has no SHA extensions";
    was_ = sha256_sha_ni();
    set_sha256_sha_ni(GetParam());
  }
  void TearDown() override { set_sha256_sha_ni(was_); }
  bool was_ = false;
};
INSTANTIATE_TEST_SUITE_P(Sha256, Sha256Paths, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "sha_ni" : "portable"; });

// Random messages of every length up to 300 bytes and a few long ones: the SHA-NI digests are the portable ones.
TEST(Sha256, ShaNiIsThePortableDigest) {
  if (!sha256_sha_ni()) GTEST_SKIP() << "this CPU has no SHA extensions";
  std::mt19937_64 rng(7);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {4096, 65536 + 17, 1000003}) lengths.push_back(n);
  for (size_t n : lengths) {
    std::string m(n, '\0');
    for (char& c : m) c = static_cast<char>(rng());
    set_sha256_sha_ni(false);
    const std::string want = sha256_hex(m.data(), m.size());
    set_sha256_sha_ni(true);
    ASSERT_EQ(sha256_hex(m.data(), m.size()), want) << "length " << n;
  }
}

TEST_P(Sha256Paths, NistVectors) {
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(sha256_hex(m448.data(), m448.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string m896 =
      "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrst"
      "nopqrstu";
  EXPECT_EQ(sha256_hex(m896.data(), m896.size()),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  const std::string million(1000000, 'a');
  const std::string million_hex = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";
  EXPECT_EQ(sha256_hex(million.data(), million.size()), million_hex);
  // Streamed in uneven pieces, so that the buffer is partly full at every update.
  Sha256 h;
  size_t off = 0;
  for (size_t piece = 1; off < million.size(); piece = piece % 131 + 1) {
    size_t n = std::min(piece, million.size() - off);
    h.update(million.data() + off, n);
    off += n;
  }
  EXPECT_EQ(h.hex_digest(), million_hex);
}

TEST(Sha256, EverySplitAgreesWithOneShot) {
  // Lengths around the 55/56/64-byte padding edges, split at every point.
  for (size_t n : {55, 56, 57, 63, 64, 65, 119, 120, 128, 200}) {
    std::string m = payload(uint32_t(n), n);
    const std::string whole = sha256_hex(m.data(), m.size());
    for (size_t cut = 0; cut <= n; ++cut) {
      Sha256 h;
      h.update(m.data(), cut);
      h.update(m.data() + cut, n - cut);
      ASSERT_EQ(h.hex_digest(), whole) << "n " << n << " cut " << cut;
    }
  }
}

TEST(Sha256, FileInBlocks) {
  const Scratch dir_scratch("sha_file");
  const std::string dir = dir_scratch.path;
  const std::string big = payload(3, (size_t(3) << 20) + 5);  // three full 1 MiB blocks and a tail
  write_raw(dir + "/f", big);
  EXPECT_EQ(sha256_file_hex(dir + "/f"), sha256_hex(big.data(), big.size()));
  EXPECT_NE(error_of([&] { sha256_file_hex(dir + "/missing"); }).find("[checkpoint] " + dir + "/missing"),
            std::string::npos);
}

TEST(Checkpoint, SaveFindRoundTrip) {
  const Scratch out_scratch("roundtrip");
  const std::string out = out_scratch.path + "/run";  // created by the save
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& w) { warnings.push_back(w); };
  EXPECT_FALSE(find_latest_checkpoint(out, warn).has_value());

  EXPECT_EQ(save_checkpoint(out, 10, files_for(10), {}), out + "/checkpoint-10");
  EXPECT_EQ(save_checkpoint(out, 20, files_for(20), {}), out + "/checkpoint-20");
  auto found = find_latest_checkpoint(out, warn);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 20);
  EXPECT_EQ(found->path, out + "/checkpoint-20");
  EXPECT_TRUE(warnings.empty());
  expect_holds(out + "/checkpoint-10", 10);
  expect_holds(out + "/checkpoint-20", 20);
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-10", "checkpoint-20"}));

  json::Value m = json::parse_file(out + "/checkpoint-20/manifest.json");
  EXPECT_EQ(m.at("step").as_int(), 20);
  const std::string big = payload(20);
  const json::Value& model = m.at("files").at("model.safetensors");
  EXPECT_EQ(model.at("bytes").as_int(), int64_t(big.size()));
  EXPECT_EQ(model.at("sha256").as_string(), sha256_hex(big.data(), big.size()));
  EXPECT_EQ(m.at("files").size(), 2u);
  std::string why = "stale";
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoint-20", &why));
  EXPECT_EQ(why, "");
}

TEST(Checkpoint, EmptyFileAndNoFiles) {
  const Scratch out_scratch("empty");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 0, {}, {});
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoint-0", nullptr));
  save_checkpoint(out, 1, {{"empty.bin", "", {}}}, {});
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoint-1", nullptr));
  EXPECT_EQ(read_all(out + "/checkpoint-1/empty.bin"), "");
}

TEST(Checkpoint, KeepPrunesOldestByNumber) {
  const Scratch out_scratch("keep");
  const std::string out = out_scratch.path;
  // 9 < 10 < 100 by number, though "checkpoint-9" sorts last by name.
  for (int64_t s : {8, 9, 10, 100}) save_checkpoint(out, s, {{"x", std::to_string(s), {}}}, {.keep = 2});
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-10", "checkpoint-100"}));
  save_checkpoint(out, 101, {{"x", "101", {}}}, {.keep = 1});
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-101"}));

  // keep = 0 keeps everything.
  const Scratch all_scratch("keep_all");
  const std::string all = all_scratch.path;
  for (int64_t s : {1, 2, 3}) save_checkpoint(all, s, {{"x", "x", {}}}, {});
  EXPECT_EQ(names_in(all).size(), 3u);
}

TEST(Checkpoint, PruneSkipsIncompleteAndSparesNewer) {
  const Scratch out_scratch("prune_incomplete");
  const std::string out = out_scratch.path;
  for (int64_t s : {1, 2, 3}) save_checkpoint(out, s, {{"x", std::to_string(s), {}}}, {});
  fs::remove(out + "/checkpoint-3/x");  // incomplete: must not count as one of the kept
  save_checkpoint(out, 50, {{"x", "50", {}}}, {});
  // Saving 4 with keep=2 keeps 4 and the newest complete older one (2); 3 (incomplete) and 1 go; 50 is
  // newer than this save and stays.
  save_checkpoint(out, 4, {{"x", "4", {}}}, {.keep = 2});
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-2", "checkpoint-4", "checkpoint-50"}));
}

TEST(Checkpoint, CorruptNewerIsSkippedWithWarning) {
  const Scratch out_scratch("corrupt");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 10, files_for(10), {});
  save_checkpoint(out, 20, files_for(20), {});
  const std::string model20 = out + "/checkpoint-20/model.safetensors";
  std::string bytes = read_all(model20);
  const std::string good = bytes;

  struct Case {
    std::function<void()> damage;
    std::string why;
  };
  std::vector<Case> cases = {
      {[&] {
         std::string b = good;
         b[b.size() / 2] ^= 1;  // same size, one bit off
         write_raw(model20, b);
       },
       "model.safetensors: checksum mismatch"},
      {[&] { write_raw(model20, good.substr(0, 1000)); },
       "model.safetensors: 1000 bytes, the manifest says " + std::to_string(good.size())},
      {[&] { fs::remove(model20); }, "model.safetensors: missing"},
      {[&] { fs::remove(out + "/checkpoint-20/manifest.json"); }, "manifest.json: missing"},
      {[&] { write_raw(out + "/checkpoint-20/manifest.json", "{\"step\": 20, \"files\": {"); },
       "manifest.json: [json]"},
      {[&] {
         write_raw(out + "/checkpoint-20/manifest.json",
                   "{\"step\": 20, \"files\": {\"../checkpoint-10/model.safetensors\": {\"bytes\": 1, \"sha256\": "
                   "\"" + std::string(64, '0') + "\"}}}");
       },
       "manifest.json: file name \"../checkpoint-10/model.safetensors\" is not allowed"},
      {[&] { fs::rename(out + "/checkpoint-20", out + "/checkpoint-21"); }, "manifest.json: step 20 does not match"},
  };
  for (const Case& c : cases) {
    fs::remove_all(out + "/checkpoint-20");
    fs::remove_all(out + "/checkpoint-21");
    save_checkpoint(out, 20, files_for(20), {});
    c.damage();
    std::vector<std::string> warnings;
    auto found = find_latest_checkpoint(out, [&](const std::string& w) { warnings.push_back(w); });
    ASSERT_TRUE(found.has_value()) << c.why;
    EXPECT_EQ(found->step, 10) << c.why;
    ASSERT_EQ(warnings.size(), 1u) << c.why;
    const std::string name = fs::exists(out + "/checkpoint-21") ? "checkpoint-21" : "checkpoint-20";
    EXPECT_EQ(warnings[0].rfind(name + " is incomplete or corrupt (" + c.why, 0), 0u) << warnings[0];
    EXPECT_NE(warnings[0].find("); using checkpoint-10"), std::string::npos) << warnings[0];
  }

  // None verifies.
  write_raw(out + "/checkpoint-10/trainer_state.json", "{\"seed\": 11}");
  std::vector<std::string> warnings;
  EXPECT_FALSE(find_latest_checkpoint(out, [&](const std::string& w) { warnings.push_back(w); }).has_value());
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings.back().find("checkpoint-10 is incomplete or corrupt (trainer_state.json: checksum mismatch); "
                                 "no older checkpoint verifies"),
            std::string::npos)
      << warnings.back();
}

TEST(Checkpoint, LeftoverTmpIgnoredThenRemoved) {
  const Scratch out_scratch("leftover");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 1, files_for(1), {});
  // A complete-looking folder under the hidden name must still be ignored: it was never renamed.
  fs::copy(out + "/checkpoint-1", out + "/.checkpoint-2.tmp");
  fs::create_directory(out + "/.checkpoint-7.del");
  fs::create_directory(out + "/.not-ours.tmp");  // not a name the saver makes: left alone
  std::vector<std::string> warnings;
  auto found = find_latest_checkpoint(out, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 1);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_EQ(warnings[0], out + "/.checkpoint-2.tmp is left over from an interrupted save; ignored (the next save "
                               "removes it)");
  save_checkpoint(out, 3, files_for(3), {});
  EXPECT_EQ(names_in(out), (std::vector<std::string>{".not-ours.tmp", "checkpoint-1", "checkpoint-3"}));
}

TEST(Checkpoint, ReplacesSameStep) {
  const Scratch out_scratch("replace");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 2, files_for(1), {});
  save_checkpoint(out, 2, files_for(2), {});
  expect_holds(out + "/checkpoint-2", 2);
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoint-2", nullptr));
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-2"}));
}

// A child process saves and dies right after step k; the parent then looks at what is left.
int save_in_child_crashing_at(int k, const std::string& out, int64_t step, uint32_t seed, int keep) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("OOMLESS_CRASH_AT", std::to_string(k).c_str(), 1);
    try {
      save_checkpoint(out, step, files_for(seed, kSmall), {.keep = keep});
    } catch (...) {
      _exit(1);
    }
    _exit(0);  // the hook did not fire
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(Checkpoint, CrashAfterEveryStepLeavesAVerifiedCheckpoint) {
  for (int k = 1; k <= 9; ++k) {
    SCOPED_TRACE("crash after step " + std::to_string(k));
    const Scratch out_scratch("crash_" + std::to_string(k));
    const std::string out = out_scratch.path;
    save_checkpoint(out, 1, files_for(1, kSmall), {});
    ASSERT_EQ(save_in_child_crashing_at(k, out, 2, 2, /*keep=*/1), 86);

    std::vector<std::string> warnings;
    auto found = find_latest_checkpoint(out, [&](const std::string& w) { warnings.push_back(w); });
    ASSERT_TRUE(found.has_value());
    // The new checkpoint exists from the rename (step 7) on; before it, the old one serves.
    EXPECT_EQ(found->step, k >= 7 ? 2 : 1);
    EXPECT_TRUE(verify_checkpoint(found->path, nullptr));
    expect_holds(found->path, uint32_t(found->step), kSmall);
    for (const std::string& w : warnings) EXPECT_EQ(w.find("incomplete or corrupt"), std::string::npos) << w;
    // Pruning (keep=1) has happened only when the crash came after it.
    EXPECT_EQ(fs::exists(out + "/checkpoint-1"), k < 9);

    save_checkpoint(out, 2, files_for(2, kSmall), {.keep = 1});
    EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-2"}));
    expect_holds(out + "/checkpoint-2", 2, kSmall);
  }
}

TEST(Checkpoint, CrashWhileReplacingSameStep) {
  for (int k = 1; k <= 9; ++k) {
    SCOPED_TRACE("crash after step " + std::to_string(k));
    const Scratch out_scratch("crash_replace_" + std::to_string(k));
    const std::string out = out_scratch.path;
    save_checkpoint(out, 2, files_for(1, kSmall), {});
    ASSERT_EQ(save_in_child_crashing_at(k, out, 2, 2, /*keep=*/1), 86);

    auto found = find_latest_checkpoint(out, {});
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->step, 2);
    EXPECT_TRUE(verify_checkpoint(found->path, nullptr));
    expect_holds(found->path, k >= 7 ? 2 : 1, kSmall);

    save_checkpoint(out, 2, files_for(3, kSmall), {.keep = 1});
    EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-2"}));
    expect_holds(out + "/checkpoint-2", 3, kSmall);
  }
}

TEST(Checkpoint, NoSpaceLeavesPreviousIntact) {
  const Scratch out_scratch("enospc");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 1, files_for(1), {});
  ::setenv("OOMLESS_FAULT_ENOSPC_AFTER", "1000000", 1);
  const std::string err = error_of([&] { save_checkpoint(out, 2, files_for(2), {}); });
  ::unsetenv("OOMLESS_FAULT_ENOSPC_AFTER");
  EXPECT_EQ(err, "[checkpoint] " + out + "/.checkpoint-2.tmp/model.safetensors: no space left on device (ENOSPC) "
                 "after writing 1000000 bytes; free space or point --out elsewhere; the previous checkpoint is "
                 "intact");
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-1"}));  // tmp folder removed
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoint-1", nullptr));
  expect_holds(out + "/checkpoint-1", 1);

  // The limit counts every file of the save: here it falls inside the manifest, written last.
  const size_t files_bytes = payload(2).size() + std::string("{\"seed\": 2}").size();
  ::setenv("OOMLESS_FAULT_ENOSPC_AFTER", std::to_string(files_bytes + 5).c_str(), 1);
  const std::string err2 = error_of([&] { save_checkpoint(out, 2, files_for(2), {}); });
  ::unsetenv("OOMLESS_FAULT_ENOSPC_AFTER");
  EXPECT_EQ(err2.rfind("[checkpoint] " + out + "/.checkpoint-2.tmp/manifest.json: no space left on device (ENOSPC) "
                       "after writing 5 bytes",
                       0),
            0u)
      << err2;
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-1"}));

  // With no earlier checkpoint the message does not promise one.
  const Scratch fresh_scratch("enospc_fresh");
  const std::string fresh = fresh_scratch.path;
  ::setenv("OOMLESS_FAULT_ENOSPC_AFTER", "0", 1);
  const std::string err3 = error_of([&] { save_checkpoint(fresh, 1, files_for(1), {}); });
  ::unsetenv("OOMLESS_FAULT_ENOSPC_AFTER");
  EXPECT_NE(err3.find("after writing 0 bytes; free space or point --out elsewhere; no checkpoint was saved"),
            std::string::npos)
      << err3;
  EXPECT_TRUE(names_in(fresh).empty());

  // Without the hook the same save succeeds.
  save_checkpoint(out, 2, files_for(2), {.keep = 1});
  EXPECT_EQ(find_latest_checkpoint(out, {})->step, 2);
}

TEST(Checkpoint, RealFullDevice) {
  int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  if (fd < 0) GTEST_SKIP() << "no /dev/full";
  const std::string data(10000, 'x');
  const std::string err = error_of([&] { checkpoint_write(fd, data.data(), data.size()); });
  ::close(fd);
  EXPECT_NE(err.find("no space left on device (ENOSPC)"), std::string::npos) << err;
  EXPECT_NE(err.find("free space or point --out elsewhere"), std::string::npos) << err;

  const std::string err2 = error_of([&] { checkpoint_write(-1, data.data(), data.size()); });
  EXPECT_NE(err2.find("[checkpoint] fd -1: write failed after 0 bytes: Bad file descriptor"), std::string::npos)
      << err2;
}

std::atomic<int> g_alarms{0};
void on_alarm(int) { g_alarms.fetch_add(1); }

// A pipe whose reader is slow makes write() block; a timer signal without SA_RESTART then interrupts
// it, so write() returns either a short count or -1 with EINTR. Every byte must still arrive, in order.
TEST(Checkpoint, WriteSurvivesSignalsAndShortWrites) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  struct sigaction sa {}, old_sa {};
  sa.sa_handler = on_alarm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: blocked writes return early
  ASSERT_EQ(::sigaction(SIGALRM, &sa, &old_sa), 0);

  const std::string data = payload(9, size_t(3) << 20);
  std::string received;
  std::thread reader([&] {
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGALRM);
    pthread_sigmask(SIG_BLOCK, &block, nullptr);  // signals go to the writing thread
    char buf[4096];
    for (;;) {
      ssize_t r = ::read(p[0], buf, sizeof buf);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      received.append(buf, size_t(r));
      ::usleep(20);
    }
  });
  struct itimerval every{{0, 200}, {0, 200}}, off{};
  g_alarms = 0;
  ::setitimer(ITIMER_REAL, &every, nullptr);
  std::string err = error_of([&] { checkpoint_write(p[1], data.data(), data.size()); });
  ::setitimer(ITIMER_REAL, &off, nullptr);
  ::close(p[1]);
  reader.join();
  ::close(p[0]);
  ::sigaction(SIGALRM, &old_sa, nullptr);

  EXPECT_EQ(err, "(no error)");
  EXPECT_GT(g_alarms.load(), 0);
  EXPECT_EQ(received.size(), data.size());
  EXPECT_TRUE(received == data);
}

TEST(Checkpoint, RefusesBadFileNames) {
  const Scratch out_scratch("names");
  const std::string out = out_scratch.path;
  auto w = [](int) {};
  for (const std::string& bad : {std::string("../escape"), std::string("a/b"), std::string(".."), std::string("."),
                                 std::string(""), std::string(".hidden"), std::string("manifest.json")}) {
    const std::string err = error_of([&] { save_checkpoint(out, 1, {{bad, "x", {}}}, {}); });
    EXPECT_EQ(err.rfind("[checkpoint] " + out + "/checkpoint-1: file name \"" + bad + "\" is not allowed", 0), 0u)
        << err;
  }
  EXPECT_NE(error_of([&] { save_checkpoint(out, 1, {{"a", "x", {}}, {"a", "y", {}}}, {}); }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_checkpoint(out, 1, {{"a", "x", w}}, {}); }).find("give exactly one"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_checkpoint(out, -1, {}, {}); }).find("the step must be >= 0"), std::string::npos);
  EXPECT_TRUE(names_in(out).empty());  // refused before touching the disk
}

TEST(Checkpoint, WriteFunctionErrorsRemoveTheTmpFolder) {
  const Scratch out_scratch("callback_error");
  const std::string out = out_scratch.path;
  save_checkpoint(out, 1, files_for(1), {});
  auto throws = [](int fd) {
    checkpoint_write(fd, "abc", 3);
    throw std::runtime_error("tensor 7 is missing");
  };
  const std::string err = error_of([&] { save_checkpoint(out, 2, {{"model.safetensors", "", throws}}, {}); });
  EXPECT_EQ(err, "[checkpoint] " + out + "/.checkpoint-2.tmp/model.safetensors: writing failed: tensor 7 is "
                 "missing; the previous checkpoint is intact");
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"checkpoint-1"}));
}

TEST(Checkpoint, UnwritableOut) {
  const Scratch base_scratch("unwritable");
  const std::string base = base_scratch.path;
  // OUT below a regular file: cannot be created, whoever runs the test.
  write_raw(base + "/file", "x");
  const std::string err = error_of([&] { save_checkpoint(base + "/file/out", 1, files_for(1), {}); });
  EXPECT_EQ(err.rfind("[checkpoint] " + base + "/file/out: cannot create the output folder", 0), 0u) << err;
  EXPECT_NE(err.find("point --out at a writable folder"), std::string::npos) << err;
  const std::string err2 = error_of([&] { save_checkpoint(base + "/file", 1, files_for(1), {}); });
  EXPECT_EQ(err2.rfind("[checkpoint] " + base + "/file: cannot create the output folder", 0), 0u) << err2;
}

TEST(Checkpoint, ReadOnlyOut) {
  // Root ignores permissions, so this runs only as another user.
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: permissions are not enforced";
  const Scratch ro_scratch("read_only");
  const std::string ro = ro_scratch.path;
  fs::create_directory(ro);
  ::chmod(ro.c_str(), 0500);
  const std::string err3 = error_of([&] { save_checkpoint(ro, 1, files_for(1), {}); });
  ::chmod(ro.c_str(), 0700);
  EXPECT_EQ(err3.rfind("[checkpoint] " + ro + "/.checkpoint-1.tmp: cannot create: Permission denied; make the "
                       "output folder writable or point --out elsewhere",
                       0),
            0u)
      << err3;
}

}  // namespace
}  // namespace oomless
