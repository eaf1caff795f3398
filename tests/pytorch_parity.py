#!/usr/bin/env python3
"""Parity of mixtape's GPT trainer (examples/train_gpt) with the same GPT written in PyTorch.

    python3 tests/pytorch_parity.py --train-gpt build/examples/train_gpt [--data FILE.txt] [--work DIR]

Two cases, each in fp32:
  mixtape-init  train_gpt --steps 0 --save initialises a model (nanoGPT's init: biases 0, norm weights 1);
                PyTorch loads that file.
  torch-init    this script draws every weight in PyTorch, biases and norm weights included (so their
                gradients matter), and writes the file that train_gpt --init loads.
In each case train_gpt --init runs 3 AdamW steps (--log-json, --save), and PyTorch runs the same 3 steps:
  * the step losses (step 1's is the loss of the initial weights: computed before any update) must agree
    with relative difference < 1e-5;
  * every weight of train_gpt's saved file must agree with PyTorch's after the 3 steps:
        max |w_mixtape - w_torch| < 1e-5, elementwise, for every tensor (absolute)
    The weights are O(0.02 .. 1) and the 3 steps move them by up to ~3e-3 (3 * lr), so this asks the two
    updates to agree to ~3e-3 of a step. A tensor-relative figure (max |diff| / max |w|) is printed too, for
    information only: it is not a sound pass criterion in fp32, because Adam divides each gradient by its own
    magnitude, so where a gradient is near zero, fp32 rounding noise (from different summation orders)
    becomes an O(lr * noise / (|g| + eps)) difference in the update.
    One exception: the key third of attn.c_attn.bias. Its true gradient is exactly zero (adding b to every
    key adds q . b to all of a query's scores, which softmax ignores), so both implementations update it by
    pure rounding noise normalised by Adam, i.e. by arbitrary amounts up to lr per step. For it the script
    checks the premise (its float64 gradient is < 1e-10 of the largest bias gradient) and that neither side
    moved it by more than 3 * lr; the q and v thirds are compared as above.
The batches follow optim/training.h's sequential formula, the vocabulary is the sorted set of bytes of the
data file (optim/training.h's char_tokens), and the optimizer is nanoGPT's: weight decay on parameters of
>= 2 dimensions only, gradient clipping at norm 1 before the step, constant lr.

Safetensors is read and written here by hand (struct + json): an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the raw little-endian data.

Exit status: 0 on parity, 1 with a report of the differences, 77 (CTest's skip) when torch is missing.
"""
import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    # Debian's python3-torch lives in the system interpreter's dist-packages; a python3 found first on PATH
    # (pyenv, a venv) may not see it, so try the system one before skipping.
    if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") \
            and not os.environ.get("PYTORCH_PARITY_REEXEC"):
        os.environ["PYTORCH_PARITY_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("pytorch_parity: SKIPPED: PyTorch is not installed (Debian: apt-get install python3-torch)")
    sys.exit(77)

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
STEPS = 3

# The trainer's options; the PyTorch side uses the same numbers.
MODEL = dict(layers=2, heads=2, width=32, block=16)
TRAIN = dict(batch=4, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0, seed=1337)
ADAM_EPS = 1e-8  # optim/training.cpp's AdamOptions eps


# ---- safetensors ----

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I32": torch.int32, "I64": torch.int64}
NAMES = {v: k for k, v in DTYPES.items()}


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        if end > begin:
            t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype)
        else:
            t = torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"]).clone()
    return tensors, metadata


def save_safetensors(path, tensors, metadata):
    header = {"__metadata__": dict(metadata)}
    chunks, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)  # data starts at a multiple of 8, as the reference writer
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)


# ---- the model: nanoGPT's model.py (pre-norm blocks, causal attention, GELU, tied embeddings) ----

class Config:
    def __init__(self, metadata):
        self.n_layer = int(metadata["n_layer"])
        self.n_head = int(metadata["n_head"])
        self.n_embd = int(metadata["n_embd"])
        self.block_size = int(metadata["block_size"])
        self.vocab_size = int(metadata["vocab_size"])
        self.bias = metadata.get("bias", "true") in ("true", "True", "1")
        self.tie = metadata.get("tie_embeddings", "true") in ("true", "True", "1")
        self.norm_eps = float(metadata.get("norm_eps", "1e-5"))
        self.dropout = float(metadata.get("dropout", "0"))
        norm = metadata.get("norm", "layernorm")
        activation = metadata.get("activation", "gelu")
        if norm != "layernorm" or activation not in ("gelu", "gelu_tanh") or self.dropout != 0:
            raise SystemExit(f"pytorch_parity: unsupported config (norm {norm}, activation {activation}, "
                             f"dropout {self.dropout}); this script covers nanoGPT's layernorm + GELU, no dropout")
        self.gelu = "tanh" if activation == "gelu_tanh" else "none"


