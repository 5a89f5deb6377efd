#!/usr/bin/python3
"""PyTorch 1.13's time for the GPT step that bench/gpt_step_bench.cc times in porter: the
same pre-LN GPT (tied head, dropout 0, tanh GELU), same shapes, forward + backward, no
optimizer, at a fixed thread count, in f32 or (--dtype bf16) under
torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's counterpart of porter's bf16 step.
Prints one JSON line with the dtype and the median step time.

Run with Debian's python3 (python3-torch), e.g. through bench/compare_step.sh:
    OPENBLAS_CORETYPE=SkylakeX /usr/bin/python3 bench/compare_pytorch.py --threads 2 --dtype f32
PyTorch is run at its best: OPENBLAS_CORETYPE=SkylakeX is set before torch loads (without it
Debian's OpenBLAS picks a slow generic kernel on this CPU), grads are set to None between
steps rather than zeroed, and two warm-up steps run first. Its f32 matmuls call OpenBLAS;
under autocast its matmuls run in bf16 through its bundled oneDNN, whatever the BLAS, while
autocast keeps the ops on its f32 list (the loss among them) in f32.

Debian's torch calls whatever libblas.so.3 the alternatives system points to. With only
libblas3 installed that is the netlib reference BLAS (~25x slower); the script refuses to
run then: `apt-get install libopenblas0-pthread` first. It reports the library it found.
"""
import os

# Forced, not defaulted: this machine's shell exports OPENBLAS_CORETYPE=Haswell.
os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)

    def forward(self, x, mask):
        b, t, c = x.shape
        hs = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, hs).transpose(1, 2)
        k = k.view(b, t, self.heads, hs).transpose(1, 2)
        v = v.view(b, t, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, c, heads, t, v):
        super().__init__()
        self.wte = nn.Embedding(v, c)
        self.wpe = nn.Embedding(t, c)
        self.blocks = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.lnf = nn.LayerNorm(c)
        self.register_buffer("mask", ~torch.tril(torch.ones(t, t, dtype=torch.bool)))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:t]
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def blas_library():
    """The libblas.so.3 this process loaded (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line}
    return sorted(os.path.realpath(l) for l in libs)


def add_model_args(ap):
    """The thread count and the model shape, defaulting to the bench's GPT step model."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)


def main():
    ap = argparse.ArgumentParser(description="PyTorch GPT step time")
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="bf16: the step under torch.autocast(\"cpu\", dtype=torch.bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # loads the BLAS
    blas = blas_library()
    if not any("openblas" in l for l in blas):
        raise SystemExit(f"PyTorch is using {blas}, not OpenBLAS: apt-get install libopenblas0-pthread")
    torch.manual_seed(0)
    model = Gpt(args.layers, args.hidden, args.heads, args.seq_len, args.vocab)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    bf16 = args.dtype == "bf16"

    def step():
        for p in model.parameters():
            p.grad = None
        # Forward only under autocast, as PyTorch prescribes: backward runs each op in the
        # dtype its forward used.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens, targets)
        loss.backward()
        return loss.item()

    loss = step()
    if abs(loss - math.log(args.vocab)) > 0.5:
        raise SystemExit(f"loss of the untrained model {loss} is not ~ln(V)")
    step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({
        "framework": f"pytorch {torch.__version__}",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "blas": blas,
        "steps": args.steps,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": times,
        "loss": loss,
    }))


if __name__ == "__main__":
    main()
