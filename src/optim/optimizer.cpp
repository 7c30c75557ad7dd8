#include "optim/optimizer.h"

#include <cmath>
#include <cstring>

#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/galore.h"

namespace oomless {

DType trainable_dtype(const TrainableSet& p) {
  OOM_CHECK(!p.empty(), "[optim] nothing to train: the trainable set is empty");
  for (const Trainable& t : p)
    OOM_CHECK(t.param.dtype == p[0].param.dtype && t.grad.dtype == t.param.dtype && t.grad.same_shape(t.param),
              "[optim] ", t.name, ": parameter ", t.param.str(), " and gradient ", t.grad.str(),
              " must share one float dtype and shape");
  return p[0].param.dtype;
}

void Optimizer::step(Ops& ops, const TrainableSet& params, double lr, int64_t step) {
  std::vector<size_t> all(params.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  step_tensors(ops, params, all, lr, step);
}

void Optimizer::check_step(const TrainableSet& params, const std::vector<size_t>& which, size_t built, double lr,
                           int64_t step) const {
  OOM_CHECK(step >= 1, "[optim] ", name(), " steps count from 1, got ", step);
  OOM_CHECK(std::isfinite(lr) && lr >= 0, "[optim] ", name(), " learning rate must be finite and >= 0, got ", lr);
  // The state is laid out from the same set; anything else would update the wrong tensors.
  OOM_CHECK(params.size() == built, "[optim] ", name(), " was built for ", built, " tensors, the step has ",
            params.size());
  for (size_t k = 0; k < which.size(); ++k)
    OOM_CHECK(which[k] < built && (k == 0 || which[k] > which[k - 1]), "[optim] ", name(),
              ": the tensors of a partial step must be ascending indices below ", built);
}

std::vector<StWrite> Optimizer::state_entries(Ops& ops) {
  std::vector<StWrite> w;
  for (const NamedTensor& t : state()) w.push_back(tensor_entry(ops, t.name, t.t));
  return w;
}

namespace {
int g_state_subset = 0;
}  // namespace
StateFileSubset::StateFileSubset() { ++g_state_subset; }
StateFileSubset::~StateFileSubset() { --g_state_subset; }

void check_state_file(const SafetensorsFile& f, const std::vector<StWrite>& want, const char* optimizer) {
  auto bytes = [](const StWrite& w) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    return static_cast<uint64_t>(dtype_bytes(w.dtype, n));
  };
  for (const StWrite& w : want) {
    const StTensor* st = f.find(w.name);
    OOM_CHECK(st, "[train] ", f.path(), " holds no optimizer tensor '", w.name, "' that ", optimizer, " needs: the "
              "checkpoint's optimizer state is another optimizer's or another model's, or the file is damaged; resume "
              "from another checkpoint, or start a new run from its weights");
    OOM_CHECK(st->dtype && *st->dtype == w.dtype && st->nbytes == bytes(w), "[train] ", f.path(), ": optimizer tensor '", w.name,
              "' is ", st->dtype_name, " of ", st->nbytes, " bytes where ", optimizer, " keeps ",
              dtype_name(w.dtype), " of ", bytes(w), " bytes: the state was saved with other settings, or the file is "
              "damaged; resume from another checkpoint, or start a new run from its weights");
  }
  OOM_CHECK(g_state_subset > 0 || f.tensors().size() == want.size(), "[train] ", f.path(), " holds ", f.tensors().size(), " optimizer "
            "tensors where ", optimizer, " has ", want.size(), ": the state was saved by another optimizer or with other "
            "settings; resume from another checkpoint, or start a new run from its weights");
}

void Optimizer::load_state(Ops& ops, const SafetensorsFile& f) {
  const std::vector<NamedTensor> mine = state();
  const std::vector<StWrite> want = state_entries(ops);
  check_state_file(f, want, name());
  for (const NamedTensor& t : mine) {
    const StTensor* st = f.find(t.name);
    ops.upload(t.t, st->data);
  }
}

void parse_optimizer(std::string_view name) {
  OOM_CHECK(name == "adamw" || name == "adamw8bit" || name == "galore" || name == "galore8bit", "[train] --optim ",
            name, " is not an optimizer oomless has; use adamw (fp32 moments), adamw8bit (bitsandbytes' blockwise "
            "8-bit AdamW), galore or galore8bit (GaLore's low-rank projected Adam, fp32 or 8-bit moments)");
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const TrainableSet& params, Arena& arena,
                                          const AdamWSettings& settings, const GaLoreSettings& galore) {
  parse_optimizer(name);
  if (name == "galore" || name == "galore8bit") {
    GaLoreSettings g = galore;
    g.eight_bit = name == "galore8bit";
    return std::make_unique<GaLore>(params, arena, settings, g);
  }
  if (name == "adamw8bit") return std::make_unique<AdamW8bit>(params, arena, settings);
  return std::make_unique<AdamW>(params, arena, settings);
}

}  // namespace oomless
