"""The studio's sequential Python session, the reference for `vnfarm-worker bench` (issue 26).

One process holds the three models warm and runs the jobs one after another, as the studio's
session does: diffusers' `StableDiffusionXLPipeline` (Euler, bf16, SDPA), diffusers'
`QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509, bf16, the Lightning 4-step LoRA fused) and
Real-ESRGAN x4plus (`fixtures/esrgan/realesrgan_ref.py`: BasicSR's RRDBNet and `RealESRGANer`, fp16,
`enhance` with `outscale`, OpenCV's Lanczos for the ×2 from ×4), each job's image written as PNG.

It reads the same work messages the worker's benchmark reads (one JSON object per line; a batch
message's jobs run one after another), from the same model files (random weights of the real
configurations: `run_bench.py`'s diffusers folder, `run_qwen_bench.py`'s ComfyUI files, the LoRA and
Real-ESRGAN file this script writes), and reports what the worker's report holds: jobs and
pipelines per hour over the wall time from the first job's start to the last PNG written, the
compute time from CUDA events recorded around each pipeline call (the call from prompt and input
image on the host to the image on the host, as the worker's engine run is timed), busy = compute ÷
wall, time per job outside compute, `max_memory_allocated` / `max_memory_reserved` (the shell
samples NVML for both processes beside it).

    python3 run_session_bench.py write --models DIR [--tiny]      # the LoRA and Real-ESRGAN files
    python3 run_session_bench.py run --models DIR --work FILE [--work FILE2] --out DIR [--tiny]

`--tiny`: the fixtures' tiny configurations on the CPU in fp32 (a smoke test of the flow; the
events are then the host's clock).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(MODELS_DIR, "fixtures", "esrgan"))

LORA_FILE = "qwen_lightning_random.safetensors"
ESRGAN_FILE = "esrgan_x4plus_random.safetensors"
LORA_RANK = 64


def emit(d):
    print(json.dumps(d), flush=True)


def qwen_args(a):
    """The attributes `run_qwen_bench`'s helpers read."""
    import run_qwen_bench as rq

    sizes = rq.TINY_SIZES if a.tiny else rq.REAL_SIZES
    return argparse.Namespace(tiny=a.tiny, work=os.path.join(a.models, "qwen"), tokenizer=rq.DEFAULT_TOKENIZER,
                              fixtures=rq.DEFAULT_FIXTURES, profile=False, **sizes)


