// QLoRA's base: projection matrices in NF4 (bitsandbytes' layout, quantised bit-exactly by quant/nf4) read by
// the GEMM while it packs. A LoRA on an NF4 base computes bitwise what the same LoRA computes on the f32
// base holding the dequantised matrices (fp32 and bf16, full sequence and chunks), a bitsandbytes 4-bit
// folder saved by transformers evaluates to transformers' logits and loss, and the misuses are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "memory/allocator.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/load.h"
#include "model/quant_base.h"
#include "util/chunked_run.h"
#include "util/harness.h"

namespace oomless {
namespace {

// The f32 parameters with every projection replaced by its NF4 round trip.
void dequantised_copy(const ParamSet& params, const QuantBase&, ParamSet& out) {
  DeviceAccess inside;  // the row readers called directly, as the GEMM calls them
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const Tensor& t = params.tensors()[i];
    const Tensor& d = out.tensors()[i];
    if (t.quant) {
      for (int64_t r = 0; r < t.dims[0]; ++r)
        t.quant->dequant_row(*t.quant, r, 0, t.dims[1], static_cast<float*>(d.data) + r * t.dims[1]);
    } else {
      std::memcpy(d.data, t.data, static_cast<size_t>(t.nbytes()));
    }
  }
}

TEST(Qlora, Nf4BaseIsBitwiseTheDequantisedBase) {
  for (const test::Variant& var : test::variants()) {
    // nf4, nf4-dq, nf4-dq with DoRA (its norms read the NF4 base), and the frozen embedding and head held in
    // bf16 or nf4-dq too (read by the embedding gather and the fused cross-entropy).
    for (int mode = 0; mode < 5; ++mode) {
      const bool dq = mode > 0, dora = mode == 2;
      const char* tables = mode == 3 ? "bf16" : mode == 4 ? "nf4" : "";
      for (ComputeDType dt : {ComputeDType::f32, ComputeDType::bf16}) {
        SCOPED_TRACE(std::string(var.name) + (dq ? " nf4-dq" : " nf4") + (dora ? " dora" : "") + " " + tables +
                     (dt == ComputeDType::bf16 ? " bf16" : " fp32"));
        CpuMemory mem(size_t{1} << 32);
        auto ops = make_ops("cpu", &mem.device);
        ParamSet full(var.cfg, DType::f32, mem.device, Category::weights);
        init_random(*ops, full, 5, 0.3);
        const bool tq = *tables != 0;
        ParamSet qp(var.cfg, DType::f32, mem.device, Category::weights, [tq](const ParamSpec& s) {
          return !is_projection_weight(s.name) && !(tq && is_embedding_or_head(s.name));
        });
        for (size_t i = 0; i < full.specs().size(); ++i)
          if (qp.tensors()[i].data) ops->copy(qp.tensors()[i], full.tensors()[i]);
        QuantBase qb;
        qb.add_nf4_from(*ops, full, qp, mem.device, dq);
        for (size_t i = 0; tq && i < full.specs().size(); ++i) {
          const Tensor& t = full.tensors()[i];
          if (!is_embedding_or_head(full.specs()[i].name)) continue;
          const std::vector<float> w = test::tensor_values<float>(t);
          if (mode == 3) qb.add_bf16_matrix(*ops, full.specs()[i].name, w.data(), t.dims[0], t.dims[1], qp, mem.device);
          else qb.add_nf4_matrix(*ops, full.specs()[i].name, w.data(), t.dims[0], t.dims[1], qp, mem.device, true);
        }
        EXPECT_EQ(qb.matrices(), 7 * var.cfg.L + (tq ? (var.cfg.tied ? 1 : 2) : 0));
        ASSERT_EQ(qp.embed.quant != nullptr, tq);
        ParamSet dp(var.cfg, DType::f32, mem.device, Category::weights);
        dequantised_copy(qp, qb, dp);
        LoraSettings ls = test::all_linear_lora(3);
        ls.dora = dora;
        auto ad = test::random_adapters(var.cfg, ls, DType::f32, mem.device, 17);
        const std::vector<int32_t> ids = test::tokens(48, var.cfg.V, 3), tg = test::targets_of(ids);
        std::vector<std::vector<float>> grads[2];
        double loss[2];
        std::vector<float> logits[2];
        ParamSet* sets[2] = {&qp, &dp};
        for (int k = 0; k < 2; ++k) {
          Model m(var.cfg, *ops, *sets[k], mem.device, {dt, SavePolicy::all, ad.get()});
          m.reserve(48, true);
          auto ids_c = ids, tg_c = tg;
          const CeResult r = m.forward(Tensor::of(ids_c.data(), {48}), Tensor::of(tg_c.data(), {48}), true);
          m.backward(1.0 / static_cast<double>(r.count));
          loss[k] = r.loss_sum;
          logits[k].resize(static_cast<size_t>(48 * var.cfg.V));  // the head through a GEMM (generation's path)
          m.logits(Tensor::of(logits[k].data(), {48, var.cfg.V}));
          for (const Trainable& t : m.trainable())
            grads[k].push_back(test::tensor_values<float>(t.grad));
        }
        EXPECT_EQ(std::memcmp(&loss[0], &loss[1], sizeof(double)), 0);
        EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * 4), 0);
        for (size_t i = 0; i < grads[0].size(); ++i)
          EXPECT_EQ(std::memcmp(grads[0][i].data(), grads[1][i].data(), grads[0][i].size() * 4), 0) << i;
        // The quantised base holds about an eighth of the f32 projections' bytes (plus the scales).
        size_t proj = 0;
        for (size_t i = 0; i < full.specs().size(); ++i)
          if (is_projection_weight(full.specs()[i].name) || (tq && is_embedding_or_head(full.specs()[i].name)))
            proj += static_cast<size_t>(full.tensors()[i].nbytes());
        EXPECT_LT(qb.bytes() * (mode == 3 ? 1 : 6), proj);
      }
    }
  }
}

