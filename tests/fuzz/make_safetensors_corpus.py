#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (tests/fuzz/safetensors_corpus):
small valid files (every porter dtype, F64, buffers, a scalar, an empty tensor, metadata) and
malformed ones (each breaking one rule of Note [Safetensors format] in io/weights_file.h).
Run it from anywhere; it rewrites the directory beside it."""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors_corpus")


def header_bytes(header):
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * ((8 - (8 + len(text)) % 8) % 8)


def file_bytes(tensors, metadata=None, length=None, pad=True):
    """tensors: [(name, dtype, shape, data bytes)] laid out in order."""
    header, data, at = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    text = header_bytes(header) if pad else json.dumps(header).encode()
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def raw(header_text, data=b"", length=None):
    text = header_text.encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def bf16(*v):
    return b"".join(struct.pack("<f", x)[2:] for x in v)


SEEDS = {
    "valid-gpt2-bare": file_bytes([
        ("wte.weight", "F32", [2, 2], f32(0.5, -1, 2, 0)),
        ("h.0.attn.c_attn.weight", "F32", [2, 6], f32(*range(12))),
        ("h.0.attn.bias", "F32", [1, 1, 2, 2], f32(1, 0, 1, 1)),
    ], {"format": "pt"}),
    "valid-bf16-f16-i32": file_bytes([
        ("transformer.ln_f.weight", "BF16", [3], bf16(1, 2, 3)),
        ("transformer.ln_f.bias", "F16", [2], struct.pack("<2e", 0.5, -0.25)),
        ("ids", "I32", [2], struct.pack("<2i", 7, -1)),
    ]),
    "valid-f64-bool-u8": file_bytes([
        ("model.norm.weight", "F64", [2], struct.pack("<2d", 1.0, 2.0)),
        ("mask", "BOOL", [3], b"\x01\x00\x01"),
        ("bytes", "U8", [1], b"\xff"),
    ]),
    "valid-scalar-empty": file_bytes([
        ("scalar", "F32", [], f32(3.0)),
        ("empty", "BF16", [0, 4], b""),
    ]),
    "valid-empty-header": file_bytes([], pad=False),
    "valid-unpadded": file_bytes([("a", "F32", [1], f32(1))], pad=False),
    "bad-short": b"\x05\x00\x00",
    "bad-length-past-file": raw("{}", length=1000),
    "bad-length-huge": raw("{}", length=1 << 40),
    "bad-not-json": raw("not json at all"),
    "bad-array-header": raw("[1, 2]"),
    "bad-metadata-number": raw('{"__metadata__":{"step":3}}'),
    "bad-dtype-unknown": raw('{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}', f32(1)),
    "bad-shape-negative": raw('{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', f32(1, 2)),
    "bad-shape-overflow": raw('{"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],'
                              '"data_offsets":[0,1]}}', b"\x00"),
    "bad-byte-count": raw('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', f32(1, 2)),
    "bad-offsets-past-end": raw('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32(1)),
    "bad-offsets-reversed": raw('{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}', f32(1, 2)),
    "bad-overlap": raw('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                       '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', f32(1, 2, 3)),
    "bad-gap": raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                   '"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', f32(1, 2, 3)),
    "bad-trailing": raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32(1, 2)),
    "bad-missing-fields": raw('{"a":{"dtype":"F32","shape":[1]}}', f32(1)),
    "bad-truncated-data": file_bytes([("a", "F32", [4], f32(1, 2, 3, 4))])[:-6],
}


def main():
    os.makedirs(HERE, exist_ok=True)
    for name in os.listdir(HERE):
        if name.startswith(("valid-", "bad-")):
            os.remove(os.path.join(HERE, name))
    for name, data in SEEDS.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
