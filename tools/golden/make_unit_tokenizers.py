#!/usr/bin/env python3
"""Writes the unit_* tokenizer goldens: small tokenizers that exercise the pipeline pieces the model
goldens (made by tools/golden/make_tokenizers.py) do not reach: every Split behaviour and invert,
Digits, Punctuation, Whitespace, WhitespaceSplit, Metaspace prepend schemes with split, added-token
lstrip/rstrip/single_word/normalized, Lowercase/NFD/NFKC/NFKD/Strip/Prepend/Replace(Regex),
continuing_subword_prefix/end_of_word_suffix, unk without fusing, byte_fallback, ignore_merges, and
the Strip/Metaspace/Replace decoders.

    python tools/golden/make_unit_tokenizers.py   # needs `pip install tokenizers`

Each folder gets tokenizer.json and cases.json in the same format as the model goldens.
"""

import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "golden", "tokenizers")
TRAIN = os.path.join(ROOT, "data", "kjv", "train.txt")
HARD = os.path.join(ROOT, "tools", "golden", "hard_texts.json")

EXTRA = [
    "well-known re-entry --- double--dash -x x-",
    "a,b;c,,d ;; e",
    "Numbers 12 345 ٣٤٥ ½ and 2024-06-01",
    "What?! Yes... (maybe) [ok] {no} #tag @user $5 100% a+b=c ^_^ `tick` ~tilde",
    "<mask> My name <mask> A<mask> <mask>ony <mask>",
    "Hi <mask> there\t<mask>\t<mask>\u2000end",
    "[SEP]   after sep   [SEP]",
    "ÅB and åb and Åb inside xÅBx",
    "<s>Hello</s> <s> spaced </s>",
    "<extra>   <extra>x<extra>",
    " leading space then <s>",
    "İstanbul ǅemal ΣΑΣ Straße",
    "   many    spaces   ",
    "ﬁ ﬂ ① ㍿ ＡＢＣ Ⅻ",
    "abc abcabc bcab cab abcd",
    "unknown chars: 😀 ∑ Ω",
    "e\u0301 vs é, o\u0308 vs ö",
]


def texts():
    with open(HARD, encoding="utf-8") as f:
        base = json.load(f)
    return base + EXTRA


def corpus():
    with open(TRAIN, encoding="utf-8") as f:
        data = f.read(300_000)
    return [data[i:i + 1000] for i in range(0, len(data), 1000)] + texts() * 3


def special(content, **kw):
    args = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    args.update(kw)
    return AddedToken(content, **args)


def train(tok, vocab_size, **kw):
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, **kw))


def write(name, tok):
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tokenizer.json")
    tok.save(path, pretty=False)
    tok = Tokenizer.from_file(path)  # the ids come from the saved file
    cases = []
    for t in texts():
        ids = tok.encode(t, add_special_tokens=True).ids
        plain = tok.encode(t, add_special_tokens=False).ids
        cases.append({"text": t, "ids": ids, "ids_plain": plain, "decoded": tok.decode(ids, skip_special_tokens=False)})
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False)
    print(name, tok.get_vocab_size(), "cases", len(cases))


def with_byte_tokens(tok, first_specials):
    """Re-numbers a trained BPE so that the specials come first, then <0x00>..<0xFF>, then the rest."""
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    order = first_specials + [f"<0x{b:02X}>" for b in range(256)]
    order += [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in order]
    d["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for a in d["added_tokens"]:
        a["id"] = d["model"]["vocab"][a["content"]]
    d["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(d))


def bytelevel_mix():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip(left=True, right=True),
        normalizers.Replace(Regex(" {2,}"), " "),
    ])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("-", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex("[,;]"), behavior="removed"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    train(tok, 700, special_tokens=[special("<bos>"), special("<eos>")],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.add_tokens([AddedToken("<mask>", single_word=True, lstrip=True, rstrip=True, normalized=True, special=False),
                    AddedToken("ÅB", normalized=True, special=False)])
    tok.add_special_tokens([special("[SEP]", lstrip=True, rstrip=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", tok.token_to_id("<bos>")), ("<eos>", tok.token_to_id("<eos>"))])
    write("unit_bytelevel_mix", tok)


def split_b():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFD()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_previous"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex("[aeiou]+"), behavior="contiguous", invert=True),
        pre_tokenizers.Split(Regex("q"), behavior="merged_with_next", invert=True),
        pre_tokenizers.Split(Regex("zz"), behavior="removed", invert=False),
        pre_tokenizers.Split("ss", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    train(tok, 600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    write("unit_split_b", tok)


def whitespace_suffix():
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Sequence([decoders.Replace("##", ""), decoders.Replace("</w>", " "),
                                     decoders.Strip(" ", 0, 1)])
    train(tok, 600, special_tokens=["[UNK]"], limit_alphabet=60, continuing_subword_prefix="##",
          end_of_word_suffix="</w>")
    write("unit_whitespace_suffix", tok)


def whitespace_split():
    tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.Strip(left=True, right=False), normalizers.Prepend("_")])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    train(tok, 500, special_tokens=["[UNK]"], limit_alphabet=50)
    write("unit_whitespace_split", tok)


def metaspace(name, scheme, fuse_unk):
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=fuse_unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    train(tok, 600, special_tokens=[special("<unk>"), special("<s>"), special("</s>")], limit_alphabet=70)
    tok = with_byte_tokens(tok, ["<unk>", "<s>", "</s>"])
    tok.add_tokens([AddedToken("<extra>", lstrip=True, normalized=False, special=False)])
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme=scheme),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    write(name, tok)


def handmade():
    # "abc": merges by rank give [a, bc] ("b c" first, then no "a bc" merge), but "abc" is a token:
    # ignore_merges emits it whole. Bytes of unknown chars fall back to <0xAB> tokens when all exist.
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, "abc": 6, "d": 7, "cd": 8,
             "<0xC3>": 9, "<0xA9>": 10, "<0xE2>": 11, "<0x88>": 12, "<0x91>": 13}
    merges = ["b c", "a b", "ab c", "c d"]
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    write("unit_handmade", Tokenizer.from_str(json.dumps(doc)))


if __name__ == "__main__":
    bytelevel_mix()
    split_b()
    whitespace_suffix()
    whitespace_split()
    metaspace("unit_metaspace_first", "first", False)
    metaspace("unit_metaspace_never", "never", True)
    handmade()
