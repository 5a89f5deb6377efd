#!/usr/bin/python3
"""torch.optim.AdamW's parameters per second on the problem that bench/cpu_adam_bench.cc
times porter's zero::CpuAdam on: 16M f32 parameters with f32 gradients and moments, lr 1e-3,
weight decay 0.01, no working copy, at a fixed thread count, with foreach=True (the
multi-tensor _foreach_ kernels) and foreach=False (the per-tensor loop). The parameters are
one flat tensor by default, as a ZeRO shard is; --tensors splits them into that many equal
tensors, where foreach's batching has something to batch.

Prints one JSON line per variant: the median step time of each repetition, their median,
parameters/s from that median, and the GB/s those would be at porter's 28 bytes per
parameter (PyTorch itself moves more: each of its elementwise passes reads and writes whole
tensors). Before timing, one step on a small tensor is checked against the AdamW formula in
float64.

Setup and run (Debian's python3 with python3-torch; the same thread count as the bench):
    apt-get install python3-torch
    /usr/bin/python3 bench/compare_adam_pytorch.py --threads 2
    ./build/release/bench/cpu_adam_bench --benchmark_repetitions=3 \\
        --benchmark_report_aggregates_only=true --benchmark_counters_tabular=true
"""
import argparse
import json
import statistics
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("compare_adam_pytorch.py needs PyTorch for Debian's python3: "
             "apt-get install python3-torch")

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28  # porter's count (Note [CpuAdam roofline] in zero/cpu_adam.h)


def check_one_step(foreach):
    """One AdamW step on 1000 elements against the formula in float64."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(1000, generator=gen)
    g = torch.randn(1000, generator=gen)
    ref_p = p.double().clone()
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                      foreach=foreach).step()
    gd = g.double()
    m = (1 - BETAS[0]) * gd
    v = (1 - BETAS[1]) * gd * gd
    ref_p = ref_p * (1 - LR * WEIGHT_DECAY)
    ref_p = ref_p - (LR / (1 - BETAS[0])) * m / (v.sqrt() / (1 - BETAS[1]) ** 0.5 + EPS)
    err = (param.detach().double() - ref_p).abs().max().item()
    if err > 1e-6:
        sys.exit(f"torch AdamW (foreach={foreach}) is {err} away from the formula")


def time_variant(params, tensors, foreach, steps, reps):
    """Median step time (s) of each repetition: a fresh optimizer, 2 warm-up steps, then
    `steps` timed ones."""
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    medians = []
    for rep in range(reps):
        gen = torch.Generator().manual_seed(rep)
        ps = []
        for n in sizes:
            p = torch.nn.Parameter(torch.rand(n, generator=gen) * 2 - 1)
            p.grad = torch.rand(n, generator=gen) * 2 - 1
            ps.append(p)
        opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                foreach=foreach)
        with torch.no_grad():
            for _ in range(2):
                opt.step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        del opt, ps
    return medians


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=16 << 20)
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    for foreach in (True, False):
        check_one_step(foreach)
        medians = time_variant(args.params, args.tensors, foreach, args.steps, args.reps)
        s = statistics.median(medians)
        print(json.dumps({
            "impl": "torch.optim.AdamW",
            "foreach": foreach,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "params": args.params,
            "tensors": args.tensors,
            "step_ms_per_rep": [round(m * 1e3, 3) for m in medians],
            "step_ms": round(s * 1e3, 3),
            "params_per_s": round(args.params / s),
            "gbps_at_28_bytes": round(args.params * BYTES_PER_PARAM / s / 1e9, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
