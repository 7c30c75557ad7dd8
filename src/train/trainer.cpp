#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>

#include "core/cpu_info.h"
#include "data/dataset.h"
#include "data/text.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/eval.h"
#include "model/generate.h"
#include "model/load.h"
#include "model/model.h"
#include "model/paged_kv.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/report.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

// Settings a resumed run must share with the run that saved the checkpoint (the rest may change).
const char* kFixedOnResume[] = {"model", "data", "seq", "batch", "grad-accum", "lr", "min-lr", "warmup",
                                "schedule", "weight-decay", "beta1", "beta2", "eps", "clip", "dtype",
                                "seed", "save-policy", "epochs", "chunk", "page", "rope-theta",
                                "rope-scaling", "sparse-pages", "sink-pages", "page-summary"};

std::string binary_id() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown";
  const auto size = fs::file_size(exe, ec);
  const auto time = fs::last_write_time(exe, ec).time_since_epoch().count();
  return exe.filename().string() + ":" + std::to_string(size) + ":" + std::to_string(time);
}

std::vector<StWrite> param_writes(const ParamSet& p, const std::string& prefix) {
  std::vector<StWrite> w;
  for (size_t i = 0; i < p.specs().size(); ++i)
    w.push_back({prefix + p.specs()[i].name, p.tensors()[i].dtype, p.specs()[i].shape, p.tensors()[i].data});
  return w;
}

void read_params(const SafetensorsFile& f, ParamSet& p, const std::string& prefix) {
  for (size_t i = 0; i < p.specs().size(); ++i) {
    const StTensor* t = f.find(prefix + p.specs()[i].name);
    OOM_CHECK(t && t->dtype == p.tensors()[i].dtype && static_cast<uint64_t>(p.tensors()[i].nbytes()) == t->nbytes,
              "[train] ", f.path(), ": tensor '", prefix, p.specs()[i].name, "' is missing or has another shape/dtype");
    std::memcpy(p.tensors()[i].data, t->data, t->nbytes);
  }
}

CheckpointFile safetensors_file(const std::string& name, std::vector<StWrite> tensors) {
  return {name, "", [tensors = std::move(tensors), name](int fd) {
            write_safetensors_stream(tensors, {{"format", "pt"}}, [fd](const void* d, size_t n) { checkpoint_write(fd, d, n); },
                                     name);
          }};
}

}  // namespace

void TrainConfig::apply_json(const json::Value& o, const std::string& source) {
  OOM_CHECK(o.is_object(), "[train] ", source, ": a config file is a JSON object of flag names and values");
  for (const auto& kv : o.as_object()) {
    const auto& k = kv.first;  // named, not a structured binding: clang 14 cannot capture those in lambdas
    const auto& v = kv.second;
    auto num = [&]() { return v.as_number(k); };
    auto integer = [&]() { return v.as_int(k); };
    auto str = [&]() { return v.as_string(k); };
    if (k == "model") model = str();
    else if (k == "data") data = str();
    else if (k == "out") out = str();
    else if (k == "seq") seq = integer();
    else if (k == "batch") batch = integer();
    else if (k == "grad-accum") grad_accum = integer();
    else if (k == "steps") steps = integer();
    else if (k == "epochs") epochs = num();
    else if (k == "lr") lr = num();
    else if (k == "min-lr") min_lr = num();
    else if (k == "warmup") warmup = integer();
    else if (k == "schedule") schedule = str();
    else if (k == "weight-decay") weight_decay = num();
    else if (k == "beta1") beta1 = num();
    else if (k == "beta2") beta2 = num();
    else if (k == "eps") eps = num();
    else if (k == "clip") clip = num();
    else if (k == "eval-data") eval_data = str();
    else if (k == "eval-every") eval_every = integer();
    else if (k == "save-every") save_every = integer();
    else if (k == "keep") keep = integer();
    else if (k == "budget") budget = str();
    else if (k == "dtype") dtype = str();
    else if (k == "seed") seed = static_cast<uint64_t>(integer());
    else if (k == "threads") threads = integer();
    else if (k == "max-nonfinite") max_nonfinite = integer();
    else if (k == "dump-tokens") dump_tokens = str();
    else if (k == "save-policy") save_policy = str();
    else if (k == "chunk") chunk = integer();
    else if (k == "page") page = integer();
    else if (k == "kv-offload") kv_offload = str();
    else if (k == "spill-dir") spill_dir = str();
    else if (k == "rope-theta") rope_theta = num();
    else if (k == "rope-scaling") rope_scaling = str();
    else if (k == "sparse-pages") sparse_pages = integer();
    else if (k == "sink-pages") sink_pages = integer();
    else if (k == "page-summary") page_summary = str();
    else fail("[train] ", source, ": unknown key \"", k, "\"; keys are the long flag names without --");
  }
}

