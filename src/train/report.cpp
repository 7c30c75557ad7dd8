#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "data/text.h"
#include "memory/arena.h"
#include "train/metrics.h"

namespace oomless {

namespace {

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> pts;  // (step, value)
  bool markers = false;                        // eval points: circles, not a line only
};

std::string esc(const std::string& s) {
  std::string r;
  for (char c : s) {
    switch (c) {
      case '<': r += "&lt;"; break;
      case '>': r += "&gt;"; break;
      case '&': r += "&amp;"; break;
      case '"': r += "&quot;"; break;
      default: r += c;
    }
  }
  return r;
}

std::string num(double v) {
  char b[32];
  const double a = std::abs(v);
  if (a != 0 && (a >= 1e5 || a < 1e-3)) std::snprintf(b, sizeof b, "%.2g", v);
  else std::snprintf(b, sizeof b, "%.4g", v);
  return b;
}

// Round tick spacing: 1, 2 or 5 times a power of ten, about n ticks over [lo, hi].
double tick_step(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  if (!(raw > 0)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

struct ChartOptions {
  bool from_zero = false;  // the y axis starts at 0 (rates, sizes)
  bool stacked = false;    // series drawn as areas stacked in order, with their total as a line
  double ref = NAN;        // a horizontal reference line (e.g. the budget), labelled ref_label
  std::string ref_label;
};

// Stacks series over the union of their x values (a missing value counts 0): each series' points become
// the running total up to it.
std::vector<Series> stack(const std::vector<Series>& in) {
  std::map<double, double> acc;
  for (const Series& s : in)
    for (const auto& pt : s.pts) acc.emplace(pt.first, 0.0);
  std::vector<Series> out;
  for (const Series& s : in) {
    std::map<double, double> v;
    for (auto [x, y] : s.pts) v[x] = std::isfinite(y) ? y : 0;
    Series t = s;
    t.pts.clear();
    for (auto& [x, a] : acc) {
      a += v.count(x) ? v[x] : 0;
      t.pts.push_back({x, a});
    }
    out.push_back(std::move(t));
  }
  return out;
}

// One chart as inline SVG (lines, or stacked areas), with axes, ticks and a legend.
std::string chart(const std::string& title, const std::string& y_label, const std::vector<Series>& series_in,
                  const ChartOptions& opt = {}) {
  const std::vector<Series> series = opt.stacked ? stack(series_in) : series_in;
  // The legend sits between the title and the plot, wrapped onto as many rows as it needs.
  const double W = 640, L = 64, R = 16, B = 40;
  std::vector<std::pair<double, int>> legend_pos;  // x and row per series
  {
    double x = L;
    int row = 0;
    for (const Series& s : series) {
      const double w = 24 + 7.0 * static_cast<double>(s.name.size());
      if (x + w > W - R && x > L) x = L, ++row;
      legend_pos.push_back({x, row});
      x += w;
    }
  }
  const int rows = legend_pos.empty() ? 0 : legend_pos.back().second + 1;
  const double T = 28 + 16.0 * rows, H = 232 + 16.0 * rows;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series& s : series)
    for (auto [x, y] : s.pts) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\">\n<text x=\"" << L << "\" y=\"16\" font-size=\"14\" font-weight=\"bold\">" << esc(title)
    << "</text>\n";
  if (x0 > x1) {
    o << "<text x=\"" << L << "\" y=\"" << H / 2 << "\" fill=\"#888\">no data</text></svg>\n";
    return o.str();
  }
  if (opt.from_zero || opt.stacked) y0 = std::min(y0, 0.0);
  if (std::isfinite(opt.ref)) y1 = std::max(y1, opt.ref);
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + (y0 == 0 ? 1 : std::abs(y0) * 0.1);
  const double pad = (y1 - y0) * 0.05;
  y0 = (opt.from_zero || opt.stacked) && y0 >= 0 ? 0 : y0 - pad;
  y1 += pad;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"#999\"/>\n";
  const double ys = tick_step(y0, y1, 5);
  for (double y = std::ceil(y0 / ys) * ys; y <= y1; y += ys) {
    if (std::abs(y) < ys * 1e-9) y = 0;  // no "-0" from accumulated rounding
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(y) << "\" y2=\"" << Y(y)
      << "\" stroke=\"#eee\"/><text x=\"" << L - 6 << "\" y=\"" << Y(y) + 4
      << "\" font-size=\"11\" text-anchor=\"end\">" << num(y) << "</text>\n";
  }
  const double xs = tick_step(x0, x1, 6);
  for (double x = std::ceil(x0 / xs) * xs; x <= x1; x += xs)
    o << "<text x=\"" << X(x) << "\" y=\"" << H - B + 16 << "\" font-size=\"11\" text-anchor=\"middle\">" << num(x)
      << "</text>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 6 << "\" font-size=\"12\" text-anchor=\"middle\">step</text>\n";
  o << "<text x=\"14\" y=\"" << (T + H - B) / 2 << "\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 "
    << (T + H - B) / 2 << ")\">" << esc(y_label) << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    const double lx = legend_pos[i].first, ly = 24 + 16.0 * legend_pos[i].second;
    if (s.pts.empty()) continue;
    std::ostringstream pts;
    for (auto [x, y] : s.pts)
      if (std::isfinite(y)) pts << X(x) << "," << Y(y) << " ";
    if (opt.stacked) {
      // The band between the series below (or the axis) and this one's running total.
      std::ostringstream band;
      band << pts.str();
      if (i == 0) {
        band << X(s.pts.back().first) << "," << Y(0) << " " << X(s.pts.front().first) << "," << Y(0);
      } else {
        const auto& below = series[i - 1].pts;
        for (auto it = below.rbegin(); it != below.rend(); ++it) band << X(it->first) << "," << Y(it->second) << " ";
      }
      o << "<polygon fill=\"" << s.color << "\" fill-opacity=\"0.55\" stroke=\"none\" points=\"" << band.str() << "\"/>\n";
    } else {
      o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\" points=\"" << pts.str() << "\"/>\n";
    }
    if (s.markers)
      for (auto [x, y] : s.pts)
        if (std::isfinite(y)) o << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"3\" fill=\"" << s.color << "\"/>\n";
    o << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"10\" height=\"10\" fill=\"" << s.color
      << "\"/><text x=\"" << lx + 14 << "\" y=\"" << ly + 9 << "\" font-size=\"11\">" << esc(s.name) << "</text>\n";
  }
  if (opt.stacked && !series.empty() && !series.back().pts.empty()) {
    std::ostringstream pts;
    for (auto [x, y] : series.back().pts) pts << X(x) << "," << Y(y) << " ";
    o << "<polyline fill=\"none\" stroke=\"#000\" stroke-width=\"1.5\" points=\"" << pts.str() << "\"/>\n"
      << "<text x=\"" << W - R - 4 << "\" y=\"" << Y(series.back().pts.back().second) - 4
      << "\" font-size=\"11\" text-anchor=\"end\">total " << num(series.back().pts.back().second) << "</text>\n";
  }
  if (std::isfinite(opt.ref)) {
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(opt.ref) << "\" y2=\"" << Y(opt.ref)
      << "\" stroke=\"#d00\" stroke-dasharray=\"6 4\"/><text x=\"" << L + 4 << "\" y=\"" << Y(opt.ref) - 4
      << "\" font-size=\"11\" fill=\"#d00\">" << esc(opt.ref_label) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

}  // namespace

std::string render_report(const std::string& metrics_jsonl, const json::Value& config, const json::Value& summary) {
  Series loss{"train loss", kColors[0], {}}, eval{"eval loss", kColors[1], {}, true};
  Series lr{"learning rate", kColors[2], {}}, tps{"tokens/s", kColors[3], {}};
  Series gnorm{"gradient norm (before clipping)", kColors[4], {}};
  double seconds = 0;  // sum of the steps' times (tokens / tokens_per_s)
  std::map<std::string, Series> mem;  // "tier category" -> current bytes (MiB)
  // --kv-dtype fp8: per step, the share (%) of stored keys / values saturated and flushed to zero
  Series ksat{"keys saturated", kColors[0], {}}, kflush{"keys flushed to zero", kColors[1], {}},
      vsat{"values saturated", kColors[2], {}}, vflush{"values flushed to zero", kColors[3], {}};
  // --act-dtype fp8: the same shares over every saved activation of the step
  Series asat{"saturated", kColors[4], {}}, aflush{"flushed to zero", kColors[5], {}};
  int64_t steps = 0, skipped = 0;
  json::Value params;  // the last train line's "params"
  std::vector<double> step_tps;  // tokens/s of each step (the plan's measured step time)
  double ram_peak = 0;           // the ledger's Device + Host peak over the steps
  json::Value ranks, ranks_before;  // several ranks: the last two train lines' "ranks"
  std::istringstream in(metrics_jsonl);
  for (std::string line; std::getline(in, line);) {
    json::Value o;
    try {
      o = json::parse(line, "metrics.jsonl");
    } catch (const Error&) {
      continue;
    }
    if (!o.is_object() || !o.find("step")) continue;
    const double s = o.at("step").as_number();
    auto val = [&](const char* k) {
      const json::Value* v = o.find(k);
      return v && v->is_number() ? v->as_number() : NAN;
    };
    if (const json::Value* t = o.find("type"); t && t->is_string() && t->as_string() == "eval") {
      eval.pts.push_back({s, val("loss")});
      continue;
    }
    ++steps;
    if (const json::Value* sk = o.find("skipped"); sk && sk->is_bool() && sk->as_bool()) ++skipped;
    if (const json::Value* p = o.find("params"); p && p->is_object()) params = *p;
    if (const json::Value* r = o.find("ranks"); r && r->is_object()) ranks_before = ranks, ranks = *r;
    loss.pts.push_back({s, val("loss")});
    lr.pts.push_back({s, val("lr")});
    tps.pts.push_back({s, val("tokens_per_s")});
    gnorm.pts.push_back({s, val("grad_norm")});
    if (const double t = val("tokens_per_s"); t > 0) seconds += 1.0 / t, step_tps.push_back(t);  // (times tokens a step below)
    if (const json::Value* m = o.find("memory"); m && m->is_object()) {
      double p = 0;
      for (const char* tier : {"device", "host"})
        if (const json::Value* t = m->find(tier); t && t->is_object())
          if (const json::Value* tot = t->find("total"); tot && tot->is_object() && tot->find("peak"))
            p += tot->at("peak").as_number();
      ram_peak = std::max(ram_peak, p);
    }
    if (const json::Value* f = o.find("kv_fp8"); f && f->is_object())
      for (const char* kind : {"k", "v"}) {
        const json::Value* c = f->find(kind);
        if (!c || !c->is_object() || !c->find("values") || !c->find("saturated") || !c->find("flushed")) continue;
        const double n = c->at("values").as_number();
        if (!(n > 0)) continue;
        (kind[0] == 'k' ? ksat : vsat).pts.push_back({s, 100.0 * c->at("saturated").as_number() / n});
        (kind[0] == 'k' ? kflush : vflush).pts.push_back({s, 100.0 * c->at("flushed").as_number() / n});
      }
    if (const json::Value* f = o.find("act_fp8"); f && f->is_object())
      if (const json::Value* c = f->find("all");
          c && c->is_object() && c->find("values") && c->find("saturated") && c->find("flushed"))
        if (const double n = c->at("values").as_number(); n > 0) {
          asat.pts.push_back({s, 100.0 * c->at("saturated").as_number() / n});
          aflush.pts.push_back({s, 100.0 * c->at("flushed").as_number() / n});
        }
    if (const json::Value* m = o.find("memory"); m && m->is_object())
      for (const auto& [tier, cats] : m->as_object()) {
        if (!cats.is_object()) continue;
        for (const auto& [cat, v] : cats.as_object()) {
          if (cat == "total" || !v.is_object() || !v.find("current")) continue;
          const std::string key = tier == "device" ? cat : tier + " " + cat;
          Series& sr = mem[key];
          if (sr.name.empty()) sr.name = key, sr.color = kColors[mem.size() % 8];
          sr.pts.push_back({s, v.at("current").as_number() / (1024.0 * 1024.0)});
        }
      }
  }
  std::vector<Series> mem_series;
  for (auto& [k, v] : mem) mem_series.push_back(v);

  auto cfg_num = [&](const char* k) {
    const json::Value* v = config.is_object() ? config.find(k) : nullptr;
    return v && v->is_number() ? v->as_number() : 0.0;
  };
  const double tokens_per_step = cfg_num("seq") * std::max(1.0, cfg_num("batch")) * std::max(1.0, cfg_num("grad-accum"));
  seconds *= tokens_per_step;
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>oomless training report</title>\n"
       "<style>body{font-family:sans-serif;margin:24px;max-width:1340px}svg{margin:6px;border:1px solid #ddd}"
       "table{border-collapse:collapse}td{border:1px solid #ccc;padding:2px 8px;font-size:13px}</style></head><body>\n"
    << "<h1>oomless training report</h1>\n<p>" << steps << " steps logged, " << skipped << " skipped (non-finite)";
  if (!loss.pts.empty()) h << "; last training loss " << num(loss.pts.back().second);
  if (!eval.pts.empty()) h << "; last eval loss " << num(eval.pts.back().second) << " at step " << eval.pts.back().first;
  h << ".</p>\n";
  // The run in one table: time, tokens, epochs, best held-out loss.
  h << "<h2>Run</h2>\n<table>\n";
  auto row = [&](const std::string& k, const std::string& v) { h << "<tr><td>" << esc(k) << "</td><td>" << esc(v) << "</td></tr>\n"; };
  if (summary.is_object() && summary.find("model")) row("model", summary.at("model").as_string());
  row("steps", std::to_string(steps) + (summary.is_object() && summary.find("total_steps")
                                            ? " of " + std::to_string(summary.at("total_steps").as_int()) : ""));
  if (tokens_per_step > 0) row("tokens trained", std::to_string(static_cast<long long>(tokens_per_step * static_cast<double>(steps))));
  if (summary.is_object() && summary.find("epochs")) row("epochs", num(summary.at("epochs").as_number()));
  if (seconds > 0) row("time in steps", num(seconds) + " s (" + num(tokens_per_step * steps / seconds) + " tokens/s)");
  if (!eval.pts.empty()) {
    auto best = std::min_element(eval.pts.begin(), eval.pts.end(), [](auto& a, auto& b) { return a.second < b.second; });
    row("best eval loss", num(best->second) + " at step " + num(best->first));
  }
  // A run over several ranks: each rank's ledger peak and optimizer state, and what each sent in the last step.
  auto per_rank = [&](const json::Value& r, const char* key, const json::Value* before) {
    const json::Value* a = r.find(key);
    const json::Value* b = before && before->is_object() ? before->find(key) : nullptr;
    std::string out;
    for (size_t i = 0; a && a->is_array() && i < a->size(); ++i) {
      double v = (*a)[i].as_number();
      if (b && b->is_array() && i < b->size()) v -= (*b)[i].as_number();
      out += (out.empty() ? "" : ", ") + format_bytes(static_cast<size_t>(std::max(0.0, v)));
    }
    return out;
  };
  if (ranks.is_object() && ranks.find("size")) {
    const bool cp = config.is_object() && config.find("context-parallel") && config.at("context-parallel").as_int() > 1;
    row("ranks", std::to_string(ranks.at("size").as_int()) +
                     (cp ? " (context parallel: each sequence in slices over the ranks" : " (data parallel") +
                     (config.is_object() && config.find("zero") && config.at("zero").as_int() > 0
                          ? ", ZeRO stage " + std::to_string(config.at("zero").as_int()) : std::string()) + ")");
    row("ledger peak by rank", per_rank(ranks, "peak", nullptr));
    if (ranks.find("optimizer")) row("optimizer state by rank", per_rank(ranks, "optimizer", nullptr));
    if (ranks_before.is_object()) row("bytes sent in the last step, by rank", per_rank(ranks, "bytes_sent", &ranks_before));
  }
  h << "</table>\n";
  // A planned run (train --plan, or --budget alone): what the planner chose and why, and its prediction
  // beside what the run measured (the ledger's Device + Host peak; the median step after the first).
  if (const json::Value* pl = summary.is_object() ? summary.find("plan") : nullptr; pl && pl->is_object()) {
    auto str = [&](const char* k) {
      const json::Value* v = pl->find(k);
      return v && v->is_string() ? v->as_string() : std::string();
    };
    auto number = [&](const char* k) {
      const json::Value* v = pl->find(k);
      return v && v->is_number() ? v->as_number() : 0.0;
    };
    h << "<h2>Plan</h2>\n<table>\n";
    row("chosen by", str("source"));
    row("settings", str("settings"));
    const double pred_peak = number("predicted_peak"), pred_s = number("predicted_step_s");
    std::vector<double> later(step_tps.size() > 1 ? step_tps.begin() + 1 : step_tps.begin(), step_tps.end());
    std::sort(later.begin(), later.end());
    const double meas_s = later.empty() || tokens_per_step <= 0 ? 0 : tokens_per_step / later[later.size() / 2];
    auto pct = [&](double pred, double meas) {
      return pred > 0 && meas > 0 ? " (measured " + std::string(meas >= pred ? "+" : "") + num(100.0 * (meas - pred) / pred) + "%)" : std::string();
    };
    if (pred_peak > 0 || ram_peak > 0)
      row("peak memory (device + host)", "predicted " + format_bytes(static_cast<size_t>(pred_peak)) + ", measured " +
                                             format_bytes(static_cast<size_t>(ram_peak)) + pct(pred_peak, ram_peak));
    if (pred_s > 0 || meas_s > 0)
      row("step time", "predicted " + num(pred_s) + " s, measured " + num(meas_s) + " s (median after the first step)" +
                           pct(pred_s, meas_s));
    h << "</table>\n";
    if (const json::Value* layers = pl->find("layers"); layers && layers->is_array() && !layers->as_array().empty()) {
      h << "<table>\n<tr><td>layer</td><td>saved activations</td><td>kept in</td></tr>\n";
      int64_t i = 0;
      for (const json::Value& l : layers->as_array()) {
        const json::Value* po = l.is_object() ? l.find("save_policy") : nullptr;
        const json::Value* at = l.is_object() ? l.find("activations") : nullptr;
        h << "<tr><td>" << i++ << "</td><td>" << esc(po && po->is_string() ? po->as_string() : "") << "</td><td>"
          << esc(at && at->is_string() ? at->as_string() : "") << "</td></tr>\n";
      }
      h << "</table>\n";
    }
    if (const std::string why = str("explain"); !why.empty()) h << "<pre>" << esc(why) << "</pre>\n";
  }
  auto count = [&](const char* k) {
    const json::Value* v = params.is_object() ? params.find(k) : nullptr;
    return v && v->is_number() ? v->as_number() : 0.0;
  };
  if (params.is_object())
    h << "<p>Trainable parameters " << static_cast<long long>(count("trainable")) << " ("
      << format_bytes(static_cast<size_t>(count("trainable_bytes"))) << "); frozen "
      << static_cast<long long>(count("frozen")) << " (" << format_bytes(static_cast<size_t>(count("frozen_bytes")))
      << ").</p>\n";
  ChartOptions zero, memo;
  zero.from_zero = true;
  memo.stacked = true;
  if (const json::Value* b = config.is_object() ? config.find("budget") : nullptr; b && b->is_string() && !b->as_string().empty()) {
    try {
      memo.ref = static_cast<double>(parse_size(b->as_string())) / (1024.0 * 1024.0);
      memo.ref_label = "--budget " + b->as_string();
    } catch (const Error&) {
    }
  }
  h << "<div>\n"
    << chart("Loss", "cross-entropy (nats)", {loss, eval}) << chart("Learning rate", "lr", {lr})
    << chart("Gradient norm", "global L2 norm", {gnorm}, zero) << chart("Throughput", "tokens/s", {tps}, zero)
    << chart("Memory held by category (ledger, stacked; device and host)", "MiB", mem_series, memo);
  if (!ksat.pts.empty())
    h << chart("FP8 keys and values: saturated and flushed to zero (share of the step's stored values)", "%",
               {ksat, kflush, vsat, vflush}, zero);
  if (!asat.pts.empty())
    h << chart("FP8 saved activations: saturated and flushed to zero (share of the step's stored values)", "%",
               {asat, aflush}, zero);
  h << "</div>\n<h2>Configuration</h2>\n<table>\n";
  if (config.is_object())
    for (const auto& [k, v] : config.as_object())
      h << "<tr><td>" << esc(k) << "</td><td>" << esc(v.is_string() ? v.as_string() : json::dump(v)) << "</td></tr>\n";
  h << "</table>\n</body></html>\n";
  return h.str();
}

std::string write_report(const std::string& out_dir, const json::Value& config, const json::Value& summary) {
  const std::string metrics = MetricsWriter::path_in(out_dir);
  const std::string text = std::filesystem::exists(metrics) ? read_text_file(metrics) : std::string();
  const std::string page = render_report(text, config, summary);
  const std::string path = out_dir + "/report.html", tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  OOM_CHECK(f, "[train] cannot write ", tmp, ": ", std::strerror(errno));
  const bool ok = std::fwrite(page.data(), 1, page.size(), f) == page.size();
  OOM_CHECK(std::fclose(f) == 0 && ok, "[train] writing ", tmp, " failed: ", std::strerror(errno));
  std::filesystem::rename(tmp, path);
  return path;
}

}  // namespace oomless
