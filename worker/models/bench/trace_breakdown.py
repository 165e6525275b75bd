"""The GPU time of a Chrome trace written by libtorch's profiler (torch.profiler's
`export_chrome_trace`, or `examples/bench.rs` / `examples/qwen_bench.rs --profile-trace`), sorted into
kernel classes by kernel name, with the largest kernels:

    python3 worker/models/bench/trace_breakdown.py TRACE.json [...]
    python3 worker/models/bench/trace_breakdown.py --block N TRACE.json   # one block's kernels

Prints one JSON object per trace, in the shape of `profile_unet.py`'s `breakdown_b8_1024`, plus what
only a trace holds: device copies and fills (`gpu_memcpy`, `gpu_memset`) beside the kernels, the
kernel count, the GPU's busy time (union of the kernels' intervals) against the span from the first
kernel's start to the last one's end, and the GPU time by the top-level CPU operator that launched
it (`by_op`: the outermost `cpu_op` around each launch, e.g. `aten::linear` with its bias add).

Since step 13, copies (`cat`, strided and casting copies, device memcpy) are a class of their own;
step 8's SDXL tables counted them as elementwise.
"""

import bisect
import json
import re
import sys
from collections import defaultdict

# First match wins: cuDNN's attention kernels are named `…sdpa…flash_fprop…`, its convolutions
# `…fprop_implicit_gemm…`, so attention goes before convolution and convolution before GEMM; a
# casting copy is an `elementwise_kernel<…direct_copy_kernel_cuda…>`, so copy goes before elementwise.
CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|sdpa|attention|\bmha", re.I)),
    ("conv", re.compile(r"conv|fprop|implicit_gemm|dgrad|wgrad", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|cublas|matmul|xmma", re.I)),
    # `gn_partial`, `gn_finalize`, `gn_apply`: our fused GroupNorm (src/nn/kernels/norms.cu).
    ("norm", re.compile(r"norm|welford|rowwise_moments|^gn_", re.I)),
    ("copy", re.compile(r"copy|CatArray|memcpy|memset|transpose|permute", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|silu|gelu|mul|add|cat|reduce", re.I)),
]
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def category(name):
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def _sorted_ms(d, limit=None):
    """µs by name → ms by name (cut to 120 characters, names that then coincide summed), largest first."""
    cut = defaultdict(float)
    for k, v in d.items():
        cut[k[:120]] += v
    rows = sorted(cut.items(), key=lambda kv: -kv[1])
    return {k: round(v / 1000, 3) for k, v in rows[:limit]}


def summarise(kernel_us):
    """`kernel_us`: kernel name → summed µs."""
    by_cat = defaultdict(float)
    for name, us in kernel_us.items():
        by_cat[category(name)] += us
    total = sum(by_cat.values()) or 1.0
    return {
        "total_ms": total / 1000,
        "share": {k: round(v / total, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "ms": _sorted_ms(by_cat),
        "top_kernels_ms": _sorted_ms(kernel_us, 25),
    }


def busy_us(intervals):
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def top_level_ops(events):
    """(pid, tid) → sorted list of (start, end, name) of the `cpu_op`s not nested in another."""
    per_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            per_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                                              e["name"]))
    tops = {}
    for key, ops in per_thread.items():
        ops.sort(key=lambda o: (o[0], -o[1]))
        out, end = [], float("-inf")
        for o in ops:
            if o[0] >= end:
                out.append(o)
                end = o[1]
        tops[key] = out
    return tops


def launching_ops(events):
    """Correlation id → name of the top-level CPU operator around its launch (`?` if none)."""
    tops = top_level_ops(events)
    starts = {k: [o[0] for o in v] for k, v in tops.items()}
    by_corr = {}
    for e in events:
        if e.get("cat") not in LAUNCH_CATS or "correlation" not in e.get("args", {}):
            continue
        key, ts = (e.get("pid"), e.get("tid")), float(e["ts"])
        i = bisect.bisect_right(starts.get(key, []), ts) - 1
        op = tops[key][i] if i >= 0 else None
        by_corr[e["args"]["correlation"]] = op[2] if op and op[0] <= ts <= op[1] else "?"
    return by_corr


def from_trace(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    kernels, by_op, count = defaultdict(float), defaultdict(float), 0
    ops = launching_ops(events)
    op_class = defaultdict(lambda: defaultdict(float))
    for e in device:
        us = float(e.get("dur", 0))
        kernels[e["name"]] += us
        op = ops.get(e.get("args", {}).get("correlation"), "?")
        by_op[op] += us
        op_class[op][category(e["name"])] += us
        count += 1
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device]
    out = summarise(kernels)
    out["kernels"] = count
    out["busy_ms"] = round(busy_us(spans) / 1000, 3)
    out["span_ms"] = round((max(e for _, e in spans) - min(s for s, _ in spans)) / 1000, 3) if spans else 0.0
    out["by_op_ms"] = _sorted_ms(by_op, 30)
    top_ops = sorted(by_op, key=lambda op: -by_op[op])[:30]
    out["by_op_class_ms"] = {op[:120]: _sorted_ms(op_class[op]) for op in top_ops}
    return out


def block_kernels(path, block):
    """The device events from the end of attention kernel `block - 1` to the end of attention kernel
    `block` (0-based, in time order): block `block - 1`'s work after its attention and block `block`'s
    before it, for a transformer with one attention kernel per block. Rows of (µs, class, launching
    operator, name)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ops = launching_ops(events)
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                    key=lambda e: float(e["ts"]))
    attention = [i for i, e in enumerate(device) if category(e["name"]) == "attention"]
    if not 1 <= block < len(attention):
        raise SystemExit(f"{path}: {len(attention)} attention kernels, no block {block}")
    return [(float(e.get("dur", 0)), category(e["name"]), ops.get(e.get("args", {}).get("correlation"), "?"), e["name"])
            for e in device[attention[block - 1] + 1: attention[block] + 1]]


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--block"]:  # --block N TRACE: one block's kernels, tab-separated
        for us, cat, op, name in block_kernels(args[2], int(args[1])):
            print(f"{us:.1f}\t{cat}\t{op}\t{name}")
    else:
        for p in args:
            print(json.dumps({"trace": p, **from_trace(p)}, indent=1))
