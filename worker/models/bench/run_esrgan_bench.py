"""Real-ESRGAN engine (vnfarm-models, tch) vs Real-ESRGAN's `RealESRGANer` tiling in Python, same GPU,
same random weights, one run.

Built on the SDXL benchmark (`run_bench.py`, docs/performance.md): its NVML sampler and process runner
are imported from there. The Python reference is `fixtures/esrgan/realesrgan_ref.py`: BasicSR's
RRDBNet and Real-ESRGAN's `RealESRGANer.pre_process` / `tile_process` / `process` / `post_process`
re-implemented line for line (the packages themselves no longer install against current torch); its
`enhance` for an RGB8 image is written out below without OpenCV (an RGB input needs no colour
conversion), ending, as upstream, with the output on the host as uint8.

Commands (repository root):

    # here: the binary
    cargo build --release -p vnfarm-models --example esrgan_bench
    mkdir -p .bench && cp $CARGO_TARGET_DIR/release/examples/esrgan_bench .bench/esrgan_bench
    # here: smoke test of the whole flow on the CPU (tiny models and sizes, fp32), debug build:
    python worker/models/bench/run_esrgan_bench.py --tiny --bin $CARGO_TARGET_DIR/debug/examples/esrgan_bench \
        --work /tmp/esmoke/work --out /tmp/esmoke/out
    # GPU machine: one device call, carry [".bench"], command
    worker/models/bench/run_esrgan_bench.sh

What one run does:
1. `write` (subprocess): RRDBNet of the three released configurations, `RealESRGAN_x4plus_anime_6B`
   (6 blocks), `RealESRGAN_x4plus` (23 blocks), `RealESRGAN_x2plus` (23 blocks, pixel-unshuffle input),
   with random weights initialised as BasicSR initialises them (`torch.manual_seed(0)`; the dense
   blocks' convs Kaiming-normal × 0.1 with zero bias, the other convs PyTorch's default), saved fp32 as
   the official files are: `torch.save({"params_ema": state_dict})`; and the synthetic RGB8 inputs
   (`img_<N>.rgb`, N² pixels: colour ramps, stripes and noise).
2. Python (one process per model, fp16 as `RealESRGANer(half=True)`, Real-ESRGAN's default): for each
   case, `torch.cuda.empty_cache()` and reset peak statistics, then the upscale once (first call) and
   `--runs` more times: time of the whole call (host clock, input on the host to uint8 output on the
   host) and of the network part alone (`tile_process` / `process`, synchronised);
   `max_memory_allocated`, `max_memory_reserved`, and the NVML peak of the case's time window. For the
   anime model at the smaller size every tiled output is compared with the full-frame one.
3. ours (`esrgan_bench`, one process per case): `Upscaler::load` of the same `.pth`, fp16, the same
   grid and merge (`--blend crop`: Real-ESRGAN's hard cut) unless the case says otherwise; first call
   and `--runs` more (host clock around `Upscaler::upscale`: RGB8 in on the host, RGB8 out on the
   host); the process's NVML peak over the idle reading.
4. Ablations of ours (anime model): the feathered merge, tiles batched 4 per forward, cuDNN's
   benchmark mode, channels-last (NHWC) weights and activations, bf16.
5. Agreement: mean |ours − Python| of the anime model's 1024² output at tile 512 / overlap 32, RGB8.

Cases (`--tiny` shrinks everything for the CPU smoke test): full frame and tiles 256/512/768/1024 with
overlaps 16/32/64 at 1024² and 2048² for the anime model; full frame and tiles 256/512/768/1024 with
overlap 32 for x4plus; full frame and tiles 512/768 with overlap 32 for x2plus. Every process runs with
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (what the worker sets). `--budget` bounds the run:
each process gets what is left, later cases are skipped (and listed) when time runs out, and results
are written after every process.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(MODELS_DIR, "fixtures", "esrgan"))
from run_bench import emit, run_sampled  # noqa: E402  (NVML sampler + process runner of the SDXL bench)

REAL = {
    "models": {"anime_6b": dict(num_block=6, scale=4, num_feat=64, num_grow_ch=32),
               "x4plus": dict(num_block=23, scale=4, num_feat=64, num_grow_ch=32),
               "x2plus": dict(num_block=23, scale=2, num_feat=64, num_grow_ch=32)},
    "sizes": [1024, 2048],
    "tiles": [256, 512, 768, 1024],
    "overlaps": [16, 32, 64],
    "agree": ("anime_6b", 1024, 512, 32),
}
TINY = {
    "models": {"anime_6b": dict(num_block=1, scale=4, num_feat=8, num_grow_ch=4),
               "x4plus": dict(num_block=2, scale=4, num_feat=8, num_grow_ch=4),
               "x2plus": dict(num_block=2, scale=2, num_feat=8, num_grow_ch=4)},
    "sizes": [48, 96],
    "tiles": [16, 32],
    "overlaps": [4, 8],
    "agree": ("anime_6b", 48, 32, 8),
}


# Run 2 (`--followup`): channels-last across the fastest tilings of run 1, the chosen default
# feathered, x4plus at that default, and two run-1 cases again (run-to-run spread).
FOLLOWUP = [
    ("anime_6b", 2048, 1024, 16, []),
    ("anime_6b", 2048, 512, 16, []),
    ("anime_6b", 2048, 512, 16, ["--channels-last"]),
    ("anime_6b", 2048, 768, 16, ["--channels-last"]),
    ("anime_6b", 2048, 1024, 16, ["--channels-last"]),
    ("anime_6b", 2048, 1024, 32, ["--channels-last"]),
    ("anime_6b", 1024, 512, 16, ["--channels-last"]),
    ("anime_6b", 1024, 1024, 16, ["--channels-last"]),
    ("anime_6b", 2048, 1024, 16, ["--blend", "feather"]),
    ("anime_6b", 2048, 1024, 16, ["--channels-last", "--blend", "feather"]),
    ("x4plus", 2048, 1024, 16, []),
    ("x4plus", 2048, 1024, 16, ["--channels-last"]),
]


def cases(cfg):
    """(model, size, tile or 0, overlap) per side, in run order."""
    out = []
    t, o = cfg["tiles"], cfg["overlaps"]
    mid = o[len(o) // 2]
    for size in cfg["sizes"]:
        out.append(("anime_6b", size, 0, 0))
        out += [("anime_6b", size, tile, ov) for tile in t for ov in o]
    for size in cfg["sizes"]:
        out.append(("x4plus", size, 0, 0))
        out += [("x4plus", size, tile, mid) for tile in t]
    for size in cfg["sizes"]:
        out.append(("x2plus", size, 0, 0))
        out += [("x2plus", size, tile, mid) for tile in t[1:3] or t]
    return out


def ablations(cfg):
    """Extra runs of ours (anime model, larger size): (tag, tile, overlap, extra flags)."""
    t, o = cfg["tiles"], cfg["overlaps"]
    mid = o[len(o) // 2]
    small, mid_tile = t[0], t[min(1, len(t) - 1)]
    rows = []
    for tile in t[1:3] or t:
        rows.append((f"feather_{tile}_{mid}", tile, mid, ["--blend", "feather"]))  # (the last --blend wins)
    rows.append((f"batch4_{small}_{mid}", small, mid, ["--batch", "4"]))
    rows.append((f"batch4_{mid_tile}_{mid}", mid_tile, mid, ["--batch", "4"]))
    rows.append((f"cudnn_benchmark_{mid_tile}_{mid}", mid_tile, mid, ["--cudnn-benchmark"]))
    rows.append(("cudnn_benchmark_full", 0, 0, ["--cudnn-benchmark"]))
    rows.append((f"channels_last_{mid_tile}_{mid}", mid_tile, mid, ["--channels-last"]))
    rows.append((f"channels_last_cudnn_benchmark_{mid_tile}_{mid}", mid_tile, mid,
                 ["--channels-last", "--cudnn-benchmark"]))
    rows.append(("channels_last_full", 0, 0, ["--channels-last"]))
    rows.append((f"bf16_{mid_tile}_{mid}", mid_tile, mid, ["--dtype", "bf16"]))
    return rows


# ---------------------------------------------------------------------------------------------
# write side


def basicsr_init(net, torch):
    """BasicSR's `default_init_weights(..., 0.1)` of every dense block's convs (the rest keep
    PyTorch's default init), as `ResidualDenseBlock.__init__` does."""
    from realesrgan_ref import ResidualDenseBlock

    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, ResidualDenseBlock):
                for c in (m.conv1, m.conv2, m.conv3, m.conv4, m.conv5):
                    torch.nn.init.kaiming_normal_(c.weight)
                    c.weight.mul_(0.1)
                    c.bias.zero_()


