// eval, generate, tokenize and convert: the commands that run a model (or its tokenizer) as it is.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cli/args.h"
#include "cli/commands.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "data/text.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/adapter_io.h"
#include "model/engine.h"
#include "model/eval.h"
#include "model/generate.h"
#include "model/gguf_export.h"
#include "model/load.h"
#include "model/model.h"
#include "kv/paged_kv.h"
#include "model/quant_base.h"

namespace oomless::cli {

namespace {

using Loaded = Engine;

// need_weights false: only the source (config, tokenizer) is opened.
Loaded load(const Args& a, bool need_weights, bool keep_quantised = false, bool int8_decode = false) {
  EngineOptions o;
  o.model = a.required("model");
  o.backend = a.str("backend", "cpu");
  o.seed = static_cast<uint64_t>(a.integer("seed", 0, 0, INT64_MAX));
  if (!need_weights) {
    Loaded l;
    l.src = open_model(o.model, o.seed);
    return l;
  }
  // eval and generate read a GGUF's projection matrices in their blocks (about the file's size in
  // memory); convert and merge need them in f32.
  o.keep_quantised = keep_quantised;
  o.int8_decode = int8_decode;
  o.base_dtype = a.str("base-dtype", "fp32");
  o.embed_dtype = a.str("embed-dtype", "auto");
  o.adapter = a.str("adapter", "");
  if (a.has("rope-theta")) o.rope_theta = a.number("rope-theta", 0, 1e-30, 1e30);
  o.rope_scaling = a.str("rope-scaling", "");
  o.dtype = parse_compute_dtype(a.str("dtype", "fp32"));
  return build_engine(o);
}

std::vector<int32_t> parse_id_list(const std::string& s, int64_t V, const char* what) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == ' ' || s[i] == ',' || s[i] == '\n' || s[i] == '\t') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    OOM_CHECK(j > i && (j == s.size() || std::strchr(" ,\n\t", s[j])), "[", what, "] '", s,
              "' is not a list of token ids (whole numbers separated by spaces or commas)");
    const long long v = std::stoll(s.substr(i, j - i));
    OOM_CHECK(v < V, "[", what, "] token id ", v, " is outside the vocabulary [0, ", V, ")");
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

const char* kEvalHelp =
    "usage: oomless eval --model M [--adapter DIR] --data FILE --seq T [--dtype fp32|bf16] [--grads OUT] [--json]\n"
    "                    [--chunk C [--page P] [--kv-offload none|host|disk] [--spill-dir DIR]] [--rope-theta x]\n"
    "                    [--rope-scaling S] [--sparse-pages k [--sink-pages s] [--page-summary mean|minmax]]\n"
    "\n"
    "Loss and perplexity of a model on a text or .ids file. A text file is one document, encoded with the\n"
    "tokenizer's post-processor (BOS where the model adds one), no EOS; a .ids file holds decimal token ids,\n"
    "one document per line (blank lines skipped, lines concatenated as they are, nothing added). The stream\n"
    "is cut into non-overlapping windows of T tokens (the last partial window dropped);\n"
    "loss = sum of cross-entropy / number of predictions (T - 1 per window).\n"
    "A .jsonl file (chats, prompt-completion pairs, text lines) or a folder is read as `train` reads it:\n"
    "documents in file order, packed into sequences of T tokens with EOS between them, and only the\n"
    "targets training supervises are scored (assistant turns of a chat, the completion of a pair).\n"
    "\n"
    "  --model M        (required)\n"
    "  --adapter DIR    a LoRA adapter folder (PEFT's format: adapter_config.json, adapter_model.safetensors)\n"
    "                   applied to the model\n"
    "  --base-dtype D   fp32 (default), bf16 (half the bytes), nf4 or nf4-dq: the projections stored at load (nf4:\n"
    "                   as the QLoRA run that trained the adapter saw them; a GGUF keeps its blocks; a bitsandbytes\n"
    "                   4-bit folder is NF4)\n"
    "  --embed-dtype D  auto (default: a GGUF's own blocks, else fp32), fp32, bf16 or nf4: storage of the\n"
    "                   embedding and LM head\n"
    "  --data FILE      text, .ids or .jsonl file, or a folder (required)\n"
    "  --seq T          window length in tokens (required, >= 2)\n"
    "  --dtype D        fp32 (default) or bf16 projections with fp32 accumulation\n"
    "  --grads OUT      write the gradient of window 0's mean loss as F32 safetensors under Hugging Face names\n"
    "                   (with --adapter: the adapter's gradients, under PEFT's names)\n"
    "  --chunk C        run each window chunk by chunk (C tokens of activations at a time; keys and values of\n"
    "                   earlier chunks in a paged store) (default 0: the whole window at once)\n"
    "  --page P         tokens per K/V page; divides --chunk (default min(64, C))\n"
    "  --kv-offload M   none, host or disk: where earlier chunks' K/V pages live (default none)\n"
    "  --spill-dir DIR  disk: folder of the spill file, not tmpfs (default: the current folder)\n"
    "  --sparse-pages k page-sparse attention (with --chunk): each query page reads its own chunk, the first\n"
    "                   --sink-pages pages and its k best-scoring earlier pages (default 0: dense)\n"
    "  --sink-pages s   pages every query page reads with --sparse-pages (default 1)\n"
    "  --page-summary S minmax (per dimension, as Quest; the default) or mean (of a page's keys) page scores\n"
    "  --rope-theta x   override the model's RoPE base (default: the model's)\n"
    "  --rope-scaling S override the model's RoPE scaling: linear:F, yarn:F or llama3:F (F times the model's\n"
    "                   context), none, or a rope_scaling JSON object (default: the model's)\n"
    "  --json           print one JSON object: loss, ppl, windows, tokens, loss_by_position_bucket\n"
    "  --threads N      CPU threads (default: all)\n"
    "  --backend B      where the model computes: cpu (default); cuda is refused until its kernels exist\n";

}  // namespace

