"""Random-weight models of the real configurations, for runs on the GPU machine that need no
diffusers: an SDXL single-file checkpoint in ldm key names (every key and shape of SDXL base, from
`worker/models/fixtures/sdxl/reference/sdxl_base_tables.json.gz`) and a Real-ESRGAN x4plus network
(RRDBNet, 23 blocks, BasicSR names) as safetensors.

Weights follow PyTorch's default initialisation, which diffusers' `from_config` models also get:
convolution and linear weights uniform in +-1/sqrt(fan_in), biases uniform in the same bound,
normalisation weights one and biases zero, embeddings normal(0, 0.02). A network so initialised
keeps its activations bounded in bf16, which is what speed and agreement measurements need; its
images mean nothing.

    python3 make_random_models.py OUT_DIR [--dtype bf16|fp16]
"""

import argparse
import gzip
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TABLES = os.path.join(HERE, "..", "fixtures", "sdxl", "reference", "sdxl_base_tables.json.gz")


def random_tensor(name, shape, gen):
    if len(shape) == 0:
        return torch.ones(shape)
    if len(shape) == 1:
        # Every 1-D weight of SDXL is a normalisation's scale (ldm names some `in_layers.0`,
        # `out.0`): one; biases zero. A zero scale would make the UNet's output identically zero.
        return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
    if "embedding" in name or name.endswith("positional_embedding") or "token_embedding" in name:
        return torch.randn(shape, generator=gen) * 0.02
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    bound = 1.0 / math.sqrt(max(fan_in, 1))
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def sdxl(out, dtype, gen):
    with gzip.open(TABLES, "rt") as f:
        shapes = json.load(f)["shapes"]["ldm"]
    tensors = {}
    for name, shape in shapes.items():
        t = random_tensor(name, shape, gen)
        # logit_scale and similar scalars stay fp32-like values; everything else in dtype.
        tensors[name] = t.to(dtype).contiguous()
    path = os.path.join(out, "sdxl_random.safetensors")
    save_file(tensors, path)
    return path, sum(t.numel() for t in tensors.values())


def esrgan(out, gen):
    feat, grow, blocks = 64, 32, 23
    t = {}

    def conv(name, cout, cin):
        t[name + ".weight"] = random_tensor(name + ".weight", [cout, cin, 3, 3], gen) * 0.1
        t[name + ".bias"] = torch.zeros(cout)

    conv("conv_first", feat, 3)
    for b in range(blocks):
        for r in range(1, 4):
            for c in range(1, 6):
                cin = feat + (c - 1) * grow
                cout = feat if c == 5 else grow
                conv(f"body.{b}.rdb{r}.conv{c}", cout, cin)
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"]:
        conv(name, feat, feat)
    conv("conv_last", 3, feat)
    path = os.path.join(out, "esrgan_x4plus_random.safetensors")
    save_file({k: v.contiguous() for k, v in t.items()}, path)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    path, n = sdxl(args.out, dtype, gen)
    print(f"{path}: {n / 1e9:.2f} B parameters", file=sys.stderr)
    print(esrgan(args.out, gen), file=sys.stderr)


if __name__ == "__main__":
    main()