def make_image(size):
    """Synthetic RGB8, size² (HWC bytes): ramps, stripes, a hard diagonal edge and noise."""
    import torch

    g = torch.Generator().manual_seed(size)
    y = torch.arange(size).view(-1, 1).float()
    x = torch.arange(size).view(1, -1).float()
    r = 40 + 170 * x / size + 0 * y
    gg = 60 + 150 * y / size + 0 * x
    b = torch.where((x + y) > size, 200.0, 50.0) + 30 * torch.sin(x / 7) * torch.cos(y / 11)
    img = torch.stack([r, gg, b], -1) + torch.randint(-16, 16, (size, size, 3), generator=g)
    return img.clamp(0, 255).round().to(torch.uint8).contiguous()


def write_side(a, cfg):
    import torch
    from realesrgan_ref import RRDBNet

    for name, m in cfg["models"].items():
        torch.manual_seed(0)
        net = RRDBNet(3, 3, scale=m["scale"], num_feat=m["num_feat"], num_block=m["num_block"],
                      num_grow_ch=m["num_grow_ch"])
        basicsr_init(net, torch)
        path = os.path.join(a.work, f"{name}.pth")
        torch.save({"params_ema": net.state_dict()}, path)
        emit({"name": f"write_{name}", "params": sum(p.numel() for p in net.parameters()),
              "bytes": os.path.getsize(path)})
    for size in cfg["sizes"]:
        make_image(size).numpy().tofile(os.path.join(a.work, f"img_{size}.rgb"))
    emit({"name": "write_images", "sizes": cfg["sizes"]})


