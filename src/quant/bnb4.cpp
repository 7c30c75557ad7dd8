// bitsandbytes 4-bit checkpoints: the quant_state JSON and the consistency of a weight's tensors.
#include "quant/bnb4.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>

#include "core/error.h"
#include "io/json.h"

namespace oomless {
namespace {

constexpr int64_t kMaxNumel = int64_t{1} << 40;

// The keys bitsandbytes' QuantState packs into the JSON (QuantState.valid_qs_keys minus the tensors).
constexpr std::string_view kKeys[] = {"quant_type", "blocksize", "dtype", "shape",
                                      "nested_blocksize", "nested_dtype", "nested_offset"};

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t positive_int(const json::Value& v, std::string_view key, std::string_view where) {
  OOM_CHECK(v.is_integer(), "[bnb4] ", where, ": \"", key, "\" must be an integer, found ",
            v.is_number() ? json::dump(v) : json::Value::kind_name(v.kind()));
  return v.as_int();
}

const std::string& string_of(const json::Value& v, std::string_view key, std::string_view where) {
  OOM_CHECK(v.is_string(), "[bnb4] ", where, ": \"", key, "\" must be a string, found ",
            json::Value::kind_name(v.kind()));
  return v.as_string();
}

int64_t blocksize_of(const json::Value& v, std::string_view key, std::string_view where) {
  const int64_t b = positive_int(v, key, where);
  OOM_CHECK(nf4::valid_blocksize(b), "[bnb4] ", where, ": ", key, " ", b,
            " is not one of bitsandbytes' 32, 64, 128, 256, 512, 1024, 2048, 4096");
  return b;
}

// The float32 values of a tensor that must be F32 of exactly `want` elements equal to `table` bitwise.
void check_table(const StTensor* t, const float* table, int64_t want, const char* what, std::string_view file) {
  OOM_CHECK(t->dtype_name == "F32" && t->shape == std::vector<int64_t>{want}, "[bnb4] ", file, ": ", t->name,
            ": ", t->dtype_name, " ", shape_str(t->shape), ", expected F32 [", want, "] (", what, ")");
  for (int64_t k = 0; k < want; ++k) {
    float v;
    std::memcpy(&v, static_cast<const uint8_t*>(t->data) + 4 * k, 4);
    uint32_t a, b;
    std::memcpy(&a, &v, 4), std::memcpy(&b, &table[k], 4);
    OOM_CHECK(a == b, "[bnb4] ", file, ": ", t->name, ": entry ", k, " is ", v, ", not ", table[k], " of ", what,
              " (only bitsandbytes' own table is supported)");
  }
}

// A 1-D tensor of `want` elements of dtype `dtype`.
void check_vector(const StTensor* t, const char* dtype, int64_t want, const char* what, std::string_view file) {
  OOM_CHECK(t->dtype_name == dtype, "[bnb4] ", file, ": ", t->name, ": dtype ", t->dtype_name, ", expected ", dtype,
            " (", what, ")");
  OOM_CHECK(t->shape == std::vector<int64_t>{want}, "[bnb4] ", file, ": ", t->name, ": shape ", shape_str(t->shape),
            ", expected [", want, "] (", what, ")");
}

using Finder = std::function<const StTensor*(std::string_view)>;

std::string state_key(std::string_view prefix, std::string_view type) {
  return std::string(prefix) + ".weight.quant_state.bitsandbytes__" + std::string(type);
}

nf4::Matrix load(const Finder& find, const std::string& prefix, std::string_view file) {
  const StTensor* qs_t = find(state_key(prefix, "nf4"));
  if (!qs_t) {
    OOM_CHECK(!find(state_key(prefix, "fp4")), "[bnb4] ", file, ": ", state_key(prefix, "fp4"),
              ": quant_type fp4 is not supported, only nf4");
    fail("[bnb4] ", file, ": ", prefix, " is not a bitsandbytes 4-bit weight (no ", state_key(prefix, "nf4"),
         "; give the linear's name, e.g. model.layers.0.self_attn.q_proj)");
  }
  OOM_CHECK(qs_t->dtype_name == "U8" && qs_t->shape.size() == 1, "[bnb4] ", file, ": ", qs_t->name, ": ",
            qs_t->dtype_name, " ", shape_str(qs_t->shape), ", expected U8 [bytes] holding JSON");
  const std::string where = std::string(file) + ": " + qs_t->name;
  const Bnb4QuantState qs = parse_bnb4_quant_state(
      std::string_view(static_cast<const char*>(qs_t->data), static_cast<size_t>(qs_t->nbytes)), where);
  const std::string w = prefix + ".weight";
  Bnb4Tensors t;
  t.weight = find(w);
  t.absmax = find(w + ".absmax");
  t.quant_map = find(w + ".quant_map");
  t.nested_absmax = find(w + ".nested_absmax");
  t.nested_quant_map = find(w + ".nested_quant_map");
  return bnb4_matrix(qs, t, file, prefix);
}

}  // namespace

int64_t Bnb4QuantState::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Bnb4QuantState parse_bnb4_quant_state(std::string_view json_text, std::string_view where) {
  json::Value v;
  try {
    v = json::parse(json_text, where);
  } catch (const Error& e) {
    fail("[bnb4] ", where, ": the quant state is not valid JSON: ", e.what());
  }
  OOM_CHECK(v.is_object(), "[bnb4] ", where, ": the quant state must be a JSON object, found ",
            json::Value::kind_name(v.kind()));
  for (const auto& [k, val] : v.as_object()) {
    bool known = false;
    for (std::string_view key : kKeys) known = known || k == key;
    OOM_CHECK(known, "[bnb4] ", where, ": unknown key \"", k, "\" (bitsandbytes writes quant_type, blocksize, "
              "dtype, shape and, with double quantisation, nested_blocksize, nested_dtype, nested_offset)");
  }
  auto need = [&](std::string_view key) -> const json::Value& {
    const json::Value* p = v.find(key);
    OOM_CHECK(p, "[bnb4] ", where, ": missing key \"", key, "\"");
    return *p;
  };
  Bnb4QuantState qs;
  qs.quant_type = string_of(need("quant_type"), "quant_type", where);
  OOM_CHECK(qs.quant_type != "fp4", "[bnb4] ", where, ": quant_type fp4 is not supported, only nf4");
  OOM_CHECK(qs.quant_type == "nf4", "[bnb4] ", where, ": unknown quant_type \"", qs.quant_type,
            "\" (only nf4 is supported)");
  qs.blocksize = blocksize_of(need("blocksize"), "blocksize", where);
  qs.dtype = string_of(need("dtype"), "dtype", where);
  OOM_CHECK(qs.dtype == "float32" || qs.dtype == "bfloat16" || qs.dtype == "float16", "[bnb4] ", where,
            ": dtype \"", qs.dtype, "\" is not one of float32, bfloat16, float16");
  const json::Value& shape = need("shape");
  OOM_CHECK(shape.is_array() && shape.size() >= 1, "[bnb4] ", where,
            ": \"shape\" must be a non-empty array of dimensions");
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = positive_int(shape[i], "shape", where);
    OOM_CHECK(d >= 1 && d <= kMaxNumel / numel, "[bnb4] ", where, ": shape ", json::dump(shape),
              " must have dimensions >= 1 and fewer than 2^40 elements");
    numel *= d;
    qs.shape.push_back(d);
  }
  const bool any_nested = v.find("nested_blocksize") || v.find("nested_dtype") || v.find("nested_offset");
  if (any_nested) {
    qs.nested = true;
    qs.nested_blocksize = blocksize_of(need("nested_blocksize"), "nested_blocksize", where);
    qs.nested_dtype = string_of(need("nested_dtype"), "nested_dtype", where);
    OOM_CHECK(qs.nested_dtype == "float32", "[bnb4] ", where, ": nested_dtype \"", qs.nested_dtype,
              "\" is not supported (bitsandbytes keeps absmax in float32)");
    const json::Value& off = need("nested_offset");
    OOM_CHECK(off.is_number(), "[bnb4] ", where, ": \"nested_offset\" must be a number, found ",
              json::Value::kind_name(off.kind()));
    qs.nested_offset = static_cast<float>(off.as_number());
    OOM_CHECK(std::isfinite(qs.nested_offset), "[bnb4] ", where, ": nested_offset ", json::dump(off),
              " is not a finite float32");
  }
  return qs;
}

