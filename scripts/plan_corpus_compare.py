#!/usr/bin/env python3
"""Compares two folders written by scripts/plan_corpus.sh (two builds of porter).

A profiled plan carries times measured on this machine (each `*_s` field, the time fractions),
which differ between two runs of one binary; the rest of an answer (bytes, schedules, checks)
must not. Prints, for estimates and plans, how many answers are byte-identical and how many
are identical once the measured times are dropped, and names the others. A plan whose choice
depends on measured times (the optimal policy under a tight budget) can differ between two runs
of the same binary: run the corpus twice with the old binary to see which do.

  scripts/plan_corpus_compare.py OLD_DIR NEW_DIR

Exits 1 when an answer differs beyond its measured times, 2 on a usage error.
"""
import json
import os
import sys


def without_times(x):
    if isinstance(x, dict):
        return {k: without_times(v) for k, v in x.items()
                if not (k.endswith("_s") or "fraction" in k or k == "config")}
    if isinstance(x, list):
        return [without_times(v) for v in x]
    return x


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    old, new = sys.argv[1], sys.argv[2]
    names = sorted(set(os.listdir(old)) | set(os.listdir(new)))
    figures = {"estimate": [0, 0, 0], "plan": [0, 0, 0]}  # answers, byte-identical, same but times
    differ = []
    for name in names:
        kind = "estimate" if name.endswith(".estimate.json") else "plan"
        figures[kind][0] += 1
        a_path, b_path = os.path.join(old, name), os.path.join(new, name)
        if not (os.path.exists(a_path) and os.path.exists(b_path)):
            differ.append(f"{name}: only in {'old' if os.path.exists(a_path) else 'new'}")
            continue
        with open(a_path) as f:
            a = f.read()
        with open(b_path) as f:
            b = f.read()
        if a == b:
            figures[kind][1] += 1
            continue
        try:
            same = without_times(json.loads(a)) == without_times(json.loads(b))
        except json.JSONDecodeError:
            same = False
        if same:
            figures[kind][2] += 1
        else:
            differ.append(name)
    for kind, (n, identical, but_times) in figures.items():
        print(f"{kind}s: {n}, byte-identical {identical}, identical but for measured times "
              f"{but_times}, different {n - identical - but_times}")
    for name in differ:
        print(f"  differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