def transformer_linears(torch, tr):
    """(name, out, in) of every Linear in the transformer's blocks: what a Lightning LoRA touches."""
    return [(n, m.out_features, m.in_features) for n, m in tr.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")]


def write(a):
    """A Lightning-shaped LoRA of random weights (lightx2v's names: `<module>.lora_down.weight`
    `[r, in]`, `.lora_up.weight` `[out, r]`, `.alpha`) for every Linear of the transformer's blocks,
    and Real-ESRGAN x4plus (or the tiny fixture's shape) as safetensors in BasicSR's names."""
    import torch
    from safetensors.torch import save_file
    from diffusers import QwenImageTransformer2DModel

    qa = qwen_args(a)
    cfg_dir = os.path.join(qa.work, "config", "transformer")
    with torch.device("meta"):
        tr = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(cfg_dir))
    rank = 4 if a.tiny else LORA_RANK
    gen = torch.Generator().manual_seed(1)
    t = {}
    for name, out_f, in_f in transformer_linears(torch, tr):
        # Small enough that the fused transformer stays as bounded as the random base.
        t[f"{name}.lora_down.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).to(torch.bfloat16)
        t[f"{name}.lora_up.weight"] = (torch.randn(out_f, rank, generator=gen) * 1e-3).to(torch.bfloat16)
        t[f"{name}.alpha"] = torch.tensor(float(rank))
    path = os.path.join(a.models, LORA_FILE)
    save_file(t, path)
    emit({"name": "write_lora", "tensors": len(t), "bytes": os.path.getsize(path), "rank": rank})

    import make_random_models

    if a.tiny:
        import shutil

        shutil.copy(os.path.join(MODELS_DIR, "fixtures", "esrgan", "tiny_x4.pth"), os.path.join(a.models, "esrgan.pth"))
    else:
        make_random_models.esrgan(a.models, torch.Generator().manual_seed(0))
    emit({"name": "write_esrgan"})


def esrgan_path(a):
    return os.path.join(a.models, "esrgan.pth" if a.tiny else ESRGAN_FILE)


def load_esrgan(a, torch, dev):
    from realesrgan_ref import RRDBNet

    path = esrgan_path(a)
    if path.endswith(".pth"):
        sd = torch.load(path, map_location="cpu")
        sd = sd.get("params_ema", sd.get("params", sd))
    else:
        from safetensors.torch import load_file

        sd = load_file(path)
    num_feat = sd["conv_first.weight"].shape[0]
    num_block = len({k.split(".")[1] for k in sd if k.startswith("body.")})
    num_grow = sd["body.0.rdb1.conv1.weight"].shape[0]
    net = RRDBNet(3, 3, scale=4, num_feat=num_feat, num_block=num_block, num_grow_ch=num_grow)
    net.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    net = net.eval().to(dev)
    return net.half() if dev.type == "cuda" else net


def fuse_lora(a, torch, pipe, dev):
    """The Lightning LoRA into the transformer: diffusers' `load_lora_weights` + `fuse_lora` (peft),
    else, where that path refuses the file, the same arithmetic by hand (W += up·down·alpha/r)."""
    path = os.path.join(a.models, LORA_FILE)
    t = time.time()
    try:
        pipe.load_lora_weights(path, adapter_name="lightning")
        pipe.fuse_lora(lora_scale=1.0)
        pipe.unload_lora_weights()
        how = "diffusers"
    except Exception as e:  # noqa: BLE001 (recorded, then the fallback)
        emit({"name": "lora_diffusers_refused", "error": repr(e)[:500]})
        from safetensors import safe_open

        mods = dict(pipe.transformer.named_modules())
        with torch.no_grad(), safe_open(path, "pt", device=str(dev)) as f:
            for k in f.keys():
                if not k.endswith(".lora_down.weight"):
                    continue
                name = k[: -len(".lora_down.weight")]
                down, up = f.get_tensor(k).float(), f.get_tensor(name + ".lora_up.weight").float()
                alpha = f.get_tensor(name + ".alpha").item()
                w = mods[name].weight
                w.add_((up @ down * (alpha / down.shape[0])).to(w.dtype))
        how = "by hand"
    if dev.type == "cuda":
        torch.cuda.synchronize()
    emit({"name": "lora_fused", "how": how, "s": time.time() - t})
    return how


def load_all(a, torch, dev, dt):
    import run_qwen_bench as rq
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel, StableDiffusionXLPipeline)
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    times = {}
    t = time.time()
    sdxl = StableDiffusionXLPipeline.from_pretrained(os.path.join(a.models, "sdxl"), torch_dtype=dt).to(dev)
    sdxl.set_progress_bar_config(disable=True)
    times["sdxl"] = time.time() - t

    qa = qwen_args(a)
    edit_plus.CONDITION_IMAGE_SIZE, edit_plus.VAE_IMAGE_SIZE = qa.condition_area, qa.vae_area
    t = time.time()
    cfg_dir = os.path.join(qa.work, "config")
    tok, proc = rq.make_tokenizer_processor(qa)
    torch.set_default_dtype(dt)
    with torch.device(dev):
        tr = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(f"{cfg_dir}/transformer")).eval()
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_pretrained(f"{cfg_dir}/text_encoder")).eval()
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(f"{cfg_dir}/vae")).eval()
    torch.set_default_dtype(torch.float32)
    te_names = set(te.state_dict())

    def te_rename(k):
        for cand in (k, "model.language_model." + k[len("model."):] if k.startswith("model.") else None,
                     "model." + k if k.startswith("visual.") else None):
            if cand in te_names:
                return cand
        return k

    rq.load_weights(torch, tr, f"{qa.work}/{rq.FILES['transformer']}", lambda k: k, dev)
    rq.load_weights(torch, te, f"{qa.work}/{rq.FILES['text_encoder']}", te_rename, dev)
    rq.load_weights(torch, vae, f"{qa.work}/{rq.FILES['vae']}", lambda k: k, dev)
    sched = FlowMatchEulerDiscreteScheduler.from_config(FlowMatchEulerDiscreteScheduler.load_config(f"{cfg_dir}/scheduler"))
    qwen = QwenImageEditPlusPipeline(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, processor=proc,
                                     transformer=tr)
    qwen.set_progress_bar_config(disable=True)
    times["qwen"] = time.time() - t
    t = time.time()
    lora_how = fuse_lora(a, torch, qwen, dev)
    times["lora"] = time.time() - t

    t = time.time()
    esrgan = load_esrgan(a, torch, dev)
    times["esrgan"] = time.time() - t
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return sdxl, qwen, esrgan, times, lora_how


