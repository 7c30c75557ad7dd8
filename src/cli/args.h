// A small flag parser shared by the subcommands: `--name value` and `--name=value`, boolean switches,
// and errors that name the flag and show the command's help.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace oomless::cli {

struct Flag {
  std::string name;   // without "--"
  bool takes_value;
};

class Args {
 public:
  // Throws "[cmd] unknown option '--x'" (with the help text) for anything not in `flags`.
  // `help_requested()` is true for --help / -h.
  Args(const std::vector<std::string>& argv, const std::vector<Flag>& flags, const std::string& cmd,
       const std::string& help);

  bool help_requested() const { return help_; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string str(const std::string& name, const std::string& dflt = "") const;
  std::string required(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t dflt, int64_t min, int64_t max) const;
  double number(const std::string& name, double dflt, double min, double max) const;

 private:
  std::string cmd_, help_text_;
  bool help_ = false;
  std::map<std::string, std::string> values_;
};

// Applies --threads when given (shared by every command that computes).
void apply_threads(const Args& a);

}  // namespace oomless::cli
