#include "model/quant_base.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "quant/bnb4.h"

namespace oomless {

namespace {

// The GGUF row that holds HF row r.
int64_t gguf_row(const QuantBase::Blocks& g, int64_t r) {
  if (g.heads == 0) return r;
  // HF row h*D + s*D/2 + i is GGUF row h*D + 2i + s
  const int64_t h = r / g.D, rem = r % g.D, s = rem / (g.D / 2), i = rem % (g.D / 2);
  return h * g.D + 2 * i + s;
}

// Where HF rows rows[0, g) start (base: their first block's column), gguf_row's rows: a run of consecutive
// rows stepped through (one set of divisions a run, not a row; the products of a decode step ask for some
// 200K rows in runs of eight).
void row_starts(const QuantBase::Blocks& b, const int64_t* rows, int g, const uint8_t* base, const uint8_t** p) {
  if (b.heads == 0) {
    for (int i = 0; i < g; ++i) p[i] = base + rows[i] * b.row_bytes;
    return;
  }
  const int64_t half = b.D / 2;
  int64_t h = 0, s = 0, j = 0;  // HF row h D + s D/2 + j is GGUF row h D + 2 j + s
  for (int i = 0; i < g; ++i) {
    if (i == 0 || rows[i] != rows[i - 1] + 1) {
      const int64_t rem = rows[i] % b.D;
      h = rows[i] / b.D, s = rem / half, j = rem % half;
    } else if (++j == half) {
      j = 0;
      if (++s == 2) s = 0, ++h;
    }
    p[i] = base + (h * b.D + 2 * j + s) * b.row_bytes;
  }
}

// Row r (HF order) of a GGUF matrix, elements [col, col + n), one block at a time.
void dequant_gguf_row(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) {
  const QuantBase::Blocks& g = *static_cast<const QuantBase::Blocks*>(q.aux);
  const char* row = static_cast<const char*>(q.data) + gguf_row(g, r) * g.row_bytes;
  // Partial blocks at either end through a block's worth of scratch; the whole blocks between in one call.
  float tmp[256];
  const int64_t end = col + n;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  auto partial = [&](int64_t c, int64_t take) {
    const int64_t b = c / g.block;
    g.decode(bytes + b * g.block_bytes, 1, tmp);
    std::memcpy(out + (c - col), tmp + (c - b * g.block), static_cast<size_t>(take) * sizeof(float));
  };
  int64_t c = col;
  if (c % g.block) {
    const int64_t take = std::min(g.block - c % g.block, end - c);
    partial(c, take);
    c += take;
  }
  const int64_t whole = (end - c) / g.block;
  if (whole > 0) {
    g.decode(bytes + c / g.block * g.block_bytes, whole, out + (c - col));
    c += whole * g.block;
  }
  if (c < end) partial(c, end - c);
}

// The one-row product over whole blocks of rows[0, g), from the blocks (QuantMatrix::dot_rows).
bool dot_gguf_rows(const QuantMatrix& q, const int64_t* rows, int g, int64_t col, int64_t n, const float* a, float* acc) {
  const QuantBase::Blocks& b = *static_cast<const QuantBase::Blocks*>(q.aux);
  if (!b.dot || g > 8 || col % b.block || n % b.block) return false;
  const uint8_t* p[8];
  row_starts(b, rows, g, static_cast<const uint8_t*>(q.data) + col / b.block * b.block_bytes, p);
  b.dot(p, g, n / b.block, a, acc, 8 * b.row_bytes);  // the next group of eight rows
  return true;
}

// The same with the activations quantised to 8 bits (QuantMatrix::dot_rows_q8).
bool dot_gguf_rows_q8(const QuantMatrix& q, const int64_t* rows, int g, int64_t col, int64_t n, const Q8Act& a,
                      float* out) {
  const QuantBase::Blocks& b = *static_cast<const QuantBase::Blocks*>(q.aux);
  if (!b.dot_q8 || g > 8 || col % b.block || n % b.block || b.block != kQ8Block) return false;
  if (g == 0) return true;
  const uint8_t* p[8];
  row_starts(b, rows, g, static_cast<const uint8_t*>(q.data) + col / b.block * b.block_bytes, p);
  b.dot_q8(p, g, n / b.block, a, out, 8 * b.row_bytes);
  return true;
}

// 16 NF4 elements from 8 bytes (the first of each pair in the high nibble): a 16-entry table lookup as
// two 8-lane permutes, times the block's scale; the same products as the scalar loop.
__attribute__((target("avx2,fma"))) void nf4_groups_avx2(const uint8_t* bytes, int64_t groups, float scale, float* out) {
  const __m256 lo = _mm256_loadu_ps(nf4::kCode), hi = _mm256_loadu_ps(nf4::kCode + 8);
  const __m256 s = _mm256_set1_ps(scale);
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m256i seven = _mm256_set1_epi32(7);
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * g));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
    for (int h = 0; h < 2; ++h) {
      const __m256i idx = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(codes, 8) : codes);
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                                        _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven)));
      _mm256_storeu_ps(out + 16 * g + 8 * h, _mm256_mul_ps(v, s));
    }
  }
}

bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// Row r of an NF4 matrix (bitsandbytes' layout, elements row-major, two per byte, first in the high
// nibble), elements [col, col + n): each block's scale (dequantised from its 8-bit code when double
// quantised), times the NF4 value of the code, as bitsandbytes' dequantize_4bit computes it (16 at a time
// with AVX2 where a run starts on a byte).
void dequant_nf4_row(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) {
  const nf4::Matrix& m = *static_cast<const nf4::Matrix*>(q.aux);
  const int64_t start = r * m.cols + col, end = start + n, bs = m.blocksize;
  const bool avx2 = have_avx2();
  for (int64_t i = start; i < end;) {
    const int64_t b = i / bs, stop = std::min(end, (b + 1) * bs);
    float scale;
    if (m.double_quant()) nf4::dequantize_absmax(m.absmax_codes, m.nested_absmax, m.nested_blocksize, m.offset, b, 1, &scale);
    else std::memcpy(&scale, m.absmax + b, sizeof scale);
    if (avx2 && (i & 1) == 0 && stop - i >= 16) {
      const int64_t groups = (stop - i) / 16;
      nf4_groups_avx2(m.packed + (i >> 1), groups, scale, out + (i - start));
      i += 16 * groups;
    }
    for (; i < stop; ++i) {
      const uint8_t byte = m.packed[i >> 1];
      out[i - start] = nf4::kCode[(i & 1) ? (byte & 0x0Fu) : (byte >> 4)] * scale;
    }
  }
}

// Row r of a bf16 matrix, elements [col, col + n), widened.
void dequant_bf16_row(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) {
  const uint16_t* row = static_cast<const uint16_t*>(q.data) + r * q.cols + col;
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(row[i]);
}

bool is_table(const std::string& n) { return n == "model.embed_tokens.weight" || n == "lm_head.weight"; }

}  // namespace

bool is_embedding_or_head(const std::string& hf_name) { return is_table(hf_name); }

void QuantBase::add_bf16_matrix(Ops& ops, const std::string& name, const float* w, int64_t rows, int64_t cols,
                                ParamSet& params, Arena& arena) {
  const size_t n = static_cast<size_t>(rows * cols) * 2;
  bufs_.push_back(arena.alloc(n, Category::weights, "bf16 base"));
  ops.write_host(bufs_.back().view(DType::bf16, {rows * cols}),
                 [&](void* host) { convert(host, DType::bf16, w, DType::f32, rows * cols); });
  bytes_ += n;
  QuantMatrix& q = mats_.emplace_back();
  q.format = "bf16";
  q.rows = rows, q.cols = cols;
  q.dequant_row = &dequant_bf16_row;
  q.data = bufs_.back().data();
  Tensor v(nullptr, params.dtype(), {rows, cols});
  v.quant = &q;
  params.set_view(name, v);
}

