// bitsandbytes 4-bit (NF4) weights in Hugging Face checkpoints, as transformers' save_pretrained writes
// them for a model loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4").
//
// For a linear P with weight (out, in) and n = out * in elements, blocks = ceil(n / blocksize):
//   P.weight                                U8  [ceil(n/2), 1]  packed codes (layout: quant/nf4.h)
//   P.weight.absmax                         F32 [blocks], or U8 [blocks] codes when double-quantised
//   P.weight.quant_map                      F32 [16]   the NF4 table
//   P.weight.nested_absmax                  F32 [ceil(blocks / nested_blocksize)]  } double quant
//   P.weight.nested_quant_map               F32 [256]  the signed dynamic map      } only
//   P.weight.quant_state.bitsandbytes__nf4  U8  [bytes]  UTF-8 JSON (bitsandbytes' QuantState.as_dict):
//     {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [out, in],
//      "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5335}
//   (the nested_* keys only with double quantisation; dtype is the weight's dtype before quantisation).
// config.json carries "quantization_config" {"quant_method": "bitsandbytes", "load_in_4bit": true, ...};
// the weights themselves say everything needed to read them, so nothing here reads it.
//
// Supported: quant_type nf4 (fp4 is refused with a message saying so), the blocksizes bitsandbytes
// accepts (32 ... 4096), uint8 storage (bnb_4bit_quant_storage "uint8", the default), quant_map equal to
// the NF4 table and nested_quant_map equal to the dynamic map, bit for bit. Every other deviation is an
// oomless::Error "[bnb4] FILE: KEY: what was found, what is supported".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"
#include "quant/nf4.h"

namespace oomless {

struct Bnb4QuantState {
  std::string quant_type;      // "nf4"
  int64_t blocksize = 0;       // 32, 64, ..., 4096
  std::string dtype;           // "float32", "bfloat16" or "float16"
  std::vector<int64_t> shape;  // at least one dimension, each >= 1, product below 2^40
  bool nested = false;         // double-quantised absmax
  int64_t nested_blocksize = 0;
  std::string nested_dtype;    // "float32"
  float nested_offset = 0;     // the JSON double rounded to float32, as bitsandbytes' from_dict does

  int64_t numel() const;
};

// Parses the quant_state JSON. `where` names it in errors ("FILE: KEY"). Unknown keys, missing keys,
// wrong types, fp4 or other quant types, blocksizes, dtypes and shapes outside the supported set throw.
Bnb4QuantState parse_bnb4_quant_state(std::string_view json_text, std::string_view where);

// The tensors of one weight (null when absent from the file).
struct Bnb4Tensors {
  const StTensor* weight = nullptr;            // P.weight
  const StTensor* absmax = nullptr;            // P.weight.absmax
  const StTensor* quant_map = nullptr;         // P.weight.quant_map
  const StTensor* nested_absmax = nullptr;     // P.weight.nested_absmax
  const StTensor* nested_quant_map = nullptr;  // P.weight.nested_quant_map
};

// Checks the tensors against the quant state (dtypes, shapes, sizes, tables) and returns the matrix as a
// view of their data. `file` and `prefix` (P) name them in errors.
nf4::Matrix bnb4_matrix(const Bnb4QuantState& qs, const Bnb4Tensors& t, std::string_view file,
                        std::string_view prefix);

// True when P.weight has a bitsandbytes 4-bit quant state (nf4 or fp4) in the file.
bool is_bnb4_weight(const SafetensorsFile& f, std::string_view prefix);
bool is_bnb4_weight(const SafetensorsSet& s, std::string_view prefix);

// Reads the 4-bit weight of linear `prefix` (e.g. "model.layers.0.self_attn.q_proj"): parses and checks
// everything above. The returned matrix views the file's mapping (no copy): it stays valid as long as the
// SafetensorsFile (Set) does; nf4::copy_to moves it into memory of the caller's choosing.
nf4::Matrix load_bnb4_weight(const SafetensorsFile& f, const std::string& prefix);
nf4::Matrix load_bnb4_weight(const SafetensorsSet& s, const std::string& prefix);

}  // namespace oomless
