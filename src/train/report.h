// report.html: a self-contained page (inline SVG, no scripts, no network) drawn from a run's
// metrics.jsonl: training and eval loss, learning rate, throughput, memory per category over the steps,
// and the run's configuration.
#pragma once
#include <string>

#include "io/json.h"

namespace oomless {

// Reads OUT/metrics.jsonl and writes OUT/report.html (atomically); returns its path. `config` is shown as a
// table. Lines that do not parse are skipped (a torn last line after a crash).
std::string write_report(const std::string& out_dir, const json::Value& config);

// The page as a string (for tests): from metrics.jsonl text.
std::string render_report(const std::string& metrics_jsonl, const json::Value& config);

}  // namespace oomless