nf4::Matrix bnb4_matrix(const Bnb4QuantState& qs, const Bnb4Tensors& t, std::string_view file,
                        std::string_view prefix) {
  const std::string p(prefix);
  OOM_CHECK(qs.shape.size() == 2, "[bnb4] ", file, ": ", p, ".weight: shape ", shape_str(qs.shape),
            " in the quant state is not 2-D (a linear's weight is (out_features, in_features))");
  auto missing = [&](const char* suffix, const char* why) {
    fail("[bnb4] ", file, ": ", p, ".weight", suffix, " is missing (", why, ")");
  };
  if (!t.weight) missing("", "the packed codes");
  if (!t.absmax) missing(".absmax", "the block scales");
  if (!t.quant_map) missing(".quant_map", "the NF4 table");
  nf4::Matrix m;
  m.rows = qs.shape[0], m.cols = qs.shape[1], m.blocksize = qs.blocksize;
  const int64_t n = m.numel(), blocks = m.blocks(), bytes = nf4::packed_bytes(n);

  const StTensor* w = t.weight;
  OOM_CHECK(w->dtype_name == "U8", "[bnb4] ", file, ": ", w->name, ": dtype ", w->dtype_name,
            ", expected U8 (bnb_4bit_quant_storage uint8; other storages are not supported)");
  const bool shape_ok = w->shape == std::vector<int64_t>{bytes, 1} || w->shape == std::vector<int64_t>{1, bytes} ||
                        w->shape == std::vector<int64_t>{bytes};
  OOM_CHECK(shape_ok, "[bnb4] ", file, ": ", w->name, ": shape ", shape_str(w->shape), ", expected [", bytes,
            ", 1]: ", n, " codes of the ", shape_str(qs.shape), " weight, two a byte");
  m.packed = static_cast<const uint8_t*>(w->data);
  check_table(t.quant_map, nf4::kCode, 16, "the NF4 table", file);

  if (qs.nested) {
    if (!t.nested_absmax) missing(".nested_absmax", "the quant state is double-quantised");
    if (!t.nested_quant_map) missing(".nested_quant_map", "the quant state is double-quantised");
    check_vector(t.absmax, "U8", blocks, "the 8-bit codes of the block scales", file);
    const int64_t nested = nf4::num_blocks(blocks, qs.nested_blocksize);
    check_vector(t.nested_absmax, "F32", nested, "the scales of the block scales", file);
    check_table(t.nested_quant_map, nf4::kDynamicMap, 256, "the signed dynamic map", file);
    m.absmax_codes = static_cast<const uint8_t*>(t.absmax->data);
    m.nested_absmax = static_cast<const float*>(t.nested_absmax->data);
    m.nested_blocksize = qs.nested_blocksize;
    m.offset = qs.nested_offset;
  } else {
    OOM_CHECK(!t.nested_absmax && !t.nested_quant_map, "[bnb4] ", file, ": ", p,
              ".weight has nested_absmax/nested_quant_map but its quant state has no nested_* keys");
    check_vector(t.absmax, "F32", blocks, "the block scales", file);
    m.absmax = static_cast<const float*>(t.absmax->data);
  }
  nf4::check(m);
  return m;
}

bool is_bnb4_weight(const SafetensorsFile& f, std::string_view prefix) {
  return f.find(state_key(prefix, "nf4")) || f.find(state_key(prefix, "fp4"));
}
bool is_bnb4_weight(const SafetensorsSet& s, std::string_view prefix) {
  return s.find(state_key(prefix, "nf4")) || s.find(state_key(prefix, "fp4"));
}

nf4::Matrix load_bnb4_weight(const SafetensorsFile& f, const std::string& prefix) {
  return load([&f](std::string_view k) { return f.find(k); }, prefix, f.path());
}

nf4::Matrix load_bnb4_weight(const SafetensorsSet& s, const std::string& prefix) {
  const StTensor* qs = s.find(state_key(prefix, "nf4"));
  const std::string file = qs ? qs->file : std::string("the checkpoint");
  return load([&s](std::string_view k) { return s.find(k); }, prefix, file);
}

}  // namespace oomless
