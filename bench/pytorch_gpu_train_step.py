#!/usr/bin/env python3
"""The PyTorch side of bench_gpu_train: times the GPT training step on a CUDA device in PyTorch, eager and
torch.compile, in several precisions.

    python3 bench/pytorch_gpu_train_step.py --layers 12 --heads 12 --width 768 --block 1024 --vocab 50304 \
        --batch 16 --warmup 3 --steps 20 [--modes eager_fp32,eager_tf32,eager_bf16,eager_fp16,compile_bf16] \
        [--attention sdpa|math] [--adamw fused|foreach|single] [--device 0]

The model is tests/pytorch_parity.py's nanoGPT GPT (layernorm with bias, fused qkv, exact GELU, tied
embeddings, no dropout), moved to cuda:N. Two changes, neither of which changes the math:
  * the position ids are made on the model's device (the parity script's forward makes them on the CPU);
  * --attention sdpa (the default) computes the causal attention with
    F.scaled_dot_product_attention(q, k, v, is_causal=True) (PyTorch's flash / memory-efficient kernels),
    like mixtape's fused causal attention; --attention math keeps the parity script's explicit
    masked-softmax attention (a [B, H, T, T] score matrix per layer).
The step is train_gpt's: forward, cross-entropy, backward, global gradient clipping at norm 1, AdamW (lr 1e-4,
betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on the >= 2-d parameters). --adamw picks the implementation:
fused (default: fused=True, one CUDA kernel for all parameters), foreach (foreach=True, PyTorch's CUDA
default), single (foreach=False, fused=False: a loop over the parameters).

Modes (the parameters, gradients and optimizer state stay fp32 in all of them):
  eager_fp32    plain fp32, torch.backends.cuda.matmul.allow_tf32 = False (cuDNN's off too)
  eager_tf32    fp32 with allow_tf32 = True for matmuls (and cuDNN)
  eager_bf16    forward + loss under torch.autocast("cuda", dtype=torch.bfloat16), no GradScaler
  eager_fp16    forward + loss under torch.autocast("cuda", dtype=torch.float16) with a GradScaler
                (init_scale 2^16: scale(loss).backward(), unscale_, clip, scaler.step, scaler.update)
  compile_bf16  eager_bf16 with the model wrapped in torch.compile(model) (default mode); the compilation
                happens during the warm-up steps
  eager_fp8     eager_bf16 with the transformer blocks' Linear layers in tensorwise fp8 (current scaling, E4M3
                activations and weights, E5M2 gradients): torchao's convert_to_float8_training where torchao
                imports, else torch._scaled_mm in a small autograd Function here (the "fp8" key says which).
                Needs an sm_89+ GPU; otherwise the mode reports why it did not run (an "error" line).
Timing: torch.cuda.synchronize(), then CUDA events recorded around the step (zero_grad .. optimizer step ..
loss.item(): the step ends with a host sync, as mixtape's train_step does), so the device is idle when each
step starts. Batches are uniform random tokens made on the GPU before the step. Peak memory:
torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats() at the end of the warm-up (live
tensors, not the caching allocator's reserve).

Prints one line of JSON per mode: {"torch", "device", "mode", "autocast", "compile", "grad_scaler",
"attention", "adamw", "step_ms": [one time per timed step], "peak_bytes", "skipped_steps"}, or
{"torch", "mode", "error"} when a mode fails (e.g. torch.compile without a working Triton); the other modes
still run.
Exit status 77 when PyTorch is missing or has no CUDA device.
"""
import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import pytorch_parity as ref  # noqa: E402  (exits 77 without torch)

torch = ref.torch
F = ref.F

MODES = ["eager_fp32", "eager_tf32", "eager_bf16", "eager_fp16", "compile_bf16", "eager_fp8"]


def quantize_tensorwise(t, dtype):
    # Current tensorwise scaling: codes of t * (fmax / amax), saturated; returns the codes and the decode scale.
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    codes = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return codes, scale.reciprocal()


def scaled_mm(a, b_t, scale_a, scale_b, out_dtype):
    # a [M, K] row-major @ b_t [K, N] column-major (the layout torch._scaled_mm needs); older PyTorch returns
    # (out, amax).
    out = torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


