#!/usr/bin/env python3
"""Tokenizes text files into token shards that `porter train` reads (porter.data.type "tokens").

Writes a train and a validation split, as llm.c .bin shards (a header of 256 int32: magic
20240520, version 1, token count; then uint16 tokens) or, with --nanogpt, as nanoGPT's raw
uint16 train.bin and val.bin. Standard library only. docs/data.md has the formats and commands.

The input: files, or directories read recursively in sorted order (hidden entries skipped),
concatenated as bytes in that order, as porter's text data reads them. The last
--val-fraction of the bytes (moved forward to the next newline, so no line is cut) is the
validation split.

Tokenizers (deterministic: the same input and flags give the same bytes):
  bytes  ids are the bytes, 0..255; vocab 256. Nothing to learn.
  bpe    byte-level byte-pair encoding learned on the train split up to --vocab ids:
         ids 0..255 are the bytes, id 256 + i is merge i, which joins two earlier ids. The
         text is first cut into chunks (a run of letters, of digits or of other non-space
         bytes, each with at most one leading space; or a run of whitespace) and merges never
         cross a chunk. Each merge joins the most frequent adjacent pair (ties: the smallest
         pair of ids). Encoding applies the merges in the order learned. Learning stops early
         when no pair occurs twice; the vocab written is then smaller than asked for.
The tokenizer goes to OUT/tokenizer.json ({"tokenizer", "vocab_size", "merges"}), with which
the ids decode back to the bytes. Set porter.model.vocab to at least its vocab_size.

    python3 scripts/write_token_shards.py data/shakespeare.txt --out data/tok
    python3 scripts/write_token_shards.py corpus/ --out data/bpe --tokenizer bpe --vocab 2048
    python3 scripts/write_token_shards.py corpus/ --out data/ng --nanogpt
"""
import argparse
import json
import os
import re
import struct
import sys
from array import array
from collections import Counter, defaultdict

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
HEADER_INTS = 256
MAX_VOCAB = 1 << 16  # uint16 ids