class LayerNorm(nn.Module):
    def __init__(self, c, config):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c)) if config.bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        t = config.block_size
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.approximate = config.gelu
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config)))
        self.lm_head = None if config.tie else nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.transformer.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# ---- data: optim/training.h's char tokens and sequential batches ----

def char_tokens(path):
    with open(path, "rb") as f:
        raw = f.read()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    present = torch.zeros(256, dtype=torch.bool)
    present[data] = True
    vocab = present.nonzero().flatten()
    ids = torch.full((256,), -1, dtype=torch.long)
    ids[vocab] = torch.arange(len(vocab))
    return ids[data], [int(b) for b in vocab]


def batch(tokens, step, B, T):
    n_train = len(tokens) * 9 // 10
    span = n_train - T - 1
    rows = []
    for i in range(B):
        start = (((step * B + i) % span) * T) % span
        rows.append(tokens[start:start + T + 1])
    rows = torch.stack(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def write_generated_text(path):
    # A deterministic text with ~50 distinct bytes, when no data file is given.
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "To", "be", "or", "not",
             "question", "Whether", "nobler", "mind", "suffer", "slings", "arrows", "outrageous", "fortune!",
             "KING:", "Queen,", "why?", "42", "lords;", "exeunt."]
    rng = random.Random(2024)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(600)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ---- the comparison ----

def run(cmd):
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        print("pytorch_parity: FAILED: command exited with", result.returncode, ":\n  " + " ".join(cmd))
        print(result.stdout)
        sys.exit(1)
    return result.stdout


def model_tensors(tensors):
    return {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}