class Timer:
    """CUDA events around a call on the current stream (the host's clock on the CPU)."""

    def __init__(self, torch, dev):
        self.torch, self.cuda = torch, dev.type == "cuda"

    def __call__(self, fn):
        torch = self.torch
        if not self.cuda:
            t = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3


def upscale(torch, net, img, scale, dev, timer):
    """Real-ESRGAN's `enhance(img, outscale=scale)` for an RGB8 image: the network's part timed."""
    import numpy as np
    from realesrgan_ref import RealESRGANer

    half = dev.type == "cuda"
    arr = np.asarray(img, dtype=np.uint8)
    h, w = arr.shape[:2]

    # Real-ESRGAN's `enhance` runs under `@torch.no_grad()`; called part by part, the network would
    # otherwise keep every activation for a backward pass (the first H200 run ran out of memory so).
    @torch.inference_mode()
    def net_part():
        up = RealESRGANer(4, net, tile=0, tile_pad=10, pre_pad=0, half=half)
        up.device = dev
        up.pre_process(arr.astype(np.float32) / 255)
        up.process()
        out = up.post_process()
        return out.data.squeeze().float().cpu().clamp_(0, 1).numpy()

    out, s = timer(net_part)
    out = (np.transpose(out, (1, 2, 0)) * 255.0).round().astype(np.uint8)
    if scale != 4:
        try:
            import cv2

            out = cv2.resize(out, (int(w * scale), int(h * scale)), interpolation=cv2.INTER_LANCZOS4)
        except ImportError:
            from PIL import Image

            out = np.asarray(Image.fromarray(out).resize((int(w * scale), int(h * scale)), Image.LANCZOS))
    return out, s