json::Value TrainConfig::to_json() const {
  using json::Value;
  Value o = Value::object();
  o.set("model", Value::string(model));
  o.set("data", Value::string(data));
  o.set("out", Value::string(out));
  o.set("seq", Value::integer(seq));
  o.set("batch", Value::integer(batch));
  o.set("grad-accum", Value::integer(grad_accum));
  o.set("steps", Value::integer(steps));
  o.set("epochs", Value::number(epochs));
  o.set("lr", Value::number(lr));
  o.set("min-lr", Value::number(min_lr));
  o.set("warmup", Value::integer(warmup));
  o.set("schedule", Value::string(schedule));
  o.set("weight-decay", Value::number(weight_decay));
  o.set("beta1", Value::number(beta1));
  o.set("beta2", Value::number(beta2));
  o.set("eps", Value::number(eps));
  o.set("clip", Value::number(clip));
  o.set("eval-data", Value::string(eval_data));
  o.set("eval-every", Value::integer(eval_every));
  o.set("save-every", Value::integer(save_every));
  o.set("keep", Value::integer(keep));
  o.set("budget", Value::string(budget));
  o.set("dtype", Value::string(dtype));
  o.set("seed", Value::integer(static_cast<int64_t>(seed)));
  o.set("threads", Value::integer(threads));
  o.set("max-nonfinite", Value::integer(max_nonfinite));
  o.set("dump-tokens", Value::string(dump_tokens));
  o.set("save-policy", Value::string(save_policy));
  o.set("chunk", Value::integer(chunk));
  o.set("page", Value::integer(page));
  o.set("kv-offload", Value::string(kv_offload));
  o.set("spill-dir", Value::string(spill_dir));
  o.set("rope-theta", Value::number(rope_theta));
  o.set("rope-scaling", Value::string(rope_scaling));
  o.set("sparse-pages", Value::integer(sparse_pages));
  o.set("sink-pages", Value::integer(sink_pages));
  o.set("page-summary", Value::string(page_summary));
  return o;
}

namespace {
int train_run(const TrainConfig& c, const std::string& out);
}

