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
  cfg.set("seq", json::Value::integer(100));
  cfg.set("batch", json::Value::integer(2));
  cfg.set("budget", json::Value::string("3MiB"));
  json::Value summary = json::Value::object();
  summary.set("epochs", json::Value::number(0.25));
  summary.set("total_steps", json::Value::integer(8));
  const std::string page = render_report(m, cfg, summary);
  EXPECT_EQ(count(page, "<svg"), 5);       // loss, lr, gradient norm, throughput, memory
  EXPECT_EQ(count(page, "<polyline"), 6);  // loss, eval, lr, gradient norm, throughput, memory total
  EXPECT_EQ(count(page, "<polygon"), 1);   // the stacked weights band
  EXPECT_EQ(count(page, "<circle"), 1);    // the eval point
  EXPECT_NE(page.find("5 steps logged, 1 skipped"), std::string::npos);
  EXPECT_NE(page.find("last eval loss 4.5 at step 5"), std::string::npos);
  EXPECT_NE(page.find(">weights</text>"), std::string::npos);
  EXPECT_NE(page.find(">total 1</text>"), std::string::npos);            // 1 MiB held
  EXPECT_NE(page.find(">--budget 3MiB</text>"), std::string::npos);      // the budget line
  EXPECT_NE(page.find("<td>steps</td><td>5 of 8</td>"), std::string::npos);
  EXPECT_NE(page.find("<td>tokens trained</td><td>1000</td>"), std::string::npos);  // 5 x 100 x 2
  EXPECT_NE(page.find("<td>epochs</td><td>0.25</td>"), std::string::npos);
  EXPECT_NE(page.find("<td>time in steps</td><td>1 s (1000 tokens/s)</td>"), std::string::npos);
  EXPECT_NE(page.find("<td>best eval loss</td><td>4.5 at step 5</td>"), std::string::npos);
  // Throughput's axis starts at 0 although every value is 1000.
  const size_t thr = page.find("Throughput");
  ASSERT_NE(thr, std::string::npos);
  EXPECT_NE(page.substr(thr, page.find("</svg>", thr) - thr).find("text-anchor=\"end\">0</text>"), std::string::npos);
  EXPECT_NE(page.find("preset:&lt;micro&gt;"), std::string::npos);
  EXPECT_EQ(page.find("<micro>"), std::string::npos);
  EXPECT_EQ(page.find("<script"), std::string::npos);  // self-contained, nothing to fetch or run
  EXPECT_EQ(page.find("http://") == std::string::npos ? 0 : count(page, "http://") - count(page, "http://www.w3.org/2000/svg"), 0);
}

TEST(Report, EmptyMetricsStillRender) {
  const std::string page = render_report("", json::Value::object());
  EXPECT_NE(page.find("0 steps logged"), std::string::npos);
  EXPECT_EQ(count(page, "no data"), 5);
}

}  // namespace
}  // namespace oomless