def run(a):
    import numpy as np
    import torch
    from PIL import Image

    dev = torch.device(a.device or ("cpu" if a.tiny else "cuda"))
    dt = torch.float32 if a.tiny else torch.bfloat16
    if dev.type == "cpu":
        torch.set_num_threads(2)
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    sdxl, qwen, esrgan, load_times, lora_how = load_all(a, torch, dev, dt)
    load_s = time.time() - t0
    emit({"name": "load", "s": load_s, "parts_s": load_times, "lora": lora_how})
    timer = Timer(torch, dev)
    results = {}
    for work in a.work:
        results[os.path.basename(work)] = run_workload(a, torch, np, Image, dev, sdxl, qwen, esrgan, timer, work)
    out = {"load_s": load_s, "total_s": time.time() - t0, "load_parts_s": load_times, "lora": lora_how, "workloads": results,
           "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
           "max_memory_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if dev.type == "cuda" else None}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "session-report.json"), "w") as f:
        json.dump(out, f, indent=1)
    for name, r in results.items():
        emit({"name": "summary", "workload": name, **{k: v for k, v in r.items() if k != "job_records"}})


def run_workload(a, torch, np, Image, dev, sdxl, qwen, esrgan, timer, work):
    messages = [json.loads(line) for line in open(work) if line.strip()]
    root = os.path.join(a.out, os.path.basename(work) + ".results")
    os.makedirs(root, exist_ok=True)
    pngs = {}
    records = []
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first = time.time()
    for m in messages:
        jobs = [{"job_id": m["job_id"], "task": m["task"]}] + m.get("batch", [])
        for job in jobs:
            task, kind = job["task"], job["task"]["kind"]
            rec = {"job_id": job["job_id"], "kind": kind, "start_s": time.time() - first}
            t = time.time()
            if kind == "generate":
                gen = torch.Generator(dev).manual_seed(task["seed"])
                imgs, s = timer(lambda: sdxl(prompt=task["prompt"], negative_prompt=task.get("negative_prompt", ""),
                                            width=task["width"], height=task["height"],
                                            num_inference_steps=task["steps"], guidance_scale=task["cfg"],
                                            generator=gen).images)
                img = imgs[0]
            elif kind == "edit":
                inputs = [Image.open(pngs[r["job_output"]["job"]]).convert("RGB") for r in task["inputs"]]
                rec["load_input_s"] = time.time() - t
                gen = torch.Generator(dev).manual_seed(task["seed"])
                size = {k: task[k] for k in ("width", "height") if task.get(k)}  # else the model's ~1 MP
                imgs, s = timer(lambda: qwen(image=inputs, prompt=task["instruction"], negative_prompt=" ",
                                            true_cfg_scale=task["cfg"], num_inference_steps=task["steps"],
                                            generator=gen, **size).images)
                img = imgs[0]
            elif kind == "upscale":
                src = Image.open(pngs[task["input"]["job_output"]["job"]]).convert("RGB")
                rec["load_input_s"] = time.time() - t
                arr, s = upscale(torch, esrgan, src, task.get("scale", 2), dev, timer)
                img = Image.fromarray(arr)
            else:
                raise ValueError(f"unknown kind {kind}")
            rec["compute_s"] = s
            t = time.time()
            path = os.path.join(root, f"{job['job_id']}.png")
            img.save(path, format="PNG")
            rec["png_s"] = time.time() - t
            pngs[job["job_id"]] = path
            rec["end_s"] = time.time() - first
            rec["size"] = list(img.size)
            records.append(rec)
    wall = time.time() - first
    compute = sum(r["compute_s"] for r in records)
    bases = {r["job_id"] for r in records if r["kind"] == "generate"}
    readers = {}
    for m in messages:
        for job in [m] + m.get("batch", []):
            task = job["task"]
            refs = task.get("inputs", []) + ([task["input"]] if "input" in task else [])
            for r in refs:
                if "job_output" in r and r["job_output"]["job"] in bases:
                    readers.setdefault(r["job_output"]["job"], []).append(job["job_id"])
    pipelines = len(readers)
    by_kind = {}
    for r in records:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    mean = lambda k: sum(r.get(k, 0) for r in records) / len(records)  # noqa: E731
    return {"jobs": len(records), "by_kind": by_kind, "pipelines": pipelines, "wall_s": wall,
            "jobs_per_hour": len(records) * 3600 / wall, "pipelines_per_hour": pipelines * 3600 / wall,
            "compute_s": compute, "busy_fraction": compute / wall,
            "busy_clock": "device" if dev.type == "cuda" else "host",
            "outside_compute_per_job_s": (wall - compute) / len(records),
            "stage_means_s": {"compute": mean("compute_s"), "png": mean("png_s"), "load_input": mean("load_input_s")},
            "job_records": records}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["write", "run"])
    ap.add_argument("--models", required=True, help="sdxl/ (diffusers folder), qwen/ (ComfyUI files), the LoRA, Real-ESRGAN")
    ap.add_argument("--work", action="append", default=[], help="work messages, one JSON object per line")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", help="cuda or cpu (default: cpu with --tiny, else cuda)")
    a = ap.parse_args()
    if a.side == "write":
        write(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
