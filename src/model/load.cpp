#include "model/load.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "backend/ops.h"
#include "data/text.h"
#include "io/gguf.h"
#include "quant/bnb4.h"
#include "io/gguf_model.h"
#include "io/safetensors.h"

extern "C" const char oomless_bundled_tokenizer_json[];
extern "C" const char oomless_bundled_tokenizer_json_end[];
extern "C" const char oomless_bundled_tokenizer_config[];
extern "C" const char oomless_bundled_tokenizer_config_end[];
extern "C" const char oomless_bundled_train_txt[];
extern "C" const char oomless_bundled_train_txt_end[];
extern "C" const char oomless_bundled_eval_txt[];
extern "C" const char oomless_bundled_eval_txt_end[];
extern "C" const char oomless_smollm2_tokenizer_json[];
extern "C" const char oomless_smollm2_tokenizer_json_end[];

namespace oomless {

namespace fs = std::filesystem;

namespace {

std::string_view embedded(const char* b, const char* e) { return {b, static_cast<size_t>(e - b)}; }

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Copies float32 values into a parameter of any float dtype.
void store(Ops& ops, const Tensor& dst, const std::vector<float>& src) {
  ops.write_host(dst, [&](void* host) { convert(host, dst.dtype, src.data(), DType::f32, dst.numel()); });
}

ModelSource open_preset(const std::string& spec, std::string_view name, uint64_t seed) {
  ModelSource m;
  m.spec = spec;
  m.kind = "preset";
  m.cfg = preset_config(name);
  if (name == "micro" || name == "tiny") {
    m.tokenizer = bundled_tokenizer();
    m.tokenizer_json = std::string(embedded(oomless_bundled_tokenizer_json, oomless_bundled_tokenizer_json_end));
    m.tokenizer_config = bundled_tokenizer_config();
  } else if (name == "smollm2-135m") {
    static const Tokenizer smollm2 = Tokenizer::from_json(
        json::parse(embedded(oomless_smollm2_tokenizer_json, oomless_smollm2_tokenizer_json_end), "SmolLM2 tokenizer.json"),
        "SmolLM2 tokenizer.json");
    m.tokenizer = smollm2;
    m.tokenizer_json = std::string(embedded(oomless_smollm2_tokenizer_json, oomless_smollm2_tokenizer_json_end));
  }
  m.load_weights = [seed](Ops& ops, ParamSet& p) { init_random(ops, p, seed); };
  return m;
}

// A parameter's random initial values from (seed, its name) alone, element by element (a counter-based
// normal: splitmix64 of the element index, Box-Muller), so one matrix can be drawn without the others
// and in parallel: norms 1, biases 0, everything else N(0, 0.02^2).
void init_tensor(const ParamSpec& s, uint64_t seed, float* out) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  const bool is_norm = s.name.find("norm.weight") != std::string::npos;
  const bool is_bias = ends_with(s.name, ".bias");
  if (is_norm || is_bias) {
    std::fill(out, out + n, is_norm ? 1.0f : 0.0f);
    return;
  }
  uint64_t key = seed ^ 0x6A09E667F3BCC909ull;
  for (unsigned char c : s.name) key = (key ^ c) * 0x100000001B3ull;  // FNV-1a of the name
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = key + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(i) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u1 = (static_cast<double>(z >> 32) + 1.0) * 0x1.0p-32;
    const double u2 = static_cast<double>(z & 0xFFFFFFFFull) * 0x1.0p-32;
    out[i] = static_cast<float>(0.02 * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
}

// A folder's tokenizer.json and tokenizer_config.json, where present.
void read_tokenizer_files(ModelSource& m, const fs::path& dir) {
  if (fs::exists(dir / "tokenizer.json")) {
    m.tokenizer_json = read_text_file((dir / "tokenizer.json").string());
    m.tokenizer = Tokenizer::from_json(json::parse(m.tokenizer_json, (dir / "tokenizer.json").string()),
                                       (dir / "tokenizer.json").string());
  }
  if (fs::exists(dir / "tokenizer_config.json"))
    m.tokenizer_config = json::parse_file((dir / "tokenizer_config.json").string());
  if (fs::exists(dir / "generation_config.json"))
    m.generation_config = json::parse_file((dir / "generation_config.json").string());
  // Current transformers save the template beside tokenizer_config.json, in chat_template.jinja: it is
  // the template when the config holds none (as transformers reads it), and is then written back into
  // the tokenizer_config.json of checkpoints.
  if (fs::exists(dir / "chat_template.jinja")) {
    if (!m.tokenizer_config.is_object()) m.tokenizer_config = json::Value::object();
    if (!m.tokenizer_config.find("chat_template"))
      m.tokenizer_config.set("chat_template", json::Value::string(read_text_file((dir / "chat_template.jinja").string())));
  }
}

// config.json alone: the model it describes, randomly initialised tensor by tensor (init_tensor), so a
// quantised base is drawn straight into its storage one matrix at a time.
ModelSource open_config_only(const std::string& spec, const fs::path& cfg_path, uint64_t seed) {
  ModelSource m;
  m.spec = spec;
  m.kind = "config";
  m.cfg = ModelConfig::from_file(cfg_path.string());
  const fs::path dir = cfg_path.parent_path().empty() ? fs::path(".") : cfg_path.parent_path();
  read_tokenizer_files(m, dir);
  m.read_f32 = [seed](const ParamSpec& s, float* out) { init_tensor(s, seed, out); };
  m.load_weights = [seed](Ops& ops, ParamSet& p) {
    std::vector<float> buf;
    for (size_t i = 0; i < p.specs().size(); ++i) {
      const Tensor& t = p.tensors()[i];
      if (!t.data) continue;  // held elsewhere (a quantised base)
      if (t.dtype == DType::f32) {  // in place: no second copy of a large embedding
        ops.write_host(t, [&](void* host) { init_tensor(p.specs()[i], seed, static_cast<float*>(host)); });
        continue;
      }
      buf.resize(static_cast<size_t>(t.numel()));
      init_tensor(p.specs()[i], seed, buf.data());
      store(ops, t, buf);
    }
  };
  return m;
}

bool has_safetensors(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir.empty() ? fs::path(".") : dir, ec))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

ModelSource open_hf(const std::string& spec, const fs::path& dir) {
  ModelSource m;
  m.spec = spec;
  m.kind = "hf";
  const fs::path cfg_path = dir / "config.json";
  OOM_CHECK(fs::exists(cfg_path), "[model] ", dir.string(), " has no config.json; --model takes a Hugging Face model "
            "folder (config.json + *.safetensors), a .gguf file or preset:NAME (", "micro, tiny, smollm2-135m)");
  OOM_CHECK(has_safetensors(dir), "[model] ", dir.string(), " has a config.json but no *.safetensors weights; for a "
            "randomly initialised model of that shape give the file itself: --model ", (dir / "config.json").string());
  m.cfg = ModelConfig::from_file(cfg_path.string());
  read_tokenizer_files(m, dir);
  auto set = std::make_shared<SafetensorsSet>(SafetensorsSet::open(dir.string()));
  m.keep_open = set;
  if (is_bnb4_weight(*set, "model.layers.0.self_attn.q_proj")) m.bnb4 = set;
  m.read_f32 = [set, dir](const ParamSpec& s, float* out) {
    const StTensor* t = set->find(s.name);
    OOM_CHECK(t, "[model] ", dir.string(), ": the weights have no tensor '", s.name, "'");
    read_as_f32(*t, s.shape, out);
  };
  m.load_weights = [set, dir](Ops& ops, ParamSet& p) {
    std::vector<float> buf;
    for (size_t i = 0; i < p.specs().size(); ++i) {
      const ParamSpec& s = p.specs()[i];
      if (!p.tensors()[i].data) continue;  // held elsewhere (a quantised base)
      const StTensor* t = set->find(s.name);
      OOM_CHECK(t, "[model] ", dir.string(), ": the weights have no tensor '", s.name, "' (shape ", shape_str(s.shape),
                ") that config.json implies; the folder's config and weights do not belong together");
      buf.resize(static_cast<size_t>(p.tensors()[i].numel()));
      read_as_f32(*t, s.shape, buf.data());
      store(ops, p.tensors()[i], buf);
    }
  };
  return m;
}

ModelSource open_gguf(const std::string& spec) {
  ModelSource m;
  m.spec = spec;
  m.kind = "gguf";
  auto file = std::make_shared<GgufFile>(GgufFile::open(spec));
  m.keep_open = file;
  m.cfg = ModelConfig::from_json(gguf_config_json(*file), spec);
  const json::Value tok = gguf_tokenizer_json(*file);
  m.tokenizer = Tokenizer::from_json(tok, spec + " (tokenizer.ggml.*)");
  m.tokenizer_json = json::dump(tok);
  GgufTokenizerConfig tc = gguf_tokenizer_config(*file);
  json::Value c = json::Value::object();
  if (!tc.chat_template.empty()) c.set("chat_template", json::Value::string(tc.chat_template));
  c.set("add_bos_token", json::Value::boolean(tc.add_bos));
  if (tc.bos) c.set("bos_token", json::Value::string(m.tokenizer->id_to_token(*tc.bos)));
  if (tc.eos) c.set("eos_token", json::Value::string(m.tokenizer->id_to_token(*tc.eos)));
  m.tokenizer_config = std::move(c);
  if (!m.cfg.eos_id && tc.eos) m.cfg.eos_id = tc.eos;
  if (!m.cfg.bos_id && tc.bos) m.cfg.bos_id = tc.bos;
  auto tensors = std::make_shared<std::vector<GgufHfTensor>>(gguf_hf_tensors(*file));
  m.gguf_tensors = tensors;
  m.load_weights = [file, tensors, spec](Ops& ops, ParamSet& p) {
    std::map<std::string, const GgufHfTensor*, std::less<>> by_name;
    for (const GgufHfTensor& t : *tensors) by_name[t.hf_name] = &t;
    std::vector<float> buf;
    for (size_t i = 0; i < p.specs().size(); ++i) {
      const ParamSpec& s = p.specs()[i];
      if (!p.tensors()[i].data) continue;  // held elsewhere (a quantised base)
      auto it = by_name.find(s.name);
      OOM_CHECK(it != by_name.end(), "[model] ", spec, ": the GGUF has no tensor for '", s.name,
                "' that its metadata implies; the file is incomplete");
      OOM_CHECK(it->second->shape == s.shape, "[model] ", spec, ": tensor '", s.name, "' has shape ",
                shape_str(it->second->shape), " but the metadata implies ", shape_str(s.shape));
      buf.resize(static_cast<size_t>(p.tensors()[i].numel()));
      gguf_read_f32(*it->second, buf.data());
      store(ops, p.tensors()[i], buf);
    }
  };
  return m;
}

}  // namespace