int eval(const std::vector<std::string>& argv) {
  Args a(argv,
         {{"model", true}, {"data", true}, {"seq", true}, {"dtype", true}, {"grads", true}, {"json", false},
          {"threads", true}, {"seed", true}, {"chunk", true}, {"page", true}, {"kv-offload", true},
          {"spill-dir", true}, {"rope-theta", true}, {"rope-scaling", true},
          {"sparse-pages", true}, {"sink-pages", true}, {"page-summary", true}, {"adapter", true},
          {"base-dtype", true}, {"embed-dtype", true}, {"backend", true}},
         "eval", kEvalHelp);
  if (a.help_requested()) return std::fputs(kEvalHelp, stdout), 0;
  apply_threads(a);
  const std::string data = a.required("data");
  const int64_t T = a.integer("seq", 0, 2, int64_t{1} << 24);
  a.required("seq");
  // A GGUF stays in its blocks unless the base gradients are asked for (--grads without --adapter).
  Loaded l = load(a, true, !a.has("grads") || a.has("adapter"));
  const bool grads = a.has("grads");
  // .jsonl data (chats, prompt-completion pairs) and folders are read as training reads them and only
  // the targets training supervises are scored; text and .ids are one stream cut into windows.
  const bool docs = reads_as_documents(data);
  OOM_CHECK(!docs || !grads, "[eval] --grads takes a text or .ids file (the gradient of its first window), not ", data);
  std::vector<int32_t> stream;
  Sequences seqs;
  if (docs) {
    OOM_CHECK(l.src.cfg.eos_id.has_value(), "[eval] ", a.str("model"), " names no end-of-sequence token "
              "(eos_token_id), which goes between documents");
    DatasetOptions dopt;
    dopt.paths = {data};
    dopt.T = T;
    dopt.eos_id = *l.src.cfg.eos_id;
    dopt.vocab = l.src.cfg.V;
    seqs = document_sequences(dopt, l.src.tokenizer ? &*l.src.tokenizer : nullptr, l.src.tokenizer_config, 0);
    OOM_CHECK(seqs.supervised() > 0, "[eval] ", data, " has no supervised token (chat data needs assistant turns)");
  } else {
    stream = is_ids_file(data) ? read_ids_file(data, l.src.cfg.V)
                               : l.src.require_tokenizer().encode(read_text_file(data), true);
    for (int32_t id : stream)
      OOM_CHECK(id < l.src.cfg.V, "[eval] the tokenizer produced id ", id, " outside the model's vocabulary ",
                l.src.cfg.V, "; the tokenizer and the model do not belong together");
  }
  const int64_t windows = docs ? static_cast<int64_t>(seqs.ids.size()) : static_cast<int64_t>(stream.size()) / T;
  std::fprintf(stderr, "oomless eval: %lld window%s of %lld tokens%s...\n", static_cast<long long>(windows),
               windows == 1 ? "" : "s", static_cast<long long>(T), docs ? " (supervised targets only, as training)" : "");
  std::unique_ptr<PagedKvStore> kv;
  const int64_t C = std::min(a.integer("chunk", 0, 0, int64_t{1} << 24), T);
  OOM_CHECK(C > 0 || !a.has("sparse-pages"), "[eval] --sparse-pages needs --chunk C: page-sparse attention selects "
            "among the pages of the chunked K/V store");
  if (C > 0) {
    PagedKvOptions ko;
    ko.C = C;
    ko.P = a.integer("page", std::min<int64_t>(64, C), 1, C);
    ko.offload = parse_kv_offload(a.str("kv-offload", "none"));
    ko.spill_dir = a.str("spill-dir", ".");
    ko.sparse_pages = a.integer("sparse-pages", 0, 0, int64_t{1} << 30);
    ko.sink_pages = a.integer("sink-pages", 1, 0, int64_t{1} << 30);
    ko.summary = parse_page_summary(a.str("page-summary", "minmax"));
    kv = std::make_unique<PagedKvStore>(kv_dims(l.src.cfg), *l.ops, l.mem->device, l.mem->host, ko, T, grads);
  }
  // Progress on stderr: a counter on a terminal, every tenth of the windows otherwise.
  const bool tty = isatty(2);
  int64_t shown = 0;
  auto progress = [&](int64_t done, int64_t all) {
    if (tty) {
      std::fprintf(stderr, "\r  window %lld/%lld%s", static_cast<long long>(done), static_cast<long long>(all),
                   done == all ? "\n" : "");
    } else if (done * 10 / all > shown) {
      shown = done * 10 / all;
      std::fprintf(stderr, "oomless eval: %lld/%lld windows\n", static_cast<long long>(done), static_cast<long long>(all));
    }
  };
  EvalResult r = docs ? evaluate_sequences(*l.model, seqs.ids, seqs.targets, kv.get(), C, progress)
                      : evaluate(*l.model, stream, T, grads, kv.get(), C, progress);
  if (grads) {
    // With an adapter the base is frozen: the adapter's gradients, under PEFT's names.
    const ParamSet& g = l.adapters ? l.model->adapter_grads().tensors() : l.model->grads();
    std::vector<StWrite> w;
    for (size_t i = 0; i < g.specs().size(); ++i)
      w.push_back(tensor_entry(*l.ops, g.specs()[i].name, g.tensors()[i]));
    write_safetensors(a.str("grads"), w, {{"format", "pt"}});
  }
  const double loss = r.loss();
  if (a.has("json")) {
    json::Value o = json::Value::object();
    o.set("loss", json::Value::number(loss));
    o.set("ppl", json::Value::number(std::exp(loss)));
    o.set("windows", json::Value::integer(r.windows));
    o.set("tokens", json::Value::integer(r.tokens));
    o.set("predictions", json::Value::integer(r.predictions));
    json::Value b = json::Value::array();
    for (const PositionBucket& p : r.buckets) {
      json::Value x = json::Value::object();
      x.set("start", json::Value::integer(p.start));
      x.set("end", json::Value::integer(p.end));
      x.set("loss", json::Value::number(p.count ? p.loss_sum / static_cast<double>(p.count) : 0.0));
      x.set("count", json::Value::integer(p.count));
      b.push_back(std::move(x));
    }
    o.set("loss_by_position_bucket", std::move(b));
    std::printf("%s\n", json::dump(o).c_str());
  } else {
    std::printf("loss %.6f  ppl %.4f  windows %lld  tokens %lld\n", loss, std::exp(loss),
                static_cast<long long>(r.windows), static_cast<long long>(r.tokens));
    for (const PositionBucket& p : r.buckets) {
      if (p.count == 0) {
        std::printf("  positions [%lld, %lld): no targets\n", static_cast<long long>(p.start), static_cast<long long>(p.end));
        continue;
      }
      std::printf("  positions [%lld, %lld): loss %.4f (%lld targets)\n", static_cast<long long>(p.start),
                  static_cast<long long>(p.end), p.loss_sum / static_cast<double>(p.count), static_cast<long long>(p.count));
    }
  }
  return 0;
}

