#!/usr/bin/python3
"""PyTorch 1.13's torch.utils.checkpoint overhead on the GPT step of bench/checkpoint_bench.cc:
the model of bench/compare_pytorch.py (same shapes, tied head, dropout 0), a step of forward,
backward and AdamW, in three variants measured in one process, interleaved round by round so
that machine noise hits them alike:
  none   no checkpointing;
  full   every block wrapped in torch.utils.checkpoint.checkpoint;
  two    torch.utils.checkpoint.checkpoint_sequential over the blocks in 2 segments.
Prints one JSON line: each variant's median step time and its ratio to none.

Run with Debian's python3 (python3-torch), e.g. through bench/compare_checkpoint.sh.
"""
import os

os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"  # see bench/compare_pytorch.py

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_pytorch import Gpt, add_model_args, blas_library  # noqa: E402


class MaskedBlock(torch.nn.Module):
    """A block with the causal mask bound, so checkpoint_sequential can chain blocks."""

    def __init__(self, block, mask):
        super().__init__()
        self.block = block
        self.mask = mask

    def forward(self, x):
        return self.block(x, self.mask)


def forward(model, tokens, targets, mode):
    t = tokens.shape[1]
    mask = model.mask[:t, :t]
    x = model.wte(tokens) + model.wpe.weight[:t]
    if mode == "none":
        for blk in model.blocks:
            x = blk(x, mask)
    elif mode == "full":
        for blk in model.blocks:
            x = checkpoint(blk, x, mask)
    elif mode == "two":
        chain = torch.nn.Sequential(*[MaskedBlock(b, mask) for b in model.blocks])
        x = checkpoint_sequential(chain, 2, x)
    logits = F.linear(model.lnf(x), model.wte.weight)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def param_groups(model, weight_decay):
    """porter's default parameter groups (porter.optimizer.no_decay ["ndim<2", "wpe"]): only
    matrices decay, and not the position table."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("wpe.") else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main():
    ap = argparse.ArgumentParser(description="PyTorch torch.utils.checkpoint overhead")
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    blas = blas_library()
    if not any("openblas" in lib for lib in blas):
        raise SystemExit(f"PyTorch is using {blas}, not OpenBLAS: apt-get install libopenblas0-pthread")
    torch.manual_seed(0)
    model = Gpt(args.layers, args.hidden, args.heads, args.seq_len, args.vocab)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len))

    def step(mode):
        opt.zero_grad(set_to_none=True)
        loss = forward(model, tokens, targets, mode)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    modes = ["none", "full", "two"]
    for m in modes:  # warm-up
        step(m)
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            t0 = time.perf_counter()
            step(m)
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(json.dumps({
        "framework": f"pytorch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "blas": blas,
        "rounds": args.rounds,
        "median_s": med,
        "ratio_to_none": {m: med[m] / med["none"] for m in modes},
        "times_s": times,
    }))


if __name__ == "__main__":
    main()
