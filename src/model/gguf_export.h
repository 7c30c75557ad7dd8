// Writing a model as a GGUF file for llama.cpp (oomless convert --out FILE.gguf): llama.cpp's metadata
// for the architecture (llama for Llama and Mistral, qwen2, qwen3), its tensor names, the Q/K row
// interleave llama.cpp's llama architecture expects, the byte-level BPE tokenizer as tokenizer.ggml.*
// (model gpt2), and the matrices in F32, F16, BF16 or Q8_0 (norms and biases stay F32, as llama.cpp
// keeps them). Read back by oomless's GGUF reader and by gguf-py.
#pragma once
#include <string>

#include "backend/ops.h"
#include "io/gguf.h"
#include "model/load.h"
#include "model/params.h"

namespace oomless {

// "f32", "f16", "bf16" or "q8_0" (an error names them otherwise).
GgmlType parse_gguf_type(const std::string& s);

// Writes PATH, each tensor brought to the host through `ops` (the backend that holds params); returns notes for
// the user (e.g. a tensor kept in F16 because its rows do not fit Q8_0's blocks). Errors name what cannot be
// written (a tokenizer other than byte-level BPE).
std::vector<std::string> save_gguf(Ops& ops, const std::string& path, const ModelSource& src, const ParamSet& params,
                                   GgmlType type);

}  // namespace oomless
