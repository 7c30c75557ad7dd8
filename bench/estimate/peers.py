"""What two well-known memory estimators say for our model shapes: accelerate's `accelerate estimate-memory`
(1.15.0) and DeepSpeed's ZeRO model-state estimators (0.19.8). Both are called, not reimplemented; nothing is
downloaded: each model is built on the meta device from a transformers LlamaConfig.

accelerate (accelerate/commands/estimate.py; accelerate/utils/modeling.py):
  - The CLI builds `AutoModel.from_config(config)` (estimate.py:145), which for Llama is LlamaModel: the
    decoder without lm_head, so an untied head is not counted. Its size is calculate_maximum_sizes()
    (modeling.py:1079), i.e. compute_module_sizes(): every parameter and buffer (the rotary inv_freq ones
    too) times its dtype's bytes. Call that S; for an fp32 model S = 4 * params + a few hundred bytes.
  - estimate_training_usage(S, dtype) (estimate.py:239-271) gives four stages, always from the fp32 S
    (gather_data passes S before halving it for float16, estimate.py:295):
      float32: model S, gradients S, optimizer 2S, step 4S
      float16 (mixed precision; bfloat16 takes the same branch): model S, gradients 1.5S, optimizer 2S, step 2S
  - "Training using Adam" is max() of those stages (estimate_command, estimate.py:316), not their sum:
    4S = 16 bytes/param in float32 (equal to model + gradients + optimizer there) and 2S = 8 bytes/param in
    float16, below the 4.5S its own model + gradients + optimizer add up to. No activations.
  We run gather_data() itself with create_empty_model replaced by the local build, then take the max as
  estimate_command does. "with_lm_head" reruns calculate_maximum_sizes + estimate_training_usage on
  LlamaForCausalLM, which adds the head when it is untied.

DeepSpeed (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py), P = params, N = GPUs of one node, f = 1.5 (its
default additional_buffer_factor); it assumes 16-bit mixed precision and leaves activations out:
  estimate_zero2_model_states_mem_needs(P, cpu_offload):
      False: gpu = 2P + 18P/N, cpu = 4P * N * f
      True:  gpu = 2P,         cpu = P * max(4N, 16) * f
  estimate_zero3_model_states_mem_needs(P, largest_layer, cpu_offload, cpu_offload_params, zero_init),
  with M = 4 * largest_layer:
      optimizer and params on cpu:  gpu = M,          cpu = 18P * f   (zero_init=0: P * max(4N, 18) * f)
      optimizer on cpu only:        gpu = M + 2P/N,   cpu = 16P * f   (zero_init=0: P * max(4N, 16) * f)
      no offload:                   gpu = M + 18P/N,  cpu = N * M * f   (zero_init=0: 4P * N * f)
  P and largest_layer are counted as DeepSpeed's model_to_params does (shared tensors once; largest layer =
  most parameters held directly by one module), but by tensor identity: on meta tensors data_ptr() is 0.

Run: tools/golden/.venv/bin/python bench/estimate/peers.py [--json]
Needs tools/golden/.venv and bench/estimate/.venv (bench/estimate/setup.sh makes both); DeepSpeed is imported
from the latter.
"""
import argparse
import glob
import json
import os
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Llama shapes: the two presets as preset_config() in src/model/config.cpp has them (both tie the head to the
# embedding), and the TinyLlama-1.1B shape the benchmarks use.
PRESETS = {
    "tiny": dict(num_hidden_layers=6, hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, vocab_size=8192, tie_word_embeddings=True),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
}
SHAPE_FILES = {"tinyllama-1.1b": os.path.join(ROOT, "bench/shapes/tinyllama-1.1b/config.json")}


def shapes():
    out = dict(PRESETS)
    keys = list(PRESETS["tiny"])
    for name, path in SHAPE_FILES.items():
        cfg = json.load(open(path))
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        out[name] = {k: cfg[k] for k in keys}
    return out


def param_count(s):
    """Llama with SwiGLU MLP, RMSNorm and no biases, counted from the shape."""
    E, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = E * q + 2 * E * kv + q * E + 3 * E * F + 2 * E  # q, k, v, o; gate, up, down; two norms
    return V * E * (1 if s["tie_word_embeddings"] else 2) + s["num_hidden_layers"] * layer + E


def import_deepspeed():
    found = glob.glob(os.path.join(HERE, ".venv/lib/python3*/site-packages"))
    if not found:
        sys.exit("peers.py: bench/estimate/.venv is missing; run bench/estimate/setup.sh")
    import site
    site.addsitedir(found[0])  # after the golden venv's paths, so its torch is the one used
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    return deepspeed.__version__, zero2, zero3


def estimate(name, s, ds):
    import accelerate
    import torch
    from accelerate.commands import estimate as acc
    from accelerate.utils import calculate_maximum_sizes, convert_bytes
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**s, attention_bias=False, mlp_bias=False)
    with accelerate.init_empty_weights():
        base = AutoModel.from_config(cfg, dtype=torch.float32)  # what the CLI builds
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    lm.tie_weights()  # under init_empty_weights the head is left untied; tie it as a real load would

    params = param_count(s)
    unique = {id(p): p.numel() for p in lm.parameters()}
    assert params == lm.num_parameters() == sum(unique.values()), (name, params, lm.num_parameters())

    # accelerate: the CLI's own pipeline, fed the locally built model instead of a Hub download.
    args = argparse.Namespace(model_name=name, library_name="transformers", trust_remote_code=False,
                              dtypes=["float32", "float16"])
    with mock.patch.object(acc, "create_empty_model", return_value=base):
        rows = acc.gather_data(args)
    a = {"version": accelerate.__version__, "counts": type(base).__name__,
         "params": base.num_parameters()}
    for dtype, largest, total, stages in rows:
        a[dtype] = {"largest_layer": largest, "total_size": total, **stages,
                    "training_adam": max(stages.values()),
                    "model_grads_optimizer": stages["model"] + stages["gradients"] + stages["optimizer"],
                    "as_printed": [convert_bytes(largest), convert_bytes(total), convert_bytes(max(stages.values()))]}
    total, _ = calculate_maximum_sizes(lm)
    a["with_lm_head"] = {"counts": type(lm).__name__, "total_size": total,
                         **{f"{d}_training_adam": max(acc.estimate_training_usage(total, d).values())
                            for d in ("float32", "float16")}}

    # DeepSpeed: 1 node, 1 GPU, its default buffer factor.
    version, zero2, zero3 = ds
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in lm.modules())
    d = {"version": version, "total_params": params, "largest_layer_params": largest,
         "additional_buffer_factor": 1.5, "zero2": {}, "zero3": {}}
    for off in (False, True):
        cpu, gpu = zero2(params, num_gpus_per_node=1, num_nodes=1, cpu_offload=off)
        d["zero2"][f"offload_optimizer={'cpu' if off else 'none'}"] = {"cpu": cpu, "gpu": gpu}
    for opt, par in ((True, True), (True, False), (False, False)):
        for zi in (True, False):
            cpu, gpu, _ = zero3(params, largest, num_gpus_per_node=1, num_nodes=1, cpu_offload=opt,
                                cpu_offload_params=par, zero_init=zi)
            key = f"offload_param={'cpu' if par else 'none'}, offload_optimizer={'cpu' if opt else 'none'}, " \
                  f"zero_init={int(zi)}"
            d["zero3"][key] = {"cpu": cpu, "gpu": gpu}
    return {"model": name, "params": params, "shape": s, "accelerate": a, "deepspeed": d}