namespace {
const char* kGenerateHelp =
    "usage: oomless generate --model M [--adapter DIR] [--prompt S | --prompt-ids \"1 2 3\"] [--max-new N]\n"
    "                        [--chat [--system S] [--messages FILE.jsonl]] [--dtype fp32|bf16]\n"
    "                        [--kv-dtype fp32|bf16|fp8|int8] [--decode-dot int8|f32]\n"
    "                        [--temperature t] [--top-k k] [--top-p p] [--repetition-penalty r] [--seed s]\n"
    "                        [--ignore-eos] [--json]\n"
    "\n"
    "Continues a prompt with a KV cache. Temperature 0 (the default) is greedy decoding; otherwise tokens are\n"
    "sampled from softmax(logits / t) restricted to the top-k tokens, then to the smallest set whose\n"
    "probability reaches top-p. Generation stops at the model's end-of-sequence token unless --ignore-eos.\n"
    "With --chat the model's chat template (ChatML or Llama 3) renders the conversation and the assistant's\n"
    "reply is generated up to its end-of-turn token, which is not printed: --prompt is the user's message;\n"
    "--messages continues the conversation of a .jsonl file's first line ({\"messages\": [...]}); with neither,\n"
    "each line read from stdin is the next user turn of one conversation (an empty line or end of input ends it).\n"
    "\n"
    "  --adapter DIR    a LoRA adapter folder (PEFT's format) applied to the model\n"
    "  --dtype D        fp32 (default) or bf16 projections with fp32 accumulation (as eval)\n"
    "  --base-dtype D   fp32 (default), bf16, nf4 or nf4-dq projections (as eval)\n"
    "  --embed-dtype D  auto (default), fp32, bf16 or nf4 embedding and LM head (as eval)\n"
    "  --prompt S       text, encoded with the tokenizer's post-processor (default: empty); with --chat the\n"
    "                   user's message\n"
    "  --prompt-ids L   token ids instead of text\n"
    "  --chat           apply the chat template (see above)\n"
    "  --system S       with --chat: a system message first\n"
    "  --messages F     with --chat: continue the conversation in F's first line\n"
    "  --max-new N      new tokens (default 64; with --chat 256)\n"
    "  --kv-dtype D     KV-cache storage: fp32 (default); bf16 (half the bytes; keys and values rounded as\n"
    "                   they are stored); fp8 (E4M3) or int8 (a quarter of the bytes plus a 4-byte scale per\n"
    "                   head and position: each key and value row scaled by its own absolute max)\n"
    "  --decode-dot A   how a token's products with a GGUF's Q4_0, Q4_1 and Q8_0 weights are taken (--dtype\n"
    "                   fp32): f32 (default) multiplies the dequantised weights in f32, the bits of a forward;\n"
    "                   int8 quantises the token's activations to 8 bits per 32 values and multiplies\n"
    "                   integers, as llama.cpp does: faster, but a token's log-probability moves (by 0.04 on\n"
    "                   average on SmolLM2-135M, and greedy continuations can differ at near ties)\n"
    "  --temperature t  (default 0: greedy)\n"
    "  --top-k k        sample among the k most likely tokens (default 0: all)\n"
    "  --top-p p        nucleus sampling mass (default 1)\n"
    "  --repetition-penalty r  divide the (positive) logits of tokens already seen by r (default 1: off)\n"
    "  --seed s         sampling seed (default 0)\n"
    "  --json           print {prompt_ids, ids, text} instead of the text\n"
    "  --threads N      CPU threads (default: all)\n"
    "  --backend B      where the model computes: cpu (default); cuda is refused until its kernels exist\n";
}  // namespace

