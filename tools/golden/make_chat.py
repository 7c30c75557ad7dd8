#!/usr/bin/env python3
"""Chat goldens (tests/golden/chat/NAME.json) for the dataset's chat rendering and loss mask.

    tools/golden/.venv/bin/python tools/golden/make_chat.py

Each file holds
  tokenizer         the tokenizer.json used, relative to the repository root
  tokenizer_config  {"chat_template", "bos_token", "eos_token"}: what the engine reads from a model's
                    tokenizer_config.json to pick and render the template
  cases             [{"messages", "ids", "mask"}]
ids come from transformers' apply_chat_template(messages, tokenize=True) with the template below.

mask (1 = the token is a supervised target: assistant content and the end-of-turn token that closes an
assistant turn) cannot come from transformers directly: return_assistant_tokens_mask only works with
templates that wrap assistant text in {% generation %} tags, and neither real template has them. So the
mask is computed here from the rendered string instead: each assistant turn's content (trimmed where the
template trims it) followed by its end-of-turn token is located in the rendered text, and a token is
supervised when its character span (offset mapping of the same tokenizer on the rendered text, whose ids
are checked to equal apply_chat_template's) overlaps that region. A token that straddles the header and
the content (a merge across the boundary) therefore counts as supervised.

Templates:
  smollm2  SmolLM2-135M-Instruct's template, read from the tokenizer.chat_template field of the GGUF that
           scripts/fetch_smollm2.sh fetches (ChatML with a default system message).
  llama3   Meta-Llama-3-8B-Instruct's template (tokenizer_config.json of the release), over the small
           Llama-3-style tokenizer in tests/golden/tokenizers/llama3_style.
"""

import json
import os

import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "chat")

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?\n"},
        {"role": "assistant", "content": "Rome"},
    ],
    [
        {"role": "user", "content": "  Spaces around, and a\n\nblank line.  "},
        {"role": "assistant", "content": "\n\nStarts with newlines; ends with spaces.   "},
    ],
    [
        {"role": "user", "content": "Ünïcödé: 日本語 🙂"},
        {"role": "assistant", "content": "Ça va — très bien! 1234567"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": " leading space"},
    ],
]

CASES = {
    "smollm2": ("tests/golden/tokenizers/smollm2/tokenizer.json", SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>",
                "<|im_end|>\n", False),
    "llama3": ("tests/golden/tokenizers/llama3_style/tokenizer.json", LLAMA3_TEMPLATE, "<|begin_of_text|>",
               "<|eot_id|>", "<|eot_id|>", True),
}


def assistant_regions(rendered, messages, end_token, trims):
    """Character ranges [content start, end of the end-of-turn token) of each assistant turn."""
    regions, pos = [], 0
    for m in messages:
        content = m["content"].strip() if trims else m["content"]
        # Every turn renders as HEADER + content + end token; searching for the closing part from the
        # previous turn's end finds this turn's content.
        needle = content + end_token
        at = rendered.index(needle, pos)
        if m["role"] == "assistant":
            regions.append((at, at + len(needle)))
        pos = at + len(needle)
    return regions


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, (tok_path, template, bos, eos, turn_end, trims) in CASES.items():
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ROOT, tok_path), bos_token=bos, eos_token=eos)
        tok.chat_template = template
        end_token = turn_end.rstrip("\n")
        cases = []
        for messages in CONVERSATIONS:
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
            rendered = tok.apply_chat_template(messages, tokenize=False)
            enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
            assert enc["input_ids"] == list(ids), name
            regions = assistant_regions(rendered, messages, end_token, trims)
            mask = [int(any(s < e1 and e > s1 for s1, e1 in regions)) for s, e in enc["offset_mapping"]]
            cases.append({"messages": messages, "ids": list(ids), "mask": mask})
        doc = {
            "tokenizer": tok_path,
            "tokenizer_config": {"chat_template": template, "bos_token": bos, "eos_token": eos},
            "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
            "cases": cases,
        }
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(name, [len(c["ids"]) for c in cases])


if __name__ == "__main__":
    main()
