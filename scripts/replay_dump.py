#!/usr/bin/env python3
"""Replays a `porter train --dump-dir DIR` step in PyTorch and compares it with porter's.

Loads the parameters (as they were at the start of the dumped step) and every micro-batch,
computes the mean loss over the micro-batches with the reference GPT of
tests/reference/make_fixtures.py (dropout 0), runs backward, and prints the loss and the
largest gradient difference per tensor. Exits 1 when a difference exceeds --tol.

    /usr/bin/python3 scripts/replay_dump.py build/dump [--tol 1e-4]
"""
import argparse
import importlib.util
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def reference_model():
    path = os.path.join(HERE, "..", "tests", "reference", "make_fixtures.py")
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpt_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs gradient difference")
    args = ap.parse_args()
    d = args.dump_dir
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    model = m["model"]
    if model.get("dropout", 0.0) != 0.0:
        print("note: dropout > 0; porter's Philox masks are not reproduced here, expect differences")
    p = {t["name"]: torch.from_numpy(np.load(os.path.join(d, t["param"]))).double().requires_grad_()
         for t in m["tensors"]}
    gpt_loss = reference_model()
    loss = 0.0
    for b in m["batches"]:
        tokens = torch.from_numpy(np.load(os.path.join(d, b["tokens"]))).long()
        targets = torch.from_numpy(np.load(os.path.join(d, b["targets"]))).long()
        loss = loss + gpt_loss(p, tokens, targets, model["layers"], model["heads"],
                               model["tie_embeddings"]) / len(m["batches"])
    loss.backward()
    print(f"loss: porter {m['loss']:.6f}  pytorch {loss.item():.6f}")
    worst = 0.0
    for t in m["tensors"]:
        ours = np.load(os.path.join(d, t["grad"]))
        diff = float(np.max(np.abs(ours - p[t["name"]].grad.numpy())))
        worst = max(worst, diff)
        print(f"  {t['name']:<24} max |dgrad| {diff:.3e}")
    print(f"largest gradient difference: {worst:.3e} (tolerance {args.tol:g})")
    return 0 if worst <= args.tol and abs(loss.item() - m["loss"]) <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