int generate(const std::vector<std::string>& argv) {
  Args a(argv,
         {{"model", true}, {"prompt", true}, {"prompt-ids", true}, {"max-new", true}, {"dtype", true},
          {"temperature", true}, {"top-p", true}, {"top-k", true}, {"repetition-penalty", true}, {"seed", true},
          {"ignore-eos", false}, {"json", false}, {"threads", true}, {"adapter", true}, {"base-dtype", true},
          {"embed-dtype", true}, {"chat", false}, {"system", true}, {"messages", true}, {"kv-dtype", true},
          {"decode-dot", true}, {"backend", true}},
         "generate", kGenerateHelp);
  if (a.help_requested()) return std::fputs(kGenerateHelp, stdout), 0;
  apply_threads(a);
  const bool chat = a.has("chat");
  OOM_CHECK(chat || (!a.has("system") && !a.has("messages")), "[generate] --system and --messages need --chat");
  OOM_CHECK(!chat || !a.has("prompt-ids"), "[generate] --chat renders text: give --prompt (or --messages), not --prompt-ids");
  const int64_t max_new = a.integer("max-new", chat ? 256 : 64, 0, int64_t{1} << 20);
  const double temp = a.number("temperature", 0.0, 0.0, 100.0);
  const double top_p = a.number("top-p", 1.0, 1e-6, 1.0);
  OOM_CHECK(!(a.has("prompt") && a.has("prompt-ids")), "[generate] give --prompt or --prompt-ids, not both");
  const std::string dot = a.str("decode-dot", "f32");
  OOM_CHECK(dot == "int8" || dot == "f32", "[generate] --decode-dot ", dot, " is not a product arithmetic oomless has; ",
            "use f32 (the default) or int8 (8-bit activations)");
  Loaded l = load(a, true, true, dot == "int8");
  const ModelConfig& cfg = l.src.cfg;
  GenerateOptions opt;
  opt.max_new = max_new;
  opt.temperature = temp;
  opt.top_p = top_p;
  opt.top_k = a.integer("top-k", 0, 0, INT64_MAX);
  opt.repetition_penalty = a.number("repetition-penalty", 1.0, 1e-3, 1e3);
  opt.seed = static_cast<uint64_t>(a.integer("seed", 0, 0, INT64_MAX));
  if (!a.has("ignore-eos")) opt.stop_id = cfg.eos_id;
  {
    const std::string kv = a.str("kv-dtype", "fp32");
    OOM_CHECK(kv == "fp32" || kv == "bf16" || kv == "fp8" || kv == "int8", "[generate] --kv-dtype ", kv,
              " is not a KV-cache storage oomless has; use fp32, bf16, fp8 or int8");
    OOM_CHECK(kv == "fp32" || l.model->params().dtype() == DType::f32, "[generate] --kv-dtype ", kv,
              " needs the f32 backend");
    opt.kv_dtype = kv == "bf16" ? DType::bf16 : kv == "fp8" ? DType::f8_e4m3 : kv == "int8" ? DType::i8 : DType::f32;
  }
  const bool stream_text = !a.has("json") && l.src.tokenizer.has_value();
  // One generation from `prompt`, streamed as text (stop tokens are not printed); returns the new ids.
  auto run = [&](const std::vector<int32_t>& prompt) {
    std::vector<int32_t> sofar;
    std::string printed;
    return oomless::generate(*l.model, l.mem->device, prompt, opt, [&](int32_t id) {
      if (!stream_text || (chat && opt.stops_at(id))) return;
      // Print the newly completed text (decoding the whole output keeps multi-byte characters whole).
      sofar.push_back(id);
      const std::string text = l.src.tokenizer->decode(sofar, false);
      if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
        std::fputs(text.c_str() + printed.size(), stdout);
        std::fflush(stdout);
        printed = text;
      }
    });
  };
  auto print_json = [&](const std::vector<int32_t>& prompt, const std::vector<int32_t>& out, const std::string& text) {
    auto ids = [](const std::vector<int32_t>& v) {
      json::Value x = json::Value::array();
      for (int32_t i : v) x.push_back(json::Value::integer(i));
      return x;
    };
    json::Value o = json::Value::object();
    o.set("prompt_ids", ids(prompt));
    o.set("ids", ids(out));
    if (l.src.tokenizer) o.set("text", json::Value::string(text));
    std::printf("%s\n", json::dump(o).c_str());
  };

  if (chat) {
    const ChatTemplate ct = ChatTemplate::from_config(l.src.tokenizer_config);
    OOM_CHECK(ct.kind() != ChatTemplate::Kind::none, "[generate] --chat needs the model's chat template: ",
              ct.unsupported_reason());
    const Tokenizer& tok = l.src.require_tokenizer();
    const std::optional<int32_t> eot = tok.token_to_id(ct.end_of_turn());
    OOM_CHECK(eot.has_value(), "[generate] the tokenizer has no ", ct.end_of_turn(), " token, which its chat template uses");
    opt.stop_ids = {*eot};
    std::vector<ChatMessage> conv;
    if (a.has("messages")) conv = read_first_conversation(a.str("messages"));
    if (a.has("system")) {
      OOM_CHECK(conv.empty() || conv[0].role != "system", "[generate] --system: ", a.str("messages"),
                " already starts with a system message");
      conv.insert(conv.begin(), {"system", a.str("system")});
    }
    // The next assistant turn of `conv`, printed and appended to it.
    auto reply = [&]() {
      std::vector<int32_t> prompt;
      std::vector<uint8_t> mask;
      ct.render(conv, tok, prompt, mask, true);
      std::vector<int32_t> out = run(prompt);
      std::vector<int32_t> said = out;
      while (!said.empty() && opt.stops_at(said.back())) said.pop_back();
      const std::string text = tok.decode(said, false);
      if (a.has("json")) print_json(prompt, out, text);
      else std::printf("\n");
      conv.push_back({"assistant", text});
    };
    if (a.has("prompt")) {
      conv.push_back({"user", a.str("prompt")});
      reply();
    } else if (a.has("messages")) {
      OOM_CHECK(!conv.empty() && conv.back().role != "assistant", "[generate] --messages ", a.str("messages"),
                ": the conversation ends with an assistant turn; add the user's next message (or --prompt)");
      reply();
    } else {
      for (std::string line; ;) {
        if (isatty(0)) std::fputs("> ", stderr);
        char buf[65536];
        if (!std::fgets(buf, sizeof buf, stdin)) break;
        line = buf;
        while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
        if (line.empty()) break;
        conv.push_back({"user", line});
        reply();
      }
    }
    return 0;
  }

  std::vector<int32_t> prompt = a.has("prompt-ids") ? parse_id_list(a.str("prompt-ids"), cfg.V, "generate")
                                                    : l.src.require_tokenizer().encode(a.str("prompt"), true);
  if (prompt.empty()) {
    OOM_CHECK(cfg.bos_id.has_value(), "[generate] the prompt is empty and the model has no BOS token to start from; "
              "give --prompt");
    prompt.push_back(*cfg.bos_id);
  }
  const std::vector<int32_t> out = run(prompt);
  if (a.has("json")) {
    print_json(prompt, out, l.src.tokenizer ? l.src.tokenizer->decode(out, false) : "");
  } else if (!stream_text) {
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? " " : "", out[i]);
    std::printf("\n");
  } else {
    std::printf("\n");
  }
  return 0;
}

