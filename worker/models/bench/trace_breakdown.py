"""The GPU kernel time of a Chrome trace written by libtorch's profiler (torch.profiler's
`export_chrome_trace`, or `examples/bench.rs --profile-trace`), sorted into the categories of
`profile_unet.py` by kernel name, with the largest kernels:

    python3 worker/models/bench/trace_breakdown.py TRACE.json [...]

Prints one JSON object per trace, in the shape of `profile_unet.py`'s `breakdown_b8_1024`.
"""

import json
import re
import sys
from collections import defaultdict

# First match wins: cuDNN's attention kernels are named `…sdpa…flash_fprop…`, its convolutions
# `…fprop_implicit_gemm…`, so attention goes before convolution and convolution before GEMM.
CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|sdpa|attention|\bmha", re.I)),
    ("conv", re.compile(r"conv|fprop|implicit_gemm|dgrad|wgrad", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|cublas|matmul|xmma", re.I)),
    # `gn_partial`, `gn_finalize`, `gn_apply`: our fused GroupNorm (src/nn/kernels/norms.cu).
    ("norm", re.compile(r"norm|welford|rowwise_moments|^gn_", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|silu|gelu|mul|add|copy|cat|reduce", re.I)),
]


def category(name):
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def summarise(kernel_us):
    """`kernel_us`: kernel name → summed µs."""
    by_cat = defaultdict(float)
    for name, us in kernel_us.items():
        by_cat[category(name)] += us
    total = sum(by_cat.values()) or 1.0
    return {
        "total_ms": total / 1000,
        "share": {k: round(v / total, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "ms": {k: round(v / 1000, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k[:120]: round(v / 1000, 3)
                           for k, v in sorted(kernel_us.items(), key=lambda kv: -kv[1])[:25]},
    }


def from_trace(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            kernels[e["name"]] += float(e.get("dur", 0))
    return summarise(kernels)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps({"trace": p, **from_trace(p)}, indent=1))
