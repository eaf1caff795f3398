#!/usr/bin/env python3
"""The PyTorch side of bench_train_gpt: times the training step of the same GPT in PyTorch, in fp32 or under
bf16 autocast.

    python3 bench/pytorch_train_step.py --layers 4 --heads 4 --width 256 --block 128 --batch 16 --vocab 65 \
        --threads 2 --warmup 3 --steps 10 [--autocast bf16]

The model is tests/pytorch_parity.py's nanoGPT GPT (layernorm with bias, fused qkv, causal softmax attention,
exact GELU, tied embeddings, no dropout), the step is train_gpt's: forward, cross-entropy, backward, global
gradient clipping at norm 1, AdamW (weight decay 0.1 on the >= 2-d parameters) with fused=False (1.13's
default). Batches are uniform random tokens (the time of a step does not depend on their values).

--autocast bf16 is PyTorch's CPU mixed precision: the forward and the loss run under
torch.autocast("cpu", dtype=torch.bfloat16) (matmuls/linears in bf16, the ops on autocast's fp32 list in
fp32), the parameters, gradients and optimizer stay fp32, and there is no GradScaler (bf16 has fp32's
exponent range, so gradients do not underflow the way fp16's do).

Prints one line of JSON: {"torch": version, "threads": n, "autocast": "none"|"bf16", "blas": path,
"step_ms": [one time per timed step]}. "blas" is the file of the BLAS library the process has mapped (Debian's
torch calls the generic libblas.so.3, which is the slow reference BLAS unless libopenblas0-pthread is
installed), or "" if none is mapped.
Exit status 77 when PyTorch is missing (the import below tries Debian's /usr/bin/python3 first).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import pytorch_parity as ref  # noqa: E402  (exits 77 without torch)

torch = ref.torch


def loaded_blas():
    """The real path of the BLAS library mapped into this process (after a matmul has run), or ""."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return ""
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(("libblas.so", "libopenblas", "libblis", "libmkl_rt", "libmkl_core")):
            return os.path.realpath(path)
    return ""


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("heads", 4), ("width", 256), ("block", 128), ("batch", 16),
                          ("vocab", 65), ("threads", 2), ("warmup", 3), ("steps", 10)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="bf16: forward + loss under torch.autocast('cpu', dtype=torch.bfloat16)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    config = ref.Config({"n_layer": a.layers, "n_head": a.heads, "n_embd": a.width, "block_size": a.block,
                         "vocab_size": a.vocab})
    model = ref.GPT(config)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    times = []
    for step in range(a.warmup + a.steps):
        x = torch.randint(0, a.vocab, (a.batch, a.block))
        y = torch.randint(0, a.vocab, (a.batch, a.block))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if a.autocast == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "autocast": a.autocast,
                      "blas": loaded_blas(), "step_ms": times}))


if __name__ == "__main__":
    main()
