#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace oomless {

namespace {

enum class Kind { cosine, linear, constant };

Kind parse_kind(std::string_view k) {
  if (k == "cosine") return Kind::cosine;
  if (k == "linear") return Kind::linear;
  if (k == "constant") return Kind::constant;
  fail("[optim] unknown learning-rate schedule \"", k, "\"; supported: cosine, linear, constant");
}

}  // namespace

void validate(const ScheduleSettings& s) {
  parse_kind(s.kind);
  OOM_CHECK(std::isfinite(s.lr) && std::isfinite(s.min_lr) && s.min_lr >= 0 && s.lr >= s.min_lr,
            "[optim] schedule needs finite 0 <= min_lr <= lr, got lr ", s.lr, ", min_lr ", s.min_lr);
  OOM_CHECK(s.total_steps >= 1, "[optim] schedule total_steps must be >= 1, got ", s.total_steps);
  OOM_CHECK(s.warmup >= 0 && s.warmup <= s.total_steps, "[optim] schedule warmup must be in [0, total_steps = ",
            s.total_steps, "], got ", s.warmup);
}

double lr_at(const ScheduleSettings& s, int64_t step) {
  validate(s);
  OOM_CHECK(step >= 1, "[optim] schedule steps count from 1, got ", step);
  const Kind kind = parse_kind(s.kind);
  if (step <= s.warmup) return s.lr * static_cast<double>(step) / static_cast<double>(s.warmup);
  if (kind == Kind::constant) return s.lr;
  // warmup == total_steps leaves no decay phase: steps past the end read the finished (floor) value.
  const int64_t decay_steps = s.total_steps - s.warmup;
  const double progress =
      decay_steps == 0 ? 1.0
                       : std::clamp(static_cast<double>(step - s.warmup) / static_cast<double>(decay_steps), 0.0, 1.0);
  const double shape = kind == Kind::cosine ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) : 1.0 - progress;
  return s.min_lr + (s.lr - s.min_lr) * shape;
}

}  // namespace oomless
