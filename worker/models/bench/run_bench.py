"""SDXL engine (vnfarm-models, tch) vs diffusers, same GPU, same random weights, one run.

Usage on a GPU machine with torch and diffusers (see docs/performance.md for the exact device call):

    python3 worker/models/bench/run_bench.py --bin .bench/bench [--work /tmp/sdxl_bench] [--out DIR]

1. A subprocess builds diffusers' UNet2DConditionModel and AutoencoderKL from the real SDXL base
   configs with random weights (seed 0), bf16, and saves them with `save_pretrained` (safetensors);
   it then times `from_pretrained` of those files and the same calls as the Rust example (SDPA
   attention, eager, CUDA events, warm-up, median).
2. A second subprocess runs our example binary (`cargo build --release --example bench`) on the same
   files.
3. GPU memory: `nvidia-smi --query-gpu=memory.used` sampled every 100 ms during each subprocess
   (peak minus the idle reading before it; includes the CUDA context and allocator cache), plus
   diffusers' `torch.cuda.max_memory_allocated` per measurement (no tch binding exists for ours).

Prints one table: diffusers, ours, ratio ours/diffusers (< 1 means ours is faster).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

UNET_CASES = {"unet_cfg_1024": (2, 128, 128), "unet_cfg_1280x720": (2, 90, 160), "unet_b8_1024": (8, 128, 128)}
VAE_CASES = {
    "vae_decode_1024": (128, 128, False),
    "vae_decode_1920x1080_untiled": (135, 240, False),
    "vae_decode_1920x1080_tiled": (135, 240, True),
}


def diffusers_side(work, phase):
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    dev, dt = "cuda", torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True

    def emit(d):
        print(json.dumps(d), flush=True)

    def sync():
        torch.cuda.synchronize()

    def bench(name, fn, warm, iters):
        for _ in range(warm):
            fn()
        sync()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            sync()
            ts.append(s.elapsed_time(e))
        ts.sort()
        emit({"name": name, "ms_median": ts[len(ts) // 2], "ms_min": ts[0], "ms_max": ts[-1], "iters": iters,
              "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30})

    unet_kw = dict(sample_size=128, in_channels=4, out_channels=4, flip_sin_to_cos=True, freq_shift=0,
                   down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                   block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
                   transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
                   addition_embed_type="text_time", addition_time_embed_dim=256,
                   projection_class_embeddings_input_dim=2816)
    vae_kw = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                  layers_per_block=2, latent_channels=4, sample_size=1024, scaling_factor=0.13025)
    if phase in ("all", "write"):
        write_weights(work, unet_kw, vae_kw, emit, sync)
    if phase == "write":
        return


    # Load as a user would (files just written, so in the page cache for both engines).
    t = time.time()
    unet = UNet2DConditionModel.from_pretrained(f"{work}/unet", torch_dtype=dt).to(dev).eval()
    sync()
    emit({"name": "unet_load", "s": time.time() - t})
    with torch.no_grad():
        for name, (b, h, w) in UNET_CASES.items():
            x = torch.randn(b, 4, h, w, device=dev, dtype=dt)
            ctx = torch.randn(b, 154, 2048, device=dev, dtype=dt)
            added = {"text_embeds": torch.randn(b, 1280, device=dev, dtype=dt),
                     "time_ids": torch.randn(b, 6, device=dev, dtype=dt)}
            ts = torch.tensor([500.0] * b, device=dev)
            torch.cuda.reset_peak_memory_stats()
            bench(name, lambda: unet(x, ts, encoder_hidden_states=ctx, added_cond_kwargs=added).sample, 3, 10)
    del unet
    torch.cuda.empty_cache()

    t = time.time()
    vae = AutoencoderKL.from_pretrained(f"{work}/vae", torch_dtype=dt).to(dev).eval()
    sync()
    emit({"name": "vae_load", "s": time.time() - t})
    with torch.no_grad():
        for name, (h, w, tiled) in VAE_CASES.items():
            if tiled:
                vae.enable_tiling()
            else:
                vae.disable_tiling()
            z = torch.randn(1, 4, h, w, device=dev, dtype=dt)
            torch.cuda.reset_peak_memory_stats()
            bench(name, lambda: vae.decode(z).sample, 2, 5)
        vae.disable_tiling()
        x = torch.randn(1, 3, 1024, 1024, device=dev, dtype=dt)
        torch.cuda.reset_peak_memory_stats()
        bench("vae_encode_1024", lambda: vae.encode(x).latent_dist.mean, 2, 5)


def write_weights(work, unet_kw, vae_kw, emit, sync):
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    t = time.time()
    with torch.device("cuda"):
        unet = UNet2DConditionModel(**unet_kw).to(torch.bfloat16)
        vae = AutoencoderKL(**vae_kw).to(torch.bfloat16)
    sync()
    emit({"name": "random_init", "s": time.time() - t,
          "unet_params_M": sum(p.numel() for p in unet.parameters()) / 1e6})
    t = time.time()
    unet.save_pretrained(f"{work}/unet", max_shard_size="100GB")
    vae.save_pretrained(f"{work}/vae", max_shard_size="100GB")
    emit({"name": "save_weights", "s": time.time() - t})


def smi_used():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[0])


def run_sampled(cmd, log_path, env=None):
    """Runs cmd, echoing and logging its output; returns (json lines, peak MiB over idle, rc)."""
    idle = smi_used()
    peak = [idle]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], smi_used())
            except Exception:
                pass
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    rows = []
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in p.stdout:
            sys.stdout.write(line)
            log.write(line)
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
        rc = p.wait()
    stop.set()
    th.join()
    return {r["name"]: r for r in rows}, peak[0] - idle, rc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".bench/bench")
    ap.add_argument("--work", default="/tmp/sdxl_bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ours-first", action="store_true",
                    help="write the weights, then time ours before diffusers (checks order effects)")
    ap.add_argument("--diffusers-side", choices=["all", "write", "time"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.diffusers_side:
        diffusers_side(a.work, a.diffusers_side)
        return
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,memory.used", "--format=csv"],
                         capture_output=True, text=True).stdout, flush=True)

    def run_diffusers(phase):
        r = run_sampled([sys.executable, "-u", __file__, "--diffusers-side", phase, "--work", a.work],
                        f"{a.out}/diffusers_{phase}.log")
        print(f"diffusers side ({phase}) rc={r[2]} nvidia-smi peak {r[1]} MiB", flush=True)
        return r

    def run_ours():
        import torch
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.path.join(os.path.dirname(torch.__file__), "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
        r = run_sampled([a.bin, f"{a.work}/unet/diffusion_pytorch_model.safetensors",
                         f"{a.work}/vae/diffusion_pytorch_model.safetensors"], f"{a.out}/ours.log", env)
        print(f"ours rc={r[2]} nvidia-smi peak {r[1]} MiB", flush=True)
        return r

    if a.ours_first:
        run_diffusers("write")
        ours, ours_peak, rc_o = run_ours()
        diff, diff_peak, rc_d = run_diffusers("time")
    else:
        diff, diff_peak, rc_d = run_diffusers("all")
        ours, ours_peak, rc_o = run_ours()

    json.dump({"diffusers": diff, "ours": ours, "diffusers_smi_peak_mib": diff_peak, "ours_smi_peak_mib": ours_peak,
               "rc": {"diffusers": rc_d, "ours": rc_o}}, open(f"{a.out}/results.json", "w"), indent=1)
    lines = ["| measurement | diffusers | ours | ours/diffusers |", "| --- | ---: | ---: | ---: |"]

    def fmt(r, key):
        return f"{r[key]:.1f}" if r and key in r else "n/a"

    for name in ["unet_load", "vae_load"]:
        d, o = diff.get(name), ours.get(name)
        ratio = f"{o['s'] / d['s']:.2f}" if d and o else "n/a"
        lines.append(f"| {name} (s) | {d['s'] if d else float('nan'):.2f} | {o['s'] if o else float('nan'):.2f} | {ratio} |")
    for name in list(UNET_CASES) + list(VAE_CASES) + ["vae_encode_1024"]:
        d, o = diff.get(name), ours.get(name)
        ratio = f"{o['ms_median'] / d['ms_median']:.2f}" if d and o else "n/a"
        extra = f" (diffusers peak alloc {d['peak_alloc_gib']:.1f} GiB)" if d and "peak_alloc_gib" in d else ""
        lines.append(f"| {name} median ms [min–max]{extra} | {fmt(d, 'ms_median')} [{fmt(d, 'ms_min')}–{fmt(d, 'ms_max')}]"
                     f" | {fmt(o, 'ms_median')} [{fmt(o, 'ms_min')}–{fmt(o, 'ms_max')}] | {ratio} |")
    lines.append(f"| process GPU memory peak, nvidia-smi (MiB over idle) | {diff_peak} | {ours_peak} |"
                 f" {ours_peak / diff_peak if diff_peak else float('nan'):.2f} |")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    with open(f"{a.out}/table.md", "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
