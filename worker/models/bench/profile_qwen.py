"""Where one Qwen-Image-Edit-2509 transformer step's GPU time goes at the 1024² edit shape (4096 target
+ 4096 reference tokens + the prompt), ours and diffusers', and what the kernels that step 13 plans
could reach at those shapes: the profile mode of `run_qwen_bench.py` (`--profile`), as
`profile_unet.py` did for SDXL before step 8's kernels.

What `run_qwen_bench.sh --profile` does (one device call, carry `.whl`, `.bench`):
1. `write`: the transformer (fp8 e4m3fn Linear weights) and the VAE with random weights of the real
   configuration, as the benchmark writes them (no text encoder: the step takes a random prompt of
   `--txt-len` tokens, 211 = the real prompt's length in run 2 of 2026-11-30).
2. `profile` (this file, diffusers 0.42.1 in its own process): `QwenImageTransformer2DModel` from the
   written config, the same weights (fp8 dequantised to bf16 as our loader does), SDPA; the step timed
   (median of 5 after 2, host clock after a synchronize, as the benchmark), then one step recorded by
   torch.profiler (CPU operators and CUDA kernels) into a Chrome trace; then the levers at the step's
   shapes, each timed with CUDA events (median of 10 after 3):
   - attention: SDPA over the joint sequence in the layout both sides give it (`[1, L, 24, 128]`
     transposed), by backend (default, flash, cuDNN, memory-efficient);
   - every GEMM shape of a block (image stream M = 8192, text stream M = `--txt-len`, the modulation
     M = 1), in bf16 (`F.linear` with bias; random full-mantissa weights, and the file's fp8-valued
     weights as `upcast` computes with; the feed-forward's first GEMM also with GELU-tanh in cuBLASLt's
     epilogue) and in fp8 e4m3fn through `torch._scaled_mm` with the activation already quantised and
     static scales (per tensor, with and without fast accumulation; per row × per column with fast
     accumulation), i.e. the GEMM time an fp8 path reaches when the quantisation is fused into the
     kernel before it; plus the fused-QKV shape (N = 3 × 3072). The SM clock after each;
   - the separate passes such a path must avoid: quantising one activation in its own kernel, and one
     read + write of the hidden state and of the feed-forward's hidden layer (a memory-bound pass).
3. ours (`qwen_bench components --profile-trace`): the same step timed, then one recorded by
   libtorch's profiler.
4. both traces sorted into kernel classes by `trace_breakdown.py` (`from_trace`), with the time by
   top-level operator and by the work each planned kernel would take over (`fusion_groups`);
   `qwen_profile.md` tabulates them and the levers.

`python3 profile_qwen.py levers --out DIR` runs the levers alone (torch only, no weights), into
`DIR/profile_qwen_levers.json`.
"""

import json
import os
import time

from trace_breakdown import DEVICE_CATS, category, from_trace

LAYERS = 60  # QwenImageTransformer2DModel num_layers (diffusers' default = the real config)


def block_gemms(img, txt, dim=3072, ff=4 * 3072):
    """(name, M, K, N, per block) of every Linear in one dual-stream block: q, k, v, out and the
    feed-forward of each stream, and each stream's AdaLN modulation (M = 1: one timestep)."""
    out = []
    for stream, m in (("img", img), ("txt", txt)):
        out += [(f"{stream}_qkv", m, dim, dim, 3), (f"{stream}_out", m, dim, dim, 1),
                (f"{stream}_ff_up", m, dim, ff, 1), (f"{stream}_ff_down", m, ff, dim, 1),
                (f"{stream}_mod", 1, dim, 6 * dim, 1)]
    return out


