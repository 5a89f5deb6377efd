#!/usr/bin/python3
"""A PyTorch reference for Hugging Face's GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM) and
Qwen2 (Qwen2ForCausalLM, a Llama with biases on q_proj, k_proj and v_proj):
fixtures in Hugging Face's on-disk layout, a check of model directories porter exports, and
a replay of the steps porter dumps.

Run it with Debian's python3 and PyTorch (not the pyenv python3 first on PATH). On Debian 12:

    apt-get install python3-torch python3-numpy libopenblas0-pthread

    /usr/bin/python3 scripts/hf_reference.py fixtures [--out tests/nn/fixtures/hf]
    /usr/bin/python3 scripts/hf_reference.py check --model DIR --tokens tokens.npy \\
        [--targets targets.npy] [--logits logits.npy] [--tol 1e-5]
    /usr/bin/python3 scripts/hf_reference.py replay DUMP_DIR [--tol 1e-4]
    /usr/bin/python3 scripts/hf_reference.py selftest
    python3 scripts/hf_reference.py init --out DIR [--layers 4 --hidden 128 ...]

`init` writes a random Llama checkpoint (config.json and model.safetensors) with the standard
library alone, so it runs on a machine without PyTorch: the start of examples/llama-finetune.json.

The models follow transformers' modeling_gpt2.py, modeling_llama.py and modeling_qwen2.py (eager attention,
no dropout, no cache) and compute in float64. Neither transformers nor safetensors is needed:
the safetensors format (an 8-byte little-endian header length N, N bytes of JSON padded with
spaces so that 8 + N is a multiple of 8, then the raw little-endian tensor data) is read and
written here with struct and json. The loss is the mean token cross-entropy over all (B, T)
positions against explicit targets (no label shift, unlike transformers' labels=).

Relative differences are per tensor, max |ours - reference| / max |reference|, the measure of
tests/nn/gpt_reference_test.cc.
"""
import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile

try:  # every subcommand but init needs them; init runs without
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as _import_error:  # pragma: no cover - depends on the machine
    np = torch = F = None
    TORCH_MISSING = str(_import_error)
else:
    TORCH_MISSING = None
import random

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRANSFORMERS_VERSION = "4.46.3"  # the version whose save_pretrained output config.json mimics


class InputError(Exception):
    """Bad input (a file, a config, a flag): the message names it, the rule and the fix."""


# ---- the model's shape ------------------------------------------------------------------------

class Shape:
    """Everything the forward pass needs, whichever file it came from (config.json or a porter
    dump's manifest). arch is "gpt2", "llama" or "qwen2" (a Llama with q, k and v biases)."""

    def __init__(self, arch, layers, hidden, heads, vocab, tied, eps, kv_heads=None,
                 head_dim=None, intermediate=None, rope_theta=10000.0, positions=None,
                 attn_scale=True, attn_scale_by_layer=False):
        self.arch = arch
        self.layers, self.hidden, self.heads, self.vocab = layers, hidden, heads, vocab
        self.tied, self.eps = tied, eps
        self.kv_heads = kv_heads or heads
        self.head_dim = head_dim or hidden // heads
        default_inner = 4 * hidden if arch == "gpt2" else None
        self.intermediate = intermediate or default_inner
        self.rope_theta = rope_theta
        self.positions = positions
        self.attn_scale, self.attn_scale_by_layer = attn_scale, attn_scale_by_layer
        if arch == "gpt2" and hidden % heads != 0:
            raise InputError(f"n_embd {hidden} is not a multiple of n_head {heads}")
        if heads % self.kv_heads != 0:
            raise InputError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {self.kv_heads}; grouped-query attention "
                             "needs it")
        if arch != "gpt2" and self.head_dim % 2 != 0:
            raise InputError(f"head_dim {self.head_dim} is odd; rotary embeddings rotate pairs")

    def describe(self):
        s = (f"{self.arch}: {self.layers} layers, hidden {self.hidden}, heads {self.heads}")
        if self.arch != "gpt2":
            s += (f", kv_heads {self.kv_heads}, head_dim {self.head_dim}, intermediate "
                  f"{self.intermediate}, rope_theta {self.rope_theta:g}")
        else:
            s += f", n_positions {self.positions}"
        return s + f", vocab {self.vocab}, eps {self.eps:g}, {'tied' if self.tied else 'untied'}"