class ScaledMmLinear(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs on fp8 tensor cores (torch._scaled_mm), mixtape's fp8 recipe."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_tensorwise(x2, torch.float8_e4m3fn)
        wq, ws = quantize_tensorwise(weight, torch.float8_e4m3fn)
        y = scaled_mm(xq, wq.t(), xs, ws, torch.bfloat16)
        if bias is not None:
            y = y + bias.to(torch.bfloat16)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gq, gs = quantize_tensorwise(g2, torch.float8_e5m2)
        wtq, wts = quantize_tensorwise(weight.t().contiguous(), torch.float8_e4m3fn)
        dx = scaled_mm(gq, wtq.t(), gs, wts, torch.bfloat16)
        gtq, gts = quantize_tensorwise(g2.t().contiguous(), torch.float8_e5m2)
        xtq, xts = quantize_tensorwise(x2.t().contiguous(), torch.float8_e4m3fn)
        dw = scaled_mm(gtq, xtq.t(), gts, xts, torch.bfloat16)
        db = g2.float().sum(0) if ctx.has_bias else None
        return dx.view(ctx.x_shape).to(ctx.x_dtype), dw.to(weight.dtype), db


def convert_to_fp8(model):
    """The blocks' Linear layers in fp8; returns which implementation ("torchao" or "torch._scaled_mm")."""
    if torch.cuda.get_device_capability() < (8, 9):
        raise RuntimeError("fp8 tensor cores need sm_89 or newer; this GPU is sm_%d%d" %
                           torch.cuda.get_device_capability())
    try:
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn.startswith("transformer.h."))
        return "torchao"
    except ImportError:
        pass
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("neither torchao nor torch._scaled_mm in torch " + torch.__version__)
    for module in model.transformer.h.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = (lambda m: lambda x: ScaledMmLinear.apply(x, m.weight, m.bias))(module)
    return "torch._scaled_mm"


def sdpa_attention_forward(self, x):
    # The parity script's CausalSelfAttention.forward with the attention in one fused call.
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class CudaGPT(ref.GPT):
    def forward(self, idx, targets):
        # ref.GPT.forward with the positions on the input's device.
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.transformer.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make_grad_scaler():
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            return torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)
        except TypeError:
            pass
    return torch.cuda.amp.GradScaler(init_scale=2.0 ** 16)


def run_mode(mode, a, device):
    compiled = mode.startswith("compile_")
    precision = mode.split("_", 1)[1]
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision)
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32

    torch.manual_seed(1337)
    config = ref.Config({"n_layer": a.layers, "n_head": a.heads, "n_embd": a.width, "block_size": a.block,
                         "vocab_size": a.vocab})
    model = CudaGPT(config).to(device)
    model.train()
    fp8 = convert_to_fp8(model) if precision == "fp8" else None
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "single": {"foreach": False}}[a.adamw]
    adamw = a.adamw
    try:
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.99), eps=1e-8, **kwargs)
    except (TypeError, RuntimeError):  # AdamW(fused=True) needs PyTorch >= 2.0
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.99), eps=1e-8, foreach=True)
        adamw = "foreach (fused unavailable in this PyTorch)"
    if compiled and not hasattr(torch, "compile"):
        raise RuntimeError("torch.compile needs PyTorch >= 2.0")
    forward = torch.compile(model) if compiled else model
    scaler = make_grad_scaler() if precision == "fp16" else None
    params = list(model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast("cuda", dtype=autocast):
                loss = forward(x, y)
        else:
            loss = forward(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale  # the scale backs off exactly when the step was skipped
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            skipped = False
        loss.item()
        return skipped

    def batch():
        return (torch.randint(0, a.vocab, (a.batch, a.block), device=device),
                torch.randint(0, a.vocab, (a.batch, a.block), device=device))

    for _ in range(a.warmup):
        step(*batch())
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times, skipped = [], 0
    for _ in range(a.steps):
        x, y = batch()
        torch.cuda.synchronize(device)
        start.record()
        skipped += step(x, y)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    peak = torch.cuda.max_memory_allocated(device)
    result = {"mode": mode, "autocast": precision if autocast is not None else "none", "compile": compiled,
              "grad_scaler": scaler is not None, "attention": a.attention, "adamw": adamw, "step_ms": times,
              "peak_bytes": peak, "skipped_steps": skipped}
    if fp8 is not None:
        result["fp8"] = fp8
    del forward, model, opt, scaler, params
    return result


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 12), ("heads", 12), ("width", 768), ("block", 1024), ("batch", 16),
                          ("vocab", 50304), ("warmup", 3), ("steps", 20), ("device", 0)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    p.add_argument("--attention", choices=["sdpa", "math"], default="sdpa")
    p.add_argument("--adamw", choices=["fused", "foreach", "single"], default="fused")
    a = p.parse_args()
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (modes: {', '.join(MODES)})")
    if not torch.cuda.is_available():
        print("pytorch_gpu_train_step: SKIPPED: PyTorch sees no CUDA device (torch " + torch.__version__ + ")")
        sys.exit(77)
    if a.attention == "sdpa":
        if hasattr(F, "scaled_dot_product_attention"):
            ref.CausalSelfAttention.forward = sdpa_attention_forward
        else:  # PyTorch < 2.0
            a.attention = "math (no scaled_dot_product_attention in this PyTorch)"
    device = torch.device("cuda", a.device)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    for mode in modes:
        try:
            result = run_mode(mode, a, device)
        except Exception as e:  # a failing mode (torch.compile without Triton, out of memory) is reported
            result = {"mode": mode, "error": f"{type(e).__name__}: {e}".replace("\n", " ")[:2000]}
        result = {"torch": torch.__version__, "device": name, **result}
        print(json.dumps(result), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        if hasattr(torch, "_dynamo"):
            torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main()
