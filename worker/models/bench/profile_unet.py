"""Where the SDXL UNet's time goes at batch 8 (1024², bf16) on a GPU, and what the usual eager-mode
levers do to it, measured on diffusers' UNet with random weights of the real config (the same
module vnfarm's UNet mirrors, the same kernels libtorch picks for both):

- a kernel-time breakdown of one forward (torch.profiler), grouped into GEMM, convolution,
  attention, normalisation, elementwise and other by kernel name;
- the forward's time (median of 10 after warm-up, CUDA events) for: the default; fused QKV
  projections (`fuse_qkv_projections`); each SDPA backend forced (flash, cuDNN, memory-efficient);
  channels-last; at batch 8 and at CFG batch 2.

It decides which kernel work could reach step 8's goal (batch 8 ≤ 0.8× diffusers) before any of
it is written in Rust. Usage on the GPU machine, diffusers on PYTHONPATH:

    python3 worker/models/bench/profile_unet.py --out DIR

Writes DIR/profile_unet.json and prints it.
"""

import argparse
import json
import os
from collections import defaultdict

import torch
from diffusers import UNet2DConditionModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from trace_breakdown import summarise  # this folder is on sys.path when run as a script

DEV, DT = "cuda", torch.bfloat16


def make_unet():
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=128, in_channels=4, out_channels=4, flip_sin_to_cos=True, freq_shift=0,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    ).to(DEV, DT).eval()


def inputs(batch, h=128, w=128, channels_last=False):
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(batch, 4, h, w, device=DEV, dtype=DT, generator=g)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    ctx = torch.randn(batch, 154, 2048, device=DEV, dtype=DT, generator=g)
    added = {
        "text_embeds": torch.randn(batch, 1280, device=DEV, dtype=DT, generator=g),
        "time_ids": torch.randn(batch, 6, device=DEV, dtype=DT, generator=g),
    }
    t = torch.full((batch,), 500.0, device=DEV)
    return x, t, ctx, added


def timed(fn, warm=3, iters=10):
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
    return {"ms_median": ts[len(ts) // 2], "ms_min": ts[0], "ms_max": ts[-1]}


def forward(unet, args):
    x, t, ctx, added = args
    return lambda: unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added).sample


def breakdown(unet, args):
    f = forward(unet, args)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for avg in prof.key_averages():
        if avg.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(avg, "self_device_time_total", 0) or getattr(avg, "self_cuda_time_total", 0)
        kernels[avg.key] += us
    return summarise(kernels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    unet = make_unet()
    with torch.no_grad():
        res["breakdown_b8_1024"] = breakdown(unet, inputs(8))
        print(json.dumps(res["breakdown_b8_1024"], indent=1), flush=True)
        cases = {"b8_1024": 8, "cfg_b2_1024": 2}
        variants = {}
        for case, batch in cases.items():
            args = inputs(batch)
            variants[f"{case}/default"] = timed(forward(unet, args))
            for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
                try:
                    with sdpa_kernel(backend):
                        variants[f"{case}/sdpa_{name}"] = timed(forward(unet, args))
                except Exception as e:  # a backend may refuse a shape
                    variants[f"{case}/sdpa_{name}"] = {"error": str(e)[:200]}
            print(case, json.dumps({k: v for k, v in variants.items() if k.startswith(case)}), flush=True)
        unet.fuse_qkv_projections()
        for case, batch in cases.items():
            variants[f"{case}/fused_qkv"] = timed(forward(unet, inputs(batch)))
        unet.unfuse_qkv_projections()
        unet.to(memory_format=torch.channels_last)
        for case, batch in cases.items():
            variants[f"{case}/channels_last"] = timed(forward(unet, inputs(batch, channels_last=True)))
        res["variants"] = variants
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_unet.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["variants"], indent=1))


if __name__ == "__main__":
    main()
