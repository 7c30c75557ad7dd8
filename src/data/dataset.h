// The training data pipeline: documents from text, .ids and .jsonl files, packed into sequences of T
// tokens in a deterministic shuffled order that a saved cursor resumes exactly.
//
// Sources (DatasetOptions::paths; --data takes them comma-separated):
//   FILE.txt (or any other file)  one document, encoded with add_special_tokens (BOS where the tokenizer
//                                  adds one); an empty file is no document
//   FILE.ids                       one document per line of decimal ids (as data/text.h reads them);
//                                  blank lines skipped
//   FILE.jsonl                     one document per line: {"text": "..."}, {"messages": [{"role":
//                                  "system"|"user"|"assistant", "content": "..."}, ...]} rendered with the
//                                  model's chat template (data/chat.h), or TRL's {"prompt": ..., "completion":
//                                  ...}: two strings (encoded apart, the prompt with BOS; only the
//                                  completion and the EOS after it supervised) or two lists of messages (a
//                                  conversation whose prompt messages are not supervised); blank lines skipped
//   FILE.json                      refused (a JSON array would otherwise train as text): use JSON Lines
//   FOLDER                         every *.txt, *.ids and *.jsonl inside, recursively, sorted by path
//
// Packing: the documents of an epoch, in its order, form one stream with EOS (DatasetOptions::eos_id)
// after each. A sequence takes T+1 stream tokens: ids are the first T, targets the last T (the next
// token), and the next sequence starts at the last of them, so every stream token after the first is
// predicted exactly once. A target is -100 (ignored by the loss) when its token is not supervised:
// outside assistant turns of a conversation, and the EOS after a conversation (the end-of-turn token
// already taught the model to stop); every token of a text or .ids document and the EOS after it are
// supervised. The stream runs on from one epoch into the next without a break.
//
// Limitation: positions restart at 0..T-1 in every sequence and attention is causal over the whole
// sequence, so a token attends to the end of the previous document in the same sequence (the EOS
// between them marks the change). Nothing is padded.
//
// Memory: the constructor reads every file once to index and validate it, keeping 16 bytes per document
// (file, byte offset, line); tokens are produced on demand, one document (or one piece of a large text
// document) at a time, so files larger than RAM stream. A text document larger than text_piece_bytes is
// encoded in pieces cut after a line break between two printable ASCII characters (a place where the
// byte-level pre-tokenizers of Llama 3/Qwen/SmolLM always split, so the ids equal those of encoding the
// whole document; Metaspace tokenizers (Llama 2, Mistral v1) may differ at the cuts). A document without
// such a line break is read whole.
//
// Every document is validated when indexed (ids in range, JSON shape, roles, UTF-8, chat template), so
// next() does not fail on data it indexed; only a file changed or removed since then is an error.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat.h"
#include "io/json.h"
#include "tokenizer/tokenizer.h"

namespace oomless {

// What happens to a conversation (or prompt-completion pair) longer than a sequence of T + 1 tokens:
// split across sequences (later pieces train without the start of their prompt in view), dropped, or an
// error naming it.
enum class Truncation { split, drop, error };
Truncation parse_truncation(std::string_view s);  // "split", "drop", "error"

struct DatasetOptions {
  std::vector<std::string> paths;
  int64_t T = 0;               // tokens per sequence
  uint64_t seed = 0;           // the order of epoch e is a shuffle seeded with seed + e
  int32_t eos_id = -1;         // appended after every document
  int64_t vocab = 0;           // ids must be below this (the model's vocabulary); 0: the tokenizer's size
                               // when there is one, else only non-negative int32 is checked
  int64_t text_piece_bytes = 1 << 20;  // see "Memory" above
  bool shuffle = true;         // false: every epoch in file order (evaluation)
  Truncation truncation = Truncation::split;
};

class Dataset {
 public:
  // tok may be null when every source is a .ids file. tokenizer_config is the model's
  // tokenizer_config.json (null when absent); only conversations need it.
  Dataset(const DatasetOptions& opt, const Tokenizer* tok, const json::Value& tokenizer_config);
  ~Dataset();
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;

  // Fills ids (T) and targets (T); returns the epoch of the sequence's first target token (the epoch
  // that is under way when the sequence is taken). Never fails on data the constructor indexed.
  int64_t next(int32_t* ids, int32_t* targets);