namespace {
const char* kTokenizeHelp =
    "usage: oomless tokenize --model M (--text S | --text-file F) [--decode] [--no-special] [--json]\n"
    "\n"
    "Prints the token ids of a text (with the tokenizer's post-processor, e.g. BOS, unless --no-special),\n"
    "or with --decode the text of a list of ids given in --text / --text-file.\n"
    "\n"
    "  --text S         the text (or ids with --decode)\n"
    "  --text-file F    read it from a file\n"
    "  --decode         ids -> text\n"
    "  --no-special     encode without the post-processor's special tokens; decode without special tokens\n"
    "  --json           print {\"ids\": [...]} or {\"text\": \"...\"}\n";
}

int tokenize(const std::vector<std::string>& argv) {
  Args a(argv, {{"model", true}, {"text", true}, {"text-file", true}, {"decode", false}, {"no-special", false}, {"json", false}},
         "tokenize", kTokenizeHelp);
  if (a.help_requested()) return std::fputs(kTokenizeHelp, stdout), 0;
  OOM_CHECK(a.has("text") != a.has("text-file"), "[tokenize] give exactly one of --text and --text-file\n\n",
            kTokenizeHelp);
  Loaded l = load(a, false);
  const Tokenizer& tok = l.src.require_tokenizer();
  const std::string text = a.has("text") ? a.str("text") : read_text_file(a.str("text-file"));
  const bool special = !a.has("no-special");
  if (a.has("decode")) {
    const std::string s = tok.decode(parse_id_list(text, tok.vocab_size(), "tokenize"), !special);
    if (a.has("json")) {
      json::Value o = json::Value::object();
      o.set("text", json::Value::string(s));
      std::printf("%s\n", json::dump(o).c_str());
    } else {
      std::printf("%s\n", s.c_str());
    }
    return 0;
  }
  const std::vector<int32_t> ids = tok.encode(text, special);
  if (a.has("json")) {
    json::Value arr = json::Value::array();
    for (int32_t i : ids) arr.push_back(json::Value::integer(i));
    json::Value o = json::Value::object();
    o.set("ids", std::move(arr));
    std::printf("%s\n", json::dump(o).c_str());
  } else {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
  }
  return 0;
}