int run_training(const TrainConfig& c) {
  OOM_CHECK(c.seq >= 2, "[train] --seq must be at least 2");
  OOM_CHECK(c.batch >= 1 && c.grad_accum >= 1, "[train] --batch and --grad-accum must be at least 1");
  if (c.threads > 0) set_threads(static_cast<int>(c.threads));
  std::string out = c.resume && !c.resume_dir.empty() ? c.resume_dir : c.out;
  if (out.empty()) {
    OOM_CHECK(!c.resume, "[train] --resume needs the run folder: --resume DIR (or --out DIR)");
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
    out = std::string("runs/run-") + stamp;
  }
  // A new run never writes over an earlier one: its checkpoints and metrics stay as they are.
  if (!c.resume && fs::exists(out)) {
    bool used = false;
    for (const auto& e : fs::directory_iterator(out)) used |= e.path().filename().string().rfind("checkpoint-", 0) == 0;
    OOM_CHECK(!used, "[train] ", out, " already holds a run (checkpoints); continue it with --resume, or give a new --out");
    // Metrics of a run that stopped before its first checkpoint: start them again.
    if (fs::exists(MetricsWriter::path_in(out))) MetricsWriter::truncate_after(MetricsWriter::path_in(out), 0);
  }
  fs::create_directories(out);
  // No --data: the bundled corpus, written once into the run folder so the data pipeline (and a resumed
  // run) reads it like any file.
  TrainConfig cfg_local = c;
  if (c.data.empty()) {
    const std::string dir = out + "/bundled-data";
    fs::create_directories(dir);
    auto put = [&](const std::string& p, std::string_view text) {
      if (fs::exists(p) && fs::file_size(p) == text.size()) return;
      std::FILE* f = std::fopen(p.c_str(), "wb");
      OOM_CHECK(f && std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fclose(f) == 0,
                "[train] cannot write the bundled corpus to ", p, ": ", std::strerror(errno));
    };
    // Training documents are the chapters (heading, blank line, verses), as JSONL, so each epoch visits
    // them in a shuffled order instead of reading the Bible front to back.
    std::string jsonl;
    const std::string_view text = bundled_train_text();
    size_t i = 0;
    while (i < text.size()) {
      size_t head_end = text.find("\n\n", i);
      if (head_end == std::string_view::npos) head_end = text.size();
      size_t body_end = head_end < text.size() ? text.find("\n\n", head_end + 2) : text.size();
      if (body_end == std::string_view::npos) body_end = text.size();
      std::string chapter(text.substr(i, body_end - i));
      while (!chapter.empty() && chapter.back() == '\n') chapter.pop_back();
      if (!chapter.empty()) {
        json::Value o = json::Value::object();
        o.set("text", json::Value::string(chapter + "\n"));
        jsonl += json::dump(o) + "\n";
      }
      i = body_end + 2;
    }
    put(dir + "/kjv-train.jsonl", jsonl);
    put(dir + "/kjv-eval.txt", bundled_eval_text());
    cfg_local.data = dir + "/kjv-train.jsonl";
    // The embedded default is sized to finish in minutes on a 2-core machine.
    if (cfg_local.steps == 0 && cfg_local.epochs == 0) cfg_local.steps = 250;
    if (cfg_local.eval_data.empty()) cfg_local.eval_data = dir + "/kjv-eval.txt";
    std::fprintf(stderr, "oomless train: no --data: training %s on the bundled KJV corpus (%s)\n", c.model.c_str(),
                 cfg_local.data.c_str());
  }
  return train_run(cfg_local, out);
}