# A run of letters, digits or other non-space bytes with at most one leading space, or a run
# of whitespace (the trailing-space rule of GPT-2's pattern, simplified to ASCII classes).
CHUNK = re.compile(rb" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def list_files(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            if not found:
                sys.exit(f"error: the directory {p!r} holds no files")
            files += sorted(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            sys.exit(f"error: {p!r} does not exist")
    return files


def split(data, val_fraction):
    """The train and validation bytes: the last val_fraction, from the next newline on."""
    if not 0.0 < val_fraction < 1.0:
        sys.exit(f"error: --val-fraction {val_fraction}: must be between 0 and 1 (exclusive)")
    cut = int(len(data) * (1.0 - val_fraction))
    nl = data.find(b"\n", cut)
    if nl != -1 and nl + 1 < len(data):
        cut = nl + 1
    return data[:cut], data[cut:]


def learn_bpe(data, vocab):
    """Merges [(a, b), ...] learned on `data` until `vocab` ids (see the module's docstring)."""
    counts = Counter(CHUNK.findall(data))
    words = [list(w) for w in counts]
    freq = [counts[w] for w in counts]
    pairs = Counter()
    where = defaultdict(set)  # pair -> indices of the words that hold it
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pairs[pair] += freq[i]
            where[pair].add(i)
    merges = []
    while 256 + len(merges) < vocab and pairs:
        # Most frequent; ties go to the smallest pair of ids.
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        (a, b), new = best[0], 256 + len(merges)
        merges.append((a, b))
        for i in sorted(where.pop((a, b), ())):
            w = words[i]
            for pair in zip(w, w[1:]):
                pairs[pair] -= freq[i]
                if pairs[pair] <= 0:
                    del pairs[pair]
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for pair in zip(out, out[1:]):
                pairs[pair] += freq[i]
                where[pair].add(i)
    return merges


def make_encoder(merges):
    rank = {pair: i for i, pair in enumerate(merges)}
    cache = {}

    def encode_chunk(chunk):
        w = list(chunk)
        while len(w) > 1:
            # The earliest-learned merge among the adjacent pairs.
            best = min(zip(w, w[1:]), key=lambda p: rank.get(p, len(rank)))
            if best not in rank:
                break
            new, out, j = 256 + rank[best], [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            w = out
        return w

    def encode(data):
        ids = array("H")
        if not merges:
            ids.extend(data)
            return ids
        for chunk in CHUNK.findall(data):
            got = cache.get(chunk)
            if got is None:
                got = cache[chunk] = encode_chunk(chunk)
            ids.extend(got)
        return ids

    return encode


def decode(ids, merges):
    table = [bytes([i]) for i in range(256)]
    for a, b in merges:
        table.append(table[a] + table[b])
    return b"".join(table[i] for i in ids)


def to_le_bytes(ids):
    a = array("H", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def write_llmc(path, ids):
    with open(path, "wb") as f:
        header = [0] * HEADER_INTS
        header[0], header[1], header[2] = LLMC_MAGIC, LLMC_VERSION, len(ids)
        f.write(struct.pack("<256i", *header))
        f.write(to_le_bytes(ids))


def write_raw(path, ids):
    with open(path, "wb") as f:
        f.write(to_le_bytes(ids))


def shards_of(ids, shard_tokens):
    """Near-equal parts of at most shard_tokens each, so that no shard is a short tail."""
    n = len(ids)
    k = max(1, -(-n // shard_tokens))
    bounds = [n * i // k for i in range(k + 1)]
    return [ids[bounds[i]:bounds[i + 1]] for i in range(k)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files or directories")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    ap.add_argument("--vocab", type=int, default=None,
                    help="bpe: the vocab size to learn up to (257..65536); bytes: 256")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="the share of the bytes, from the end, that is the validation split")
    ap.add_argument("--nanogpt", action="store_true",
                    help="write nanoGPT's raw train.bin and val.bin instead of llm.c shards")
    ap.add_argument("--prefix", default="data",
                    help="llm.c shard names: PREFIX_train_000000.bin, PREFIX_val_000000.bin")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000,
                    help="llm.c: at most this many tokens per shard (default 100M, as llm.c)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="check that every shard holds at least SEQ_LEN + 1 tokens")
    args = ap.parse_args()

    if args.tokenizer == "bytes":
        if args.vocab not in (None, 256):
            sys.exit(f"error: --vocab {args.vocab}: the bytes tokenizer's vocab is 256; use "
                     "--tokenizer bpe for another size")
        vocab = 256
    else:
        vocab = args.vocab if args.vocab is not None else 512
        if not 256 < vocab <= MAX_VOCAB:
            sys.exit(f"error: --vocab {vocab}: bpe needs 257..{MAX_VOCAB} (ids are uint16)")
    if not 1 <= args.shard_tokens < 1 << 31:
        sys.exit(f"error: --shard-tokens {args.shard_tokens}: 1..2^31-1 (llm.c's count is int32)")

    files = list_files(args.inputs)
    data = b"".join(open(f, "rb").read() for f in files)
    train_bytes, val_bytes = split(data, args.val_fraction)
    if not train_bytes or not val_bytes:
        sys.exit(f"error: {len(data)} bytes of input are too few to split into train and "
                 f"validation with --val-fraction {args.val_fraction}")

    merges = learn_bpe(train_bytes, vocab) if args.tokenizer == "bpe" else []
    vocab_size = 256 + len(merges)
    encode = make_encoder(merges)
    train, val = encode(train_bytes), encode(val_bytes)
    # Every id decodes back to the bytes it came from.
    if decode(train, merges) != train_bytes or decode(val, merges) != val_bytes:
        sys.exit("error: the encoding does not decode back to the input (a bug in this script)")

    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.nanogpt:
        for name, ids in (("train.bin", train), ("val.bin", val)):
            write_raw(os.path.join(args.out, name), ids)
            written.append((name, len(ids)))
        train_glob, val_glob = "train.bin", "val.bin"
    else:
        for split_name, ids in (("train", train), ("val", val)):
            for i, part in enumerate(shards_of(ids, args.shard_tokens)):
                name = f"{args.prefix}_{split_name}_{i:06d}.bin"
                write_llmc(os.path.join(args.out, name), part)
                written.append((name, len(part)))
        train_glob, val_glob = f"{args.prefix}_train_*.bin", f"{args.prefix}_val_*.bin"
    with open(os.path.join(args.out, "tokenizer.json"), "w") as f:
        json.dump({"tokenizer": args.tokenizer, "vocab_size": vocab_size,
                   "merges": [list(m) for m in merges]}, f)
        f.write("\n")

    if args.tokenizer == "bpe" and vocab_size < vocab:
        print(f"note: bpe stopped at {vocab_size} ids (no pair occurs twice), not {vocab}")
    print(f"{len(data)} bytes from {len(files)} file(s) -> {len(train)} train and {len(val)} "
          f"validation tokens, vocab {vocab_size} ({args.tokenizer})")
    for name, n in written:
        print(f"  {os.path.join(args.out, name)}: {n} tokens")
        if args.seq_len is not None and n < args.seq_len + 1:
            sys.exit(f"error: {name} has {n} tokens, fewer than --seq-len + 1 = "
                     f"{args.seq_len + 1}; porter reads windows of seq_len + 1 tokens within a "
                     "shard: give more text, a larger --val-fraction or --shard-tokens")
    out = args.out.rstrip("/")
    print("porter config:")
    print(f'  "model": {{"vocab": {vocab_size}, ...}},')
    print(f'  "data": {{"type": "tokens", "paths": "{out}/{train_glob}", '
          f'"val_paths": "{out}/{val_glob}"}}')


if __name__ == "__main__":
    main()