void QuantBase::add_nf4(Ops& ops, const std::string& name, const nf4::Matrix& m, ParamSet& params, Arena& arena) {
  const size_t n = nf4::storage_bytes(m);
  bufs_.push_back(arena.alloc(n, Category::weights, "quantised base"));
  void* dev = bufs_.back().data();
  nf4::Matrix staged;
  const void* at = nullptr;
  ops.write_host(bufs_.back().view(DType::u8, {static_cast<int64_t>(n)}), [&](void* host) {
    staged = nf4::copy_to(m, host, n);
    at = host;
  });
  nf4::Matrix& kept = nf4_.emplace_back(nf4::rebase(staged, at, dev));
  bytes_ += n;
  QuantMatrix& q = mats_.emplace_back();
  q.format = kept.double_quant() ? "nf4-dq" : "nf4";
  q.rows = kept.rows, q.cols = kept.cols;
  q.dequant_row = &dequant_nf4_row;
  q.aux = &kept;
  Tensor v(nullptr, params.dtype(), {kept.rows, kept.cols});
  v.quant = &q;
  params.set_view(name, v);
}

void QuantBase::add_nf4_matrix(Ops& ops, const std::string& name, const float* w, int64_t rows, int64_t cols,
                               ParamSet& params, Arena& arena, bool double_quant) {
  const size_t n = nf4::storage_bytes(rows, cols, 64, double_quant);
  std::vector<uint8_t> tmp(n);
  add_nf4(ops, name, nf4::quantize_matrix(w, rows, cols, 64, double_quant, tmp.data(), n), params, arena);
}

int64_t QuantBase::set_int8_activations(bool on) {
  int64_t n = 0;
  for (QuantMatrix& q : mats_) {
    if (q.dequant_row != &dequant_gguf_row) continue;
    const bool take = on && static_cast<const Blocks*>(q.aux)->dot_q8;
    q.dot_rows_q8 = take ? &dot_gguf_rows_q8 : nullptr;
    n += take;
  }
  return n;
}

void QuantBase::add_nf4_from(Ops& ops, const ParamSet& f32, ParamSet& params, Arena& arena, bool double_quant) {
  for (size_t i = 0; i < f32.specs().size(); ++i) {
    const ParamSpec& s = f32.specs()[i];
    if (!is_projection_weight(s.name)) continue;
    const Tensor& w = f32.tensors()[i];
    ops.read_host(w, [&](const void* host) {
      add_nf4_matrix(ops, s.name, static_cast<const float*>(host), w.dims[0], w.dims[1], params, arena, double_quant);
    });
  }
}

void QuantBase::add_bnb4_from(Ops& ops, const SafetensorsSet& files, ParamSet& params, Arena& arena) {
  for (const ParamSpec& s : params.specs()) {
    if (!is_projection_weight(s.name)) continue;
    const std::string prefix = s.name.substr(0, s.name.size() - std::string(".weight").size());
    const nf4::Matrix m = load_bnb4_weight(files, prefix);
    OOM_CHECK(m.rows == s.shape[0] && m.cols == s.shape[1], "[model] ", s.name, ": the 4-bit weight is ", m.rows,
              " x ", m.cols, " but config.json implies ", s.shape[0], " x ", s.shape[1]);
    add_nf4(ops, s.name, m, params, arena);
  }
}