namespace {

int train_run(const TrainConfig& c, const std::string& out) {

  // Model, memory, optimizer: everything is reserved here, before step 1.
  ModelSource src = open_model(c.model, c.seed);
  if (c.rope_theta > 0) {
    OOM_CHECK(std::isfinite(c.rope_theta), "[train] --rope-theta must be a positive number, got ", c.rope_theta);
    src.cfg.rope.theta = c.rope_theta;  // and so into every checkpoint's config.json
  }
  if (!c.rope_scaling.empty()) apply_rope_scaling(src.cfg, c.rope_scaling, "--rope-scaling");
  const size_t budget = c.budget.empty() ? (size_t{1} << 46) : parse_size(c.budget);
  CpuMemory mem(budget);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(src.cfg, DType::f32, mem.device, Category::weights);
  src.load_weights(params);
  src.release_weights();
  Model model(src.cfg, *ops, params, mem.device, {parse_compute_dtype(c.dtype), parse_save_policy(c.save_policy)});
  AdamW opt(src.cfg, params, mem.host, {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay});
  model.grads();
  // Chunk-recurrent mode: activations for one chunk, K/V of earlier chunks in a paged store.
  std::unique_ptr<PagedKvStore> kv;
  const int64_t C = c.chunk > 0 ? std::min(c.chunk, c.seq) : 0;
  OOM_CHECK(c.sparse_pages == 0 || C > 0, "[train] --sparse-pages ", c.sparse_pages, " needs --chunk C: page-sparse "
            "attention selects among the pages of chunk-recurrent training's K/V store");
  try {
    if (C > 0) {
      PagedKvOptions ko;
      ko.C = C;
      ko.P = c.page > 0 ? c.page : std::min<int64_t>(64, C);
      ko.offload = parse_kv_offload(c.kv_offload);
      ko.spill_dir = c.spill_dir.empty() ? out : c.spill_dir;
      ko.sparse_pages = c.sparse_pages;
      ko.sink_pages = c.sink_pages;
      ko.summary = parse_page_summary(c.page_summary);
      if (ko.offload == KvOffload::disk) fs::create_directories(out);
      model.reserve(C, true, true);
      kv = std::make_unique<PagedKvStore>(src.cfg, *ops, mem.device, mem.host, ko, c.seq, true);
    } else {
      model.reserve(c.seq, true);
    }
    // A dry forward + backward on zeros before step 1: the kernels' workspaces (GEMM packing, cross-entropy
    // chunks) are taken from the arena on first use, so a budget too small for them fails here, at setup,
    // not in the middle of the run. Chunk-recurrent: two chunks suffice (a chunk with history; every call
    // of a longer sequence has the same shapes or smaller ones, and the store reserved its pages for
    // --seq already), so the dry run does not cost a whole long step.
    const int64_t dry_T = kv ? std::min<int64_t>(c.seq, 2 * C) : c.seq;
    std::vector<int32_t> zeros(static_cast<size_t>(dry_T), 0);
    const Tensor z(zeros.data(), DType::i32, {dry_T});
    if (kv) {
      model.chunked_step(z, z, C, *kv, 0.0);
    } else {
      model.forward(z, z, true);
      model.backward(0.0);
    }
    model.zero_grads();
  } catch (const OutOfBudget& e) {
    fail("[train] the run does not fit --budget ", c.budget, ": ", e.what(),
         "\nuse a larger --budget, a smaller --seq, --save-policy selective or none, --dtype bf16, or --chunk "
         "with --kv-offload host or disk");
  }
  OOM_CHECK(src.cfg.eos_id.has_value(), "[train] ", c.model, " names no end-of-sequence token (eos_token_id); packing "
            "needs one between documents");
  src.cfg.check_sequence(c.seq);

  std::vector<std::string> paths;
  for (size_t i = 0; i <= c.data.size();) {
    size_t j = c.data.find(',', i);
    if (j == std::string::npos) j = c.data.size();
    if (j > i) paths.push_back(c.data.substr(i, j - i));
    i = j + 1;
  }
  DatasetOptions dopt;
  dopt.paths = paths;
  dopt.T = c.seq;
  dopt.seed = c.seed;
  dopt.eos_id = *src.cfg.eos_id;
  dopt.vocab = src.cfg.V;
  Dataset data(dopt, src.tokenizer ? &*src.tokenizer : nullptr, src.tokenizer_config);

  const int64_t seqs_per_step = c.batch * c.grad_accum;
  int64_t total = c.steps;
  if (total == 0) {
    // --epochs: the schedule needs the run's length up front, so one pass over a second reader counts the
    // sequences of the first epoch (documents are tokenized as they stream by; nothing is kept).
    const double ep = c.epochs > 0 ? c.epochs : 1.0;
    Dataset counter(dopt, src.tokenizer ? &*src.tokenizer : nullptr, src.tokenizer_config);
    std::vector<int32_t> a(static_cast<size_t>(c.seq)), b(static_cast<size_t>(c.seq));
    int64_t per_epoch = 0;
    while (counter.next(a.data(), b.data()) == 0) ++per_epoch;
    total = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ep * static_cast<double>(std::max<int64_t>(per_epoch, 1)) /
                                                                static_cast<double>(seqs_per_step))));
  }
  // A warmup longer than the run (e.g. the default with a short --steps) covers the whole run.
  ScheduleSettings sched{c.schedule, c.lr, c.min_lr, std::min(c.warmup, total), total};
  validate(sched);

  // Resume: the newest checkpoint that verifies.
  int64_t step = 0, nonfinite_total = 0;
  if (c.resume) {
    auto warn = [](const std::string& w) { std::fprintf(stderr, "oomless train: warning: %s\n", w.c_str()); };
    std::optional<FoundCheckpoint> ck = find_latest_checkpoint(out, warn);
    OOM_CHECK(ck.has_value(), "[train] --resume: no complete checkpoint in ", out, "; start without --resume");
    json::Value st = json::parse_file(ck->path + "/trainer_state.json");
    const json::Value& saved = st.at("config");
    const json::Value now = c.to_json();
    const json::Value defaults = TrainConfig{}.to_json();  // settings a run saved by an older binary lacks
    for (const char* k : kFixedOnResume) {
      const json::Value& was = saved.find(k) ? saved.at(k) : defaults.at(k);
      OOM_CHECK(json::dump(was) == json::dump(now.at(k)), "[train] --resume: --", k, " was ", json::dump(was),
                " in the saved run and is ", json::dump(now.at(k)),
                " now; only steps, save, eval and keep settings may change on resume");
    }
    if (st.at("threads").as_int() != get_threads() || st.at("isa").as_string() != detect_cpu().isa_summary() ||
        st.at("binary").as_string() != binary_id())
      warn("the thread count, CPU instruction set or binary differs from the saved run's: results may differ in the "
           "last bits from an uninterrupted run");
    SafetensorsFile mf = SafetensorsFile::open(ck->path + "/model.safetensors");
    read_params(mf, params, "");
    SafetensorsFile of = SafetensorsFile::open(ck->path + "/optimizer.safetensors");
    read_params(of, opt.m(), "m.");
    read_params(of, opt.v(), "v.");
    data.restore(st.at("data"));
    step = st.at("step").as_int();
    nonfinite_total = st.at("nonfinite_total").as_int();
    MetricsWriter::truncate_after(MetricsWriter::path_in(out), step);
    std::fprintf(stderr, "oomless train: resumed from %s (step %lld of %lld)\n", ck->path.c_str(),
                 static_cast<long long>(step), static_cast<long long>(total));
  }

  auto save = [&](int64_t s) {
    std::vector<CheckpointFile> files;
    files.push_back(safetensors_file("model.safetensors", param_writes(params, "")));
    std::vector<StWrite> ow = param_writes(opt.m(), "m."), vw = param_writes(opt.v(), "v.");
    ow.insert(ow.end(), vw.begin(), vw.end());
    files.push_back(safetensors_file("optimizer.safetensors", ow));
    files.push_back({"config.json", json::dump(src.cfg.to_json(), 2) + "\n", {}});
    if (src.tokenizer_json.size()) files.push_back({"tokenizer.json", src.tokenizer_json, {}});
    if (!src.tokenizer_config.is_null()) files.push_back({"tokenizer_config.json", json::dump(src.tokenizer_config, 2) + "\n", {}});
    json::Value st = json::Value::object();
    st.set("step", json::Value::integer(s));
    st.set("total_steps", json::Value::integer(total));
    st.set("nonfinite_total", json::Value::integer(nonfinite_total));
    st.set("data", data.state());
    st.set("config", c.to_json());
    st.set("threads", json::Value::integer(get_threads()));
    st.set("isa", json::Value::string(detect_cpu().isa_summary()));
    st.set("binary", json::Value::string(binary_id()));
    st.set("lr", json::Value::number(lr_at(sched, std::max<int64_t>(s, 1))));
    files.push_back({"trainer_state.json", json::dump(st, 2) + "\n", {}});
    const std::string p = save_checkpoint(out, s, files, {static_cast<int>(c.keep)});
    std::fprintf(stderr, "oomless train: saved %s\n", p.c_str());
  };

  MetricsWriter metrics(out);
  // Held-out loss: the first (at most 32) windows of --eval-data, read once.
  std::vector<int32_t> eval_stream;
  if (!c.eval_data.empty()) {
    eval_stream = is_ids_file(c.eval_data) ? read_ids_file(c.eval_data, src.cfg.V)
                                           : src.require_tokenizer().encode(read_text_file(c.eval_data), true);
    eval_stream.resize(std::min<size_t>(eval_stream.size(), static_cast<size_t>(32 * c.seq)));
    OOM_CHECK(static_cast<int64_t>(eval_stream.size()) >= c.seq, "[train] --eval-data ", c.eval_data, " holds fewer than --seq ",
              c.seq, " tokens");
  }
  auto run_eval = [&](int64_t s) {
    if (eval_stream.empty()) return;
    EvalResult r = evaluate(model, eval_stream, c.seq, false, kv.get(), C);
    metrics.write_eval(s, r.loss(), std::exp(r.loss()));
    std::fprintf(stderr, "%seval at step %lld: loss %.4f  ppl %.2f\n", isatty(2) ? "\n" : "", static_cast<long long>(s),
                 r.loss(), std::exp(r.loss()));
  };

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::FILE* dump = c.dump_tokens.empty() ? nullptr : std::fopen(c.dump_tokens.c_str(), c.resume ? "ab" : "wb");
  OOM_CHECK(c.dump_tokens.empty() || dump, "[train] cannot write --dump-tokens ", c.dump_tokens, ": ", std::strerror(errno));
  const bool tty = isatty(2);
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(seqs_per_step), std::vector<int32_t>(static_cast<size_t>(c.seq)));
  std::vector<std::vector<int32_t>> tg = ids;
  int64_t nonfinite_run = 0;
  double last_loss = 0;
  auto t_start = std::chrono::steady_clock::now();
  const int64_t first = step;
  while (step < total && !g_stop) {
    const auto t0 = std::chrono::steady_clock::now();
    ++step;
    try {
    const double lr = lr_at(sched, step);
    // The step's sequences, and N, its supervised targets, before any backward.
    int64_t N = 0;
    for (int64_t i = 0; i < seqs_per_step; ++i) {
      data.next(ids[static_cast<size_t>(i)].data(), tg[static_cast<size_t>(i)].data());
      for (int32_t t : tg[static_cast<size_t>(i)]) N += t >= 0;
    }
    if (dump) std::fputs((dump_line(step, ids, tg) + "\n").c_str(), dump);
    model.zero_grads();
    double loss_sum = 0;
    for (int64_t i = 0; i < seqs_per_step && N > 0; ++i) {
      const Tensor id_t(ids[static_cast<size_t>(i)].data(), DType::i32, {c.seq});
      const Tensor tg_t(tg[static_cast<size_t>(i)].data(), DType::i32, {c.seq});
      if (kv) {
        loss_sum += model.chunked_step(id_t, tg_t, C, *kv, 1.0 / static_cast<double>(N)).loss_sum;
      } else {
        CeResult r = model.forward(id_t, tg_t, true);
        model.backward(1.0 / static_cast<double>(N));
        loss_sum += r.loss_sum;
      }
    }
    const double loss = N > 0 ? loss_sum / static_cast<double>(N) : 0.0;
    const double norm = global_grad_norm(*ops, model.grads());
    const bool skip = !std::isfinite(loss) || !std::isfinite(norm);
    if (skip) {
      ++nonfinite_run, ++nonfinite_total;
      std::fprintf(stderr, "oomless train: step %lld skipped: non-finite %s (%lld in a row, %lld in all)\n",
                   static_cast<long long>(step), std::isfinite(loss) ? "gradients" : "loss",
                   static_cast<long long>(nonfinite_run), static_cast<long long>(nonfinite_total));
    } else {
      nonfinite_run = 0;
      if (c.clip > 0) clip_grads(*ops, model.grads(), c.clip, norm);
      opt.step(*ops, params, model.grads(), lr, step - nonfinite_total);
      last_loss = loss;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = static_cast<double>(seqs_per_step * c.seq) / dt;
    metrics.write_step(step, loss, lr, norm, tps, skip, mem.ledger);
    OOM_CHECK(nonfinite_run <= c.max_nonfinite, "[train] ", nonfinite_run,
              " steps in a row had a non-finite loss or gradient (more than --max-nonfinite ", c.max_nonfinite,
              "); lower --lr, check the data, or use fp32; the last checkpoint is in ", out);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    const double eta = elapsed / static_cast<double>(step - first) * static_cast<double>(total - step);
    std::fprintf(stderr, tty ? "\rstep %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %.0fs  Device peak %s   "
                             : "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %.0fs  Device peak %s\n",
                 static_cast<long long>(step), static_cast<long long>(total), loss, lr, tps, eta,
                 format_bytes(mem.ledger.peak_total(Tier::Device)).c_str());
    if (c.eval_every > 0 && step % c.eval_every == 0 && step < total) run_eval(step);
    if (c.save_every > 0 && step % c.save_every == 0 && step < total) save(step);
    } catch (const OutOfBudget& e) {
      // Setup reserves everything a step needs; reaching this is a bug in that reservation.
      fail("[train] ran out of memory budget at step ", step, ", after setup had reserved the run: ", e.what());
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  if (kv && kv->options().offload != KvOffload::none) {
    // What moving the history cost: bytes each way and the time compute waited for them.
    const OffloadStats st = kv->stats();
    const int dev = static_cast<int>(Tier::Device);
    const int tier = static_cast<int>(kv->options().offload == KvOffload::host ? Tier::Host : Tier::Disk);
    const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("kv offload (%s%s%s): %s out, %s in; compute waited %.2f s on transfers (%.1f%% of %.1f s)\n",
                kv_offload_name(kv->options().offload), *kv->io_name() ? ", " : "", kv->io_name(),
                format_bytes(st.bytes[dev][tier]).c_str(), format_bytes(st.bytes[tier][dev]).c_str(), st.wait_seconds,
                run_s > 0 ? 100.0 * st.wait_seconds / run_s : 0.0, run_s);
  }
  if (dump) std::fclose(dump);
  if (!g_stop) run_eval(step);
  save(step);
  const std::string report = write_report(out, c.to_json());
  std::printf("trained %lld steps; last loss %.4f; checkpoint in %s/checkpoint-%lld; metrics in %s; report in %s\n",
              static_cast<long long>(step), last_loss, out.c_str(), static_cast<long long>(step),
              MetricsWriter::path_in(out).c_str(), report.c_str());
  if (!g_stop && src.tokenizer) {
    // A sample from the trained weights, greedy, so a person sees what the run learned.
    const std::string prompt = "And God said";
    std::vector<int32_t> p = src.tokenizer->encode(prompt, true);
    GenerateOptions gopt;
    gopt.max_new = 40;
    gopt.stop_id = src.cfg.eos_id;
    try {
      const std::vector<int32_t> gen = generate(model, mem.device, p, gopt);
      std::printf("sample: %s%s\n", prompt.c_str(), src.tokenizer->decode(gen, true).c_str());
    } catch (const OutOfBudget&) {
      std::printf("sample: skipped (its KV cache does not fit in what --budget leaves after training)\n");
    }
  }
  return g_stop ? 130 : 0;
}

}  // namespace

}  // namespace oomless