  int64_t documents() const { return static_cast<int64_t>(docs_.size()); }
  // Conversations longer than a sequence met so far (split, dropped; with error the first one throws).
  int64_t long_documents() const { return long_docs_; }
  int64_t epoch() const { return epoch_; }
  // The cursor: {"epoch", "doc" (position in the epoch's order), "piece" (byte offset of the text piece
  // being read), "offset" (tokens of it already taken), "carry" (the token the next sequence starts
  // with, null at the very start), "documents" and "seed" (checked by restore)}.
  json::Value state() const;
  // Errors when the state was saved for a different number of documents or seed, or is malformed.
  void restore(const json::Value& state);

  // The document order of an epoch (a permutation of [0, documents())): Fisher-Yates with
  // std::mt19937_64(seed + epoch), drawing j = rng() % (i + 1) for i = n-1 down to 1. Written out
  // rather than std::shuffle, whose algorithm differs between standard libraries.
  static std::vector<uint32_t> order(int64_t n, uint64_t seed, int64_t epoch);

 private:
  enum class FileKind : uint8_t { text, ids, jsonl };
  struct File {
    std::string path;
    FileKind kind;
    uint64_t size;
  };
  struct Doc {
    uint64_t offset;  // byte offset of the line (0 for a text file)
    uint32_t file;
    uint32_t line;    // 1-based line number, for messages
  };

  void index_file(uint32_t fi);
  void index_lines(uint32_t fi);
  void validate_jsonl(const std::string& line, const File& f, uint64_t lineno) const;
  void load();  // fills buf_ for (epoch_, pos_, piece_)
  std::string read_range(const File& f, uint64_t offset, uint64_t max_bytes, bool to_eol);
  void advance();    // move_on + load_kept
  void move_on();    // the cursor to the next document (or text piece)
  void load_kept();  // load, skipping dropped documents
  FILE* open(uint32_t fi);

  DatasetOptions opt_;
  const Tokenizer* tok_;
  ChatTemplate chat_;
  std::vector<File> files_;
  std::vector<Doc> docs_;
  std::vector<uint32_t> order_;

  // Cursor.
  int64_t epoch_ = 0;
  int64_t pos_ = 0;         // position in order_
  uint64_t piece_ = 0;      // byte offset of the current text piece within its file
  uint64_t next_piece_ = 0; // offset of the following piece; == file size after the last piece
  size_t offset_ = 0;       // tokens of buf_ already taken
  bool has_carry_ = false;
  int32_t carry_ = 0;
  bool loaded_ = false;
  bool drop_ = false;       // the loaded document is dropped (--truncation drop)
  int64_t long_docs_ = 0;

  std::vector<int32_t> buf_;   // tokens of the current document or piece (+ EOS after the last piece)
  std::vector<uint8_t> sup_;   // 1 where the token is a supervised target

  struct Fclose {
    void operator()(FILE* f) const { std::fclose(f); }
  };
  // The last file read, kept open; owned, so that a constructor that throws while indexing closes it too.
  std::unique_ptr<FILE, Fclose> fp_;
  uint32_t fp_file_ = 0;
};

// One line of --dump-tokens: {"step": STEP, "ids": [[...], ...], "targets": [[...], ...]} (no newline): each
// sequence of the step's micro-batches in order and its targets (-100 where a position is not supervised).
std::string dump_line(int64_t step, const std::vector<std::vector<int32_t>>& seqs,
                      const std::vector<std::vector<int32_t>>& targets);

// Sequences with their own targets (-100: not supervised), T tokens each.
struct Sequences {
  std::vector<std::vector<int32_t>> ids, targets;
  int64_t supervised() const;  // targets >= 0 over every sequence
};

// Evaluation data that training would read as documents (.jsonl: chats, prompt-completion pairs, text
// lines; or a folder): the documents in file order, packed as training packs them, the sequences of one
// pass (at most max_sequences; 0: all), so the loss is over exactly the targets training supervises.
bool reads_as_documents(const std::string& path);  // a .jsonl or .json file, or a folder
Sequences document_sequences(DatasetOptions opt, const Tokenizer* tok, const json::Value& tokenizer_config,
                             int64_t max_sequences);

}  // namespace oomless