const Tokenizer& ModelSource::require_tokenizer() const {
  OOM_CHECK(tokenizer.has_value(), "[model] ", spec, " has no tokenizer (no tokenizer.json); give token ids "
            "instead (a .ids file) or a model folder with tokenizer.json");
  return *tokenizer;
}

const Tokenizer& bundled_tokenizer() {
  static const Tokenizer tok = Tokenizer::from_json(
      json::parse(embedded(oomless_bundled_tokenizer_json, oomless_bundled_tokenizer_json_end), "bundled tokenizer.json"),
      "bundled tokenizer.json");
  return tok;
}

json::Value bundled_tokenizer_config() {
  return json::parse(embedded(oomless_bundled_tokenizer_config, oomless_bundled_tokenizer_config_end),
                     "bundled tokenizer_config.json");
}

std::string_view bundled_train_text() { return embedded(oomless_bundled_train_txt, oomless_bundled_train_txt_end); }
std::string_view bundled_eval_text() { return embedded(oomless_bundled_eval_txt, oomless_bundled_eval_txt_end); }

ModelSource open_model(const std::string& spec, uint64_t seed) {
  OOM_CHECK(!spec.empty(), "[model] --model is empty; give a Hugging Face folder, a .gguf file or preset:NAME");
  if (spec.rfind("preset:", 0) == 0) return open_preset(spec, std::string_view(spec).substr(7), seed);
  std::error_code ec;
  const fs::path p(spec);
  OOM_CHECK(fs::exists(p, ec), "[model] ", spec, " does not exist; --model takes a Hugging Face model folder, a "
            ".gguf file or preset:NAME (micro, tiny, smollm2-135m)");
  if (fs::is_directory(p, ec)) return open_hf(spec, p);
  if (ends_with(spec, ".gguf")) return open_gguf(spec);
  // config.json beside its weights: that model; alone: its shape, randomly initialised (as presets are).
  if (p.filename() == "config.json")
    return has_safetensors(p.parent_path()) ? open_hf(spec, p.parent_path()) : open_config_only(spec, p, seed);
  // A file without the .gguf suffix: the magic decides.
  FILE* f = std::fopen(spec.c_str(), "rb");
  char magic[4] = {};
  const bool gguf = f && std::fread(magic, 1, 4, f) == 4 && std::memcmp(magic, "GGUF", 4) == 0;
  if (f) std::fclose(f);
  OOM_CHECK(gguf, "[model] ", spec, " is neither a folder nor a GGUF file; --model takes a Hugging Face model folder, "
            "a .gguf file or preset:NAME");
  return open_gguf(spec);
}