def cuda_timed(torch, fn, warm=3, iters=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return {"ms_median": round(ts[len(ts) // 2], 4), "ms_min": round(ts[0], 4), "ms_max": round(ts[-1], 4)}


def sm_clock(torch):
    """The SM clock (MHz) through NVML just after a timing, or None."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 (no NVML: the timing stands without it)
        return None


def attention_levers(torch, seq, heads=24, head_dim=128):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    out = {"shape": [1, heads, seq, head_dim]}
    out["default"] = cuda_timed(torch, lambda: F.scaled_dot_product_attention(q, k, v))
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                out[name] = cuda_timed(torch, lambda: F.scaled_dot_product_attention(q, k, v))
        except Exception as e:  # noqa: BLE001 (a backend may refuse the shape)
            out[name] = {"error": str(e)[:200]}
    return out


def gemm_levers(torch, img, txt):
    """Per shape: ms per call by path, and the step's total per path (× per block × LAYERS; a path
    that a shape refused or that runs on one shape only has no total). `_scaled_mm` wants M a multiple of 16: the fp8 paths take
    the activation padded to one (`m_fp8`), as an fp8 path of ours would."""
    import torch.nn.functional as F

    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(3)
    shapes = block_gemms(img, txt) + [("img_qkv_fused", img, 3072, 3 * 3072, 0)]
    rows, totals, refused = {}, {}, set()
    for name, m, k, n, per_block in shapes:
        m8 = -(-m // 16) * 16
        x = torch.randn(m, k, device="cuda", dtype=bf, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=bf, generator=g) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=bf, generator=g)
        x8 = F.pad(x, (0, 0, 0, m8 - m))
        x8, w8 = (x8 / (x8.abs().amax() / 448)).to(f8), (w / (w.abs().amax() / 448)).to(f8)
        # The step's weights: the benchmark's file holds `w.to(float8_e4m3fn)` (no scale), which
        # `upcast` turns back into bf16 with few mantissa bits set; cuBLAS runs measurably faster on
        # such data than on full-mantissa random bf16.
        w_file = (w.to(f8)).to(bf)
        one = torch.ones((), device="cuda")
        row_a, col_b = torch.ones(m8, 1, device="cuda"), torch.ones(1, n, device="cuda")
        paths = {
            "bf16": lambda: F.linear(x, w, b),
            "bf16_file_weights": lambda: F.linear(x, w_file, b),
            "fp8_tensor": lambda: torch._scaled_mm(x8, w8.t(), one, one, bias=b, out_dtype=bf),
            "fp8_tensor_fast": lambda: torch._scaled_mm(x8, w8.t(), one, one, bias=b, out_dtype=bf,
                                                        use_fast_accum=True),
            "fp8_row_fast": lambda: torch._scaled_mm(x8, w8.t(), row_a, col_b, bias=b, out_dtype=bf,
                                                     use_fast_accum=True),
        }
        if name.endswith("ff_up"):  # the feed-forward's GELU-tanh in cuBLASLt's epilogue
            paths["bf16_file_weights_gelu_epilogue"] = lambda: torch._addmm_activation(b, x, w_file.t(), use_gelu=True)
        r = {"m": m, "m_fp8": m8, "k": k, "n": n, "per_block": per_block}
        for path, fn in paths.items():
            try:
                t = cuda_timed(torch, fn)
                t["sm_mhz"] = sm_clock(torch)
                t["tflops"] = round(2 * m * k * n / (t["ms_median"] * 1e-3) / 1e12, 1)
                r[path] = t
                totals[path] = totals.get(path, 0.0) + t["ms_median"] * per_block * LAYERS
            except Exception as e:  # noqa: BLE001 (a shape the fp8 kernel refuses is a finding)
                r[path] = {"error": str(e)[:200]}
                refused.add(path)
        rows[name] = r
        del x, w, b, x8, w8, w_file
    # A total only for a path measured on every shape of the block (the epilogue GELU is one shape's).
    counted = [r for r in rows.values() if r["per_block"]]
    whole = {p for p in totals if p not in refused and all(p in r for r in counted)}
    return {"shapes": rows, "step_total_ms": {k: round(v, 2) for k, v in totals.items() if k in whole}}


def pass_levers(torch, seq, txt, dim=3072, ff=4 * 3072):
    """Memory-bound passes at the step's sizes: one read + write of the joint hidden state and of
    the image stream's feed-forward hidden layer (bf16), and quantising one image-stream activation
    to fp8 in its own kernels (scale, cast) as a per-call path would."""
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn
    h = torch.randn(seq, dim, device="cuda", dtype=bf)
    h2 = torch.empty_like(h)
    u = torch.randn(seq - txt, ff, device="cuda", dtype=bf)
    u2 = torch.empty_like(u)
    x = h[: seq - txt]
    scale = torch.full((), 0.01, device="cuda")
    out = {
        "copy_hidden": cuda_timed(torch, lambda: h2.copy_(h)),
        "copy_ff_hidden": cuda_timed(torch, lambda: u2.copy_(u)),
        "quantise_img_activation": cuda_timed(torch, lambda: (x / scale).to(f8)),
        "quantise_img_activation_dynamic": cuda_timed(torch, lambda: (x / (x.abs().amax() / 448)).to(f8)),
    }
    for k, nbytes in (("copy_hidden", 2 * h.numel() * 2), ("copy_ff_hidden", 2 * u.numel() * 2)):
        out[k]["tb_per_s"] = round(nbytes / (out[k]["ms_median"] * 1e-3) / 1e12, 2)
    return out


def profile_side(a, emit, setup_torch, sync, load_weights, files):
    """The diffusers side of `--profile`: step timed, one step traced into `a.trace`, levers."""
    torch, dev, dt = setup_torch(a)
    import diffusers
    from diffusers import QwenImageTransformer2DModel

    cuda = dev.type == "cuda"
    emit({"name": "versions", "torch": torch.__version__, "diffusers": diffusers.__version__,
          "gpu": torch.cuda.get_device_name(0) if cuda else "cpu"})
    t0 = time.time()
    torch.set_default_dtype(dt)
    with torch.device(dev):
        tr = QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(os.path.join(a.work, "config", "transformer"))).eval()
    torch.set_default_dtype(torch.float32)
    s, missing = load_weights(torch, tr, os.path.join(a.work, files["transformer"]), lambda k: k, dev)
    assert not missing, missing
    emit({"name": "load", "s": time.time() - t0, "weights_s": s, "t0": t0, "t1": time.time(),
          "attn_processor": type(next(iter(tr.attn_processors.values()))).__name__})

    # The pipeline's shapes: its vae_scale_factor, a 2×2 patch per token, the reference resized to
    # `vae_area` as diffusers' calculate_dimensions(area, 1.0) does (a multiple of 32).
    with open(os.path.join(a.work, "config", "vae", "config.json")) as fh:
        f = 2 ** len(json.load(fh)["temperal_downsample"])
    side = a.size // f // 2
    vside = round(a.vae_area ** 0.5 / 32) * 32 // f // 2
    tgt, ref = side * side, vside * vside
    g = torch.Generator(device=dev).manual_seed(1)
    hs = torch.randn(1, tgt + ref, tr.config.in_channels, device=dev, dtype=dt, generator=g)
    ehs = torch.randn(1, a.txt_len, tr.config.joint_attention_dim, device=dev, dtype=dt, generator=g)
    ts_ = torch.full((1,), 0.9, device=dev, dtype=dt)
    shapes = [[(1, side, side), (1, vside, vside)]]

    def step():
        return tr(hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=None, timestep=ts_,
                  img_shapes=shapes, return_dict=False)[0]

    with torch.no_grad():
        t0 = time.time()
        for _ in range(2):
            step()
        sync(torch, dev)
        ts = []
        for _ in range(5):
            t = time.time()
            step()
            sync(torch, dev)
            ts.append((time.time() - t) * 1e3)
        ts.sort()
        emit({"name": "transformer_step", "ms_median": ts[2], "ms_min": ts[0], "ms_max": ts[-1], "iters": 5,
              "t0": t0, "t1": time.time(), "tokens": [tgt, ref, a.txt_len]})

        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            t = time.time()
            step()
            sync(torch, dev)
            ms = (time.time() - t) * 1e3
        prof.export_chrome_trace(a.trace)
        emit({"name": "transformer_step_profile", "ms": ms, "trace": a.trace})
        del tr
        if not cuda:
            return
        torch.cuda.empty_cache()
        seq = tgt + ref + a.txt_len
        emit({"name": "lever_attention", **attention_levers(torch, seq)})
        emit({"name": "lever_gemm", **gemm_levers(torch, tgt + ref, a.txt_len)})
        emit({"name": "lever_passes", **pass_levers(torch, seq, a.txt_len)})


def fusion_groups(path):
    """A trace's GPU time (ms) by the work that step 13's planned kernels would take over, from the
    sequence of ATen kernels one dual-stream block launches (both sides launch the same ones):
    `ln_modulate` (LayerNorm and the AdaLN scale/shift after it), `rmsnorm` (q/k RMSNorm: fp32 cast,
    pow, mean, rsqrt, products, cast back), `rope` (cast to complex, product, cast back), `cat` (the
    joint text+image q/k/v), `gelu`, `gated_residual` (gate product and residual add after a GEMM),
    `gemm`, `attention`, `memset`. Kernels of our own, once they exist, need rules of their own here."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                    key=lambda e: float(e["ts"]))
    out, group = {}, None
    for i, e in enumerate(device):
        name, cls = e["name"], category(e["name"])
        following = device[i + 1]["name"] if i + 1 < len(device) else ""
        if cls in ("gemm", "attention"):
            group = cls
        elif cls == "norm":
            group = "ln_modulate"
        elif "CatArray" in name:
            group = "cat"
        elif "Gelu" in name:
            group = "gelu"
        elif "direct_copy" in name:  # RMSNorm's fp32 cast is followed by its pow, RoPE's by its product
            group = "rmsnorm" if "pow" in following else "rope"
        elif group in ("gemm", "gelu"):
            group = "gated_residual"
        key = "memset" if name.startswith("Memset") else group or "other"
        out[key] = out.get(key, 0.0) + float(e.get("dur", 0)) / 1000
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


# The GEMMs of one dual-stream block in launch order, as both sides launch them between two
# attention kernels (`trace_breakdown.block_kernels`): the previous block's outputs and feed-forwards,
# then this block's modulations and projections.
GEMM_ROLES = ["img_out", "txt_out", "img_ff_up", "img_ff_down", "txt_ff_up", "txt_ff_down", "img_mod", "txt_mod",
              "img_q", "img_k", "img_v", "txt_q", "txt_k", "txt_v"]


def gemm_roles(path):
    """In-step GEMM time by role: µs per block (median over the blocks that have all 14) and ms per
    step (× LAYERS)."""
    import statistics

    from trace_breakdown import block_kernels

    per = {r: [] for r in GEMM_ROLES}
    for b in range(1, LAYERS):
        gemms = [us for us, cls, _, _ in block_kernels(path, b) if cls == "gemm"]
        if len(gemms) == len(GEMM_ROLES):
            for role, us in zip(GEMM_ROLES, gemms):
                per[role].append(us)
    med = {r: statistics.median(v) for r, v in per.items() if v}
    return {"us_per_block": {r: round(v, 1) for r, v in med.items()},
            "ms_per_step": round(sum(med.values()) * LAYERS / 1000, 2)}


def fp8_estimate(roles, levers):
    """The step's GEMM time (ms) if the image stream's QKV (fused), FF up and FF down ran in fp8:
    each in-step bf16 time × (fp8 path ÷ bf16 with the file's weights) at that shape in the same
    levers run; to_out in fp8 as a variant; the text stream and the modulations stay bf16."""
    shapes, us = levers["shapes"], roles["us_per_block"]
    qkv = us["img_q"] + us["img_k"] + us["img_v"]
    out = {}
    for path in ["fp8_tensor", "fp8_tensor_fast", "fp8_row_fast"]:
        def ratio(name, bf16_name=None, times=1):
            return shapes[name][path]["ms_median"] / (times * shapes[bf16_name or name]["bf16_file_weights"]["ms_median"])

        block = (sum(us.values()) - qkv - us["img_ff_up"] - us["img_ff_down"]
                 + qkv * ratio("img_qkv_fused", "img_qkv", 3)
                 + us["img_ff_up"] * ratio("img_ff_up") + us["img_ff_down"] * ratio("img_ff_down"))
        out[path] = {"ms_per_step": round(block * LAYERS / 1000, 1),
                     "with_fp8_out_ms_per_step": round((block - us["img_out"] * (1 - ratio("img_out"))) * LAYERS / 1000, 1)}
    fused = shapes["img_qkv_fused"]["bf16_file_weights"]["ms_median"] / (3 * shapes["img_qkv"]["bf16_file_weights"]["ms_median"])
    out["bf16_fused_qkv"] = {"ms_per_step": round((sum(us.values()) - qkv * (1 - fused)) * LAYERS / 1000, 1)}
    return out


def drive(a, res, save, py_side, ours, src, sizes, modes):
    """The driver's `--profile` run after the weights are written: both profiles, the breakdowns,
    `qwen_profile.md`. Traces stay in `a.work`; their gzipped copies go to `a.out`."""
    import gzip
    import shutil

    traces = {"diffusers": os.path.join(a.work, "trace_diffusers.json")}
    py_side("profile", ["--trace", traces["diffusers"], "--txt-len", str(a.txt_len)])
    for m in modes:
        traces[f"ours_{m}"] = os.path.join(a.work, f"trace_ours_{m}.json")
        ours(f"profile_{m}", ["components", *src, *sizes, "--fp8", m, "--txt-len", str(a.txt_len),
                              "--profile-trace", traces[f"ours_{m}"]])
    res["breakdown"] = {}
    for side, path in traces.items():
        if not os.path.exists(path):
            res["breakdown"][side] = {"error": f"no trace at {path}"}
            continue
        res["breakdown"][side] = from_trace(path)
        res["breakdown"][side]["fusion_groups_ms"] = fusion_groups(path)
        with open(path, "rb") as f, gzip.open(os.path.join(a.out, os.path.basename(path) + ".gz"), "wb") as g:
            shutil.copyfileobj(f, g)
    table = profile_table(res, modes)
    res["table"] = table
    save()
    print("\n" + table, flush=True)
    with open(os.path.join(a.out, "qwen_profile.md"), "w") as f:
        f.write(table + "\n")
    return 0


CLASSES = ["gemm", "attention", "norm", "elementwise", "copy", "other"]


def profile_table(res, modes):
    """qwen_profile.md: the kernel classes of both sides, then the levers."""
    d = res.get("py_profile", {}).get("rows", {}) or {}
    return "\n".join(breakdown_lines(res, modes) + [""] + lever_lines(d))


def breakdown_lines(res, modes):
    def step_ms(key):
        return ((res.get(key, {}).get("rows", {}) or {}).get("transformer_step") or {}).get("ms_median")

    sides = [("diffusers", "py_profile")] + [(f"ours_{m}", f"ours_profile_{m}") for m in modes]
    bd = res.get("breakdown", {})

    def row(label, cells):
        return "| " + " | ".join([label] + sum(cells, [])) + " |"

    def cell(side, cls):
        b = bd.get(side, {})
        ms = b.get("ms", {}).get(cls)
        return ["n/a", ""] if ms is None else [f"{ms:.1f}", f"{b['share'].get(cls, 0):.1%}"]

    lines = ["| | " + " | ".join(f"{s} ms | share" for s, _ in sides) + " |", "|---" * (1 + 2 * len(sides)) + "|"]
    lines += [row(cls, [cell(s, cls) for s, _ in sides]) for cls in CLASSES]
    for label, key in [("kernel sum", "total_ms"), ("GPU busy (union)", "busy_ms"), ("first to last kernel", "span_ms")]:
        lines.append(row(label, [[f"{bd.get(s, {}).get(key, 0):.1f}", ""] for s, _ in sides]))
    lines.append(row("kernels launched", [[str(bd.get(s, {}).get("kernels", "n/a")), ""] for s, _ in sides]))
    lines.append(row("step, host clock, median of 5",
                     [[f"{step_ms(k):.1f}" if step_ms(k) else "n/a", ""] for _, k in sides]))
    for s, _ in sides:
        b = bd.get(s, {})
        if b.get("top_kernels_ms"):
            lines += ["", f"{s}: largest kernels (ms): " + "; ".join(
                f"`{k[:90]}` {v}" for k, v in list(b["top_kernels_ms"].items())[:12])]
            lines += [f"{s}: by top-level operator (ms): " + "; ".join(
                f"`{k}` {v}" for k, v in list(b.get("by_op_ms", {}).items())[:15])]
            lines += [f"{s}: by the work of the planned kernels (ms): " + "; ".join(
                f"{k} {v}" for k, v in b.get("fusion_groups_ms", {}).items())]
    return lines


def lever_lines(d):
    """The levers' rows (`lever_attention`, `lever_gemm`, `lever_passes`) as text and a table."""
    lines = []
    att = d.get("lever_attention")
    if att:
        lines += [f"SDPA at {att['shape']}, ms per call (× {LAYERS} per step): " + "; ".join(
            f"{k} {v['ms_median']:.3f}" if "ms_median" in v else f"{k} refused"
            for k, v in att.items() if isinstance(v, dict)), ""]
    gm = d.get("lever_gemm")
    if gm:
        paths = ["bf16", "bf16_file_weights", "fp8_tensor", "fp8_tensor_fast", "fp8_row_fast"]
        lines += ["| GEMM (M×K×N, per block) | " + " | ".join(f"{p} ms (TFLOP/s)" for p in paths) + " |",
                  "|---" * (1 + len(paths)) + "|"]
        for name, r in gm["shapes"].items():
            cells = [f"{name} {r['m']}×{r['k']}×{r['n']}, ×{r['per_block']}"]
            for p in paths:
                v = r.get(p, {})
                cells.append(f"{v['ms_median']:.3f} ({v['tflops']})" if "ms_median" in v else "n/a")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"| step total (× {LAYERS} blocks) | " + " | ".join(
            f"{gm['step_total_ms'][p]:.1f}" if p in gm["step_total_ms"] else "n/a" for p in paths) + " |")
        up = gm["shapes"].get("img_ff_up", {})
        epi, plain = up.get("bf16_file_weights_gelu_epilogue", {}), up.get("bf16_file_weights", {})
        if "ms_median" in epi and "ms_median" in plain:
            lines += ["", f"img_ff_up with GELU-tanh in cuBLASLt's epilogue: {epi['ms_median']:.3f} ms "
                          f"(without: {plain['ms_median']:.3f} ms)"]
    ps = d.get("lever_passes")
    if ps:
        lines += ["", "memory-bound passes (ms): " + "; ".join(
            f"{k} {v['ms_median']:.4f}" + (f" ({v['tb_per_s']} TB/s)" if "tb_per_s" in v else "")
            for k, v in ps.items() if isinstance(v, dict))]
    return lines


def analyse(a):
    """Per trace: the work of the planned kernels and the in-step GEMMs by role; with `--levers`, the
    fp8 estimate from each levers file. Prints JSON."""
    levers = {}
    for path in a.levers:
        with open(path) as f:
            levers[os.path.relpath(path)] = json.load(f)["lever_gemm"]
    res = {}
    for path in a.traces:
        roles = gemm_roles(path)
        res[os.path.basename(path)] = {"fusion_groups_ms": fusion_groups(path), "gemm_roles": roles,
                                       "fp8_estimate": {k: fp8_estimate(roles, v) for k, v in levers.items()}}
    print(json.dumps(res, indent=1))


def main():
    """`python3 profile_qwen.py levers --out DIR`: the levers alone (no weights, no diffusers).
    `python3 profile_qwen.py analyse TRACE... [--levers JSON...]`: `analyse`'s JSON on stdout."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["levers", "analyse"])
    ap.add_argument("traces", nargs="*", help="analyse: the profile's Chrome traces")
    ap.add_argument("--levers", nargs="*", default=[], help="analyse: levers JSON files for the fp8 estimate")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--img", type=int, default=8192, help="image-stream tokens (target + reference)")
    ap.add_argument("--txt", type=int, default=211, help="prompt tokens")
    a = ap.parse_args()
    if a.what == "analyse":
        return analyse(a)
    import torch

    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    with torch.no_grad():
        res["lever_gemm"] = gemm_levers(torch, a.img, a.txt)
        res["lever_attention"] = attention_levers(torch, a.img + a.txt)
        res["lever_passes"] = pass_levers(torch, a.img + a.txt, a.txt)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_qwen_levers.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n".join(lever_lines(res)), flush=True)


if __name__ == "__main__":
    main()
