// One function per subcommand: takes the arguments after the command name, returns the exit code.
// Errors are thrown as oomless::Error and printed by main.
#pragma once
#include <string>
#include <vector>

namespace oomless::cli {

int probe(const std::vector<std::string>& args);
int eval(const std::vector<std::string>& args);
int generate(const std::vector<std::string>& args);
int tokenize(const std::vector<std::string>& args);
int train(const std::vector<std::string>& args);
int estimate(const std::vector<std::string>& args);
int plan(const std::vector<std::string>& args);
int convert(const std::vector<std::string>& args);
int merge(const std::vector<std::string>& args);

}  // namespace oomless::cli
