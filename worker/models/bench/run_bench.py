"""SDXL engine (vnfarm-models, tch) vs diffusers, same GPU, same random weights, one run.

Usage on a GPU machine with torch, transformers and diffusers (docs/performance.md has the exact
device call):

    python3 worker/models/bench/run_bench.py --bin .bench/bench [--work /tmp/sdxl_bench] [--out DIR]
        [--base-bin .bench/bench_base] [--variants base,after,...] [--skip-components] [--iters 5]

1. `write`: a subprocess builds diffusers' `StableDiffusionXLPipeline` from the real SDXL base configs
   (UNet, VAE, CLIP ViT-L, OpenCLIP bigG) with random weights (seed 0), bf16, CLIP tokenizers rebuilt
   from our bundled `tokenizer/clip/tokenizer.json.gz` (pad `<|endoftext|>` and `!`), an Euler scheduler,
   and `save_pretrained`s it into `--work` (a diffusers folder both engines load).
2. `read`: the time to read every weight file of that folder from the page cache, twice, in Python
   (`readinto` a 64 MiB buffer) and with our binary (`bench read`, `read` into a 64 MiB buffer): the
   baseline for load times.
3. `pipeline`: diffusers (`StableDiffusionXLPipeline.from_pretrained(...).to("cuda")`, SDPA, eager) and
   ours (`bench pipeline`, `SdxlPipeline::load` + `generate`) in separate processes: load time, then
   Euler 20 steps, cfg 4.5, prompt + negative prompt, seed 0: 1024² first call and median of
   `--iters`, 1920×1080 and 4 images at 1024² (first call and median of `ceil(iters/2)`). Ours runs
   once per `--variants` entry (library version, loader, allocator settings; see VARIANTS).
4. `components` (unless `--skip-components`; run before step 3): the UNet/VAE cases of the first
   benchmark (UNet CFG batch 2 and batch 8, VAE decode/encode), diffusers then ours.

GPU memory is sampled every 20 ms during each process (NVML `memory.used` of GPU 0, else nvidia-smi
every 100 ms): the peak minus the idle reading before the process, for the whole process and for each
case's time window (`t0`..`t1` printed by both sides). It includes the CUDA context and the caching
allocator's reserved-but-free memory. diffusers' `torch.cuda.max_memory_allocated` is reported per
case for information (no tch binding exists for ours).

Writes `results.json`, `table.md` and the logs to `--out`; prints the tables.
`--tiny --cpu --iters 1` runs the whole flow on the CPU with diffusers' tiny SDXL test configs (a
smoke test of this script, not a benchmark).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_TOKENIZER = os.path.join(HERE, "..", "tokenizer", "clip", "tokenizer.json.gz")

# Same strings as examples/bench.rs.
PROMPT = ("a photograph of an astronaut riding a horse on the surface of the moon, "
          "earth in the sky, highly detailed, sharp focus, dramatic lighting")
NEGATIVE = "blurry, low quality, watermark, text, deformed"
CFG, STEPS = 4.5, 20

# name -> (width, height, images); iterations: gen_1024 `--iters`, the others ceil(iters/2).
GEN_CASES = {"gen_1024": (1024, 1024, 1), "gen_1920x1080": (1920, 1080, 1), "gen_1024_x4": (1024, 1024, 4)}
# With --gen-2048 (run 5): diffusers also generates at 2048² (untiled VAE, its default).
GEN_2048 = {"gen_2048": (2048, 2048, 1)}
ALL_GEN = {**GEN_CASES, **GEN_2048}
UNET_CASES = {"unet_cfg_1024": (2, 128, 128), "unet_cfg_1280x720": (2, 90, 160), "unet_b8_1024": (8, 128, 128)}
VAE_CASES = {
    "vae_decode_1024": (128, 128, False),
    "vae_decode_1216x832_untiled": (104, 152, False),
    "vae_decode_1216x832_difftiled": (104, 152, True),
    "vae_decode_1920x1080_untiled": (135, 240, False),
    "vae_decode_1920x1080_difftiled": (135, 240, True),
    "vae_decode_2048_untiled": (256, 256, False),
    "vae_decode_2048_difftiled": (256, 256, True),
}
# Our seam-free tiled decode (no diffusers counterpart), reported beside the cases above.
OURS_VAE_EXTRA = [f"vae_decode_{s}_{v}" for s in ["1216x832", "1920x1080", "2048"]
                  for v in ["seamfree"]] + ["vae_decode_1920x1080_seamfree_exact_stats"]
# `bench components` runs of ours (`--component-variants`): extra arguments. The kernels campaign's
# variants (channels-last, cuDNN benchmark mode, the memory-efficient SDPA kernel; docs/performance.md)
# are gone with the code they measured. Every components run also times the UNet cases replayed from a
# CUDA graph (`unet_graph_*`, with their parity against the eager forward).
COMPONENT_VARIANTS = {
    "c_base": [],
    "c_base_again": ["--unet-only"],
    "c_unet": ["--unet-only"],
    # The feed-forward GELU in the matmul's epilogue (kernels attempt 8).
    "c_gelu": ["--unet-only", "--ff-gelu-epilogue"],
    # The same, with one batch-8 forward recorded by libtorch's profiler into OUT/trace_*.json
    # (`trace_breakdown.py` sorts the kernels).
    # The UNet NHWC (kernels attempt 10), with and without the epilogue GELU.
    "c_cl": ["--unet-only", "--unet-channels-last"],
    "c_cl_gelu": ["--unet-only", "--unet-channels-last", "--ff-gelu-epilogue"],
    "c_cl_prof": ["--unet-only", "--unet-channels-last", "--profile-trace", "{out}/trace_c_cl.json"],
    "c_unet_prof": ["--unet-only", "--profile-trace", "{out}/trace_c_unet.json"],
    "c_gelu_prof": ["--unet-only", "--ff-gelu-epilogue", "--profile-trace", "{out}/trace_c_gelu.json"],
    # The fused normalisation kernels (kernels attempt 11): NCHW (only the residual add + LayerNorm
    # pairs are fused), NHWC (the GroupNorms too; with the kernel check against fp32 first), NHWC
    # with the epilogue GELU, and that one profiled.
    "c_fused": ["--unet-only", "--norm-kernels-fused"],
    "c_cl_fused": ["--unet-only", "--unet-channels-last", "--norm-kernels-fused", "--norms-check"],
    "c_cl_gelu_fused": ["--unet-only", "--unet-channels-last", "--ff-gelu-epilogue", "--norm-kernels-fused"],
    "c_cl_gelu_fused_prof": ["--unet-only", "--unet-channels-last", "--ff-gelu-epilogue", "--norm-kernels-fused",
                             "--profile-trace", "{out}/trace_c_cl_gelu_fused.json"],
    "c_vae": ["--vae-only"],
    "c_vae_nchw": ["--vae-only", "--vae-memory-format", "contiguous"],
}
# Our pipeline runs: binary ("bin" = --bin, "base" = --base-bin), extra `bench pipeline` arguments,
# environment. Runs 1 and 2 of docs/performance.md also measured variants of intermediate versions
# (VAE decode batch, mmap copies, device slabs); their options are gone with the code they measured.
VARIANTS = {
    # The library before this work (git ca35d46, built with this bench.rs and `set_loader` emptied):
    # copy out of the mmap + synchronous pageable copy per tensor.
    "base": ("base", [], {}),
    # Pinned staging buffer (pread) + asynchronous copies, tokenizers parsed in a thread during the
    # load, resnets free activations early.
    "after": ("bin", [], {}),
    "after_again": ("bin", [], {}),
    "after_expandable": ("bin", [], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    # 4 images at 1024² alone (no earlier case has grown the allocator's pool).
    "x4only_after": ("bin", ["--cases", "gen_1024_x4"], {}),
    "x4only_base": ("base", ["--cases", "gen_1024_x4"], {}),
    # Load-only runs (loader comparisons).
    "load_staged": ("bin", ["--load-only"], {}),
    "load_staged_again": ("bin", ["--load-only"], {}),
    "load_direct": ("bin", ["--load-only", "--loader", "direct"], {}),
    "load_base": ("base", ["--load-only"], {}),
    "load_staged_expandable": ("bin", ["--load-only"], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    # 2048² alone in its own process (so the process peak is this case's): VAE tiling automatic (the
    # worker's default: tiles above 1024 px) and off.
    "gen2048_auto": ("bin", ["--cases", "gen_2048", "--tiling", "auto"], {}),
    "gen2048_never": ("bin", ["--cases", "gen_2048", "--tiling", "never"], {}),
    # The UNet loaded on its own thread (the default since run 4) against one thread for everything.
    "load_parallel": ("bin", ["--load-only"], {}),
    "load_parallel_again": ("bin", ["--load-only"], {}),
    "load_sequential": ("bin", ["--load-only", "--sequential-load"], {}),
    "load_sequential_again": ("bin", ["--load-only", "--sequential-load"], {}),
    # 1024² alone (2026-12-01 runs).
    "k_default": ("bin", ["--cases", "gen_1024"], {}),
    # 2048² with the VAE budget rule (the default budget decodes it untiled) and with a 2 GiB budget
    # (the seam-free tiled decode).
    "gen2048_budget": ("bin", ["--cases", "gen_2048", "--tiling", "auto"], {}),
    "gen2048_budget2g": ("bin", ["--cases", "gen_2048", "--tiling", "auto", "--vae-budget-mib", "2048"], {}),
    # The UNet forward replayed from a CUDA graph (`PipelineConfig::cuda_graphs`).
    "graphs": ("bin", ["--cuda-graphs"], {}),
    # One size alone in its own process (process peak = that case's), eager (k_default, x4only_after) and graphed.
    "k_graphs": ("bin", ["--cases", "gen_1024", "--cuda-graphs"], {}),
    "x4only_graphs": ("bin", ["--cases", "gen_1024_x4", "--cuda-graphs"], {}),
    # The feed-forward GELU in the matmul's epilogue (kernels attempt 8), eager and graphed.
    "gelu": ("bin", ["--ff-gelu-epilogue"], {}),
    "gelu_graphs": ("bin", ["--ff-gelu-epilogue", "--cuda-graphs"], {}),
    # The UNet NHWC (kernels attempt 10), eager and graphed.
    "cl": ("bin", ["--unet-channels-last"], {}),
    "cl_graphs": ("bin", ["--unet-channels-last", "--cuda-graphs"], {}),
    # The fused normalisation kernels on the NHWC UNet (kernels attempt 11), with the epilogue GELU,
    # eager and graphed.
    "cl_fused": ("bin", ["--unet-channels-last", "--norm-kernels-fused"], {}),
    "cl_gelu_fused": ("bin", ["--unet-channels-last", "--ff-gelu-epilogue", "--norm-kernels-fused"], {}),
    "cl_gelu_fused_graphs": ("bin", ["--unet-channels-last", "--ff-gelu-epilogue", "--norm-kernels-fused",
                                     "--cuda-graphs"], {}),
}

SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, flip_sin_to_cos=True, freq_shift=0,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)
SDXL_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, latent_channels=4, sample_size=1024, scaling_factor=0.13025)
SDXL_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
SDXL_CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                   vocab_size=49408, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
# diffusers' test_stable_diffusion_xl.py::get_dummy_components, with the full CLIP vocabulary.
TINY_UNET = dict(block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                 transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
                 cross_attention_dim=64, norm_num_groups=1)
TINY_VAE = dict(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                latent_channels=4, sample_size=128)
TINY_CLIP = dict(hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4,
                 num_hidden_layers=5, vocab_size=49408, hidden_act="gelu", projection_dim=32)


def emit(d):
    print(json.dumps(d), flush=True)


def weight_files(work):
    out = []
    for sub in ["unet", "vae", "text_encoder", "text_encoder_2"]:
        d = os.path.join(work, sub)
        out += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    return out


# ---------------------------------------------------------------------------------------------
# diffusers side (subprocesses of this script)


def diffusers_side(a):
    import torch

    dev = "cpu" if a.cpu else "cuda"
    dt = torch.float32 if a.cpu else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True

    def sync():
        if not a.cpu:
            torch.cuda.synchronize()

    def peak_gib():
        return None if a.cpu else torch.cuda.max_memory_allocated() / 2**30

    def reset_peak():
        if not a.cpu:
            torch.cuda.reset_peak_memory_stats()

    if a.diffusers_side == "write":
        write_weights(a, dev, dt, sync)
    elif a.diffusers_side == "pipeline":
        pipeline_diffusers(a, dev, dt, sync, peak_gib, reset_peak)
    elif a.diffusers_side == "components":
        components_diffusers(a, dev, dt, sync, peak_gib, reset_peak)


def make_tokenizer(pad):
    from transformers import CLIPTokenizer

    import gzip

    tj = json.load(gzip.open(BUNDLED_TOKENIZER, "rt", encoding="utf-8"))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in tj["model"]["merges"]]
    return CLIPTokenizer(vocab=tj["model"]["vocab"], merges=merges, pad_token=pad, model_max_length=77)


def write_weights(a, dev, dt, sync):
    import torch
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    emit({"name": "versions", "torch": torch.__version__, "diffusers": diffusers.__version__,
          "transformers": transformers.__version__})
    unet_kw, vae_kw = (TINY_UNET, TINY_VAE) if a.tiny else (SDXL_UNET, SDXL_VAE)
    l_kw, g_kw = (TINY_CLIP, TINY_CLIP) if a.tiny else (SDXL_CLIP_L, SDXL_CLIP_G)
    torch.manual_seed(0)
    t = time.time()
    with torch.device(dev):
        unet = UNet2DConditionModel(**unet_kw).to(dt)
        vae = AutoencoderKL(**vae_kw).to(dt)
        te1 = CLIPTextModel(CLIPTextConfig(**l_kw)).to(dt)
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(**g_kw)).to(dt)
    sync()
    emit({"name": "random_init", "s": time.time() - t,
          "params_M": {k: sum(p.numel() for p in m.parameters()) / 1e6
                       for k, m in [("unet", unet), ("vae", vae), ("te1", te1), ("te2", te2)]}})
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                   timestep_spacing="leading", prediction_type="epsilon")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=make_tokenizer("<|endoftext|>"),
                                     tokenizer_2=make_tokenizer("!"), unet=unet, scheduler=sched)
    t = time.time()
    pipe.save_pretrained(a.work, safe_serialization=True)
    os.sync()
    emit({"name": "save_weights", "s": time.time() - t,
          "files": {os.path.relpath(f, a.work): os.path.getsize(f) for f in weight_files(a.work)}})


def timed_cases(a, run_case, sync, peak_gib, reset_peak):
    """Runs every GEN_CASES entry through run_case(w, h, n) -> (seconds, first PIL/array image)."""
    import numpy as np

    cases = dict(GEN_CASES, **(GEN_2048 if a.gen_2048 else {}))
    for name, (w, h, n) in cases.items():
        if a.cpu:  # smoke-test sizes (as `bench pipeline --cpu`)
            w, h = {"gen_1920x1080": (96, 64)}.get(name, (64, 64))
        iters = a.iters if name == "gen_1024" else max(1, (a.iters + 1) // 2)
        t0 = time.time()
        reset_peak()
        first, img = run_case(w, h, n)
        row = {"name": name, "first_s": first}
        if a.save:
            os.makedirs(a.save, exist_ok=True)
            arr = np.asarray(img, dtype=np.uint8)
            p = os.path.join(a.save, f"{name}.rgb")
            arr.tofile(p)
            row.update(saved=p, width=arr.shape[1], height=arr.shape[0])
        ts = sorted(run_case(w, h, n)[0] for _ in range(iters))
        row.update(s_median=ts[len(ts) // 2], s_min=ts[0], s_max=ts[-1], iters=iters, t0=t0, t1=time.time(),
                   peak_alloc_gib=peak_gib())
        emit(row)


def pipeline_diffusers(a, dev, dt, sync, peak_gib, reset_peak):
    import torch
    from diffusers import StableDiffusionXLPipeline

    t0 = time.time()
    pipe = StableDiffusionXLPipeline.from_pretrained(a.work, torch_dtype=dt).to(dev)
    sync()
    emit({"name": "pipeline_load", "s": time.time() - t0, "t0": t0, "t1": time.time(), "peak_alloc_gib": peak_gib()})
    pipe.set_progress_bar_config(disable=True)
    emit({"name": "config", "attn_processor": type(pipe.unet.attn_processors[next(iter(pipe.unet.attn_processors))]).__name__,
          "vae_tiling": bool(getattr(pipe.vae, "use_tiling", False)), "vae_slicing": bool(getattr(pipe.vae, "use_slicing", False))})

    def run_case(w, h, n):
        gens = [torch.Generator("cpu").manual_seed(s) for s in range(n)]
        t = time.time()
        images = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, width=w, height=h, num_inference_steps=STEPS,
                      guidance_scale=CFG, num_images_per_prompt=n, generator=gens if n > 1 else gens[0],
                      output_type="pil").images
        sync()
        return time.time() - t, images[0]

    with torch.no_grad():
        timed_cases(a, run_case, sync, peak_gib, reset_peak)


def components_diffusers(a, dev, dt, sync, peak_gib, reset_peak):
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    def bench(name, fn, warm, iters):
        t0 = time.time()
        reset_peak()
        before = torch.cuda.memory_allocated() / 2**30
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
              "t0": t0, "t1": time.time(), "peak_alloc_gib": peak_gib(), "work_gib": peak_gib() - before})

    t0 = time.time()
    unet = UNet2DConditionModel.from_pretrained(f"{a.work}/unet", torch_dtype=dt).to(dev).eval()
    sync()
    emit({"name": "unet_load", "s": time.time() - t0, "t0": t0, "t1": time.time()})
    with torch.no_grad():
        for name, (b, h, w) in UNET_CASES.items():
            x = torch.randn(b, 4, h, w, device=dev, dtype=dt)
            ctx = torch.randn(b, 154, 2048, device=dev, dtype=dt)
            added = {"text_embeds": torch.randn(b, 1280, device=dev, dtype=dt),
                     "time_ids": torch.randn(b, 6, device=dev, dtype=dt)}
            ts = torch.tensor([500.0] * b, device=dev)
            bench(name, lambda: unet(x, ts, encoder_hidden_states=ctx, added_cond_kwargs=added).sample, 3, 10)
    del unet
    torch.cuda.empty_cache()

    t0 = time.time()
    vae = AutoencoderKL.from_pretrained(f"{a.work}/vae", torch_dtype=dt).to(dev).eval()
    sync()
    emit({"name": "vae_load", "s": time.time() - t0, "t0": t0, "t1": time.time()})
    def rgb8(x):
        return ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round()

    with torch.no_grad():
        untiled = {}
        for name, (h, w, tiled) in VAE_CASES.items():
            if tiled:
                vae.enable_tiling()
            else:
                vae.disable_tiling()
            torch.manual_seed(1)
            z = torch.randn(1, 4, h, w, device=dev, dtype=dt)
            if not tiled:
                untiled[(h, w)] = rgb8(vae.decode(z).sample)
            elif (h, w) in untiled:  # diffusers' own tiled vs untiled (seams)
                d = (rgb8(vae.decode(z).sample) - untiled[(h, w)]).abs()
                emit({"name": f"{name}_vs_untiled", "mae": d.mean().item(), "max": d.max().item()})
            bench(name, lambda: vae.decode(z).sample, 2, 5)
        untiled.clear()
        vae.disable_tiling()
        x = torch.randn(1, 3, 1024, 1024, device=dev, dtype=dt)
        bench("vae_encode_1024", lambda: vae.encode(x).latent_dist.mean, 2, 5)


# ---------------------------------------------------------------------------------------------
# driver


class MemSampler:
    """GPU 0 memory.used in MiB, sampled in a thread: NVML every 20 ms, else nvidia-smi every 100 ms."""

    def __init__(self):
        self.samples, self.kind, self._nvml, self.period = [], None, None, 0.1
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20
            self.kind, self.period = "nvml", 0.02
        except Exception:
            try:
                self._smi()
                self.kind, self.period = "nvidia-smi", 0.1
            except Exception:
                self.kind = None

    @staticmethod
    def _smi():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True)
        return int(out.stdout.strip().splitlines()[0])

    def used(self):
        if self.kind is None:
            return 0
        return self._nvml() if self._nvml else self._smi()

    def run(self, stop):
        while not stop.is_set():
            try:
                self.samples.append((time.time(), self.used()))
            except Exception:
                pass
            time.sleep(self.period)


def run_sampled(cmd, log_path, env=None, timeout=420):
    """Runs cmd (killed after `timeout` s), echoing and logging its output.
    Returns (rows by name, memory info, rc)."""
    sampler = MemSampler()
    time.sleep(0.5)
    idle = sampler.used()
    stop = threading.Event()
    th = threading.Thread(target=sampler.run, args=(stop,), daemon=True)
    th.start()
    rows = []
    t_start = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        watchdog = threading.Timer(timeout, p.kill)
        watchdog.start()
        for line in p.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
        rc = p.wait()
        watchdog.cancel()
    wall = time.time() - t_start
    stop.set()
    th.join()
    s = sampler.samples
    peak = max([u for _, u in s] + [idle]) - idle
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if "t0" in r and "t1" in r:
            inside = [u for t, u in s if r["t0"] <= t <= r["t1"]]
            r["smi_peak_mib"] = (max(inside) - idle) if inside else None
    return by_name, {"idle_mib": idle, "peak_mib": peak, "sampler": sampler.kind, "samples": len(s),
                     "wall_s": wall}, rc


def py_read(files):
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    out = []
    for i in range(2):
        t = time.time()
        total = 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    n = fh.readinto(mv)
                    if not n:
                        break
                    total += n
        s = time.time() - t
        out.append({"name": f"py_read_pass{i}", "s": s, "bytes": total, "gb_per_s": total / s / 1e9})
        emit(out[-1])
    return out


def ratio(o, d):
    return f"**{o / d:.2f}**" if o is not None and d else "n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".bench/bench")
    ap.add_argument("--base-bin", default=".bench/bench_base")
    ap.add_argument("--work", default="/tmp/sdxl_bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="base,after")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-components", action="store_true")
    ap.add_argument("--component-variants", default="c_base", help="our `bench components` runs (COMPONENT_VARIANTS)")
    ap.add_argument("--skip-write", action="store_true", help="reuse the weights already in --work")
    ap.add_argument("--skip-pipeline", action="store_true", help="components only")
    ap.add_argument("--gen-2048", action="store_true", help="diffusers also runs a 2048x2048 generate")
    ap.add_argument("--tiny", action="store_true", help="diffusers' tiny SDXL test configs (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="run everything on the CPU in fp32 (smoke test)")
    ap.add_argument("--diffusers-side", choices=["write", "pipeline", "components"], help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.diffusers_side:
        diffusers_side(a)
        return
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    imgs = os.path.join(a.work, "images")
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,memory.used", "--format=csv"],
                             capture_output=True, text=True).stdout, flush=True)
    except FileNotFoundError:
        pass
    results = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    common = ["--work", a.work, "--iters", str(a.iters)] + (["--tiny"] if a.tiny else []) + (["--cpu"] if a.cpu else []) + (["--gen-2048"] if a.gen_2048 else [])

    def diffusers(phase, extra=()):
        r = run_sampled([sys.executable, "-u", __file__, "--diffusers-side", phase, *common, *extra],
                        f"{a.out}/diffusers_{phase}.log")
        print(f"== diffusers {phase}: rc={r[2]} {r[1]}", flush=True)
        results[f"diffusers_{phase}"] = {"rows": r[0], "mem": r[1], "rc": r[2]}
        json.dump(results, open(f"{a.out}/results.json", "w"), indent=1)
        return r

    import torch  # only for the location of libtorch

    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.join(os.path.dirname(torch.__file__), "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
    ours_flags = ["--cpu"] if a.cpu else []

    def ours(tag, args, extra_env, binary=None):
        e = dict(env)
        e.update(extra_env)
        r = run_sampled([binary or a.bin, *args, *ours_flags], f"{a.out}/ours_{tag}.log", e)
        print(f"== ours {tag}: rc={r[2]} {r[1]}", flush=True)
        results[f"ours_{tag}"] = {"rows": r[0], "mem": r[1], "rc": r[2], "args": args, "env": extra_env}
        json.dump(results, open(f"{a.out}/results.json", "w"), indent=1)
        return r

    if not a.skip_write:
        diffusers("write")
    files = weight_files(a.work)
    results["weight_bytes"] = sum(os.path.getsize(f) for f in files)
    results["py_read"] = py_read(files)
    ours("read", ["read", *files], {})

    if not a.skip_components and not a.cpu:
        diffusers("components")
        for cv in [v for v in a.component_variants.split(",") if v]:
            ours(f"components_{cv}", ["components", f"{a.work}/unet/diffusion_pytorch_model.safetensors",
                                      f"{a.work}/vae/diffusion_pytorch_model.safetensors",
                                      *[x.format(out=a.out) for x in COMPONENT_VARIANTS[cv]]], {})
    variants = [v for v in a.variants.split(",") if v]
    if a.skip_pipeline:
        variants = []
    else:
        diffusers("pipeline", ["--save", os.path.join(imgs, "diffusers")])
    for v in variants:
        which, args, extra_env = VARIANTS[v]
        ours(f"pipeline_{v}", ["pipeline", a.work, "--iters", str(a.iters), "--save", os.path.join(imgs, v), *args],
             extra_env, a.base_bin if which == "base" else a.bin)

    # Image agreement: mean |ours - diffusers| of the first image, in 1/255 units.
    try:
        import numpy as np

        for v in variants:
            for case in ALL_GEN:
                d = results["diffusers_pipeline"]["rows"].get(case, {})
                o = results[f"ours_pipeline_{v}"]["rows"].get(case, {})
                if d.get("saved") and o.get("saved") and os.path.exists(d["saved"]) and os.path.exists(o["saved"]):
                    x = np.fromfile(d["saved"], dtype=np.uint8).astype(np.float64)
                    y = np.fromfile(o["saved"], dtype=np.uint8).astype(np.float64)
                    if x.shape == y.shape:
                        results.setdefault("image_mae", {}).setdefault(v, {})[case] = {
                            "mae": float(np.abs(x - y).mean()), "max": float(np.abs(x - y).max()),
                            "diffusers_mean": float(x.mean()), "ours_mean": float(y.mean()),
                            "diffusers_std": float(x.std()), "ours_std": float(y.std())}
                # Against our eager run (`after`), for variants of the same engine.
                e = results.get("ours_pipeline_after", {}).get("rows", {}).get(case, {})
                if v != "after" and e.get("saved") and o.get("saved") and os.path.exists(e["saved"]) \
                        and os.path.exists(o["saved"]):
                    x = np.fromfile(e["saved"], dtype=np.uint8).astype(np.float64)
                    y = np.fromfile(o["saved"], dtype=np.uint8).astype(np.float64)
                    if x.shape == y.shape:
                        results.setdefault("image_vs_after", {}).setdefault(v, {})[case] = {
                            "mae": float(np.abs(x - y).mean()), "max": float(np.abs(x - y).max())}
    except Exception as ex:  # secondary measurement
        results["image_mae_error"] = repr(ex)

    json.dump(results, open(f"{a.out}/results.json", "w"), indent=1)
    table = make_tables(results, variants, a)
    print("\n" + table, flush=True)
    with open(f"{a.out}/table.md", "w") as f:
        f.write(table + "\n")


def make_tables(res, variants, a):
    """Markdown tables: pipeline (diffusers vs each ours variant) and components."""

    def num(rows, name, key):
        r = (rows or {}).get(name)
        return r.get(key) if r else None

    def f(x, digits):
        return "n/a" if x is None else f"{x:.{digits}f}"

    dp = res.get("diffusers_pipeline", {})
    dr = dp.get("rows", {})
    ours = {v: res.get(f"ours_pipeline_{v}", {}) for v in variants}
    load_only = [v for v in variants if "--load-only" in VARIANTS[v][1]]
    partial = [v for v in variants if "--cases" in VARIANTS[v][1]]
    variants = [v for v in variants if v not in load_only and v not in partial]
    read_rust = num(res.get("ours_read", {}).get("rows"), "read_files_pass1", "s")
    read_py = res["py_read"][1]["s"] if res.get("py_read") else None
    loads = "; ".join(f"`{v}` {num(ours[v].get('rows', {}), 'pipeline_load', 's'):.2f} s = "
                      f"{num(ours[v].get('rows', {}), 'pipeline_load', 's') / read_rust:.2f}×"
                      for v in variants if read_rust and num(ours[v].get("rows", {}), "pipeline_load", "s"))
    lines = [f"Weights: {res.get('weight_bytes', 0) / 1e9:.2f} GB. Page-cache read, 2nd pass: `bench read` "
             f"{f(read_rust, 3)} s, Python `readinto` {f(read_py, 3)} s. Load ÷ `bench read`: {loads}", "",
             "| measurement | diffusers | " + " | ".join(f"ours `{v}` | ÷" for v in variants) + " |",
             "| --- | ---: |" + " ---: | ---: |" * len(variants)]

    def row(label, get, digits):
        """get(rows, mem) -> number for one side."""
        d = get(dr, dp.get("mem", {}))
        cells = [label, f(d, digits)]
        for v in variants:
            o = get(ours[v].get("rows", {}), ours[v].get("mem", {}))
            cells += [f(o, digits), ratio(o, d)]
        lines.append("| " + " | ".join(cells) + " |")

    row("pipeline load, page cache (s)", lambda r, m: num(r, "pipeline_load", "s"), 2)
    for case in ALL_GEN:
        row(f"{case}: first call (s)", lambda r, m, c=case: num(r, c, "first_s"), 3)
        row(f"{case}: median (s)", lambda r, m, c=case: num(r, c, "s_median"), 3)
    for case in ["pipeline_load"] + list(ALL_GEN):
        row(f"GPU memory during {case}: peak over idle (MiB)", lambda r, m, c=case: num(r, c, "smi_peak_mib"), 0)
    row("GPU memory, whole process: peak over idle (MiB)", lambda r, m: m.get("peak_mib"), 0)
    pk = [f"{c} {dr[c]['peak_alloc_gib']:.2f}" for c in ["pipeline_load"] + list(ALL_GEN)
          if dr.get(c, {}).get("peak_alloc_gib") is not None]
    if pk:
        lines += ["", "diffusers `torch.cuda.max_memory_allocated` (GiB, reset per case): " + ", ".join(pk)]
    if load_only:
        dl = num(dr, "pipeline_load", "s")
        lines += ["", "| load-only run | load (s) | ÷ diffusers | ÷ `bench read` |", "| --- | ---: | ---: | ---: |"]
        for v in load_only:
            o = num(ours[v].get("rows", {}), "pipeline_load", "s")
            lines.append(f"| `{v}` | {f(o, 2)} | {ratio(o, dl)} | {ratio(o, read_rust)} |")
    if partial:
        lines += ["", "| single-case run | case | first call (s) | median (s) | GPU memory, whole process: peak over idle (MiB) |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for v in partial:
            rows = ours[v].get("rows", {})
            for case in ALL_GEN:
                if case in rows:
                    lines.append(f"| `{v}` | {case} | {f(num(rows, case, 'first_s'), 3)} | {f(num(rows, case, 's_median'), 3)} | "
                                 f"{ours[v].get('mem', {}).get('peak_mib')} |")
    tok = [f"`{v}` {num(ours[v].get('rows', {}), 'tokenizers_parse', 's'):.3f} s" for v in variants + load_only
           if num(ours[v].get("rows", {}), "tokenizers_parse", "s") is not None]
    if tok:
        lines += ["", "Tokenizer parse time alone (both tokenizers, before the load): " + ", ".join(tok)]
    spread = []
    for case in ALL_GEN:
        for name, rows in [("diffusers", dr)] + [(f"`{v}`", ours[v].get("rows", {})) for v in variants]:
            r = rows.get(case)
            if r and r.get("s_min") is not None:
                spread.append(f"{case} {name} {r['s_min']:.3f}–{r['s_max']:.3f} ({r['iters']})")
    if spread:
        lines += ["", "min–max (iterations): " + "; ".join(spread)]
    if res.get("image_vs_after"):
        lines += ["", "Image agreement with our eager run (`after`), first image, mean in 1/255 (max): " + "; ".join(
            f"`{v}` " + ", ".join(f"{c} {m['mae']:.2f} ({m['max']:.0f})" for c, m in cs.items())
            for v, cs in res["image_vs_after"].items())]
    if res.get("image_mae"):
        lines += ["", "Image agreement, first image, mean |ours − diffusers| in 1/255 (max): " + "; ".join(
            f"`{v}` " + ", ".join(f"{c} {m['mae']:.2f} ({m['max']:.0f})" for c, m in cs.items())
            for v, cs in res["image_mae"].items())]

    cvs = [v for v in a.component_variants.split(",") if f"ours_components_{v}" in res]
    if "diffusers_components" in res and cvs:
        dc = res["diffusers_components"]["rows"]
        ocs = {v: res[f"ours_components_{v}"]["rows"] for v in cvs}
        lines += ["", "Components, median ms (ours ÷ diffusers); GPU memory: nvidia-ml peak over idle in the case's window (MiB), "
                  "diffusers' `max_memory_allocated` − allocated before the case (GiB)", "",
                  "| component | diffusers | " + " | ".join(f"`{v}`" for v in cvs) + " | memory: diffusers smi / work GiB; ours (first) smi |",
                  "| --- | ---: |" + " ---: |" * len(cvs) + " ---: |"]
        for name in ["unet_load", "vae_load"]:
            ds = num(dc, name, "s")
            cells = [f"{f(num(ocs[v], name, 's'), 3)} ({ratio(num(ocs[v], name, 's'), ds)})" for v in cvs]
            lines.append(f"| {name} (s) | {f(ds, 3)} | " + " | ".join(cells) + " | |")
        graphed = [n.replace("unet_", "unet_graph_", 1) for n in UNET_CASES]
        for name in list(UNET_CASES) + graphed + list(VAE_CASES) + OURS_VAE_EXTRA + ["vae_encode_1024"]:
            # A graphed UNet case is compared with diffusers' eager forward of the same shapes.
            x = dc.get(name) or dc.get(name.replace("unet_graph_", "unet_", 1))
            d = x["ms_median"] if x else None
            cells = []
            for v in cvs:
                y = ocs[v].get(name)
                cells.append(f"{y['ms_median']:.1f} ({ratio(y['ms_median'], d)})" if y else "–")
            first = ocs[cvs[0]]
            lines.append(f"| {name} | {f(d, 1)} | " + " | ".join(cells) +
                         f" | {num(dc, name, 'smi_peak_mib')} / {f(num(dc, name, 'work_gib'), 2)}; {num(first, name, 'smi_peak_mib')} |")
        par = [f"{v} {n}: capture {r['capture_s']:.2f} s, max |graph − eager| {r['max_abs_diff_vs_eager']:.3g} "
               f"(mean {r['mean_abs_diff_vs_eager']:.3g}, mean |eager| {r['mean_abs_eager']:.3g}), "
               f"replay vs replay {r['max_abs_diff_replay_vs_replay']:.3g}"
               for v in cvs for n in graphed for r in [ocs[v].get(f"{n}_parity")] if r]
        errs = [f"{v} {n}: {ocs[v][n]['error']}" for v in cvs for n in graphed if ocs[v].get(n, {}).get("error")]
        if par or errs:
            lines += ["", "CUDA graph parity (same inputs and weights): " + "; ".join(par + errs)]
        diffs = []
        for name in list(VAE_CASES) + OURS_VAE_EXTRA:
            for side, rows in [("diffusers", dc)] + [(f"`{v}`", ocs[v]) for v in cvs]:
                r = rows.get(f"{name}_vs_untiled")
                if r:
                    diffs.append(f"{name} {side} {r['mae']:.3f} ({r['max']:.0f})")
        if diffs:
            lines += ["", "Tiled vs untiled decode, RGB8, mean (max) in 1/255: " + "; ".join(diffs)]
        plans = [f"{k[len('vae_plan_'):]}: estimate {r['decode_bytes_estimate'] / 2**30:.2f} GiB, core {r['core']}, margin {r['margin']}, "
                 f"stats stride {r['stats_stride']} (budget {r['budget_mib']} MiB)"
                 for k, r in ocs[cvs[0]].items() if k.startswith("vae_plan_")]
        if plans:
            lines += ["", "Seam-free plans (latent px): " + "; ".join(plans)]
        sdp = [f"{k}={r['backend']}" for k, r in ocs[cvs[0]].items() if k.startswith("sdp_choice")]
        if sdp:
            lines += ["", "SDPA backend libtorch picks (0 math, 1 flash, 2 efficient, 3 cuDNN): " + ", ".join(sdp)]
        dm = res["diffusers_components"]["mem"]["peak_mib"]
        lines.append("")
        lines.append(f"Process GPU memory peak over idle (MiB): diffusers {dm}; " +
                     ", ".join(f"`{v}` {res[f'ours_components_{v}']['mem']['peak_mib']}" for v in cvs))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
