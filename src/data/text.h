// Reading evaluation/training inputs: whole text files and `.ids` files (decimal token ids, one
// document per line, blank lines skipped, lines concatenated as they are).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace oomless {

// The file's bytes; errors name the path.
std::string read_text_file(const std::string& path);
// Token ids, each checked to be in [0, vocab); errors name the file, line and the offending text.
std::vector<int32_t> read_ids_file(const std::string& path, int64_t vocab);
bool is_ids_file(const std::string& path);  // by the .ids suffix

}  // namespace oomless