// --base-dtype bf16: the projections stored in bf16 at load (half their bytes). Under bf16 compute, which reads an
// f32 base's projections rounded to bf16, a LoRA forward and backward over it and a few decode steps (the
// embedding and head in bf16 in both runs) are bitwise those over the f32 base (the one-row products read the
// bf16 rows where they are, the f32 ones rounding as they load).
TEST(Qlora, Bf16BaseIsBitwiseTheF32BaseReadAsBf16) {
  double loss[2];
  std::vector<std::vector<float>> grads[2];
  std::vector<float> logits[2];
  size_t stored[2], proj_bytes = 0;
  for (int k = 0; k < 2; ++k) {
    EngineOptions o;
    o.model = "preset:micro";
    o.keep_quantised = true;
    o.base_dtype = k == 0 ? "bf16" : "fp32";
    o.embed_dtype = "bf16";  // both (an f32 embedding's rows are gathered unrounded under bf16 compute)
    o.dtype = ComputeDType::bf16;
    o.lora = test::all_linear_lora(3);
    Engine e = build_engine(o);
    const ModelConfig& cfg = e.src.cfg;
    stored[k] = e.quant ? e.quant->bytes() : 0;
    if (k == 1)
      for (size_t i = 0; i < e.params->specs().size(); ++i)
        if (is_projection_weight(e.params->specs()[i].name))
          proj_bytes += static_cast<size_t>(e.params->tensors()[i].nbytes());
    Model& m = *e.model;
    const int64_t T = 40;
    m.reserve(T, true);
    std::vector<int32_t> ids = test::tokens(T, cfg.V, 7), tg = test::targets_of(ids);
    const CeResult r = m.forward(Tensor::of(ids.data(), {T}), Tensor::of(tg.data(), {T}), true);
    m.backward(1.0 / static_cast<double>(r.count));
    loss[k] = r.loss_sum;
    for (const Trainable& t : m.trainable()) grads[k].push_back(test::tensor_values<float>(t.grad));
    DecodeCache cache = make_decode_cache(e.mem->device, cfg, 8, DType::f32);
    std::vector<float> last(static_cast<size_t>(cfg.V));
    for (int64_t t = 0; t < 8; ++t) {
      m.decode_forward(Tensor(ids.data() + t, DType::i32, {1}), t, cache.slots, Tensor::of(last.data(), {cfg.V}));
      logits[k].insert(logits[k].end(), last.begin(), last.end());
    }
  }
  EXPECT_EQ(std::memcmp(&loss[0], &loss[1], sizeof(double)), 0) << loss[0] << " vs " << loss[1];
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_EQ(std::memcmp(grads[0][i].data(), grads[1][i].data(), grads[0][i].size() * 4), 0) << i;
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * 4), 0);
  // The bf16 run stores half the projections' bytes beside the bf16 tables, which are all the f32 run stores apart.
  EXPECT_GT(proj_bytes, 0u);
  EXPECT_EQ(stored[0], stored[1] + proj_bytes / 2);
}