def shape_from_hf_config(cfg, where):
    """The Shape a transformers config.json describes; refuses what the reference does not do."""
    def need(key):
        if key not in cfg:
            raise InputError(f"{where}: no \"{key}\"; a {cfg.get('model_type')} config.json has it")
        return cfg[key]

    def refuse(key, ok, what):
        ok = ok if isinstance(ok, tuple) else (ok,)
        if key in cfg and cfg[key] is not None and cfg[key] not in ok:
            raise InputError(f"{where}: \"{key}\" is {json.dumps(cfg[key])}, but this reference "
                             f"implements only {' or '.join(json.dumps(v) for v in ok)} ({what})")

    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        refuse("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "the tanh GELU")
        return Shape("gpt2", need("n_layer"), need("n_embd"), need("n_head"), need("vocab_size"),
                     cfg.get("tie_word_embeddings", True), cfg.get("layer_norm_epsilon", 1e-5),
                     intermediate=cfg.get("n_inner"), positions=need("n_positions"),
                     attn_scale=cfg.get("scale_attn_weights", True),
                     attn_scale_by_layer=cfg.get("scale_attn_by_inverse_layer_idx", False))
    if model_type == "llama":
        refuse("hidden_act", "silu", "SwiGLU")
        refuse("attention_bias", False, "no biases")
        refuse("mlp_bias", False, "no biases")
        refuse("rope_scaling", None, "plain RoPE, no scaling")
        return Shape("llama", need("num_hidden_layers"), need("hidden_size"),
                     need("num_attention_heads"), need("vocab_size"),
                     cfg.get("tie_word_embeddings", False), cfg.get("rms_norm_eps", 1e-6),
                     kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                     intermediate=need("intermediate_size"),
                     rope_theta=cfg.get("rope_theta", 10000.0),
                     positions=cfg.get("max_position_embeddings"))
    if model_type == "qwen2":
        refuse("hidden_act", "silu", "SwiGLU")
        refuse("rope_scaling", None, "plain RoPE, no scaling")
        refuse("use_sliding_window", False, "full causal attention")
        return Shape("qwen2", need("num_hidden_layers"), need("hidden_size"),
                     need("num_attention_heads"), need("vocab_size"),
                     cfg.get("tie_word_embeddings", False), cfg.get("rms_norm_eps", 1e-6),
                     kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                     intermediate=need("intermediate_size"),
                     rope_theta=cfg.get("rope_theta", 10000.0),
                     positions=cfg.get("max_position_embeddings"))
    raise InputError(f"{where}: model_type {json.dumps(model_type)} is none of \"gpt2\", "
                     "\"llama\" and \"qwen2\"")


def hf_config(shape, torch_dtype):
    """config.json as transformers' save_pretrained writes it (sorted keys, indent 2): every
    field of the model's config class, and of PretrainedConfig only those that differ from its
    defaults, which is why a tied GPT-2 has no tie_word_embeddings (True is the default) and a
    Llama always has it (LlamaConfig's default is False). Dropout is 0, as in the reference."""
    s = shape
    if s.arch == "gpt2":
        cfg = {
            "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.0, "bos_token_id": s.vocab - 1, "embd_pdrop": 0.0,
            "eos_token_id": s.vocab - 1, "initializer_range": 0.02,
            "layer_norm_epsilon": s.eps, "model_type": "gpt2", "n_embd": s.hidden,
            "n_head": s.heads, "n_inner": None, "n_layer": s.layers, "n_positions": s.positions,
            "reorder_and_upcast_attn": False, "resid_pdrop": 0.0,
            "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
            "summary_activation": None, "summary_first_dropout": 0.0,
            "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
            "use_cache": True, "vocab_size": s.vocab,
        }
        if not s.tied:
            cfg["tie_word_embeddings"] = False
    elif s.arch == "qwen2":
        cfg = {
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": s.vocab - 2, "eos_token_id": s.vocab - 1, "hidden_act": "silu",
            "hidden_size": s.hidden, "initializer_range": 0.02,
            "intermediate_size": s.intermediate, "max_position_embeddings": s.positions,
            "max_window_layers": s.layers, "model_type": "qwen2",
            "num_attention_heads": s.heads, "num_hidden_layers": s.layers,
            "num_key_value_heads": s.kv_heads, "rms_norm_eps": s.eps, "rope_scaling": None,
            "rope_theta": float(s.rope_theta), "sliding_window": None,
            "tie_word_embeddings": s.tied, "use_cache": True, "use_sliding_window": False,
            "vocab_size": s.vocab,
        }
    else:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
            "head_dim": s.head_dim, "hidden_act": "silu", "hidden_size": s.hidden,
            "initializer_range": 0.02, "intermediate_size": s.intermediate,
            "max_position_embeddings": s.positions, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": s.heads, "num_hidden_layers": s.layers,
            "num_key_value_heads": s.kv_heads, "pretraining_tp": 1, "rms_norm_eps": s.eps,
            "rope_scaling": None, "rope_theta": float(s.rope_theta),
            "tie_word_embeddings": s.tied, "use_cache": True, "vocab_size": s.vocab,
        }
    cfg["torch_dtype"] = torch_dtype
    cfg["transformers_version"] = TRANSFORMERS_VERSION
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


# ---- safetensors ------------------------------------------------------------------------------

ST_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
TORCH_TO_ST = ({torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
                torch.float16: "F16"} if torch is not None else {})
ST_TO_TORCH_DTYPE_NAME = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def tensor_bytes(t):
    """A tensor's raw little-endian bytes, in its own dtype."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> torch tensor, written in its dtype. Data in name order, as safetensors
    lays out tensors of one dtype; the header is compact JSON padded with spaces to 8 bytes."""
    header = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        data = tensor_bytes(t)
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """name -> (float64 tensor, dtype string), checking the header against the file."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise InputError(f"{path}: {len(raw)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise InputError(f"{path}: header length {n} runs past the end of the {len(raw)}-byte file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: the header at bytes 8..{8 + n} is not JSON: {e}")
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        count = int(np.prod(shape)) if shape else 1
        if dtype not in ST_ITEMSIZE:
            raise InputError(f"{path}: tensor {name} has dtype {dtype}; expected one of "
                             f"{', '.join(ST_ITEMSIZE)}")
        if end > len(data) or end - begin != count * ST_ITEMSIZE[dtype]:
            raise InputError(f"{path}: tensor {name} {dtype} {shape} has data_offsets "
                             f"[{begin}, {end}], but needs {count * ST_ITEMSIZE[dtype]} bytes "
                             f"within the {len(data)}-byte data section")
        buf = data[begin:end]
        if dtype == "BF16":
            a = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(buf, {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8",
                                    "I32": "<i4", "U8": "u1", "BOOL": "u1"}[dtype])
        out[name] = (torch.from_numpy(a.astype(np.float64).reshape(shape)), dtype)
    return out


def load_hf_dir(d):
    """(Shape, name -> float64 tensor, set of stored dtypes) of a Hugging Face model directory:
    config.json and model.safetensors, or shards named by model.safetensors.index.json."""
    cfg_path = os.path.join(d, "config.json")
    if not os.path.exists(cfg_path):
        raise InputError(f"{d}: no config.json; a Hugging Face model directory has one")
    with open(cfg_path) as f:
        shape = shape_from_hf_config(json.load(f), cfg_path)
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(single):
        files = ["model.safetensors"]
    else:
        raise InputError(f"{d}: neither model.safetensors nor model.safetensors.index.json")
    weights, dtypes = {}, set()
    for name in files:
        for k, (t, dt) in read_safetensors(os.path.join(d, name)).items():
            weights[k] = t
            dtypes.add(dt)
    return shape, canonical_names(shape, weights, d), dtypes


# ---- names ------------------------------------------------------------------------------------
# The forward passes take Hugging Face's names as GPT2LMHeadModel and LlamaForCausalLM's state
# dicts spell them, with GPT-2's "transformer." prefix removed (the published gpt2 checkpoint
# has none) and Llama's "model." kept.

def gpt2_param_names(s):
    names = ["wte.weight", "wpe.weight"]
    for l in range(s.layers):
        h = f"h.{l}."
        names += [h + n for n in (
            "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]
    names += ["ln_f.weight", "ln_f.bias"]
    return names + ([] if s.tied else ["lm_head.weight"])


def llama_param_names(s):
    """Llama's names, and Qwen2's: the same with the q, k and v biases."""
    names = ["model.embed_tokens.weight"]
    qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    if s.arch == "qwen2":
        qkv = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
               "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")
    for l in range(s.layers):
        p = f"model.layers.{l}."
        names += [p + n for n in (
            ("input_layernorm.weight",) + qkv + (
                "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))]
    names += ["model.norm.weight"]
    return names + ([] if s.tied else ["lm_head.weight"])


def param_names(s):
    return gpt2_param_names(s) if s.arch == "gpt2" else llama_param_names(s)


def param_shapes(s):
    """HF layout: nn.Linear weights (out, in); GPT-2's Conv1D weights (in, out)."""
    c, v, f, d = s.hidden, s.vocab, s.intermediate, s.head_dim
    out = {}
    for name in param_names(s):
        leaf = re.sub(r"^(h|model\.layers)\.\d+\.", "", name)
        if s.arch == "gpt2":
            out[name] = {"wte.weight": (v, c), "wpe.weight": (s.positions, c),
                         "lm_head.weight": (v, c), "attn.c_attn.weight": (c, 3 * c),
                         "attn.c_attn.bias": (3 * c,), "attn.c_proj.weight": (c, c),
                         "mlp.c_fc.weight": (c, f), "mlp.c_fc.bias": (f,),
                         "mlp.c_proj.weight": (f, c)}.get(leaf, (c,))
        else:
            out[name] = {"model.embed_tokens.weight": (v, c), "lm_head.weight": (v, c),
                         "self_attn.q_proj.weight": (s.heads * d, c),
                         "self_attn.k_proj.weight": (s.kv_heads * d, c),
                         "self_attn.v_proj.weight": (s.kv_heads * d, c),
                         "self_attn.o_proj.weight": (c, s.heads * d),
                         "self_attn.q_proj.bias": (s.heads * d,),
                         "self_attn.k_proj.bias": (s.kv_heads * d,),
                         "self_attn.v_proj.bias": (s.kv_heads * d,),
                         "mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c),
                         "mlp.down_proj.weight": (c, f)}.get(leaf, (c,))
    return out


