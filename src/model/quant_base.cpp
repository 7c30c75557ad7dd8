#include "model/quant_base.h"

#include <algorithm>
#include <cstring>

#include "io/gguf.h"
#include "model/load.h"

namespace oomless {

namespace {

// Row r (HF order) of a GGUF matrix, elements [col, col + n), one block at a time.
void dequant_gguf_row(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) {
  const QuantBase::Blocks& g = *static_cast<const QuantBase::Blocks*>(q.aux);
  int64_t gr = r;
  if (g.heads > 0) {  // HF row h*D + s*D/2 + i is GGUF row h*D + 2i + s
    const int64_t h = r / g.D, rem = r % g.D, s = rem / (g.D / 2), i = rem % (g.D / 2);
    gr = h * g.D + 2 * i + s;
  }
  const char* row = static_cast<const char*>(q.data) + gr * g.row_bytes;
  float tmp[256];
  for (int64_t c = col; c < col + n;) {
    const int64_t b = c / g.block, off = c - b * g.block, take = std::min(g.block - off, col + n - c);
    dequantize(g.type, row + b * g.block_bytes, g.block, tmp);
    std::memcpy(out + (c - col), tmp + off, static_cast<size_t>(take) * sizeof(float));
    c += take;
  }
}

}  // namespace

bool is_projection_weight(const std::string& n) {
  if (n.rfind("model.layers.", 0) != 0) return false;
  for (const char* p : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
    if (n.size() > std::strlen(p) && n.compare(n.size() - std::strlen(p), std::string::npos, p) == 0) return true;
  return false;
}

QuantBase::QuantBase(const std::vector<GgufHfTensor>& tensors, ParamSet& params, Arena& arena) {
  for (const GgufHfTensor& t : tensors) {
    if (!is_projection_weight(t.hf_name)) continue;
    const Tensor* view = params.find(t.hf_name);
    OOM_CHECK(view && !view->data, "[model] ", t.hf_name, " is not a quantised slot of the parameter set");
    const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(t.src->type));
    OOM_CHECK(ti && ggml_can_dequantize(t.src->type), "[model] ", t.hf_name, ": GGUF type ",
              ggml_type_name(t.src->type), " cannot be read");
    OOM_CHECK(t.shape.size() == 2 && ti->block_size <= 256 && t.shape[1] % ti->block_size == 0, "[model] ", t.hf_name,
              ": rows of ", t.shape.size() == 2 ? t.shape[1] : 0, " elements are not whole ", ti->name, " blocks");
    const int64_t rows = t.shape[0], cols = t.shape[1];
    Blocks& b = info_.emplace_back();
    b.type = t.src->type;
    b.block = ti->block_size;
    b.block_bytes = ti->type_size;
    b.row_bytes = cols / ti->block_size * ti->type_size;
    b.heads = t.unpermute_heads;
    b.D = b.heads ? rows / b.heads : 0;
    const size_t n = static_cast<size_t>(rows * b.row_bytes);
    bufs_.push_back(arena.alloc(n, Category::weights, "quantised base"));
    std::memcpy(bufs_.back().data(), t.src->data, n);
    bytes_ += n;
    QuantMatrix& q = mats_.emplace_back();
    q.format = ti->name;
    q.rows = rows, q.cols = cols;
    q.dequant_row = &dequant_gguf_row;
    q.data = bufs_.back().data();
    q.aux = &b;
    Tensor v(nullptr, params.dtype(), {rows, cols});
    v.quant = &q;
    params.set_view(t.hf_name, v);
  }
}

BaseWeights load_base(ModelSource& src, Arena& arena, bool keep_quantised) {
  BaseWeights b;
  if (keep_quantised && src.gguf_tensors) {
    b.params = std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights,
                                          [](const ParamSpec& s) { return !is_projection_weight(s.name); });
    b.quant = std::make_unique<QuantBase>(*src.gguf_tensors, *b.params, arena);
  } else {
    b.params = std::make_unique<ParamSet>(src.cfg, DType::f32, arena, Category::weights);
  }
  src.load_weights(*b.params);
  return b;
}

}  // namespace oomless
