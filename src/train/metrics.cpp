#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "io/json.h"

namespace oomless {

namespace {

json::Value num(double x) { return std::isfinite(x) ? json::Value::number(x) : json::Value(); }

json::Value memory_json(const Ledger& ledger) {
  json::Value tiers = json::Value::object();
  for (int t = 0; t < kTierCount; ++t) {
    const Tier tier = static_cast<Tier>(t);
    json::Value cats = json::Value::object();
    for (int c = 0; c < kCategoryCount; ++c) {
      const Category cat = static_cast<Category>(c);
      if (ledger.peak(tier, cat) == 0) continue;
      json::Value e = json::Value::object();
      e.set("current", json::Value::integer(static_cast<int64_t>(ledger.current(tier, cat))));
      e.set("peak", json::Value::integer(static_cast<int64_t>(ledger.peak(tier, cat))));
      cats.set(category_name(cat), std::move(e));
    }
    if (cats.size() == 0) continue;
    json::Value total = json::Value::object();
    total.set("current", json::Value::integer(static_cast<int64_t>(ledger.current_total(tier))));
    total.set("peak", json::Value::integer(static_cast<int64_t>(ledger.peak_total(tier))));
    cats.set("total", std::move(total));
    tiers.set(tier_name(tier), std::move(cats));
  }
  return tiers;
}

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("[metrics] cannot write ", path, ": ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

}  // namespace

std::string MetricsWriter::path_in(const std::string& out_dir) {
  return (std::filesystem::path(out_dir) / "metrics.jsonl").string();
}

MetricsWriter::MetricsWriter(const std::string& out_dir) : path_(path_in(out_dir)) {
  f_ = std::fopen(path_.c_str(), "ab");
  OOM_CHECK(f_, "[metrics] cannot open ", path_, " for appending: ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::append(const std::string& line) {
  // One fwrite of the whole line then a flush: the line reaches the file in one write(2) (it is far
  // smaller than the stdio buffer), so a crash cannot interleave or split lines except at the very end.
  const std::string out = line + "\n";
  OOM_CHECK(std::fwrite(out.data(), 1, out.size(), f_) == out.size() && std::fflush(f_) == 0,
            "[metrics] cannot write ", path_, ": ", std::strerror(errno));
}

void MetricsWriter::write_step(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s,
                               bool skipped, const Ledger& ledger, const json::Value& kv_fp8,
                               const json::Value& act_fp8, const json::Value& ranks) {
  json::Value o = json::Value::object();
  o.set("type", json::Value::string("train"));
  o.set("step", json::Value::integer(step));
  o.set("loss", num(loss));
  o.set("lr", num(lr));
  o.set("grad_norm", num(grad_norm));
  o.set("tokens_per_s", num(tokens_per_s));
  o.set("skipped", json::Value::boolean(skipped));
  if (!params_.is_null()) o.set("params", params_);
  o.set("memory", memory_json(ledger));
  if (!kv_fp8.is_null()) o.set("kv_fp8", kv_fp8);
  if (!act_fp8.is_null()) o.set("act_fp8", act_fp8);
  if (!ranks.is_null()) o.set("ranks", ranks);
  append(json::dump(o));
}

void MetricsWriter::set_params(int64_t trainable, int64_t trainable_bytes, int64_t frozen, int64_t frozen_bytes) {
  params_ = json::Value::object();
  params_.set("trainable", json::Value::integer(trainable));
  params_.set("trainable_bytes", json::Value::integer(trainable_bytes));
  params_.set("frozen", json::Value::integer(frozen));
  params_.set("frozen_bytes", json::Value::integer(frozen_bytes));
}

void MetricsWriter::write_eval(int64_t step, double loss, double ppl) {
  json::Value o = json::Value::object();
  o.set("type", json::Value::string("eval"));
  o.set("step", json::Value::integer(step));
  o.set("loss", num(loss));
  o.set("ppl", num(ppl));
  append(json::dump(o));
}

void MetricsWriter::truncate_after(const std::string& path, int64_t step) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    OOM_CHECK(!std::filesystem::exists(path), "[metrics] cannot read ", path);
    return;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();

  // Complete lines end in '\n'; whatever follows the last newline is a torn write.
  std::vector<std::string_view> lines;
  const std::string_view all(text);
  for (size_t pos = 0; pos < all.size();) {
    const size_t nl = all.find('\n', pos);
    if (nl == std::string_view::npos) break;
    lines.push_back(all.substr(pos, nl - pos));
    pos = nl + 1;
  }

  std::string kept;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    const bool last = i + 1 == lines.size();
    int64_t line_step = 0;
    try {
      line_step = json::parse(lines[i], path).at("step").as_int("step");
    } catch (const Error& e) {
      // A crash after the data reached the disk but before its size did can leave a last line that
      // ends in a newline yet holds zeros or a fragment; only the last line can be such a write.
      if (last) break;
      fail("[metrics] ", path, " line ", i + 1, " is not a metrics record (", e.what(),
           "); the file is damaged before its last line, so it is not truncated automatically");
    }
    if (line_step <= step) {
      kept.append(lines[i]);
      kept.push_back('\n');
    }
  }

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  OOM_CHECK(fd >= 0, "[metrics] cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write_all(fd, kept, tmp);
    OOM_CHECK(::fsync(fd) == 0, "[metrics] cannot sync ", tmp, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("[metrics] cannot replace ", path, ": ", std::strerror(err));
  }
  // The rename is durable only once the folder is synced.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const int dfd = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace oomless
