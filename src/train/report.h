// report.html: a self-contained page (inline SVG, no scripts, no network) drawn from a run's
// metrics.jsonl: a run table (steps, tokens, epochs, time, best eval), training and eval loss, learning
// rate, gradient norm, throughput (from 0), memory held by category stacked with its total and the
// budget line, a planned run's plan with its predicted and measured peak and step, and the run's
// configuration.
#pragma once
#include <string>

#include "io/json.h"

namespace oomless {

// Reads OUT/metrics.jsonl and writes OUT/report.html (atomically); returns its path. `config` is shown as a
// table. Lines that do not parse are skipped (a torn last line after a crash).
// summary (optional object): "model", "total_steps", "epochs" for the run table; "plan" for a planned run's
// section: "source", "settings", "predicted_peak" (bytes), "predicted_step_s", "layers" ([{"save_policy",
// "activations"}] per layer) and "explain", shown beside the peak and median step the metrics measured.
std::string write_report(const std::string& out_dir, const json::Value& config, const json::Value& summary = {});

// The page as a string (for tests): from metrics.jsonl text.
std::string render_report(const std::string& metrics_jsonl, const json::Value& config, const json::Value& summary = {});

}  // namespace oomless
