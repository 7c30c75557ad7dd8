// MetricsWriter: the JSON lines it appends, and truncate_after, which cuts metrics.jsonl back to a
// checkpoint's step on resume (dropping a torn last line) by an atomic rewrite.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "io/json.h"
#include "memory/arena.h"
#include "train/metrics.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

class Metrics : public testing::Test {
 protected:
  void SetUp() override {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(testing::TempDir()) / ("oomless_metrics_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = MetricsWriter::path_in(dir_.string());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string read() const {
    std::ifstream f(path_, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
  }
  std::vector<json::Value> records() const {
    std::vector<json::Value> out;
    std::istringstream in(read());
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    return out;
  }
  void append_raw(const std::string& s) const {
    std::ofstream f(path_, std::ios::binary | std::ios::app);
    f << s;
  }
  // Steps 1..5 with evals after 2 and 4.
  void write_run() const {
    Ledger ledger;
    MetricsWriter w(dir_.string());
    for (int64_t s = 1; s <= 5; ++s) {
      w.write_step(s, 5.0 - 0.1 * static_cast<double>(s), 1e-3, 0.5, 1000.0, false, ledger);
      if (s % 2 == 0) w.write_eval(s, 4.0, std::exp(4.0));
    }
  }
  std::vector<int64_t> steps() const {
    std::vector<int64_t> v;
    for (const json::Value& r : records()) v.push_back(r.at("step").as_int() * (r.at("type").as_string() == "eval" ? -1 : 1));
    return v;
  }

  fs::path dir_;
  std::string path_;
};

TEST_F(Metrics, StepLineHasEveryFieldAndNonzeroLedgerCategories) {
  Ledger ledger;
  Arena host(Tier::Host, size_t{1} << 24, ledger);
  Buffer w = host.alloc(4096, Category::weights);
  {
    Buffer a = host.alloc(1000, Category::activations);
  }
  MetricsWriter mw(dir_.string());
  mw.write_step(7, 2.5, 3e-4, 1.25, 12345.5, false, ledger);
  mw.write_step(8, 2.4, 3e-4, std::numeric_limits<double>::quiet_NaN(), 12000.0, true, ledger);
  mw.write_eval(8, 2.0, std::exp(2.0));

  const std::vector<json::Value> r = records();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].at("type").as_string(), "train");
  EXPECT_EQ(r[0].at("step").as_int(), 7);
  EXPECT_EQ(r[0].at("loss").as_number(), 2.5);
  EXPECT_EQ(r[0].at("lr").as_number(), 3e-4);
  EXPECT_EQ(r[0].at("grad_norm").as_number(), 1.25);
  EXPECT_EQ(r[0].at("tokens_per_s").as_number(), 12345.5);
  EXPECT_FALSE(r[0].at("skipped").as_bool());
  const json::Value& mem = r[0].at("memory");
  ASSERT_EQ(mem.size(), 1u) << json::dump(mem);  // only the host tier held anything
  const json::Value& h = mem.at("host");
  EXPECT_EQ(h.at("weights").at("current").as_int(), 4096);
  EXPECT_EQ(h.at("weights").at("peak").as_int(), 4096);
  EXPECT_EQ(h.at("activations").at("current").as_int(), 0);  // freed, but it did hold bytes
  EXPECT_EQ(h.at("activations").at("peak").as_int(), 1000);
  EXPECT_EQ(h.find("optimizer"), nullptr);
  EXPECT_EQ(h.at("total").at("peak").as_int(), 5096);
  EXPECT_EQ(h.at("total").at("current").as_int(), 4096);

  EXPECT_TRUE(r[1].at("grad_norm").is_null());  // JSON has no NaN
  EXPECT_TRUE(r[1].at("skipped").as_bool());
  EXPECT_EQ(r[2].at("type").as_string(), "eval");
  EXPECT_EQ(r[2].at("step").as_int(), 8);
  EXPECT_EQ(r[2].at("loss").as_number(), 2.0);
  EXPECT_EQ(r[2].at("ppl").as_number(), std::exp(2.0));
}

TEST_F(Metrics, WriterAppendsToAnExistingFile) {
  write_run();
  write_run();
  EXPECT_EQ(records().size(), 14u);
}

TEST_F(Metrics, TruncateKeepsStepsUpToTheCheckpointAndDropsATornLine) {
  write_run();
  append_raw("{\"type\":\"train\",\"step\":6,\"lo");  // a crash in the middle of a write
  MetricsWriter::truncate_after(path_, 3);
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, -2, 3}));
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
  // The resumed run appends after the kept lines.
  {
    Ledger ledger;
    MetricsWriter w(dir_.string());
    w.write_step(4, 1.0, 1e-3, 0.5, 10.0, false, ledger);
  }
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, -2, 3, 4}));
  // Truncating at or past the last step changes nothing.
  const std::string before = read();
  MetricsWriter::truncate_after(path_, 4);
  EXPECT_EQ(read(), before);
  MetricsWriter::truncate_after(path_, 0);
  EXPECT_EQ(read(), "");
}

TEST_F(Metrics, TruncateDropsALastLineMissingOnlyItsNewline) {
  write_run();
  // Complete JSON, but the write stopped before its newline: the next append would run into it.
  append_raw("{\"type\":\"eval\",\"step\":5,\"loss\":1.0,\"ppl\":2.0}");
  MetricsWriter::truncate_after(path_, 10);
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, -2, 3, 4, -4, 5}));
  EXPECT_EQ(read().back(), '\n');
}

TEST_F(Metrics, TruncateDropsAGarbageLastLineButRefusesDamageBeforeIt) {
  write_run();
  append_raw(std::string("\0\0\0\0", 4) + "\n");  // zeros where a line's data had not reached the disk
  MetricsWriter::truncate_after(path_, 10);
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, -2, 3, 4, -4, 5}));

  append_raw("not json\n");
  append_raw("{\"type\":\"train\",\"step\":6}\n");
  const std::string before = read();
  try {
    MetricsWriter::truncate_after(path_, 10);
    FAIL() << "a damaged middle line was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 8"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read(), before);  // left as it was
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
}

TEST_F(Metrics, TruncateOfAMissingFileLeavesItMissing) {
  MetricsWriter::truncate_after(path_, 5);
  EXPECT_FALSE(fs::exists(path_));
}

TEST_F(Metrics, WriterNeedsAnExistingFolder) {
  EXPECT_THROW(MetricsWriter((dir_ / "absent").string()), Error);
}

}  // namespace
}  // namespace oomless
