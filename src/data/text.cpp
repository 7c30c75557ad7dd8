#include "data/text.h"

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace oomless {

std::string read_text_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  OOM_CHECK(f, "[data] cannot open ", path, ": ", std::strerror(errno));
  std::string s;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  const bool err = std::ferror(f);
  std::fclose(f);
  OOM_CHECK(!err, "[data] reading ", path, " failed: ", std::strerror(errno));
  return s;
}

bool is_ids_file(const std::string& path) {
  return path.size() >= 4 && path.compare(path.size() - 4, 4, ".ids") == 0;
}

std::vector<int32_t> read_ids_file(const std::string& path, int64_t vocab) {
  const std::string s = read_text_file(path);
  std::vector<int32_t> ids;
  size_t line = 1;
  const char* p = s.data();
  const char* end = p + s.size();
  while (p < end) {
    const char c = *p;
    if (c == '\n') {
      ++line, ++p;
    } else if (c == ' ' || c == '\t' || c == '\r' || c == ',') {
      ++p;
    } else {
      int64_t v = 0;
      auto [q, ec] = std::from_chars(p, end, v);
      const char* tok_end = p;
      while (tok_end < end && !std::strchr(" \t\r\n,", *tok_end)) ++tok_end;
      OOM_CHECK(ec == std::errc() && q == tok_end, "[data] ", path, ":", line, ": '", std::string(p, tok_end),
                "' is not a decimal token id; a .ids file holds whole numbers separated by spaces, one document per line");
      OOM_CHECK(v >= 0 && v < vocab, "[data] ", path, ":", line, ": token id ", v, " is outside the model's vocabulary [0, ",
                vocab, ")");
      ids.push_back(static_cast<int32_t>(v));
      p = tok_end;
    }
  }
  return ids;
}

}  // namespace oomless
