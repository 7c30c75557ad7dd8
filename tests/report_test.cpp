// report.html from metrics lines: the charts carry the logged values, the configuration is shown and
// escaped, and a torn last line is skipped.
#include <gtest/gtest.h>

#include "io/json.h"
#include "train/report.h"

namespace oomless {
namespace {

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(Report, ChartsAndConfiguration) {
  std::string m;
  for (int s = 1; s <= 5; ++s)
    m += "{\"type\":\"train\",\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(9 - s) +
         ",\"lr\":0.001,\"grad_norm\":1,\"tokens_per_s\":1000,\"skipped\":" + (s == 3 ? "true" : "false") +
         ",\"memory\":{\"device\":{\"weights\":{\"current\":1048576,\"peak\":1048576},\"total\":{\"current\":1048576,"
         "\"peak\":1048576}}}}\n";
  m += "{\"type\":\"eval\",\"step\":5,\"loss\":4.5,\"ppl\":90}\n";
  m += "{\"type\":\"train\",\"step\":6,\"lo";  // torn by a crash
  json::Value cfg = json::Value::object();
  cfg.set("model", json::Value::string("preset:<micro>"));
  cfg.set("lr", json::Value::number(0.001));
  const std::string page = render_report(m, cfg);
  EXPECT_EQ(count(page, "<svg"), 4);
  EXPECT_EQ(count(page, "<polyline"), 5);  // loss, eval, lr, throughput, device weights
  EXPECT_EQ(count(page, "<circle"), 1);    // the eval point
  EXPECT_NE(page.find("5 steps logged, 1 skipped"), std::string::npos);
  EXPECT_NE(page.find("last eval loss 4.5 at step 5"), std::string::npos);
  EXPECT_NE(page.find("device weights"), std::string::npos);
  EXPECT_NE(page.find("preset:&lt;micro&gt;"), std::string::npos);
  EXPECT_EQ(page.find("<micro>"), std::string::npos);
  EXPECT_EQ(page.find("<script"), std::string::npos);  // self-contained, nothing to fetch or run
  EXPECT_EQ(page.find("http://") == std::string::npos ? 0 : count(page, "http://") - count(page, "http://www.w3.org/2000/svg"), 0);
}

TEST(Report, EmptyMetricsStillRender) {
  const std::string page = render_report("", json::Value::object());
  EXPECT_NE(page.find("0 steps logged"), std::string::npos);
  EXPECT_EQ(count(page, "no data"), 4);
}

}  // namespace
}  // namespace oomless