# ---------------------------------------------------------------------------------------------
# Python side (Real-ESRGAN's algorithm)


def python_side(a, cfg):
    import numpy as np
    import torch
    from realesrgan_ref import RealESRGANer, RRDBNet

    dev = torch.device("cpu" if a.tiny else "cuda")
    half = not a.tiny
    m = cfg["models"][a.model]
    net = RRDBNet(3, 3, scale=m["scale"], num_feat=m["num_feat"], num_block=m["num_block"],
                  num_grow_ch=m["num_grow_ch"])
    t = time.time()
    loadnet = torch.load(os.path.join(a.work, f"{a.model}.pth"), map_location=torch.device("cpu"))
    net.load_state_dict(loadnet["params_ema"], strict=True)
    net = net.eval().to(dev)
    if half:
        net = net.half()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    emit({"name": "load", "s": time.time() - t})

    def enhance_rgb8(up, img):
        """`RealESRGANer.enhance` for an 8-bit RGB image (outscale = the network's)."""
        x = img.astype(np.float32) / 255  # (enhance: cv2.cvtColor BGR2RGB; this input is RGB already)
        up.pre_process(x)
        sync()
        t0 = time.time()
        if up.tile_size > 0:
            up.tile_process()
        else:
            up.process()
        sync()
        net_s = time.time() - t0
        out = up.post_process()
        out = out.data.squeeze().float().cpu().clamp_(0, 1).numpy()
        out = np.transpose(out[[2, 1, 0], :, :], (1, 2, 0))
        out = (out * 255.0).round().astype(np.uint8)
        return out, net_s

    full = {}
    for (model, size, tile, overlap) in cases(cfg):
        if model != a.model:
            continue
        img = np.fromfile(os.path.join(a.work, f"img_{size}.rgb"), dtype=np.uint8).reshape(size, size, 3)
        up = RealESRGANer(m["scale"], net, tile=tile, tile_pad=overlap, pre_pad=0, half=half)
        up.device = dev
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        times, nets = [], []
        out = None
        with torch.no_grad():
            for _ in range(a.runs + 1):
                s = time.time()
                out, net_s = enhance_rgb8(up, img)
                times.append(time.time() - s)
                nets.append(net_s)
        t1 = time.time()
        row = {"name": f"{model}_{size}_{tile}_{overlap}", "first_s": times[0],
               "median_s": sorted(times[1:])[len(times[1:]) // 2], "net_median_s": sorted(nets[1:])[len(nets[1:]) // 2],
               "times": times, "t0": t0, "t1": t1}
        if dev.type == "cuda":
            row["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            row["max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        rgb = out[:, :, ::-1]
        if model == "anime_6b" and size == cfg["sizes"][0]:
            if tile == 0:
                full[size] = rgb.astype(np.int16)
            elif size in full:
                d = np.abs(rgb.astype(np.int16) - full[size])
                row["vs_full_mae"] = float(d.mean())
                row["vs_full_max"] = int(d.max())
        if (model, size, tile, overlap) == cfg["agree"]:
            path = os.path.join(a.work, "python_agree.rgb")
            np.ascontiguousarray(rgb).tofile(path)
            row["saved"] = path
        if model == "anime_6b" and size == cfg["sizes"][0] and tile == 0:
            path = os.path.join(a.work, "python_full.rgb")
            np.ascontiguousarray(rgb).tofile(path)
        emit(row)
        del out, up


# ---------------------------------------------------------------------------------------------
# driver


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=".bench/esrgan_bench", help="our benchmark binary (examples/esrgan_bench.rs)")
    ap.add_argument("--work", default="/tmp/esrgan_bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--runs", type=int, default=2, help="timed calls after the first")
    ap.add_argument("--tiny", action="store_true", help="tiny models and sizes on the CPU, fp32 (smoke test)")
    ap.add_argument("--models", default="anime_6b,x4plus,x2plus")
    ap.add_argument("--skip-python", action="store_true")
    ap.add_argument("--skip-ablations", action="store_true")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per process before it is killed")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (see the module docs)")
    ap.add_argument("--alloc-conf", default="expandable_segments:True")
    ap.add_argument("--followup", action="store_true", help="run 2 only: the FOLLOWUP cases of ours")
    ap.add_argument("--side", choices=["write", "python"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cfg = TINY if a.tiny else REAL
    if a.side == "write":
        return write_side(a, cfg)
    if a.side == "python":
        return python_side(a, cfg)

    a.work, a.out = os.path.abspath(a.work), os.path.abspath(a.out)
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,memory.used,memory.total",
                              "--format=csv"], capture_output=True, text=True).stdout, flush=True)
    except FileNotFoundError:
        pass
    res = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": {}, "ours": {}}
    res_path = os.path.join(a.out, "esrgan_results.json")

    def save():
        res["wall_s"] = time.time() - t_start
        with open(res_path, "w") as f:
            json.dump(res, f, indent=1)

    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    import torch  # only for the location of libtorch

    env["LD_LIBRARY_PATH"] = os.path.join(os.path.dirname(torch.__file__), "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
    common = ["--work", a.work, "--runs", str(a.runs)] + (["--tiny"] if a.tiny else [])

    def time_left(tag):
        left = a.budget - (time.time() - t_start) - 10
        if left < 15:
            print(f"== {tag}: skipped, {left:.0f} s left of --budget", flush=True)
            res.setdefault("skipped", []).append(tag)
            save()
            return None
        return int(min(a.timeout, left))

    def py(side, extra=()):
        timeout = time_left(f"python_{side}_{' '.join(extra)}")
        if timeout is None:
            return None
        r = run_sampled([sys.executable, "-u", os.path.abspath(__file__), "--side", side, *common, *extra],
                        os.path.join(a.out, f"python_{side}{'_' + extra[-1] if extra else ''}.log"), env,
                        timeout=timeout)
        print(f"== python {side} {' '.join(extra)}: rc={r[2]} {r[1]}", flush=True)
        return r

    def ours(tag, args):
        timeout = time_left(tag)
        if timeout is None:
            return None
        flags = ["--cpu"] if a.tiny else []
        r = run_sampled([a.bin, *args, "--runs", str(a.runs), *flags], os.path.join(a.out, f"ours_{tag}.log"), env,
                        timeout=timeout)
        up = r[0].get("upscale", {})
        res["ours"][tag] = {"args": args, "rc": r[2], "mem": r[1], "load_s": r[0].get("load", {}).get("s"),
                            "first_s": up.get("first_s"), "median_s": up.get("median_s"), "times": up.get("times"),
                            "tiles": up.get("tiles")}
        print(f"== ours {tag}: rc={r[2]} median {up.get('median_s')} s, peak {r[1]['peak_mib']} MiB", flush=True)
        save()
        return r

    r = py("write")
    if r is None or r[2] != 0:
        print("write failed; stopping", flush=True)
        save()
        return 1
    models = [m for m in a.models.split(",") if m]

    def case_args(model, size, tile, overlap, blend="crop"):
        args = ["--model", os.path.join(a.work, f"{model}.pth"), "--input", os.path.join(a.work, f"img_{size}.rgb"),
                "--size", str(size), "--blend", blend]
        if tile:
            args += ["--tile", str(tile), "--overlap", str(overlap)]
        return args

    if a.followup:
        for (m, size, tile, overlap, extra) in FOLLOWUP:
            ours(f"followup_{m}_{size}_{tile}_{overlap}{''.join('_' + x.strip('-').replace('-', '_') for x in extra)}",
                 case_args(m, size, tile, overlap) + extra)
        lines = ["| case | median (s) | first (s) | times (s) | peak (MiB) |", "| --- | ---: | ---: | --- | ---: |"]
        for k, v in res["ours"].items():
            times = ", ".join(f"{t:.3f}" for t in v.get("times") or [])
            lines.append(f"| {k} | {v.get('median_s')} | {v.get('first_s')} | {times} | {v.get('mem', {}).get('peak_mib')} |")
        res["table"] = "\n".join(lines)
        save()
        print("\n" + res["table"], flush=True)
        with open(os.path.join(a.out, "esrgan_table.md"), "w") as f:
            f.write(res["table"] + "\n")
        return 0

    all_cases = cases(cfg)
    for model in models:
        if not a.skip_python:
            r = py("python", ["--model", model])
            if r is not None:
                res["python"][model] = {"rows": r[0], "mem": r[1], "rc": r[2]}
                save()
        for (m, size, tile, overlap) in all_cases:
            if m != model:
                continue
            args = case_args(m, size, tile, overlap)
            if (m, size, tile, overlap) == cfg["agree"]:
                args += ["--save", os.path.join(a.work, "ours_agree.rgb")]
            ours(f"{m}_{size}_{tile}_{overlap}", args)
        if model == "anime_6b" and not a.skip_ablations:
            size = cfg["sizes"][-1]
            for tag, tile, overlap, extra in ablations(cfg):
                ours(f"anime_6b_{size}_{tag}", case_args("anime_6b", size, tile, overlap) + extra)
            # Feathered output at the smaller size, against Python's full frame.
            s0 = cfg["sizes"][0]
            tile, overlap = cfg["agree"][2], cfg["agree"][3]
            ours(f"anime_6b_{s0}_feather_{tile}_{overlap}",
                 case_args("anime_6b", s0, tile, overlap, blend="feather")
                 + ["--save", os.path.join(a.work, "ours_feather.rgb")])

    # Agreement (RGB8): ours vs Python at the same tiling; ours feathered vs Python full frame.
    try:
        import numpy as np

        def mae(p, q):
            if not (os.path.exists(p) and os.path.exists(q)):
                return None
            x = np.fromfile(p, dtype=np.uint8).astype(np.int16)
            y = np.fromfile(q, dtype=np.uint8).astype(np.int16)
            if x.shape != y.shape:
                return {"error": f"sizes differ: {x.shape} vs {y.shape}"}
            d = np.abs(x - y)
            return {"mae": float(d.mean()), "max": int(d.max())}

        res["agreement"] = {
            "ours_vs_python_same_tiles": mae(os.path.join(a.work, "ours_agree.rgb"),
                                             os.path.join(a.work, "python_agree.rgb")),
            "ours_feather_vs_python_full": mae(os.path.join(a.work, "ours_feather.rgb"),
                                               os.path.join(a.work, "python_full.rgb")),
            "python_same_tiles_vs_python_full": mae(os.path.join(a.work, "python_agree.rgb"),
                                                    os.path.join(a.work, "python_full.rgb")),
        }
    except Exception as ex:  # noqa: BLE001 (secondary measurement)
        res["agreement_error"] = repr(ex)

    table = make_table(res, cfg, models)
    res["table"] = table
    save()
    print("\n" + table, flush=True)
    with open(os.path.join(a.out, "esrgan_table.md"), "w") as f:
        f.write(table + "\n")
    return 0


def make_table(res, cfg, models):
    lines = []

    def f(x, d=3):
        return "–" if x is None else f"{x:.{d}f}"

    for model in models:
        prow = res["python"].get(model, {}).get("rows", {})
        lines.append(f"\n### {model}\n")
        lines.append("| input | tiling | ours (s) | Python (s) | ÷ | Python network part (s) | ours peak (MiB) | "
                     "Python peak (MiB) | ÷ | Python max allocated (MiB) | Python tiled vs full, mean (max) /255 |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for (m, size, tile, overlap) in cases(cfg):
            if m != model:
                continue
            tag = f"{m}_{size}_{tile}_{overlap}"
            o = res["ours"].get(tag, {})
            p = prow.get(tag, {})
            om, pm = o.get("median_s"), p.get("median_s")
            opk = o.get("mem", {}).get("peak_mib")
            ppk = p.get("smi_peak_mib")
            tiling = "full frame" if not tile else f"{tile} / {overlap}"
            vs = f"{p['vs_full_mae']:.2f} ({p['vs_full_max']})" if "vs_full_mae" in p else ""
            lines.append(f"| {size}² | {tiling} | {f(om)} | {f(pm)} | {f(om / pm if om and pm else None, 2)} | "
                         f"{f(p.get('net_median_s'))} | {opk if opk is not None else '–'} | "
                         f"{ppk if ppk is not None else '–'} | "
                         f"{f(opk / ppk if opk and ppk else None, 2)} | {f(p.get('max_allocated_mib'), 0)} | {vs} |")
    abl = {k: v for k, v in res["ours"].items() if not any(k == f"{m}_{s}_{t}_{o}" for (m, s, t, o) in cases(cfg))}
    if abl:
        lines.append("\n### ablations of ours (anime_6b)\n")
        lines.append("| case | median (s) | first (s) | peak (MiB) |")
        lines.append("| --- | ---: | ---: | ---: |")
        for k, v in abl.items():
            lines.append(f"| {k} | {f(v.get('median_s'))} | {f(v.get('first_s'))} | {v.get('mem', {}).get('peak_mib')} |")
    if res.get("agreement"):
        lines.append("\nagreement (RGB8, mean (max) /255): " + json.dumps(res["agreement"]))
    if res.get("skipped"):
        lines.append("\nskipped (out of budget): " + ", ".join(res["skipped"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
