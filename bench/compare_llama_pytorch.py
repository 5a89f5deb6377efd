#!/usr/bin/python3
"""PyTorch 1.13's time and memory for the Llama step that bench/llama_step_bench.cc times in
porter: the same Llama (RMSNorm, rotate_half rotary, grouped-query attention through
repeat_kv, SwiGLU, no biases, untied head), same shapes, forward + backward, no optimizer, at
a fixed thread count, in f32 or in bf16 under torch.autocast("cpu", dtype=torch.bfloat16).
Prints one JSON line with the median step time and the memory measures described below.

Install and run with Debian's python3 (not the pyenv python3 first on PATH), e.g. through
bench/compare_llama.sh:
    apt-get install python3-torch python3-numpy libopenblas0-pthread
    /usr/bin/python3 bench/compare_llama_pytorch.py --threads 2 --dtype f32
The model follows transformers 4.46's modeling_llama.py with eager attention, the only
attention PyTorch 1.13 has (F.scaled_dot_product_attention came in 2.0): RMSNorm in f32 and
cast back, cos/sin formed in f32 outside autocast, an additive causal mask, the softmax in
f32, logits upcast to f32 before the loss. PyTorch is run at its best as in
bench/compare_pytorch.py: OPENBLAS_CORETYPE=SkylakeX before torch loads, grads set to None
between steps, two warm-up steps; the script refuses the netlib reference BLAS. Its f32
matmuls call OpenBLAS; its bf16 matmuls call its bundled oneDNN (2.6.3), whatever the BLAS.

Memory, in MiB:
- saved_MiB: the bytes autograd saves for backward in one forward, the unique storages
  that a saved_tensors_hooks pack hook sees, less the parameters themselves (which any
  framework holds anyway). Under autocast it includes the bf16 copies of the weights that
  the matmuls save, reported separately as saved_weight_casts_MiB. This is the counterpart
  of porter's activation peak; it is measured on the check step, before timing.
- anon_growth_MiB: the growth of the process's anonymous resident memory (RssAnon) from
  after the model and inputs were built, before the first step, to after the timed steps:
  gradients, activations, autograd temporaries and the heap's slack at the step's high
  point. It is a peak only because compare_llama.sh runs the script with MALLOC_MMAP_MAX_=0
  and trimming off: large tensors then come from the heap, which never shrinks, so the
  resident heap stays at its high-water mark.
- rss_growth_MiB: the peak resident set (ru_maxrss) less the resident set at the same start;
  this also counts the library code that the first step pages in (libtorch, OpenBLAS,
  oneDNN), so it is an upper bound.
"""
import os

# Forced, not defaulted: a shell may export OPENBLAS_CORETYPE=Haswell, which halves sgemm.
os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIB = 1024.0 * 1024.0


class RMSNorm(nn.Module):
    """LlamaRMSNorm: the statistics in f32, the result cast back before the weight."""

    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D): query head h reads kv head h // n_rep."""
    b, hkv, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, c, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, c // heads
        self.q_proj = nn.Linear(c, heads * self.d, bias=False)
        self.k_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, c, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (T, D), broadcast over (B, H)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d) + mask
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().reshape(b, t, -1)
        return self.o_proj(y)


class Mlp(nn.Module):
    def __init__(self, c, inter):
        super().__init__()
        self.gate_proj = nn.Linear(c, inter, bias=False)
        self.up_proj = nn.Linear(c, inter, bias=False)
        self.down_proj = nn.Linear(inter, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c, heads, kv_heads, inter, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(c, eps)
        self.self_attn = Attention(c, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(c, eps)
        self.mlp = Mlp(c, inter)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, layers, c, heads, kv_heads, inter, t, v, eps=1e-5, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, c)
        self.layers = nn.ModuleList(
            [DecoderLayer(c, heads, kv_heads, inter, eps) for _ in range(layers)])
        self.norm = RMSNorm(c, eps)
        self.lm_head = nn.Linear(c, v, bias=False)
        d = c // heads
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))
        # Hugging Face's additive mask: the dtype's minimum above the diagonal, 0 elsewhere.
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
        self.register_buffer("mask", mask[None, None])
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def rope(self, t):
        """LlamaRotaryEmbedding: cos, sin (T, D) in f32, formed with autocast off."""
        with torch.autocast("cpu", enabled=False):
            freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        cos, sin = self.rope(t)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, self.mask[:, :, :t, :t])
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def blas_library():
    """The libblas.so.3 this process loaded (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line}
    return sorted(os.path.realpath(l) for l in libs)


def status_mib(key):
    """A /proc/self/status field in kB (VmRSS, RssAnon, ...), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise SystemExit(f"no {key} in /proc/self/status")


VIEW_FNS = {"TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0"}


def is_weight_cast(t):
    """Whether t is (a view of) autocast's copy of a parameter: ToCopyBackward0 of a leaf."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in VIEW_FNS:
        fn = fn.next_functions[0][0]
    return fn is not None and type(fn).__name__ == "ToCopyBackward0" and any(
        type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions if n is not None)


def saved_bytes(model, run):
    """(all, weight casts): bytes of the unique non-parameter storages autograd saves while
    `run` executes, and those of them that are autocast's copies of the weights."""
    params = {p.data_ptr() for p in model.parameters()}
    seen, casts = {}, set()

    def pack(t):
        s = t.storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = s.nbytes()
            if is_weight_cast(t):
                casts.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values()), sum(seen[p] for p in casts)


def main():
    ap = argparse.ArgumentParser(description="PyTorch Llama step time and memory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one more step under torch.profiler; its ops by self "
                    "time to stderr")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # loads the BLAS
    blas = blas_library()
    if not any("openblas" in l for l in blas):
        raise SystemExit(f"PyTorch is using {blas}, not OpenBLAS: "
                         "apt-get install libopenblas0-pthread")
    torch.manual_seed(0)
    model = Llama(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate,
                  args.seq_len, args.vocab)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    bf16 = args.dtype == "bf16"
    rss_before, anon_before = status_mib("VmRSS"), status_mib("RssAnon")

    def step():
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens, targets)
        loss.backward()
        return loss.item()

    result = {}

    def check():
        result["loss"] = step()

    saved, casts = saved_bytes(model, check)
    if abs(result["loss"] - math.log(args.vocab)) > 0.5:
        raise SystemExit(f"loss of the untrained model {result['loss']} is not ~ln(V)")
    step()
    times, cpu_s = [], 0.0
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_s += time.process_time() - c0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB -> MiB
    anon_after = status_mib("RssAnon")
    if args.profile:
        from torch.profiler import profile
        with profile() as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
              file=sys.stderr)
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
        # CPU time of all threads over wall time x threads: near 1 when the threads had their
        # cores (they spin while waiting), well below under contention from other processes.
        "cpu_util": cpu_s / sum(times) / torch.get_num_threads(),
        "loss": result["loss"],
        "params_MiB": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
        "saved_MiB": saved / MIB,
        "saved_weight_casts_MiB": casts / MIB,
        "rss_before_MiB": rss_before,
        "rss_growth_MiB": maxrss - rss_before,
        "anon_growth_MiB": anon_after - anon_before,
    }))


if __name__ == "__main__":
    main()