bool is_projection_weight(const std::string& n) {
  if (n.rfind("model.layers.", 0) != 0) return false;
  for (const char* p : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
    if (n.size() > std::strlen(p) && n.compare(n.size() - std::strlen(p), std::string::npos, p) == 0) return true;
  return false;
}

QuantBase::QuantBase(Ops& ops, const std::vector<GgufHfTensor>& tensors, ParamSet& params, Arena& arena, bool tables) {
  for (const GgufHfTensor& t : tensors) {
    if (!is_projection_weight(t.hf_name) && !(tables && is_table(t.hf_name))) continue;
    const Tensor* view = params.find(t.hf_name);
    if (!view && is_table(t.hf_name)) continue;  // an output.weight beside a tied config: the embedding serves
    OOM_CHECK(view && !view->data, "[model] ", t.hf_name, " is not a quantised slot of the parameter set");
    const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(t.src->type));
    OOM_CHECK(ti && ggml_can_dequantize(t.src->type), "[model] ", t.hf_name, ": GGUF type ",
              ggml_type_name(t.src->type), " cannot be read");
    OOM_CHECK(t.shape.size() == 2 && ti->block_size <= 256 && t.shape[1] % ti->block_size == 0, "[model] ", t.hf_name,
              ": rows of ", t.shape.size() == 2 ? t.shape[1] : 0, " elements are not whole ", ti->name, " blocks");
    const int64_t rows = t.shape[0], cols = t.shape[1];
    Blocks& b = info_.emplace_back();
    b.type = t.src->type;
    b.decode = ggml_block_decoder(t.src->type);
    OOM_CHECK(b.decode, "[model] ", t.hf_name, ": GGUF type ", ggml_type_name(t.src->type), " has no block decoder");
    b.block = ti->block_size;
    b.block_bytes = ti->type_size;
    b.row_bytes = cols / ti->block_size * ti->type_size;
    b.heads = t.unpermute_heads;
    b.D = b.heads ? rows / b.heads : 0;
    const size_t n = static_cast<size_t>(rows * b.row_bytes);
    bufs_.push_back(arena.alloc(n, Category::weights, "quantised base"));
    ops.upload(bufs_.back().view(DType::u8, {static_cast<int64_t>(n)}), t.src->data);
    bytes_ += n;
    QuantMatrix& q = mats_.emplace_back();
    q.format = ti->name;
    q.rows = rows, q.cols = cols;
    q.dequant_row = &dequant_gguf_row;
    b.dot = ggml_row_dot(t.src->type);
    b.dot_q8 = ggml_row_dot_q8(t.src->type);
    if (b.dot) q.dot_rows = &dot_gguf_rows;
    q.data = bufs_.back().data();
    q.aux = &b;
    Tensor v(nullptr, params.dtype(), {rows, cols});
    v.quant = &q;
    params.set_view(t.hf_name, v);
  }
}

