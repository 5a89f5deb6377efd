#!/usr/bin/python3
"""Reference fixtures for porter's GPT: the same pre-LN GPT in PyTorch, one forward and
backward on fixed tokens, with weights, loss and every parameter gradient saved as .npy.

Run with Debian's python3 (PyTorch 1.13 from the python3-torch package), not the pyenv
python3 first on PATH:

    /usr/bin/python3 tests/reference/make_fixtures.py [--out tests/nn/fixtures]

The script draws the weights itself (seeded), so porter reads them rather than reproducing
PyTorch's RNG. Each config directory holds:
    params/<name>.npy  f32 weights, named as porter's flat layout names them (docs/layers.md)
    grads/<name>.npy   f32 d(loss)/d(param)
    tokens.npy, targets.npy  (B, T) i32
    loss.npy           () f32, mean cross-entropy
tests/nn/gpt_reference_test.cc holds the same config table; keep them in sync.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

# name, layers, hidden, heads, seq_len, vocab, tied, batch
CONFIGS = [
    ("tied_l2_c32_h2_t16", 2, 32, 2, 16, 64, True, 2),
    ("untied_l2_c48_h4_t13", 2, 48, 4, 13, 67, False, 3),
]


def make_params(layers, c, t, v, tied, gen):
    """Weights in porter's layout order. LN weights and biases are randomised around their
    usual init so every gradient path is exercised."""
    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float() * std

    p = {"wte": normal(v, c), "wpe": normal(t, c)}
    for l in range(layers):
        h = f"h.{l}."
        p[h + "ln1.weight"] = 1.0 + normal(c, std=0.1)
        p[h + "ln1.bias"] = normal(c, std=0.1)
        p[h + "qkv.weight"] = normal(3 * c, c)
        p[h + "qkv.bias"] = normal(3 * c)
        p[h + "proj.weight"] = normal(c, c, std=0.02 / math.sqrt(2 * layers))
        p[h + "proj.bias"] = normal(c)
        p[h + "ln2.weight"] = 1.0 + normal(c, std=0.1)
        p[h + "ln2.bias"] = normal(c, std=0.1)
        p[h + "fc1.weight"] = normal(4 * c, c)
        p[h + "fc1.bias"] = normal(4 * c)
        p[h + "fc2.weight"] = normal(c, 4 * c, std=0.02 / math.sqrt(2 * layers))
        p[h + "fc2.bias"] = normal(c)
    p["lnf.weight"] = 1.0 + normal(c, std=0.1)
    p["lnf.bias"] = normal(c, std=0.1)
    if not tied:
        p["head.weight"] = normal(v, c)
    return p


def gpt_loss(p, tokens, targets, layers, heads, tied):
    b, t = tokens.shape
    c = p["wte"].shape[1]
    hs = c // heads
    x = p["wte"][tokens] + p["wpe"][:t]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for l in range(layers):
        h = f"h.{l}."
        a = F.layer_norm(x, (c,), p[h + "ln1.weight"], p[h + "ln1.bias"], eps=1e-5)
        qkv = F.linear(a, p[h + "qkv.weight"], p[h + "qkv.bias"])
        q, k, v = qkv.split(c, dim=2)
        q = q.view(b, t, heads, hs).transpose(1, 2)
        k = k.view(b, t, heads, hs).transpose(1, 2)
        v = v.view(b, t, heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + F.linear(y, p[h + "proj.weight"], p[h + "proj.bias"])
        a = F.layer_norm(x, (c,), p[h + "ln2.weight"], p[h + "ln2.bias"], eps=1e-5)
        a = F.gelu(F.linear(a, p[h + "fc1.weight"], p[h + "fc1.bias"]), approximate="tanh")
        x = x + F.linear(a, p[h + "fc2.weight"], p[h + "fc2.bias"])
    x = F.layer_norm(x, (c,), p["lnf.weight"], p["lnf.bias"], eps=1e-5)
    logits = F.linear(x, p["wte"] if tied else p["head.weight"])
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def save(path, array):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path, np.ascontiguousarray(array))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "nn", "fixtures"))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for i, (name, layers, c, heads, t, v, tied, b) in enumerate(CONFIGS):
        gen = torch.Generator().manual_seed(1000 + i)
        # f64 forward and backward: the fixture is then the exact gradient to ~1e-12, and the
        # test measures porter's f32 error alone.
        p = {k: w.double().requires_grad_(True) for k, w in make_params(layers, c, t, v, tied, gen).items()}
        tokens = torch.randint(0, v, (b, t), generator=gen)
        targets = torch.randint(0, v, (b, t), generator=gen)
        loss = gpt_loss(p, tokens, targets, layers, heads, tied)
        loss.backward()
        d = os.path.join(args.out, name)
        for k, w in p.items():
            # The weights porter reads are the f32 values; the f64 model ran on exactly those.
            save(os.path.join(d, "params", k + ".npy"), w.detach().float().numpy())
            save(os.path.join(d, "grads", k + ".npy"), w.grad.float().numpy())
        save(os.path.join(d, "tokens.npy"), tokens.int().numpy())
        save(os.path.join(d, "targets.npy"), targets.int().numpy())
        save(os.path.join(d, "loss.npy"), np.array(loss.item(), dtype=np.float32))
        print(f"{name}: loss {loss.item():.6f}, {len(p)} parameters -> {d}")


if __name__ == "__main__":
    main()
