// Chat conversations as training documents: the model's chat template (from tokenizer_config.json)
// renders a list of messages into token ids, with a loss mask that supervises only what the assistant
// says.
//
// Jinja is not interpreted: the two template families that the supported models ship are recognised by
// the special tokens their template strings contain and rendered natively, id for id as transformers'
// apply_chat_template(tokenize=True) (tests/golden/chat, made by tools/golden/make_chat.py):
//   ChatML   <|im_start|>ROLE\nCONTENT<|im_end|>\n per message (SmolLM2, Qwen2/2.5 without tools). A
//            default system message written literally in the template ('<|im_start|>system\n...<|im_end|>')
//            is inserted when the first message is not a system one, as SmolLM2's template does.
//   Llama 3  BOS, then <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|> per message, with the
//            content trimmed of surrounding whitespace (the template's `| trim`).
// Templates that change content (Qwen3's reasoning blocks) or add dated system prompts (Llama 3.1) are
// refused rather than rendered differently.
//
// Loss mask: assistant content tokens and the end-of-turn token that closes an assistant turn
// (<|im_end|> / <|eot_id|>) are supervised; BOS, headers, the newline after <|im_end|>, and system and
// user turns are not.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/json.h"
#include "tokenizer/tokenizer.h"

namespace oomless {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  bool train = true;  // an assistant message that is supervised (false: part of a prompt)
};

// A "messages"-shaped JSON list (at `key` of a record at `where`) appended to *out, each message's `train`
// set to `train`; errors name the place, the message and what is expected (`hint` ends them).
void parse_chat_messages(const json::Value& list, const std::string& where, const char* key, bool train,
                         const std::string& hint, std::vector<ChatMessage>* out);
// The conversation on the first line of a .jsonl file: {"messages": [...]}, or {"prompt": [...],
// "completion": [...]} as one list (the prompt's messages not supervised). Errors name the file.
std::vector<ChatMessage> read_first_conversation(const std::string& path);

class ChatTemplate {
 public:
  enum class Kind { none, chatml, llama3 };

  // From tokenizer_config.json: `chat_template` as a string, or as a list of {"name", "template"} (the
  // one named "default", else the first). A config without a template gives Kind::none; an unknown
  // template gives Kind::none too, with unsupported_reason() saying why, so that datasets of plain text
  // work with any model and the error comes only when a conversation needs rendering.
  static ChatTemplate from_config(const json::Value& tokenizer_config);

  Kind kind() const { return kind_; }
  const std::string& unsupported_reason() const { return reason_; }
  const std::string& default_system() const { return default_system_; }  // empty when none

  // Token ids and a mask (1 = supervised target) of the same length. Errors: Kind::none (with the
  // reason), a role other than system/user/assistant, a special token the tokenizer lacks.
  // add_generation_prompt: then the header of an assistant turn, as a prompt for generation (the
  // templates' add_generation_prompt).
  void render(const std::vector<ChatMessage>& messages, const Tokenizer& tok, std::vector<int32_t>& ids,
              std::vector<uint8_t>& mask, bool add_generation_prompt = false) const;
  // The token that ends a turn: <|im_end|> (ChatML) or <|eot_id|> (Llama 3); generation stops at it.
  const char* end_of_turn() const;

 private:
  Kind kind_ = Kind::none;
  std::string reason_ = "the model's tokenizer_config.json has no chat_template";
  std::string default_system_;
  std::string bos_ = "<|begin_of_text|>";
};

}  // namespace oomless
