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


// A run over several ranks: the rank count, the kind (data or context parallel) and stage, each rank's peak and
// optimizer state, and what each rank sent in the last step (the difference of the last two lines' running
// totals).
TEST(Report, SeveralRanksShowEachRanksMemoryAndTraffic) {
  std::string m;
  for (int step = 1; step <= 2; ++step)
    m += "{\"type\":\"train\",\"step\":" + std::to_string(step) +
         ",\"loss\":5,\"lr\":0.001,\"grad_norm\":1,\"tokens_per_s\":100,\"skipped\":false,"
         "\"ranks\":{\"size\":2,\"peak\":[3145728,2097152],\"optimizer\":[1048576,524288],\"bytes_sent\":[" +
         std::to_string(step * 4194304) + "," + std::to_string(step * 2097152) + "]}}\n";
  json::Value cfg = json::Value::object();
  cfg.set("zero", json::Value::integer(1));
  const std::string page = render_report(m, cfg);
  EXPECT_NE(page.find("2 (data parallel, ZeRO stage 1)"), std::string::npos) << page;
  EXPECT_NE(page.find("3.00 MiB, 2.00 MiB"), std::string::npos);
  EXPECT_NE(page.find("1.00 MiB, 512.00 KiB"), std::string::npos);
  EXPECT_NE(page.find("bytes sent in the last step, by rank</td><td>4.00 MiB, 2.00 MiB"), std::string::npos);
  EXPECT_EQ(render_report("", json::Value::object()).find("by rank"), std::string::npos);
  cfg.set("context-parallel", json::Value::integer(2));
  EXPECT_NE(render_report(m, cfg).find("2 (context parallel: each sequence in slices over the ranks, ZeRO stage 1)"),
            std::string::npos);
}

// A planned run: the plan's settings, per-layer choices and reasons, and its predicted peak and step beside
// what the metrics measured (the Device + Host peak; the median step after the first).
TEST(Report, APlannedRunShowsThePlanBesideWhatItMeasured) {
  std::string m;
  const int tps[] = {100, 400, 500, 250};  // step seconds with seq 100, batch 2: 2, 0.5, 0.4, 0.8 -> median 0.5
  for (int s = 1; s <= 4; ++s)
    m += "{\"type\":\"train\",\"step\":" + std::to_string(s) + ",\"loss\":3,\"lr\":0.001,\"grad_norm\":1,"
         "\"tokens_per_s\":" + std::to_string(tps[s - 1]) + ",\"memory\":{\"device\":{\"total\":{\"current\":1,\"peak\":" +
         std::to_string(s == 2 ? 3 << 20 : 1 << 20) + "}},\"host\":{\"total\":{\"current\":1,\"peak\":1048576}}}}\n";
  json::Value cfg = json::Value::object();
  cfg.set("seq", json::Value::integer(100));
  cfg.set("batch", json::Value::integer(2));
  json::Value plan = json::Value::object();
  plan.set("source", json::Value::string("--plan p.json"));
  plan.set("settings", json::Value::string("--save-policy none:0,all --chunk 0"));
  plan.set("predicted_peak", json::Value::number(4 << 20));
  plan.set("predicted_step_s", json::Value::number(0.4));
  plan.set("explain", json::Value::string("layer 0 <recomputed>"));
  json::Value layers = json::Value::array();
  for (const char* p : {"none", "all"}) {
    json::Value l = json::Value::object();
    l.set("save_policy", json::Value::string(p));
    l.set("activations", json::Value::string(p[0] == 'n' ? "memory" : "disk"));
    layers.push_back(std::move(l));
  }
  plan.set("layers", std::move(layers));
  json::Value summary = json::Value::object();
  summary.set("plan", plan);
  const std::string page = render_report(m, cfg, summary);
  EXPECT_NE(page.find("<h2>Plan</h2>"), std::string::npos);
  EXPECT_NE(page.find("<td>chosen by</td><td>--plan p.json</td>"), std::string::npos);
  EXPECT_NE(page.find("<td>settings</td><td>--save-policy none:0,all --chunk 0</td>"), std::string::npos);
  EXPECT_NE(page.find("predicted 4.00 MiB, measured 4.00 MiB (measured +0%)"), std::string::npos) << page;
  EXPECT_NE(page.find("predicted 0.4 s, measured 0.5 s (median after the first step) (measured +25%)"), std::string::npos);
  EXPECT_NE(page.find("<tr><td>1</td><td>all</td><td>disk</td></tr>"), std::string::npos);
  EXPECT_NE(page.find("layer 0 &lt;recomputed&gt;"), std::string::npos);
  // an unplanned run has no plan section
  EXPECT_EQ(render_report(m, cfg).find("<h2>Plan</h2>"), std::string::npos);
}

}  // namespace
}  // namespace oomless
