#include "io/amax_history.h"

#include <cmath>

#include "backend/ops.h"
#include "core/error.h"

namespace oomless {

json::Value amax_history_json(const std::vector<std::vector<float>>& h) {
  json::Value a = json::Value::array();
  for (const std::vector<float>& x : h) {
    json::Value v = json::Value::array();
    for (float f : x) v.push_back(json::Value::number(f));
    a.push_back(std::move(v));
  }
  return a;
}

void restore_amax_history(std::vector<std::vector<float>>& h, const json::Value& state, const char* who,
                          const std::string& per) {
  OOM_CHECK(state.is_array() && state.as_array().size() == h.size(), who, " the saved fp8 amax history holds ",
            state.is_array() ? state.as_array().size() : 0, " entries where this model has ", h.size(), " (", per,
            "): the checkpoint is another run's");
  for (size_t i = 0; i < h.size(); ++i) {
    const json::Value& e = state.as_array()[i];
    OOM_CHECK(e.is_array() && e.as_array().size() <= static_cast<size_t>(kAmaxHistory), who, " the saved fp8 amax "
              "history entry ", i, " is not a list of at most ", kAmaxHistory, " numbers: the checkpoint is damaged");
    h[i].clear();
    for (const json::Value& f : e.as_array()) {
      const double d = f.is_number() ? f.as_number() : -1;
      OOM_CHECK(std::isfinite(d) && d >= 0, who, " the saved fp8 amax history holds a value that is not a finite "
                "number >= 0: the checkpoint is damaged");
      h[i].push_back(static_cast<float>(d));
    }
  }
}

}  // namespace oomless