// A quantised matrix's rows as the GEMM and the embedding read them (QuantMatrix::dequant_row: 16 at a
// time with AVX2 where a run starts on a byte) are bitwise nf4::dequantize_rows' (bit-exact with
// bitsandbytes), for every start and length, odd widths, plain and double-quantised scales.
TEST(Qlora, Nf4RowReadsEqualTheReferenceDequantisation) {
  DeviceAccess inside;  // the row readers called directly, as the GEMM calls them
  for (bool dq : {false, true}) {
    ModelConfig cfg = test::small_config();
    cfg.E = 333;  // odd rows: runs start on either nibble
    const std::string name = "model.layers.0.self_attn.q_proj.weight";
    const int64_t rows = cfg.q_dim(), cols = cfg.E;
    std::vector<float> w(static_cast<size_t>(rows * cols));
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 7));
    CpuMemory mem(size_t{1} << 30);
    ParamSet slot(cfg, DType::f32, mem.device, Category::weights, [&](const ParamSpec& s) { return s.name != name; });
    QuantBase qb;
    std::vector<uint8_t> store(nf4::storage_bytes(rows, cols, 64, dq));
    const nf4::Matrix m = nf4::quantize_matrix(w.data(), rows, cols, 64, dq, store.data(), store.size());
    std::vector<float> ref(static_cast<size_t>(rows * cols));
    nf4::dequantize_rows(m, 0, rows, ref.data());
    qb.add_nf4_matrix(*make_ops("cpu"), name, w.data(), rows, cols, slot, mem.device, dq);
    const Tensor& t = *slot.find(name);
    ASSERT_TRUE(t.quant);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; col += 7)
        for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{64}, int64_t{100}, cols - col}) {
          if (col + n > cols) continue;
          std::vector<float> got(static_cast<size_t>(n));
          t.quant->dequant_row(*t.quant, r, col, n, got.data());
          ASSERT_EQ(std::memcmp(got.data(), ref.data() + r * cols + col, static_cast<size_t>(n) * 4), 0)
              << "row " << r << " col " << col << " n " << n << (dq ? " dq" : "");
        }
  }
}

// transformers' BitsAndBytesConfig(nf4, double quant) folder: oomless reads it as it is stored and gives
// transformers' float32 logits and loss (tools/golden/make_nf4.py).
TEST(Qlora, Bnb4FolderMatchesTransformers) {
  const std::string dir = test::source_path("tests/golden/bnb4/llama_gqa_untied");
  ModelSource src = open_model(dir);
  ASSERT_TRUE(src.bnb4);
  CpuMemory mem(size_t{1} << 32);
  auto ops = make_ops("cpu", &mem.device);
  BaseWeights b = load_base(src, *ops, mem.device, true);
  ASSERT_TRUE(b.quant);
  EXPECT_STREQ(b.quant->format(), "nf4-dq");
  SafetensorsFile g = SafetensorsFile::open(dir + "/golden.safetensors");
  const StTensor* idt = g.find("input_ids");
  const int64_t T = idt->numel(), V = src.cfg.V;
  std::vector<int32_t> ids(static_cast<size_t>(T)), tg(static_cast<size_t>(T));
  std::memcpy(ids.data(), idt->data, static_cast<size_t>(T) * 4);
  for (int64_t t = 0; t < T; ++t) tg[static_cast<size_t>(t)] = t + 1 < T ? ids[static_cast<size_t>(t + 1)] : -100;
  Model m(src.cfg, *ops, *b.params, mem.device);
  m.reserve(T, false);
  const CeResult r = m.forward(Tensor::of(ids.data(), {T}), Tensor::of(tg.data(), {T}), false);
  float gold_loss;
  std::memcpy(&gold_loss, g.find("loss")->data, 4);
  EXPECT_NEAR(r.loss_sum / static_cast<double>(r.count), gold_loss, 1e-6 * gold_loss);
  std::vector<float> lg(static_cast<size_t>(T * V)), gold(lg.size());
  m.logits(Tensor::of(lg.data(), {T, V}));
  std::memcpy(gold.data(), g.find("logits")->data, gold.size() * 4);
  double num = 0, den = 0;
  for (size_t i = 0; i < lg.size(); ++i) num += std::pow(lg[i] - gold[i], 2), den += std::pow(gold[i], 2);
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  // Full training of a 4-bit base is refused.
  EXPECT_THROW(load_base(src, *ops, mem.device, false), Error);
}

TEST(Qlora, MisusesAreClearErrors) {
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu", &mem.device);
  auto message = [&](const std::string& model, bool keep, const std::string& dtype) {
    ModelSource src = open_model(model);
    try {
      load_base(src, *ops, mem.device, keep, dtype);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(test::source_path("tests/golden/gguf/small.gguf"), true, "nf4-dq").find("already quantised"),
            std::string::npos);
  EXPECT_NE(message("preset:micro", false, "nf4").find("needs --lora"), std::string::npos);
  EXPECT_NE(message("preset:micro", true, "int3").find("supported: fp32, bf16, nf4"), std::string::npos);
  EXPECT_EQ(message("preset:micro", true, "nf4"), "");
}

}  // namespace
}  // namespace oomless