def torch_train(model, tokens, steps):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=TRAIN["lr"], betas=(TRAIN["beta1"], TRAIN["beta2"]), eps=ADAM_EPS)
    losses = []
    for step in range(steps):
        x, y = batch(tokens, step, TRAIN["batch"], model.config.block_size)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        losses.append(loss.item())
        loss.backward()
        if TRAIN["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        opt.step()
    return losses


def key_bias_gradient_is_zero(model, tokens):
    """The premise of the key-bias exception, checked: in float64 its gradient is zero to rounding."""
    double = GPT(model.config).double()
    double.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x, y = batch(tokens, 0, TRAIN["batch"], model.config.block_size)
    double(x, y).backward()
    C = model.config.n_embd
    failures = []
    for i, block in enumerate(double.transformer.h):
        g = block.attn.c_attn.bias.grad
        ratio = g[C:2 * C].abs().max().item() / g.abs().max().item()
        if not ratio < 1e-10:
            failures.append(f"h.{i}.attn.c_attn.bias: key-third gradient / largest bias gradient = {ratio:.3e} in "
                            f"float64, expected ~1e-16 (the key-bias exception's premise is wrong)")
    return failures


def check_case(name, init_path, tokens, args):
    tensors, metadata = load_safetensors(init_path)
    config = Config(metadata)
    model = GPT(config)
    model.load_state_dict(model_tensors(tensors), strict=True)
    premise = key_bias_gradient_is_zero(model, tokens) if config.bias else []

    prefix = os.path.join(args.work, name)
    run([args.train_gpt, "--data", args.data, "--init", init_path, "--steps", str(STEPS), "--sequential",
         "--batch", str(TRAIN["batch"]), "--lr", str(TRAIN["lr"]), "--min-lr", str(TRAIN["lr"]),
         "--schedule", "constant", "--warmup", "0", "--optimizer", "adamw",
         "--weight-decay", str(TRAIN["weight_decay"]), "--beta1", str(TRAIN["beta1"]),
         "--beta2", str(TRAIN["beta2"]), "--grad-clip", str(TRAIN["grad_clip"]), "--seed", str(TRAIN["seed"]),
         "--eval-every", "0", "--log-json", prefix + ".log.jsonl", "--save", prefix + ".after.safetensors"])
    with open(prefix + ".log.jsonl") as f:
        mixtape_losses = [json.loads(line)["loss"] for line in f if line.strip()]
    torch_losses = torch_train(model, tokens, STEPS)

    failures = premise
    print(f"[{name}] step losses (mixtape | torch | relative difference):")
    if len(mixtape_losses) != STEPS:
        failures.append(f"train_gpt logged {len(mixtape_losses)} steps, expected {STEPS}")
    for step, (a, b) in enumerate(zip(mixtape_losses, torch_losses)):
        rel = abs(a - b) / abs(b)
        print(f"  step {step + 1}: {a:.9f} | {b:.9f} | {rel:.3e}")
        if not rel < LOSS_RTOL:
            failures.append(f"loss of step {step + 1}: mixtape {a!r} vs torch {b!r} (relative {rel:.3e})")

    after, _ = load_safetensors(prefix + ".after.safetensors")
    after = model_tensors(after)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    if set(after) != set(expected):
        failures.append(f"tensor names differ: only mixtape {sorted(set(after) - set(expected))}, "
                        f"only torch {sorted(set(expected) - set(after))}")
    worst_abs, worst_rel = (None, 0.0), (None, 0.0)
    C = config.n_embd
    for key in sorted(set(after) & set(expected)):
        a, b = after[key].double(), expected[key].double()
        if a.shape != b.shape:
            failures.append(f"{key}: shape {list(a.shape)} vs torch {list(b.shape)}")
            continue
        if key.endswith("attn.c_attn.bias"):
            # The key third has an exactly-zero true gradient (see the docstring; checked in float64 by
            # key_bias_gradient_is_zero): both sides move it by amplified rounding noise, at most lr per step.
            start = tensors[key].double()[C:2 * C]
            bound = STEPS * TRAIN["lr"] * 1.01
            for side, w in (("mixtape", a), ("torch", b)):
                moved_k = (w[C:2 * C] - start).abs().max().item()
                if not moved_k <= bound:
                    failures.append(f"{key} (key third) moved {moved_k:.3e} in {side}, more than {STEPS} Adam "
                                    f"steps of lr can ({bound:.3e})")
            a, b = torch.cat([a[:C], a[2 * C:]]), torch.cat([b[:C], b[2 * C:]])
            key += " (q and v thirds)"
        absolute = (a - b).abs().max().item()
        relative = absolute / max(b.abs().max().item(), 1e-3)  # informational, see the docstring
        if absolute > worst_abs[1]:
            worst_abs = (key, absolute)
        if relative > worst_rel[1]:
            worst_rel = (key, relative)
        if not absolute < WEIGHT_ATOL:
            failures.append(f"weights of {key} after {STEPS} steps: max |difference| = {absolute:.3e} "
                            f"(max |difference| / max |weight| = {relative:.3e})")
    # How far the 3 steps moved the weights: parity must be much tighter than that.
    moved = max(((after[k].double() - tensors[k].double()).abs().max().item() for k in after if k in tensors),
                default=0.0)
    print(f"[{name}] weights after {STEPS} steps: worst max|diff| = {worst_abs[1]:.3e} ({worst_abs[0]}); "
          f"(info) worst max|diff|/max|w| = {worst_rel[1]:.3e} ({worst_rel[0]}); largest change made by the steps = "
          f"{moved:.3e}")
    if moved == 0.0:
        failures.append("the weights did not change during the steps (the comparison would be vacuous)")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-gpt", required=True, help="path to the train_gpt executable")
    parser.add_argument("--data", help=".txt file (default: a generated text in --work)")
    parser.add_argument("--work", default="pytorch_parity_work", help="directory for the files it writes")
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.work, exist_ok=True)
    if not args.data:
        args.data = os.path.join(args.work, "text.txt")
        write_generated_text(args.data)
    tokens, vocab = char_tokens(args.data)
    print(f"pytorch_parity: torch {torch.__version__}, data {args.data} ({len(tokens)} chars, vocab {len(vocab)})")

    # Case 1: mixtape initialises.
    init = os.path.join(args.work, "mixtape-init.safetensors")
    run([args.train_gpt, "--data", args.data, "--steps", "0", "--layers", str(MODEL["layers"]),
         "--heads", str(MODEL["heads"]), "--width", str(MODEL["width"]), "--block", str(MODEL["block"]),
         "--dropout", "0", "--seed", str(TRAIN["seed"]), "--save", init])
    tensors, metadata = load_safetensors(init)
    if json.loads(metadata["vocab"]) != vocab:
        print("pytorch_parity: FAILED: the file's vocab metadata differs from the sorted bytes of the data")
        return 1
    failures = check_case("mixtape-init", init, tokens, args)

    # Case 2: PyTorch initialises every tensor (non-trivial biases and norm weights), mixtape loads it.
    # Matrices have std 0.2 (pre-activations ~N(0, 1) at width 32, not nanoGPT's ~N(0, 0.1)) so the
    # nonlinearities work in their curved range: at nanoGPT's init exact and tanh GELU differ by < 1e-7 and
    # attention is nearly uniform, which would hide a wrong GELU or mask.
    torch.manual_seed(0)
    weights = {}
    for key, t in model_tensors(tensors).items():
        if key.endswith(".bias"):
            weights[key] = 0.1 * torch.randn(t.shape)
        elif t.dim() == 1:
            weights[key] = 1.0 + 0.1 * torch.randn(t.shape)
        else:
            weights[key] = 0.2 * torch.randn(t.shape)
    torch_init = os.path.join(args.work, "torch-init.safetensors")
    keep = {k: v for k, v in metadata.items() if not k.startswith("optimizer.")}
    save_safetensors(torch_init, weights, keep)
    failures += check_case("torch-init", torch_init, tokens, args)

    if failures:
        print("pytorch_parity: FAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print(f"pytorch_parity: PASSED (losses within {LOSS_RTOL:g} relative, weights after {STEPS} AdamW steps "
          f"within {WEIGHT_ATOL:g}, elementwise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