BaseWeights load_base(ModelSource& src, Ops& ops, Arena& arena, bool keep_quantised, const std::string& base_dtype,
                      const std::string& embed_dtype, const std::vector<bool>* held, int gathered_copies) {
  OOM_CHECK(base_dtype == "fp32" || base_dtype == "bf16" || base_dtype == "nf4" || base_dtype == "nf4-dq",
            "[model] base dtype '", base_dtype, "' is not supported; supported: fp32, bf16, nf4 (nf4-dq: "
            "double-quantised scales)");
  OOM_CHECK(embed_dtype == "auto" || embed_dtype == "fp32" || embed_dtype == "bf16" || embed_dtype == "nf4",
            "[model] embedding dtype '", embed_dtype, "' is not supported; supported: auto, fp32, bf16, nf4");
  const bool nf4 = base_dtype != "fp32";  // the projections stored at load: in NF4 blocks, or in bf16
  const bool bf16_proj = base_dtype == "bf16";
  OOM_CHECK(!nf4 || !src.gguf_tensors, "[model] ", src.spec, " is a GGUF, already quantised in its own blocks (kept as "
            "they are for adapter training); --base-dtype ", base_dtype, " takes a Hugging Face folder or a preset");
  // The frozen embedding and LM head: a GGUF's own blocks (auto), or converted at load (bf16, nf4).
  const bool gguf_tables = keep_quantised && src.gguf_tensors && embed_dtype == "auto";
  const bool convert_tables = embed_dtype == "bf16" || embed_dtype == "nf4";
  OOM_CHECK(!convert_tables || keep_quantised, "[model] --embed-dtype ", embed_dtype, " makes the embedding and LM head "
            "a frozen base: it needs --lora r (and no --modules-to-save)");
  OOM_CHECK(!convert_tables || !src.gguf_tensors, "[model] ", src.spec, " is a GGUF: its embedding stays in its own "
            "blocks (--embed-dtype auto) or in fp32; bf16 and nf4 are for Hugging Face folders and presets");
  OOM_CHECK(!held || (!src.bnb4 && !(keep_quantised && src.gguf_tensors) && !nf4 && !convert_tables), "[model] --zero 3 "
            "shards an f32 base's layer weights over the ranks; ", src.spec, " is kept quantised here (",
            src.bnb4 ? "bitsandbytes 4-bit" : src.gguf_tensors && keep_quantised ? "GGUF blocks"
            : bf16_proj ? "--base-dtype bf16" : nf4 ? "--base-dtype nf4 / --qlora" : "--embed-dtype bf16 / nf4",
            "), which is not sharded: use --zero 1 "
            "(the adapters' optimizer state sharded)");
  BaseWeights b;
  const bool tables_elsewhere = gguf_tables || convert_tables;
  auto quantised_slots = [&] {
    return std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights, [tables_elsewhere](const ParamSpec& s) {
      return !is_projection_weight(s.name) && !(tables_elsewhere && is_table(s.name));
    });
  };
  // bf16 / nf4 tables from f32 values, one matrix at a time (tied: the one matrix).
  auto add_table = [&](const std::string& name, const float* w, int64_t rows, int64_t cols) {
    if (embed_dtype == "bf16") b.quant->add_bf16_matrix(ops, name, w, rows, cols, *b.params, arena);
    else b.quant->add_nf4_matrix(ops, name, w, rows, cols, *b.params, arena, base_dtype == "nf4-dq");
  };
  // One projection from f32 values into the base's storage.
  auto add_projection = [&](const std::string& name, const float* w, int64_t rows, int64_t cols) {
    if (bf16_proj) b.quant->add_bf16_matrix(ops, name, w, rows, cols, *b.params, arena);
    else b.quant->add_nf4_matrix(ops, name, w, rows, cols, *b.params, arena, base_dtype == "nf4-dq");
  };
  if (src.bnb4) {
    OOM_CHECK(keep_quantised, "[model] ", src.spec, " holds bitsandbytes 4-bit weights: it can only be a frozen base "
              "(train an adapter on it with --lora r, or eval / generate it)");
    b.params = quantised_slots();
    b.quant = std::make_unique<QuantBase>();
    b.quant->add_bnb4_from(ops, *src.bnb4, *b.params, arena);
    src.load_weights(ops, *b.params);
    std::vector<float> w;
    for (const ParamSpec& s : b.params->specs()) {
      if (!convert_tables || !is_table(s.name)) continue;
      w.resize(static_cast<size_t>(s.shape[0] * s.shape[1]));
      src.read_f32(s, w.data());
      add_table(s.name, w.data(), s.shape[0], s.shape[1]);
    }
  } else if (keep_quantised && src.gguf_tensors) {
    b.params = quantised_slots();
    b.quant = std::make_unique<QuantBase>(ops, *src.gguf_tensors, *b.params, arena, gguf_tables);
    src.load_weights(ops, *b.params);
  } else if ((nf4 || convert_tables) && src.read_f32) {
    OOM_CHECK(keep_quantised, "[model] --base-dtype ", base_dtype, " makes a frozen base: it needs --lora r");
    // Matrix by matrix: one projection in f32 at a time beside the stored ones.
    b.params = nf4 ? quantised_slots()
                   : std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights,
                                                [](const ParamSpec& s) { return !is_table(s.name); });
    b.quant = std::make_unique<QuantBase>();
    src.load_weights(ops, *b.params);
    std::vector<float> w;
    for (const ParamSpec& s : b.params->specs()) {
      const bool proj = nf4 && is_projection_weight(s.name), table = convert_tables && is_table(s.name);
      if (!proj && !table) continue;
      w.resize(static_cast<size_t>(s.shape[0] * s.shape[1]));
      src.read_f32(s, w.data());
      if (proj) add_projection(s.name, w.data(), s.shape[0], s.shape[1]);
      else add_table(s.name, w.data(), s.shape[0], s.shape[1]);
    }
  } else if (nf4 || convert_tables) {
    OOM_CHECK(keep_quantised, "[model] --base-dtype ", base_dtype, " makes a frozen base: it needs --lora r");
    // A preset: its random init is drawn over the whole set, so in f32 once, then quantised and dropped.
    b.params = nf4 ? quantised_slots()
                   : std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights,
                                                [](const ParamSpec& s) { return !is_table(s.name); });
    b.quant = std::make_unique<QuantBase>();
    {
      ParamSet full(src.cfg, DType::f32, arena, Category::workspace);
      src.load_weights(ops, full);
      if (nf4 && !bf16_proj) b.quant->add_nf4_from(ops, full, *b.params, arena, base_dtype == "nf4-dq");
      for (size_t i = 0; i < full.specs().size(); ++i) {
        const Tensor& t = full.tensors()[i];
        if (bf16_proj && is_projection_weight(full.specs()[i].name))
          ops.read_host(t, [&](const void* host) {
            add_projection(full.specs()[i].name, static_cast<const float*>(host), t.dims[0], t.dims[1]);
          });
        else if (convert_tables && is_table(full.specs()[i].name))
          ops.read_host(t, [&](const void* host) {
            add_table(full.specs()[i].name, static_cast<const float*>(host), t.dims[0], t.dims[1]);
          });
        else if (b.params->tensors()[i].data)
          ops.copy(b.params->tensors()[i], t);
      }
    }
  } else if (held) {
    const std::vector<ParamSpec> specs = param_specs(src.cfg);
    OOM_CHECK(base_dtype == "fp32" && held->size() == specs.size(), "[model] internal: layer "
              "tensors sharded over ranks need an f32 base and one entry per parameter");
    std::map<std::string, bool> keep;
    for (size_t i = 0; i < specs.size(); ++i) keep[specs[i].name] = (*held)[i] || layer_of_name(specs[i].name) < 0;
    b.params = std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights,
                                          [&keep](const ParamSpec& s) { return keep.at(s.name); });
    // One layer's tensors in specs order (64-byte aligned, as a ParamSet lays them out), by name after the layer.
    std::map<std::string, size_t> at;
    size_t bytes = 0;
    for (const ParamSpec& s : specs) {
      std::string rest;
      if (layer_of_name(s.name, &rest) != 0) continue;
      at[rest] = bytes;
      bytes += (static_cast<size_t>(numel_of(s.shape)) * sizeof(float) + 63) / 64 * 64;
    }
    OOM_CHECK(gathered_copies >= 1 && gathered_copies <= 4, "[model] internal: ", gathered_copies, " gathered layers");
    b.gathered = arena.alloc_zeroed(bytes * static_cast<size_t>(gathered_copies), Category::weights,
                                    gathered_copies == 1 ? "ZeRO-3 gathered layer" : "ZeRO-3 gathered layers");
    for (const ParamSpec& s : specs) {
      std::string rest;
      const int64_t layer = layer_of_name(s.name, &rest);
      if (keep.at(s.name) || layer < 0) continue;
      Tensor v = *b.params->find(s.name);
      v.data = b.gathered.as<char>() + static_cast<size_t>(layer % gathered_copies) * bytes + at.at(rest);
      v.tier = b.gathered.tier();
      b.params->set_view(s.name, v);
    }
    src.load_weights(ops, *b.params);
  } else {
    b.params = std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights);
    src.load_weights(ops, *b.params);
  }
  for (size_t i = 0; i < b.params->specs().size(); ++i)
    OOM_CHECK(b.params->tensors()[i].data || b.params->tensors()[i].quant, "[model] ", src.spec, ": no weights for ",
              b.params->specs()[i].name);
  return b;
}

}  // namespace oomless