namespace {

const char* kConvertHelp =
    "usage: oomless convert --model M --out DIR [--dtype fp32|bf16] [--seed s]\n"
    "       oomless convert --model M --out FILE.gguf [--type f32|f16|bf16|q8_0|q4_k] [--seed s]\n"
    "\n"
    "Writes a model as a Hugging Face folder that transformers and `--model DIR` load as they are:\n"
    "config.json, generation_config.json, model.safetensors (Hugging Face names) and, when the model has them,\n"
    "tokenizer.json and tokenizer_config.json. GGUF weights are dequantised; a preset is written with its random\n"
    "init, so the folder is a fixed starting point for training runs (and for other systems started from the\n"
    "same weights). An --out ending in .gguf writes one GGUF file for llama.cpp instead: its metadata for the\n"
    "architecture (llama, qwen2, qwen3), the byte-level BPE tokenizer and chat template, and the matrices in\n"
    "--type (norms and biases in F32).\n"
    "\n"
    "  --model M   HF folder, .gguf or preset:NAME (required)\n"
    "  --out DIR   a new or empty folder, or FILE.gguf (required)\n"
    "  --dtype D   folder: fp32 (default) or bf16 weights\n"
    "  --type T    GGUF: f32, f16 (default), bf16, q8_0 or q4_k matrices (q4_k: rows not a multiple of 256\n"
    "              fall back to q8_0)\n"
    "  --seed s    random init of a preset (default 0)\n"
    "  --backend B where the weights are loaded and read back: cpu (default); cuda is refused until its kernels\n"
    "              exist\n";

}  // namespace