namespace {

void write_text(const fs::path& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  OOM_CHECK(f, "[model] cannot write ", path.string(), ": ", std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok = std::fclose(f) == 0 && ok;
  OOM_CHECK(ok, "[model] writing ", path.string(), " failed: ", std::strerror(errno));
}

}  // namespace

json::Value generation_config(const ModelSource& src) {
  if (src.generation_config.is_object()) return src.generation_config;
  json::Value g = json::Value::object();
  g.set("_from_model_config", json::Value::boolean(true));
  if (src.cfg.bos_id) g.set("bos_token_id", json::Value::integer(*src.cfg.bos_id));
  if (src.cfg.eos_id) g.set("eos_token_id", json::Value::integer(*src.cfg.eos_id));
  return g;
}

void save_hf_model(Ops& ops, const std::string& dir, const ModelSource& src, const ParamSet& params, DType dtype) {
  OOM_CHECK(dtype == DType::f32 || dtype == DType::bf16, "[model] a Hugging Face folder is written in F32 or BF16, not ",
            dtype_name(dtype));
  std::error_code ec;
  OOM_CHECK(!fs::exists(dir, ec) || (fs::is_directory(dir, ec) && fs::is_empty(dir, ec)), "[model] ", dir,
            " already exists and is not an empty folder; give a new folder (nothing was written)");
  fs::create_directories(dir, ec);
  OOM_CHECK(!ec, "[model] cannot create ", dir, ": ", ec.message());
  // Each tensor downloaded and converted in the writer's pieces, not copied whole to the host first.
  std::vector<StWrite> w;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    w.push_back(tensor_entry(ops, params.specs()[i].name, params.tensors()[i], dtype));
    w.back().shape = params.specs()[i].shape;
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), w, {{"format", "pt"}});
  write_text(fs::path(dir) / "config.json", json::dump(src.cfg.to_json(), 2) + "\n");
  write_text(fs::path(dir) / "generation_config.json", json::dump(generation_config(src), 2) + "\n");
  if (!src.tokenizer_json.empty()) write_text(fs::path(dir) / "tokenizer.json", src.tokenizer_json);
  if (!src.tokenizer_config.is_null())
    write_text(fs::path(dir) / "tokenizer_config.json", json::dump(src.tokenizer_config, 2) + "\n");
}

}  // namespace oomless