def gib(b):
    return f"{b / 2**30:8.3f}"


def table(r):
    a, d = r["accelerate"], r["deepspeed"]
    out = [f"{r['model']}: {r['params']:,} params (accelerate counts {a['params']:,}: {a['counts']})",
           "  accelerate estimate-memory, GiB     total  Adam (max)  model+grads+optim  Adam with lm_head"]
    for dt in ("float32", "float16"):
        x = a[dt]
        out.append(f"    {dt:<28}{gib(x['total_size'])}    {gib(x['training_adam'])}           "
                   f"{gib(x['model_grads_optimizer'])}           {gib(a['with_lm_head'][dt + '_training_adam'])}")
    out.append(f"  DeepSpeed ZeRO, 1 GPU, GiB (largest layer {d['largest_layer_params']:,} params)   per GPU  per CPU")
    for stage in ("zero2", "zero3"):
        for k, v in d[stage].items():
            out.append(f"    {stage} {k:<58}{gib(v['gpu'])} {gib(v['cpu'])}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="a JSON array, one model object per line")
    args = ap.parse_args()
    ds = import_deepspeed()
    results = [estimate(name, s, ds) for name, s in shapes().items()]
    if args.json:
        print("[\n" + ",\n".join(json.dumps(r) for r in results) + "\n]")
    else:
        print("\n\n".join(table(r) for r in results))


if __name__ == "__main__":
    main()