int convert(const std::vector<std::string>& argv) {
  Args a(argv, {{"model", true}, {"out", true}, {"seed", true}, {"type", true}, {"dtype", true}, {"backend", true}},
         "convert", kConvertHelp);
  if (a.help_requested()) return std::fputs(kConvertHelp, stdout), 0;
  const std::string out = a.required("out");
  const bool gguf = out.size() > 5 && out.compare(out.size() - 5, 5, ".gguf") == 0;
  OOM_CHECK(gguf || !a.has("type"), "[convert] --type is for a .gguf --out; a folder takes --dtype fp32|bf16");
  OOM_CHECK(!gguf || !a.has("dtype"), "[convert] --dtype is for a folder --out; a .gguf takes --type f32|f16|bf16|q8_0|q4_k");
  const GgmlType type = parse_gguf_type(a.str("type", "f16"));
  const std::string dt = a.str("dtype", "fp32");
  OOM_CHECK(dt == "fp32" || dt == "bf16", "[convert] --dtype ", dt, " is not supported; use fp32 or bf16");
  Loaded l = load(a, true);
  if (gguf) {
    for (const std::string& n : save_gguf(*l.ops, out, l.src, *l.params, type)) std::fprintf(stderr, "oomless convert: %s\n", n.c_str());
    std::printf("wrote %s (GGUF %s, %s, %lld parameters)\n", out.c_str(), a.str("type", "f16").c_str(),
                arch_name(l.src.cfg.arch), static_cast<long long>(l.src.cfg.param_count()));
    return 0;
  }
  save_hf_model(*l.ops, out, l.src, *l.params, dt == "bf16" ? DType::bf16 : DType::f32);
  std::printf("wrote %s (%s, %lld parameters)\n", out.c_str(), arch_name(l.src.cfg.arch),
              static_cast<long long>(l.src.cfg.param_count()));
  return 0;
}