# Buffers some checkpoints carry and the model does not learn (GPT-2's causal mask and its
# masked_bias, old Llama exports' inv_freq).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def stored_name(name, prefixed):
    """The name in the file: GPT2LMHeadModel.save_pretrained puts GPT2Model's tensors under
    "transformer." and lm_head.weight beside them."""
    return "transformer." + name if prefixed and name != "lm_head.weight" else name


def canonical_names(s, weights, where):
    """Strips GPT-2's optional "transformer." prefix, drops buffers, and checks that every
    parameter is there with its shape and nothing else is."""
    if s.arch == "gpt2":
        weights = {k[len("transformer."):] if k.startswith("transformer.") else k: t
                   for k, t in weights.items()}
    weights = {k: t for k, t in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    if s.tied and "lm_head.weight" in weights:
        # Some exporters write the tied head as well; it must be the embedding itself.
        emb = weights["wte.weight" if s.arch == "gpt2" else "model.embed_tokens.weight"]
        if not torch.equal(weights.pop("lm_head.weight"), emb):
            raise InputError(f"{where}: tie_word_embeddings is true but lm_head.weight differs "
                             "from the embedding; set it false or drop lm_head.weight")
    want = param_shapes(s)
    missing = [k for k in want if k not in weights]
    extra = [k for k in weights if k not in want]
    if missing or extra:
        raise InputError(f"{where}: tensors do not match the config ({s.describe()}): missing "
                         f"{missing[:6]}, unexpected {extra[:6]}")
    for k, shp in want.items():
        if tuple(weights[k].shape) != shp:
            raise InputError(f"{where}: {k} has shape {list(weights[k].shape)}, the config "
                             f"implies {list(shp)}")
    return weights


# ---- the models -------------------------------------------------------------------------------

def gelu_new(x):
    """transformers' NewGELUActivation: the tanh approximation of GELU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def conv1d(x, w, b):
    """GPT-2's Conv1D: the weight is (in, out), so y = x @ W + b."""
    return x @ w + b


def causal_softmax(att):
    t = att.shape[-1]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def gpt2_logits(w, s, tokens):
    """GPT2LMHeadModel's forward; tokens (B, T) -> logits (B, T, V)."""
    b, t = tokens.shape
    c, nh = s.hidden, s.heads
    hd = c // nh
    if t > s.positions:
        raise InputError(f"sequence length {t} exceeds n_positions {s.positions}")
    x = w["wte.weight"][tokens] + w["wpe.weight"][torch.arange(t)]  # (B, T, C)
    for l in range(s.layers):
        h = f"h.{l}."
        a = F.layer_norm(x, (c,), w[h + "ln_1.weight"], w[h + "ln_1.bias"], s.eps)
        q, k, v = conv1d(a, w[h + "attn.c_attn.weight"], w[h + "attn.c_attn.bias"]).split(c, 2)
        q, k, v = (z.view(b, t, nh, hd).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        att = q @ k.transpose(-2, -1)
        if s.attn_scale:
            att = att / math.sqrt(hd)
        if s.attn_scale_by_layer:
            att = att / float(l + 1)
        y = (causal_softmax(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + conv1d(y, w[h + "attn.c_proj.weight"], w[h + "attn.c_proj.bias"])
        a = F.layer_norm(x, (c,), w[h + "ln_2.weight"], w[h + "ln_2.bias"], s.eps)
        a = gelu_new(conv1d(a, w[h + "mlp.c_fc.weight"], w[h + "mlp.c_fc.bias"]))
        x = x + conv1d(a, w[h + "mlp.c_proj.weight"], w[h + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (c,), w["ln_f.weight"], w["ln_f.bias"], s.eps)
    return x @ (w["wte.weight"] if s.tied else w["lm_head.weight"]).t()


def rms_norm(x, weight, eps):
    """LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight (transformers upcasts to f32; here
    everything is f64 already)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(t, d, theta):
    """cos and sin (T, D) of position * inv_freq, the frequencies repeated for both halves as
    transformers' emb = cat(freqs, freqs). transformers forms the angles in f32; these are the
    exact ones."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # (D/2,)
    freqs = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D): query head h reads kv head h // n_rep."""
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


def llama_logits(w, s, tokens):
    """LlamaForCausalLM's forward (and Qwen2ForCausalLM's, whose q, k and v have biases);
    tokens (B, T) -> logits (B, T, V)."""
    b, t = tokens.shape
    nh, nkv, d = s.heads, s.kv_heads, s.head_dim
    cos, sin = rope_cos_sin(t, d, s.rope_theta)  # (T, D), broadcast over (B, H)
    x = w["model.embed_tokens.weight"][tokens]  # (B, T, C)
    for l in range(s.layers):
        p = f"model.layers.{l}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], s.eps)
        def proj(n):
            return F.linear(a, w[p + f"self_attn.{n}.weight"], w.get(p + f"self_attn.{n}.bias"))
        q = proj("q_proj").view(b, t, nh, d).transpose(1, 2)
        k = proj("k_proj").view(b, t, nkv, d).transpose(1, 2)
        v = proj("v_proj").view(b, t, nkv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
        att = causal_softmax(q @ k.transpose(-2, -1) / math.sqrt(d))  # (B, H, T, T)
        y = (att @ v).transpose(1, 2).reshape(b, t, nh * d)
        x = x + F.linear(y, w[p + "self_attn.o_proj.weight"])
        a = rms_norm(x, w[p + "post_attention_layernorm.weight"], s.eps)
        gate = F.linear(a, w[p + "mlp.gate_proj.weight"])
        up = F.linear(a, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
    x = rms_norm(x, w["model.norm.weight"], s.eps)
    return F.linear(x, w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"])


def logits_of(w, s, tokens):
    return (gpt2_logits if s.arch == "gpt2" else llama_logits)(w, s, tokens)


def mean_loss(logits, targets):
    """Mean token cross-entropy over all (B, T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rel_diff(got, want):
    """max |got - want| / max |want| over a tensor (the absolute difference if want is 0)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise InputError(f"shapes differ: {list(got.shape)} vs the reference's {list(want.shape)}")
    ref = float(np.max(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(got - want))) if want.size else 0.0
    return diff / ref if ref > 0 else diff


# ---- porter's names ---------------------------------------------------------------------------
# porter's GPT keeps every linear weight as nn.Linear's (out, in), the transpose of GPT-2's
# Conv1D; its Llama uses the HF names without "model.". These build the HF dict from porter's
# tensors with differentiable ops, so gradients land on porter's tensors in porter's layout.

GPT2_FROM_PORTER = [  # (porter suffix, HF suffix, transposed)
    ("ln1.weight", "ln_1.weight", False), ("ln1.bias", "ln_1.bias", False),
    ("qkv.weight", "attn.c_attn.weight", True), ("qkv.bias", "attn.c_attn.bias", False),
    ("proj.weight", "attn.c_proj.weight", True), ("proj.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False), ("ln2.bias", "ln_2.bias", False),
    ("fc1.weight", "mlp.c_fc.weight", True), ("fc1.bias", "mlp.c_fc.bias", False),
    ("fc2.weight", "mlp.c_proj.weight", True), ("fc2.bias", "mlp.c_proj.bias", False),
]
GPT2_TOP = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf.weight": "ln_f.weight",
            "lnf.bias": "ln_f.bias", "head.weight": "lm_head.weight"}


def hf_name_of_porter(arch, name):
    """(HF name, transposed) for a porter parameter name."""
    if arch in ("llama", "qwen2"):
        return (name if name == "lm_head.weight" else "model." + name), False
    if name in GPT2_TOP:
        return GPT2_TOP[name], False
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "h":
        for ours, theirs, transposed in GPT2_FROM_PORTER:
            if parts[2] == ours:
                return f"h.{parts[1]}.{theirs}", transposed
    raise InputError(f"porter parameter {name} has no GPT-2 counterpart (docs/layers.md names "
                     "them)")


def hf_from_porter(arch, params):
    out = {}
    for name, t in params.items():
        hf, transposed = hf_name_of_porter(arch, name)
        out[hf] = t.t() if transposed else t
    return out


def shape_from_manifest(model, params):
    """A porter dump's porter.model, with the widths the parameters themselves show."""
    arch = model.get("arch", model.get("type", "gpt"))
    heads = model["heads"]
    if arch == "gpt":
        return Shape("gpt2", model["layers"], model["hidden"], heads, model["vocab"],
                     model["tie_embeddings"], model.get("norm_eps", 1e-5),
                     positions=params["wpe"].shape[0])
    if arch in ("llama", "qwen2"):
        inter = params["layers.0.mlp.gate_proj.weight"].shape[0]
        if model.get("intermediate", 0) not in (0, inter):
            raise InputError(f"manifest model.intermediate {model['intermediate']} differs from "
                             f"layers.0.mlp.gate_proj.weight's {inter} rows")
        return Shape(arch, model["layers"], model["hidden"], heads, model["vocab"],
                     model["tie_embeddings"], model.get("norm_eps", 1e-5),
                     kv_heads=model.get("kv_heads", 0) or heads, intermediate=inter,
                     rope_theta=model.get("rope_theta", 10000.0), positions=model.get("seq_len"))
    raise InputError(f"manifest model.arch {json.dumps(arch)} is none of \"gpt\", \"llama\" and "
                     "\"qwen2\"")


# ---- fixtures ---------------------------------------------------------------------------------

# name, Shape arguments, GPT-2 naming ("bare" with the attn.bias buffers as in the published
# gpt2 checkpoint, "prefixed" as GPT2LMHeadModel.save_pretrained writes it), stored dtype, B, T
FIXTURES = [
    ("gpt2_bare_tied", dict(arch="gpt2", layers=2, hidden=32, heads=2, vocab=64, tied=True,
                            eps=1e-5, positions=16), "bare", "float32", 2, 16),
    ("gpt2_prefixed_untied", dict(arch="gpt2", layers=2, hidden=48, heads=4, vocab=67,
                                  tied=False, eps=1e-5, positions=24), "prefixed",
     "float32", 3, 13),
    ("llama_gqa_tied", dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2,
                            intermediate=88, vocab=64, tied=True, eps=1e-5, rope_theta=10000.0,
                            positions=64), None, "float32", 2, 16),
    ("llama_mha_untied_theta", dict(arch="llama", layers=2, hidden=48, heads=4, kv_heads=4,
                                    intermediate=128, vocab=70, tied=False, eps=1e-6,
                                    rope_theta=500000.0, positions=64), None, "float32", 2, 13),
    ("llama_gqa_bf16", dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=1,
                            intermediate=88, vocab=64, tied=True, eps=1e-5, rope_theta=10000.0,
                            positions=64), None, "bfloat16", 1, 9),
    ("qwen2_gqa_untied", dict(arch="qwen2", layers=2, hidden=32, heads=4, kv_heads=2,
                              intermediate=88, vocab=64, tied=False, eps=1e-6,
                              rope_theta=1000000.0, positions=64), None, "float32", 2, 16),
    ("qwen2_mha_tied", dict(arch="qwen2", layers=2, hidden=48, heads=4, kv_heads=4,
                            intermediate=128, vocab=70, tied=True, eps=1e-6,
                            rope_theta=10000.0, positions=64), None, "float32", 2, 13),
]


def draw_params(s, gen, std=0.02):
    """f64 draws: norm weights 1 + N(0, 0.1), biases N(0, 0.1), matrices N(0, std) (GPT-2's
    residual projections std / sqrt(2 L), as its init scales them). Biases and norms are not at
    their usual init so that every gradient path carries signal."""
    p = {}
    for name, shp in param_shapes(s).items():
        z = torch.randn(*shp, generator=gen, dtype=torch.float64)
        if len(shp) == 1 and ("ln" in name or "norm" in name) and name.endswith("weight"):
            p[name] = 1.0 + 0.1 * z
        elif len(shp) == 1:
            p[name] = 0.1 * z
        elif s.arch == "gpt2" and name.endswith("c_proj.weight"):
            p[name] = std / math.sqrt(2 * s.layers) * z
        else:
            p[name] = std * z
    return p


def forward_backward(w, s, tokens, targets):
    """(logits, loss, grads) in f64, w being f64 leaves."""
    w = {k: t.detach().clone().requires_grad_(True) for k, t in w.items()}
    logits = logits_of(w, s, tokens)
    loss = mean_loss(logits, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {k: t.grad for k, t in w.items()}


def save_npy(path, array):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # np.ascontiguousarray would make a () loss (1,); np.require keeps 0-d arrays 0-d.
    np.save(path, np.require(array, requirements="C"))


def write_fixture(out, i, name, kwargs, naming, dtype, b, t):
    s = Shape(**kwargs)
    gen = torch.Generator().manual_seed(3000 + i)
    stored = {k: v.to(dtype) for k, v in draw_params(s, gen).items()}
    tokens = torch.randint(0, s.vocab, (b, t), generator=gen)
    targets = torch.randint(0, s.vocab, (b, t), generator=gen)
    # The reference runs on the stored (rounded) values, widened exactly to f64.
    logits, loss, grads = forward_backward({k: v.double() for k, v in stored.items()}, s,
                                           tokens, targets)
    d = os.path.join(out, name)
    if os.path.isdir(d):
        shutil.rmtree(d)  # no stale grads/ files from an earlier shape
    os.makedirs(d)
    prefixed = naming == "prefixed"
    files = {stored_name(k, prefixed): v for k, v in stored.items()}
    if naming == "bare":
        # GPT-2's causal mask buffer, (1, 1, n_positions, n_positions), as older transformers
        # saved it and the published gpt2 checkpoint still carries it.
        mask = torch.tril(torch.ones(s.positions, s.positions)).view(1, 1, s.positions, s.positions)
        for l in range(s.layers):
            files[f"h.{l}.attn.bias"] = mask.to(dtype)
    write_safetensors(os.path.join(d, "model.safetensors"), files)
    config = hf_config(s, ST_TO_TORCH_DTYPE_NAME[TORCH_TO_ST[dtype]])
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(config)
    cfg = json.loads(config)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write(json.dumps({"_from_model_config": True, "bos_token_id": cfg["bos_token_id"],
                            "eos_token_id": cfg["eos_token_id"],
                            "transformers_version": TRANSFORMERS_VERSION}, indent=2,
                           sort_keys=True) + "\n")
    save_npy(os.path.join(d, "tokens.npy"), tokens.numpy().astype(np.int32))
    save_npy(os.path.join(d, "targets.npy"), targets.numpy().astype(np.int32))
    save_npy(os.path.join(d, "logits.npy"), logits.numpy().astype(np.float32))
    save_npy(os.path.join(d, "loss.npy"), np.array(loss.item(), dtype=np.float32))
    for k, g in grads.items():
        save_npy(os.path.join(d, "grads", stored_name(k, prefixed) + ".npy"),
                 g.numpy().astype(np.float32))
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    print(f"{name}: {s.describe()}, {TORCH_TO_ST[dtype]}, B={b} T={t}: loss {loss.item():.6f}, "
          f"{len(grads)} parameters, {size / 1024:.0f} KiB -> {d}")


def cmd_fixtures(args):
    torch.use_deterministic_algorithms(True)
    for i, (name, kwargs, naming, dtype_name, b, t) in enumerate(FIXTURES):
        dtype = getattr(torch, dtype_name)
        write_fixture(args.out, i, name, kwargs, naming, dtype, b, t)
    return 0


# ---- check ------------------------------------------------------------------------------------

def load_int_npy(path, what):
    a = np.load(path)
    if a.dtype.kind not in "iu":
        raise InputError(f"{path}: {what} must be integers, got {a.dtype}")
    a = torch.from_numpy(a.astype(np.int64))
    return a[None] if a.dim() == 1 else a


def run_check(model_dir, tokens_path, targets_path=None, logits_path=None, tol=1e-5):
    s, w, dtypes = load_hf_dir(model_dir)
    tokens = load_int_npy(tokens_path, "tokens")
    if tokens.dim() != 2 or tokens.min() < 0 or tokens.max() >= s.vocab:
        raise InputError(f"{tokens_path}: tokens must be (B, T) in [0, {s.vocab}); got shape "
                         f"{list(tokens.shape)}, range [{tokens.min()}, {tokens.max()}]")
    print(f"{model_dir}: {s.describe()}, stored {'/'.join(sorted(dtypes))}, "
          f"tokens {list(tokens.shape)}")
    with torch.no_grad():
        logits = logits_of(w, s, tokens)
    ok = True
    if targets_path:
        targets = load_int_npy(targets_path, "targets")
        print(f"loss {mean_loss(logits, targets).item():.8f}")
    if logits_path:
        err = rel_diff(np.load(logits_path), logits.numpy())
        ok = err <= tol
        print(f"logits: largest relative difference {err:.3e} (tolerance {tol:g})"
              f"{'' if ok else '  FAIL'}")
    return ok


def cmd_check(args):
    return 0 if run_check(args.model, args.tokens, args.targets, args.logits, args.tol) else 1


# ---- replay -----------------------------------------------------------------------------------

def run_replay(d, tol=1e-4, quiet=False):
    """(reference loss, porter loss, worst relative gradient difference) of a porter dump."""
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    model = m["model"]
    if model.get("dropout", 0.0) != 0.0:
        raise InputError(f"{d}/manifest.json: model.dropout is {model['dropout']}; porter's "
                         "Philox masks are not reproduced here, so replay only runs with "
                         "porter.model.dropout 0")
    p = {t["name"]: torch.from_numpy(np.load(os.path.join(d, t["param"])).astype(np.float64))
         .requires_grad_(True) for t in m["tensors"]}
    s = shape_from_manifest(model, p)
    w = canonical_names(s, hf_from_porter("gpt" if s.arch == "gpt2" else s.arch, p),
                        os.path.join(d, "params"))
    loss = 0.0
    for b in m["batches"]:
        tokens = load_int_npy(os.path.join(d, b["tokens"]), "tokens")
        targets = load_int_npy(os.path.join(d, b["targets"]), "targets")
        loss = loss + mean_loss(logits_of(w, s, tokens), targets) / len(m["batches"])
    loss.backward()
    say = (lambda *a: None) if quiet else print
    say(f"{d}: {s.describe()}, {len(m['batches'])} micro-batches, compute {m.get('compute_dtype')}")
    say(f"loss: porter {m['loss']:.8f}  reference {loss.item():.8f}  "
        f"relative difference {abs(m['loss'] - loss.item()) / abs(loss.item()):.3e}")
    worst, worst_name = 0.0, None
    for t in m["tensors"]:
        err = rel_diff(np.load(os.path.join(d, t["grad"])), p[t["name"]].grad.numpy())
        if err >= worst:
            worst, worst_name = err, t["name"]
        say(f"  {t['name']:<36} {str(t['shape']):<14} relative gradient difference {err:.3e}")
    say(f"largest relative gradient difference {worst:.3e} ({worst_name}), tolerance {tol:g}")
    return loss.item(), m["loss"], worst


def cmd_replay(args):
    ref, ours, worst = run_replay(args.dump_dir, args.tol)
    return 0 if worst <= args.tol and abs(ref - ours) <= args.tol * abs(ref) else 1


# ---- selftest ---------------------------------------------------------------------------------

def naive_llama_logits(w, s, tokens):
    """A second Llama, written differently: rotary as complex multiplication of the pairs
    (x[i], x[i + D/2]), attention head by head with kv head h // (H / Hkv), explicit norms."""
    b, t = tokens.shape
    nh, nkv, d = s.heads, s.kv_heads, s.head_dim
    theta = torch.tensor([s.rope_theta ** (-2.0 * i / d) for i in range(d // 2)],
                         dtype=torch.float64)
    rot = torch.polar(torch.ones(t, d // 2, dtype=torch.float64),
                      torch.arange(t, dtype=torch.float64)[:, None] * theta)  # (T, D/2)

    def rope(z):  # (B, T, D)
        zc = torch.complex(z[..., : d // 2], z[..., d // 2:]) * rot
        return torch.cat((zc.real, zc.imag), dim=-1)

    def norm(x, g):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + s.eps) * g

    x = w["model.embed_tokens.weight"][tokens]
    for l in range(s.layers):
        p = f"model.layers.{l}."
        a = norm(x, w[p + "input_layernorm.weight"])
        q = a @ w[p + "self_attn.q_proj.weight"].t()
        k = a @ w[p + "self_attn.k_proj.weight"].t()
        v = a @ w[p + "self_attn.v_proj.weight"].t()
        outs = []
        for h in range(nh):
            g = h // (nh // nkv)
            qh, kh = rope(q[..., h * d:(h + 1) * d]), rope(k[..., g * d:(g + 1) * d])
            sc = torch.einsum("bid,bjd->bij", qh, kh) / math.sqrt(d)
            sc = sc + torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)
            outs.append(torch.softmax(sc, -1) @ v[..., g * d:(g + 1) * d])
        x = x + torch.cat(outs, -1) @ w[p + "self_attn.o_proj.weight"].t()
        a = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = a @ w[p + "mlp.gate_proj.weight"].t()
        x = x + (gate * torch.sigmoid(gate) * (a @ w[p + "mlp.up_proj.weight"].t())) @ \
            w[p + "mlp.down_proj.weight"].t()
    x = norm(x, w["model.norm.weight"])
    return x @ (w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"]).t()


def make_fixtures_module():
    path = os.path.join(REPO, "tests", "reference", "make_fixtures.py")
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def porter_from_hf_gpt2(w):
    out = {}
    for porter, hf in GPT2_TOP.items():
        if hf in w:
            out[porter] = w[hf]
    for k, t in w.items():
        if k.startswith("h."):
            l, rest = k.split(".", 2)[1:]
            for ours, theirs, transposed in GPT2_FROM_PORTER:
                if rest == theirs:
                    out[f"h.{l}.{ours}"] = t.t() if transposed else t
    return out


def write_dump(d, arch, s, params_hf, grads_hf, micro, loss):
    """A porter-format dump of a fixture, for replaying the fixture through porter's names."""
    def to_porter(w):
        if arch == "gpt":
            return porter_from_hf_gpt2(w)
        return {k[len("model."):] if k.startswith("model.") else k: v for k, v in w.items()}

    params, grads = to_porter(params_hf), to_porter(grads_hf)
    tensors, batches = [], []
    for name, t in params.items():
        save_npy(os.path.join(d, "params", name + ".npy"), t.numpy().astype(np.float32))
        save_npy(os.path.join(d, "grads", name + ".npy"), grads[name].numpy().astype(np.float32))
        tensors.append({"name": name, "shape": list(t.shape), "param": f"params/{name}.npy",
                        "grad": f"grads/{name}.npy"})
    for i, (tok, tgt) in enumerate(micro):
        save_npy(os.path.join(d, "batch", f"tokens_{i}.npy"), tok.numpy().astype(np.int32))
        save_npy(os.path.join(d, "batch", f"targets_{i}.npy"), tgt.numpy().astype(np.int32))
        batches.append({"tokens": f"batch/tokens_{i}.npy", "targets": f"batch/targets_{i}.npy",
                        "shape": list(tok.shape)})
    model = {"arch": arch, "layers": s.layers, "hidden": s.hidden, "heads": s.heads,
             "kv_heads": 0 if s.kv_heads == s.heads else s.kv_heads,
             "intermediate": 0, "norm_eps": s.eps, "rope_theta": s.rope_theta, "vocab": s.vocab,
             "tie_embeddings": s.tied, "seq_len": micro[0][0].shape[1], "dropout": 0.0,
             "max_positions": s.positions if arch == "gpt" else 0}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"format": "porter-dump/1", "step": 0, "dtype": "float32",
                   "compute_dtype": "f32", "loss": loss, "micro_batches": len(micro),
                   "names": list(params), "tensors": tensors, "batches": batches,
                   "model": model}, f, indent=1)


def finite_difference_error(w, s, tokens, targets, h=1e-6):
    """Central differences of the loss in every parameter element, against autograd:
    the largest relative difference over the parameters, and torch's gradcheck verdict."""
    names = list(w)
    _, _, grads = forward_backward(w, s, tokens, targets)
    worst = 0.0
    with torch.no_grad():
        for k in names:
            num = torch.zeros_like(w[k])
            flat, nflat = w[k].view(-1), num.view(-1)
            for i in range(flat.numel()):
                old = flat[i].item()
                flat[i] = old + h
                up = mean_loss(logits_of(w, s, tokens), targets).item()
                flat[i] = old - h
                down = mean_loss(logits_of(w, s, tokens), targets).item()
                flat[i] = old
                nflat[i] = (up - down) / (2 * h)
            worst = max(worst, rel_diff(num.numpy(), grads[k].numpy()))

    def f(*ts):
        return mean_loss(logits_of(dict(zip(names, ts)), s, tokens), targets)

    inputs = tuple(w[k].detach().clone().requires_grad_(True) for k in names)
    passed = torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    return worst, passed


def cmd_selftest(args):
    torch.use_deterministic_algorithms(True)
    failures = []

    def expect(what, value, limit):
        ok = value <= limit
        print(f"  {what}: {value:.3e} (limit {limit:g}){'' if ok else '  FAIL'}")
        if not ok:
            failures.append(what)

    print("1. GPT-2 against tests/reference/make_fixtures.py's gpt_loss (porter's layout), f64")
    mf = make_fixtures_module()
    for i, (name, layers, c, heads, t, v, tied, b) in enumerate(mf.CONFIGS):
        s = Shape("gpt2", layers, c, heads, v, tied, 1e-5, positions=t)
        gen = torch.Generator().manual_seed(50 + i)
        w = draw_params(s, gen, std=0.2)
        tokens = torch.randint(0, v, (b, t), generator=gen)
        targets = torch.randint(0, v, (b, t), generator=gen)
        _, loss, grads = forward_backward(w, s, tokens, targets)
        p = {k: x.detach().clone().requires_grad_(True) for k, x in porter_from_hf_gpt2(w).items()}
        theirs = mf.gpt_loss(p, tokens, targets, layers, heads, tied)
        theirs.backward()
        ours_p = porter_from_hf_gpt2(grads)
        expect(f"{name} loss", abs(loss.item() - theirs.item()) / abs(theirs.item()), 1e-12)
        expect(f"{name} gradients",
               max(rel_diff(ours_p[k].numpy(), p[k].grad.numpy()) for k in p), 1e-12)
        # The committed porter fixtures, replayed through porter's names (f32 files).
        fd = os.path.join(REPO, "tests", "nn", "fixtures", name)
        with tempfile.TemporaryDirectory() as tmp:
            params = {k: torch.from_numpy(np.load(os.path.join(fd, "params", k + ".npy"))).double()
                      for k in p}
            fgrads = {k: torch.from_numpy(np.load(os.path.join(fd, "grads", k + ".npy"))).double()
                      for k in p}
            s2 = Shape("gpt2", layers, c, heads, v, tied, 1e-5, positions=params["wpe"].shape[0])
            hf_p, hf_g = hf_from_porter("gpt", params), hf_from_porter("gpt", fgrads)
            tok = load_int_npy(os.path.join(fd, "tokens.npy"), "tokens")
            tgt = load_int_npy(os.path.join(fd, "targets.npy"), "targets")
            write_dump(tmp, "gpt", s2, hf_p, hf_g, [(tok, tgt)],
                       float(np.load(os.path.join(fd, "loss.npy"))))
            ref, ours, worst = run_replay(tmp, quiet=True)
            expect(f"replay of tests/nn/fixtures/{name} loss", abs(ref - ours) / abs(ref), 1e-6)
            expect(f"replay of tests/nn/fixtures/{name} gradients", worst, 1e-5)

    print("2. the vectorised Llama against a head-by-head one with complex rotary, f64")
    for kv, tied, theta in ((2, True, 10000.0), (1, False, 500000.0), (4, False, 10000.0)):
        s = Shape("llama", 2, 32, 4, 29, tied, 1e-5, kv_heads=kv, intermediate=40,
                  rope_theta=theta, positions=32)
        gen = torch.Generator().manual_seed(60 + kv)
        w = draw_params(s, gen, std=0.3)
        tokens = torch.randint(0, s.vocab, (2, 11), generator=gen)
        with torch.no_grad():
            expect(f"kv_heads {kv}, {'tied' if tied else 'untied'}, theta {theta:g} logits",
                   rel_diff(llama_logits(w, s, tokens).numpy(),
                            naive_llama_logits(w, s, tokens).numpy()), 1e-12)

    print("3. autograd against central differences (h 1e-6) of the f64 loss, every element")
    tiny = [
        Shape("gpt2", 2, 8, 2, 11, True, 1e-5, positions=6),
        Shape("gpt2", 1, 8, 2, 11, False, 1e-5, positions=6),
        Shape("llama", 2, 16, 4, 11, True, 1e-5, kv_heads=2, intermediate=12, positions=8),
        Shape("llama", 1, 16, 2, 11, False, 1e-6, kv_heads=2, intermediate=12,
              rope_theta=500000.0, positions=8),
    ]
    for i, s in enumerate(tiny):
        gen = torch.Generator().manual_seed(70 + i)
        w = draw_params(s, gen, std=0.5)
        tokens = torch.randint(0, s.vocab, (2, 5), generator=gen)
        targets = torch.randint(0, s.vocab, (2, 5), generator=gen)
        worst, passed = finite_difference_error(w, s, tokens, targets)
        expect(f"{s.describe()}: gradcheck {'passed' if passed else 'FAILED'}, largest relative "
               "difference", worst if passed else float("inf"), 1e-7)

    print("4. the committed fixtures, reloaded from their safetensors files")
    for name, *_ in FIXTURES:
        d = os.path.join(args.fixtures, name)
        s, w, _ = load_hf_dir(d)
        tokens = load_int_npy(os.path.join(d, "tokens.npy"), "tokens")
        targets = load_int_npy(os.path.join(d, "targets.npy"), "targets")
        logits, loss, grads = forward_backward(w, s, tokens, targets)
        prefixed = os.path.exists(os.path.join(d, "grads", "transformer.wte.weight.npy"))
        gerr = max(rel_diff(np.load(os.path.join(d, "grads", stored_name(k, prefixed) + ".npy")),
                            g.numpy()) for k, g in grads.items())
        expect(f"{name} logits",
               rel_diff(np.load(os.path.join(d, "logits.npy")), logits.numpy()), 1e-6)
        expect(f"{name} gradients", gerr, 1e-6)
        # And through porter's names, as two micro-batches of the same loss.
        with tempfile.TemporaryDirectory() as tmp:
            arch = "gpt" if s.arch == "gpt2" else "llama"
            # One row per micro-batch: equal sizes, so the mean of their mean losses is the
            # fixture's loss and its gradients are the fixture's.
            micro = [(tokens[i:i + 1], targets[i:i + 1]) for i in range(tokens.shape[0])]
            write_dump(tmp, arch, s, w, grads, micro, loss.item())
            ref, ours, worst = run_replay(tmp, quiet=True)
            expect(f"{name} replayed in {len(micro)} micro-batches, loss",
                   abs(ref - ours) / abs(ref), 1e-12)
            expect(f"{name} replayed in {len(micro)} micro-batches, gradients", worst, 1e-6)

    print("selftest: " + ("all checks passed" if not failures else f"{len(failures)} FAILED"))
    return 0 if not failures else 1


def cmd_init(args):
    """A random Llama in Hugging Face's layout, drawn with Python's own generator: matrices
    ~ normal(0, 0.02), RMSNorm weights 1 (LlamaPreTrainedModel's init), stored as F32."""
    s = Shape("llama", args.layers, args.hidden, args.heads, args.vocab, args.tied, args.eps,
              kv_heads=args.kv_heads, intermediate=args.intermediate,
              rope_theta=args.rope_theta, positions=args.max_positions)
    if s.hidden % s.heads != 0:
        raise InputError(f"--hidden {s.hidden} is not a multiple of --heads {s.heads}")
    rng = random.Random(args.seed)
    header = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, shape in sorted(param_shapes(s).items()):
        n = math.prod(shape)
        if len(shape) == 1:
            values = [1.0] * n
        else:
            values = [rng.gauss(0.0, 0.02) for _ in range(n)]
        data = struct.pack(f"<{n}f", *values)
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    os.makedirs(args.out, exist_ok=True)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(hf_config(s, "float32"))
    params = sum(math.prod(v) for v in param_shapes(s).values())
    print(f"{args.out}: {s.describe()}, {params / 1e6:.2f} M parameters, f32")
    return 0


def main():
    default_out = os.path.join(REPO, "tests", "nn", "fixtures", "hf")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures", help="write the HF-layout fixtures")
    f.add_argument("--out", default=default_out)
    c = sub.add_parser("check", help="run the reference on an HF model directory")
    c.add_argument("--model", required=True, help="config.json + model.safetensors (or shards)")
    c.add_argument("--tokens", required=True, help="(B, T) integer .npy")
    c.add_argument("--targets", help="(B, T) integer .npy; prints the mean loss")
    c.add_argument("--logits", help="(B, T, V) .npy to compare with the reference's logits")
    c.add_argument("--tol", type=float, default=1e-5, help="largest relative logits difference")
    r = sub.add_parser("replay", help="replay a porter --dump-dir step")
    r.add_argument("dump_dir")
    r.add_argument("--tol", type=float, default=1e-4,
                   help="largest relative gradient (and loss) difference")
    t = sub.add_parser("selftest", help="check the reference itself")
    t.add_argument("--fixtures", default=default_out)
    i = sub.add_parser("init", help="write a random Llama checkpoint (no PyTorch needed)")
    i.add_argument("--out", required=True)
    i.add_argument("--layers", type=int, default=4)
    i.add_argument("--hidden", type=int, default=128)
    i.add_argument("--heads", type=int, default=4)
    i.add_argument("--kv-heads", type=int, default=2)
    i.add_argument("--intermediate", type=int, default=352)
    i.add_argument("--vocab", type=int, default=512)
    i.add_argument("--max-positions", type=int, default=512)
    i.add_argument("--rope-theta", type=float, default=10000.0)
    i.add_argument("--eps", type=float, default=1e-5)
    i.add_argument("--tied", action="store_true")
    i.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cmd != "init" and TORCH_MISSING:
        print(f"error: {args.cmd} needs PyTorch and NumPy ({TORCH_MISSING}); on Debian 12: "
              "apt-get install python3-torch python3-numpy libopenblas0-pthread, and run "
              "/usr/bin/python3", file=sys.stderr)
        return 2
    try:
        return {"fixtures": cmd_fixtures, "check": cmd_check, "replay": cmd_replay,
                "selftest": cmd_selftest, "init": cmd_init}[args.cmd](args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
