#!/usr/bin/env python3
"""Tensor-core work of one SDXL UNet forward (the base config), by kind: the matmuls of the linear
layers, attention (QK^T and PV) and convolutions, in TFLOP (2 FLOP per multiply-add). With the
kernel times of a profile (`profile_unet.py`) it gives each kind's achieved rate; docs/performance.md,
kernels attempt 8, uses it for the batch-8 time budget.

    python3 worker/models/bench/unet_flops.py [--batch 8] [--latent 128] [--context 154]
"""
import argparse

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--latent", type=int, default=128, help="latent side (1024 px / 8)")
ap.add_argument("--context", type=int, default=154, help="text tokens (the benches use 2 x 77)")
a = ap.parse_args()
B, CTX, R0 = a.batch, a.context, a.latent
CH = [320, 640, 1280]  # block_out_channels
LAYERS = [0, 2, 10]  # transformer_layers_per_block (0: no attention in the block)
CROSS_DIM = 2048
flops = {"linear": 0, "attention": 0, "conv": 0}


def conv(cin, cout, r, k=3):
    flops["conv"] += 2 * B * r * r * cin * cout * k * k


def resnet(cin, cout, r):
    conv(cin, cout, r)
    conv(cout, cout, r)
    if cin != cout:
        conv(cin, cout, r, k=1)


def transformer(c, r, n):
    m = B * r * r  # tokens in the batch
    flops["linear"] += 2 * (2 * m * c * c)  # proj_in, proj_out
    for _ in range(n):
        flops["linear"] += 4 * 2 * m * c * c  # self-attention q, k, v, out
        flops["linear"] += 2 * 2 * m * c * c + 2 * 2 * B * CTX * CROSS_DIM * c  # cross: q, out; k, v
        flops["linear"] += 2 * m * c * 8 * c + 2 * m * 4 * c * c  # GEGLU proj (2 x 4c), out
        flops["attention"] += 4 * B * (r * r) ** 2 * c + 4 * B * r * r * CTX * c


res = [R0 >> i for i in range(3)]
conv(4, CH[0], R0)  # conv_in
skips, cin = [CH[0]], CH[0]
for i in range(3):
    for _ in range(2):
        resnet(cin, CH[i], res[i])
        cin = CH[i]
        if LAYERS[i]:
            transformer(CH[i], res[i], LAYERS[i])
        skips.append(cin)
    if i < 2:
        conv(CH[i], CH[i], res[i + 1])  # stride-2 downsampler, output at the next size
        skips.append(CH[i])
resnet(CH[2], CH[2], res[2])
transformer(CH[2], res[2], LAYERS[2])
resnet(CH[2], CH[2], res[2])
prev = CH[2]
for i in reversed(range(3)):
    for _ in range(3):
        resnet(prev + skips.pop(), CH[i], res[i])
        prev = CH[i]
        if LAYERS[i]:
            transformer(CH[i], res[i], LAYERS[i])
    if i > 0:
        conv(CH[i], CH[i], res[i - 1])  # upsampler's conv at the doubled size
conv(CH[0], 4, R0)  # conv_out
for k, v in flops.items():
    print(f"{k}: {v / 1e12:.1f} TFLOP")
print(f"total: {sum(flops.values()) / 1e12:.1f} TFLOP")
