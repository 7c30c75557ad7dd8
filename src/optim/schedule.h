// Learning-rate schedules, shaped as transformers' get_{cosine,linear,constant}_schedule_with_warmup
// but decaying to a floor min_lr instead of 0:
//   warmup (step <= warmup):  lr * step / warmup
//   then, with progress = (step - warmup) / (total_steps - warmup) clamped to [0, 1]:
//     cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * progress))
//     linear:   min_lr + (lr - min_lr) * (1 - progress)
//     constant: lr
// Steps are optimizer steps counted from 1, and lr_at(s) is transformers' lambda evaluated at s.
// transformers' scheduler starts its count at 0, so its first step trains at lr * 0 / warmup = 0 and a
// step is wasted; here step 1 trains at lr / warmup, step `warmup` at the peak and step total_steps at
// min_lr.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace oomless {

struct ScheduleSettings {
  std::string kind = "cosine";  // cosine | linear | constant
  double lr = 1e-3;             // peak
  double min_lr = 0.0;          // floor reached at total_steps (cosine, linear)
  int64_t warmup = 0;           // steps of linear warmup
  int64_t total_steps = 1;      // the whole run, warmup included
};

// Throws "[optim] ..." for an unknown kind (naming the supported ones), lr < min_lr, negative values,
// or warmup > total_steps.
void validate(const ScheduleSettings& s);

// The learning rate of optimizer step `step` (>= 1). Past total_steps it stays at the final value.
double lr_at(const ScheduleSettings& s, int64_t step);

}  // namespace oomless
