#include "cli/args.h"

#include <algorithm>
#include <charconv>
#include <vector>
#include <cmath>
#include <cstdlib>

#include "core/cpu_info.h"

namespace oomless::cli {

namespace {
// Levenshtein distance (flag names are short).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}
}  // namespace

Args::Args(const std::vector<std::string>& argv, const std::vector<Flag>& flags, const std::string& cmd,
           const std::string& help)
    : cmd_(cmd), help_text_(help) {
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    OOM_CHECK(a.rfind("--", 0) == 0, "[", cmd, "] unexpected argument '", a, "' (options start with --); run `oomless ",
              cmd, " --help` for the options");
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    const Flag* f = nullptr;
    for (const Flag& x : flags)
      if (x.name == name) f = &x;
    if (!f) {
      // The closest known flag by edit distance, when it is close.
      std::string best;
      size_t best_d = 3;
      for (const Flag& x : flags) {
        const size_t d = edit_distance(name, x.name);
        if (d < best_d) best_d = d, best = x.name;
      }
      fail("[", cmd, "] unknown option '--", name, "'", best.empty() ? "" : " (did you mean --" + best + "?)",
           "; run `oomless ", cmd, " --help` for the options");
    }
    if (f->takes_value) {
      if (!inline_value) {
        OOM_CHECK(i + 1 < argv.size(), "[", cmd, "] --", name, " needs a value; run `oomless ", cmd,
                  " --help` for the options");
        value = argv[++i];
      }
    } else {
      OOM_CHECK(!inline_value, "[", cmd, "] --", name, " takes no value");
      value.assign(1, '1');  // (not = "1": GCC 12 warns falsely, -Wrestrict)
    }
    values_[name] = value;
  }
}

std::string Args::str(const std::string& name, const std::string& dflt) const {
  auto it = values_.find(name);
  return it == values_.end() ? dflt : it->second;
}

std::string Args::required(const std::string& name) const {
  auto it = values_.find(name);
  OOM_CHECK(it != values_.end(), "[", cmd_, "] --", name, " is required; run `oomless ", cmd_,
            " --help` for the options");
  return it->second;
}

int64_t Args::integer(const std::string& name, int64_t dflt, int64_t min, int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return dflt;
  const std::string& s = it->second;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  OOM_CHECK(ec == std::errc() && p == s.data() + s.size(), "[", cmd_, "] --", name, " takes a whole number, got '", s,
            "'");
  OOM_CHECK(v >= min && v <= max, "[", cmd_, "] --", name, " must be between ", min, " and ", max, ", got ", v);
  return v;
}

double Args::number(const std::string& name, double dflt, double min, double max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return dflt;
  const std::string& s = it->second;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  OOM_CHECK(!s.empty() && end == s.c_str() + s.size() && std::isfinite(v), "[", cmd_, "] --", name,
            " takes a number, got '", s, "'");
  OOM_CHECK(v >= min && v <= max, "[", cmd_, "] --", name, " must be between ", min, " and ", max, ", got ", v);
  return v;
}

void apply_threads(const Args& a) {
  if (!a.has("threads")) return;
  const int cpus = detect_cpu().logical_cpus;
  const int64_t n = a.integer("threads", 0, 1, 4096);
  OOM_CHECK(cpus <= 0 || n <= cpus, "[threads] --threads ", n, " is more than this machine's ", cpus,
            " logical CPUs (threads beyond them wait on each other and run many times slower); use at most ", cpus);
  set_threads(static_cast<int>(n));
}

}  // namespace oomless::cli