namespace {

const char* kMergeHelp =
    "usage: oomless merge --model M --adapter DIR --out HF_DIR [--dtype fp32|bf16]\n"
    "\n"
    "Folds a LoRA adapter into its base model (W + s B A for every adapted projection, as PEFT's\n"
    "merge_and_unload) and writes the result as a Hugging Face folder (config.json, model.safetensors,\n"
    "tokenizer files) that transformers and `--model HF_DIR` load as they are.\n"
    "\n"
    "  --model M      the adapter's base: HF folder, .gguf or preset:NAME (required)\n"
    "  --adapter DIR  the adapter folder (PEFT's format) (required)\n"
    "  --out HF_DIR   a new or empty folder (required)\n"
    "  --dtype D      fp32 (default) or bf16 weights in model.safetensors\n"
    "  --seed s       random init of a preset base (default 0)\n"
    "  --backend B    where the merge computes: cpu (default); cuda is refused until its kernels exist\n";

}  // namespace

int merge(const std::vector<std::string>& argv) {
  Args a(argv, {{"model", true}, {"adapter", true}, {"out", true}, {"dtype", true}, {"seed", true}, {"backend", true}}, "merge",
         kMergeHelp);
  if (a.help_requested()) return std::fputs(kMergeHelp, stdout), 0;
  const std::string out = a.required("out");
  a.required("adapter");
  const std::string dt = a.str("dtype", "fp32");
  OOM_CHECK(dt == "fp32" || dt == "bf16", "[merge] --dtype ", dt, " is not supported; use fp32 or bf16");
  Loaded l = load(a, true);
  merge_lora(*l.ops, *l.params, *l.adapters, l.mem->device);
  save_hf_model(*l.ops, out, l.src, *l.params, dt == "bf16" ? DType::bf16 : DType::f32);
  std::printf("wrote %s: %s with the adapter of %s merged (r %lld, %zu projections per layer)\n", out.c_str(),
              arch_name(l.src.cfg.arch), a.str("adapter").c_str(), static_cast<long long>(l.adapters->settings().r),
              l.adapters->settings().targets.size());
  return 0;
}

}  // namespace oomless::cli
