"""The PyTorch + transformers side of bench/long_context: one optimizer step of full-sequence training on
one sequence of T tokens, for the peak-RSS-versus-T comparison with `oomless train`.

The model is a Hugging Face folder (`oomless convert --model preset:NAME --seed 0`, the same weights the
oomless runs start from), loaded in fp32 with attn_implementation="sdpa"; gradient checkpointing on
(activation_checkpointing_enable(), transformers 5's name for gradient_checkpointing_enable(); use_cache
off), so only each layer's input is kept and the layer is recomputed in backward (what `oomless train
--save-policy none` does); torch.optim.AdamW(fused=True) over every parameter. The batch is the first T ids
of a .ids file (whole numbers separated by spaces, one document per line, as `oomless tokenize` writes them;
the lines are joined, and repeated when they hold fewer than T ids), labels = the ids (transformers shifts
them). transformers computes the loss from the whole (T, vocab) logits, upcast to fp32: that tensor, its
softmax and its gradient grow with T.

Prints one JSON line: {"T", "step_s" (forward + backward + optimizer step, wall), "loss", "torch",
"transformers" (versions)}. Peak memory is measured from outside (bench/long_context/run.py runs this
under /usr/bin/time -v).
"""
import argparse
import json
import time


def read_ids(path, T):
    """The first T ids of the file (lines joined; repeated when shorter than T), read in 64 KiB pieces so that
    no more than about T ids are ever held (a line can be the whole corpus; this process's peak RSS is what
    is measured)."""
    ids, rest = [], ""
    with open(path) as f:
        while len(ids) < T:
            piece = f.read(1 << 16)
            words = (rest + piece).split()
            rest = words.pop() if piece and words and not piece[-1].isspace() else ""
            ids += map(int, words)
            if not piece:
                break
    if not ids:
        raise SystemExit(f"train_torch_long.py: {path} holds no ids")
    return (ids * -(-T // len(ids)))[:T]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (e.g. from `oomless convert`)")
    ap.add_argument("--ids", required=True, help=".ids file of the same tokenizer")
    ap.add_argument("--seq", type=int, required=True, help="T, tokens in the sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.tensor([read_ids(a.ids, a.seq)], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    # gradient_checkpointing_enable() is a deprecated alias of this in transformers 5.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)

    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    step_s = time.perf_counter() - t0
    print(json.dumps({"T": a.seq, "step_s": step_s, "loss": float(loss.detach()), "torch": torch.__version__,
                      "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main()
