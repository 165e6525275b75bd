"""Qwen-Image-Edit-2509 engine (vnfarm-models, tch) vs diffusers, same GPU, same random weights, one run.

Built on the SDXL benchmark (`run_bench.py`, docs/performance.md): same method, its NVML sampler
and process runner are imported from there.

Commands (repository root):

    # here: the binary and the wheels (see docs/performance.md for the pip download line)
    cargo build --release -p vnfarm-models --example qwen_bench
    mkdir -p .bench && cp $CARGO_TARGET_DIR/release/examples/qwen_bench .bench/qwen_bench
    # here: smoke test of the whole flow on the CPU (tiny configs of fixtures/qwen/common.py, fp32),
    # with a debug build (`cargo build -p vnfarm-models --example qwen_bench`):
    OMP_NUM_THREADS=2 /work/pyfix/bin/python worker/models/bench/run_qwen_bench.py --tiny \
        --bin $CARGO_TARGET_DIR/debug/examples/qwen_bench --work /tmp/qsmoke/work --out /tmp/qsmoke/out
    # GPU machine: one device call, carry [".whl", ".bench"], timeout_s 600, command
    worker/models/bench/run_qwen_bench.sh      # (the wrapper installs the wheels, writes $OUT)

What one run does (each side in its own process, same files, same GPU):
1. `write` (subprocess): the real Qwen-Image-Edit-2509 components in diffusers/transformers with
   random weights (`torch.manual_seed(0)`, default init, built in bf16 on the GPU):
   `QwenImageTransformer2DModel()` (diffusers' defaults are the real config, checked against the
   parameter count), `Qwen2_5_VLForConditionalGeneration` with the 7B config, `AutoencoderKLQwenImage()`.
   Written once into `--work` in the studio's ComfyUI layout, streamed tensor by tensor (no bf16
   copy of the transformer ever touches the disk):
   - `transformer_fp8_e4m3fn.safetensors`: every nn.Linear weight `w.to(float8_e4m3fn)`, the rest bf16;
   - `text_encoder_fp8_scaled.safetensors`: ComfyUI "scaled fp8" (every nn.Linear weight but lm_head
     as `q = (w / s).to(float8_e4m3fn)`, `s = amax / 448` stored as F32 `<layer>.scale_weight`,
     sentinel `scaled_fp8`), original Qwen2.5-VL names (`model.layers.*`, `model.embed_tokens`,
     `model.norm`, `visual.*`), no lm_head;
   - `vae_bf16.safetensors`: bf16, diffusers names;
   - `config/{transformer,vae,text_encoder}/config.json`, `config/scheduler/scheduler_config.json`
     (the Lightning flow-match config): what the diffusers side builds from; ours builds from its
     presets (`QwenSource::Files { config_dir: None }`, as the studio's files load) unless `--tiny`
     or `--ours-config-dir`;
   - `input.png`: a synthetic RGB input of `--size`.
2. `read`: the three weight files read from the page cache start to end (Python `readinto` once, our
   `qwen_bench read` twice; its second pass counts): the baseline for load times.
3. `diffusers` (subprocess): the components rebuilt from `config/`, weights copied in from the three
   files (fp8 dequantised on the device: `(q.float() * scale).to(bf16)`, the same arithmetic as our
   loader), `QwenImageEditPlusPipeline` (bf16, SDPA, Lightning scheduler, tokenizer = the bundled
   `tokenizer/qwen2`, processor = `Qwen2VLProcessor` with the slow (PIL) image processor). Cases:
   transformer step at the edit's shapes (target + reference tokens of `--size`, the real prompt
   length), VAE encode and decode at `--size`, text+vision encode (`encode_prompt` of one input),
   full 4-step edit (true_cfg_scale 1, seed 0, output RGB8): first call and median of `--iters`, then
   N = 1, 3, 10 variants of one input (N pipeline calls, instruction i and seed i).
4. ours (`qwen_bench`, one process per case group and fp8 mode, `--modes upcast,resident`):
   `pipeline` (load time, `encode_inputs` of the input, full edit = encode_inputs + edit first call
   and median, N variants = encode_inputs once + edit per variant) and `components` (transformer
   step at the same shapes, VAE encode/decode).

`--profile` runs instead the profile of one transformer step, ours and diffusers' (`profile_qwen.py`
says what it does): the transformer and VAE written, no text encoder, no edits.

Every process runs with `PYTORCH_CUDA_ALLOC_CONF=--alloc-conf` (default `expandable_segments:True`,
what the worker sets). `--budget` (default 540 s) bounds the whole run: each process is given what
is left, so that results and tables are written before the device command's 600 s limit.

Memory: NVML `memory.used` of GPU 0 sampled every 20 ms per process (peak minus the idle reading
before it; per case in each case's t0..t1 window, cumulative); diffusers' `max_memory_allocated`
per case (reset per case). Image agreement: mean |ours - diffusers| of the seed-0 edit, RGB8.
Writes `qwen_results.json`, `qwen_table.md` and the per-process logs to `--out`.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run_bench import emit, run_sampled  # noqa: E402  (NVML sampler + process runner of the SDXL bench)
import profile_qwen  # noqa: E402  (the --profile mode)

DEFAULT_TOKENIZER = os.path.join(MODELS, "tokenizer", "qwen2")
DEFAULT_FIXTURES = os.path.join(MODELS, "fixtures", "qwen")

# Instruction i and seed i make variant i on both sides (our binary reads them from `instructions.json`).
INSTRUCTIONS = [
    "make her smile",
    "make her look angry",
    "make her look surprised",
    "make her laugh with her eyes closed",
    "make her look sad",
    "make her wink",
    "make her look scared",
    "make her look bored",
    "make her look confused",
    "make her shout",
]
STEPS = 4
VARIANT_COUNTS = (1, 3, 10)
FP8_MAX = 448.0

# Qwen2.5-VL-7B-Instruct (the Edit-2509 text encoder), as ../shared/bench/anchor_diffusers_full.py.
TE_TEXT_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
TE_VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], in_chans=3)
TE_TOP_7B = dict(vocab_size=152064, hidden_size=3584, vision_start_token_id=151652, vision_end_token_id=151653,
                 vision_token_id=151654, image_token_id=151655, video_token_id=151656, tie_word_embeddings=False)
# Qwen-Image-Lightning's scheduler (diffusers docs api/pipelines/qwenimage.md; fixtures/qwen/common.py).
LIGHTNING_SCHEDULER = dict(base_image_seq_len=256, base_shift=math.log(3), invert_sigmas=False, max_image_seq_len=8192,
                           max_shift=math.log(3), num_train_timesteps=1000, shift=1.0, shift_terminal=None,
                           stochastic_sampling=False, time_shift_type="exponential", use_beta_sigmas=False,
                           use_dynamic_shifting=True, use_exponential_sigmas=False, use_karras_sigmas=False)
# Real sizes (diffusers' CONDITION_IMAGE_SIZE / VAE_IMAGE_SIZE) and the tiny smoke-test ones.
REAL_SIZES = dict(size=1024, condition_area=384 * 384, vae_area=1024 * 1024)
TINY_SIZES = dict(size=64, condition_area=56 * 56, vae_area=64 * 64)

FILES = {"transformer": "transformer_fp8_e4m3fn.safetensors", "text_encoder": "text_encoder_fp8_scaled.safetensors",
         "vae": "vae_bf16.safetensors"}


def weight_files(work):
    return [os.path.join(work, FILES[k]) for k in ("transformer", "text_encoder", "vae")]


# ---------------------------------------------------------------------------------------------
# safetensors streaming writer (one tensor on the host at a time)

def _st_dtype(torch, dt):
    return {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16",
            torch.int64: "I64"}[dt]


def write_safetensors(path, entries):
    """entries: list of (name, dtype, shape, produce) with produce() -> tensor of that dtype/shape
    (any device). Writes the header, then each tensor in order; returns the file size."""
    import torch

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, _ in entries:
        n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": _st_dtype(torch, dt), "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for name, dt, shape, produce in entries:
            t = produce()
            assert t.dtype == dt and list(t.shape) == list(shape), (name, t.dtype, t.shape)
            b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            f.write(memoryview(b))
    return os.path.getsize(path)


def linear_weight_names(torch, module, skip=()):
    return {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip}


def te_file_name(k):
    """transformers-5 Qwen2_5_VLForConditionalGeneration key -> the ComfyUI file's (original) key."""
    if k.startswith("model.language_model."):
        return "model." + k[len("model.language_model."):]
    if k.startswith("model.visual."):
        return "visual." + k[len("model.visual."):]
    if k.startswith(("model.", "visual.")):  # older transformers layouts
        return k
    raise KeyError(k)


# ---------------------------------------------------------------------------------------------
# sides


def setup_torch(a):
    import torch

    dev = torch.device("cpu" if a.tiny else "cuda")
    dt = torch.float32 if a.tiny else torch.bfloat16
    if a.tiny:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return torch, dev, dt


def sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def import_common(a):
    sys.path.insert(0, a.fixtures)
    import common  # fixtures/qwen/common.py

    return common


def configs(a):
    """(transformer kwargs, vae kwargs, text-encoder Qwen2_5_VLConfig kwargs, scheduler config)."""
    if a.tiny:
        c = import_common(a)
        te = dict(text_config=dict(c.TEXT_CONFIG), vision_config=dict(c.VISION_CONFIG), **c.TEXT_ENCODER_CONFIG)
        return dict(c.TRANSFORMER_CONFIG), dict(c.VAE_CONFIG), te, dict(c.LIGHTNING_SCHEDULER_CONFIG)
    te = dict(text_config=dict(TE_TEXT_7B), vision_config=dict(TE_VISION_7B), **TE_TOP_7B)
    return {}, {}, te, dict(LIGHTNING_SCHEDULER)


def make_input(path, size):
    """A synthetic RGB input (gradients, a sine pattern and shapes), same idea as the fixtures'."""
    import numpy as np
    from PIL import Image, ImageDraw

    w = h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    s = size / 64.0
    r, g = 255 * x / (w - 1), 255 * y / (h - 1)
    b = 127.5 + 127.5 * np.sin((x + 2 * y) / (5.0 * s) + 1)
    img = Image.fromarray(np.stack([r, g, b], -1).round().clip(0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(img)
    d.ellipse([w * 0.2, h * 0.15, w * 0.6, h * 0.55], fill=(250, 220, 90), outline=(10, 10, 10))
    d.rectangle([w * 0.55, h * 0.6, w * 0.9, h * 0.9], fill=(30, 40, 200))
    d.line([0, h - 1, w - 1, 0], fill=(255, 255, 255), width=max(2, size // 256))
    img.save(path, format="PNG")


def write_text_encoder(a, torch, dev, te_kw, cfg_dir):
    """Qwen2.5-VL with random weights as ComfyUI's "scaled fp8" file; returns its size."""
    import transformers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    emit({"name": "versions_text_encoder", "transformers": transformers.__version__})
    f8 = torch.float8_e4m3fn
    torch.manual_seed(0)
    t = time.time()
    with torch.device(dev):
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**te_kw)).eval()
    sync(torch, dev)
    emit({"name": "init_text_encoder", "s": time.time() - t,
          "params_B": sum(p.numel() for p in te.parameters()) / 1e9})
    te.config.save_pretrained(os.path.join(cfg_dir, "text_encoder"))
    lin = linear_weight_names(torch, te, skip=("lm_head",))
    entries = [("scaled_fp8", f8, (0,), lambda: torch.zeros(0, dtype=f8))]

    def quant(v):
        s = (v.float().abs().amax() / FP8_MAX).float()
        return (v.float() / s).to(f8), s

    for k, v in te.state_dict().items():
        if k.startswith("lm_head."):
            continue
        name = te_file_name(k)
        if k in lin:
            cache = {}

            def q(v=v, cache=cache):
                cache["q"], cache["s"] = quant(v)
                return cache["q"]

            entries.append((name, f8, tuple(v.shape), q))
            entries.append((name[: -len("weight")] + "scale_weight", torch.float32, (),
                            lambda cache=cache: cache.pop("s").reshape(())))
        else:
            entries.append((name, torch.bfloat16, tuple(v.shape), lambda v=v: v.to(torch.bfloat16)))
    t = time.time()
    size = write_safetensors(os.path.join(a.work, FILES["text_encoder"]), entries)
    emit({"name": "write_text_encoder", "s": time.time() - t, "bytes": size, "fp8_tensors": len(lin),
          "tensors": len(entries)})
    del te, entries
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return size


def write_side(a):
    torch, dev, dt = setup_torch(a)
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    emit({"name": "versions", "torch": torch.__version__, "diffusers": diffusers.__version__})
    tr_kw, vae_kw, te_kw, sched = configs(a)
    os.makedirs(a.work, exist_ok=True)
    free = shutil.disk_usage(a.work).free
    # 20.4 GB transformer + 8.8 GB text encoder + VAE, and some room
    need = 0 if a.tiny else 22e9 if a.profile else 31e9
    assert free > need, f"{a.work}: {free / 1e9:.1f} GB free, the weights need about {need / 1e9:.0f} GB"
    cfg_dir = os.path.join(a.work, "config")
    files = {}
    # Built directly in the storage dtype on the device (bf16 on the GPU: no fp32 copy of 20 B
    # parameters); default init after torch.manual_seed(0).
    torch.set_default_dtype(torch.bfloat16)
    f8 = torch.float8_e4m3fn

    # transformer
    torch.manual_seed(0)
    t = time.time()
    with torch.device(dev):
        tr = QwenImageTransformer2DModel(**tr_kw).eval()
    sync(torch, dev)
    n_params = sum(p.numel() for p in tr.parameters())
    emit({"name": "init_transformer", "s": time.time() - t, "params_B": n_params / 1e9, "config": dict(tr.config)})
    if not a.tiny:
        assert 20.0e9 < n_params < 20.9e9, f"transformer defaults are not the real config: {n_params} parameters"
    tr.save_config(os.path.join(cfg_dir, "transformer"))
    lin = linear_weight_names(torch, tr)
    entries = []
    for k, v in tr.state_dict().items():
        if k in lin:
            assert v.dim() == 2, k
            entries.append((k, f8, tuple(v.shape), lambda v=v: v.to(f8)))
        else:
            entries.append((k, torch.bfloat16, tuple(v.shape), lambda v=v: v.to(torch.bfloat16)))
    t = time.time()
    p = os.path.join(a.work, FILES["transformer"])
    files["transformer"] = write_safetensors(p, entries)
    emit({"name": "write_transformer", "s": time.time() - t, "bytes": files["transformer"], "fp8_tensors": len(lin),
          "tensors": len(entries)})
    del tr, entries
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if not a.profile:  # the profile times the transformer alone
        files["text_encoder"] = write_text_encoder(a, torch, dev, te_kw, cfg_dir)

    # VAE
    torch.manual_seed(0)
    with torch.device(dev):
        vae = AutoencoderKLQwenImage(**vae_kw).eval()
    vae.save_config(os.path.join(cfg_dir, "vae"))
    entries = [(k, torch.bfloat16, tuple(v.shape), lambda v=v: v.to(torch.bfloat16)) for k, v in vae.state_dict().items()]
    files["vae"] = write_safetensors(os.path.join(a.work, FILES["vae"]), entries)
    emit({"name": "write_vae", "bytes": files["vae"], "params_M": sum(p.numel() for p in vae.parameters()) / 1e6})
    torch.set_default_dtype(torch.float32)

    FlowMatchEulerDiscreteScheduler(**sched).save_config(os.path.join(cfg_dir, "scheduler"))
    make_input(os.path.join(a.work, "input.png"), a.size)
    emit({"name": "write_done", "files": files})


def load_weights(torch, model, path, rename, dev):
    """Copies every tensor of `path` into `model` (fp8 dequantised on the device in fp32 with its
    `scale_weight`, then cast to the parameter's dtype). Returns (seconds, names not in the file)."""
    from safetensors import safe_open

    t = time.time()
    sd = model.state_dict()
    done = set()
    with torch.no_grad(), safe_open(path, "pt", device=str(dev)) as f:
        keys = set(f.keys())
        for k in sorted(keys):
            if k == "scaled_fp8" or k.endswith(".scale_weight"):
                continue
            name = rename(k)
            if name not in sd:
                raise KeyError(f"{path}: {k} -> {name} is not a parameter")
            w = f.get_tensor(k)
            if w.dtype == torch.float8_e4m3fn:
                s = k[: -len("weight")] + "scale_weight"
                w = w.float() * f.get_tensor(s).float() if s in keys else w.float()
            assert tuple(w.shape) == tuple(sd[name].shape), (k, w.shape, sd[name].shape)
            sd[name].copy_(w.to(sd[name].dtype))
            done.add(name)
            del w
    sync(torch, dev)
    return time.time() - t, sorted(set(sd) - done)


def make_tokenizer_processor(a):
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if not os.path.exists(os.path.join(a.tokenizer, "tokenizer.json")) and os.path.exists(
        os.path.join(a.tokenizer, "tokenizer.json.gz")
    ):  # the bundled folder keeps it gzipped
        import gzip
        import shutil
        import tempfile

        unpacked = tempfile.mkdtemp(prefix="qwen2-tokenizer-")
        for name in os.listdir(a.tokenizer):
            src = os.path.join(a.tokenizer, name)
            if name == "tokenizer.json.gz":
                with gzip.open(src, "rb") as f, open(os.path.join(unpacked, "tokenizer.json"), "wb") as g:
                    shutil.copyfileobj(f, g)
            elif os.path.isfile(src):
                shutil.copy(src, unpacked)
        a.tokenizer = unpacked
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    except Exception:  # noqa: BLE001 (fallback: the bare tokenizer.json)
        from transformers import Qwen2TokenizerFast

        tok = Qwen2TokenizerFast(tokenizer_file=os.path.join(a.tokenizer, "tokenizer.json"))
    try:  # transformers >= 5.2x: the PIL ("slow") backend has its own class
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as ImgProc
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImgProc
    # Without torchvision, transformers cannot resolve the video processor class and its check fails
    # even for video_processor=None (as in fixtures/qwen/common.py): skip the check for None only.
    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, n, arg: None if arg is None else original(self, n, arg)
    try:
        proc = Qwen2VLProcessor(image_processor=ImgProc(), tokenizer=tok)
    finally:
        ProcessorMixin.check_argument_for_proper_class = original
    emit({"name": "tokenizer", "class": type(tok).__name__, "image_processor": ImgProc.__name__})
    return tok, proc


def diffusers_side(a):
    torch, dev, dt = setup_torch(a)
    import numpy as np
    from PIL import Image
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    edit_plus.CONDITION_IMAGE_SIZE, edit_plus.VAE_IMAGE_SIZE = a.condition_area, a.vae_area
    cuda = dev.type == "cuda"
    cfg_dir = os.path.join(a.work, "config")

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib():
        return torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    tok, proc = make_tokenizer_processor(a)
    t0 = time.time()
    torch.set_default_dtype(dt)  # as from_pretrained(torch_dtype=dt) builds
    with torch.device(dev):
        tr = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(f"{cfg_dir}/transformer")).eval()
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_pretrained(f"{cfg_dir}/text_encoder")).eval()
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(f"{cfg_dir}/vae")).eval()
    torch.set_default_dtype(torch.float32)
    sync(torch, dev)
    t_construct = time.time() - t0
    te_names = set(te.state_dict())

    def te_rename(k):
        for cand in (k, "model.language_model." + k[len("model."):] if k.startswith("model.") else None,
                     "model." + k if k.startswith("visual.") else None):
            if cand in te_names:
                return cand
        return k

    s_tr, miss_tr = load_weights(torch, tr, f"{a.work}/{FILES['transformer']}", lambda k: k, dev)
    s_te, miss_te = load_weights(torch, te, f"{a.work}/{FILES['text_encoder']}", te_rename, dev)
    s_vae, miss_vae = load_weights(torch, vae, f"{a.work}/{FILES['vae']}", lambda k: k, dev)
    assert not miss_tr and not miss_vae and all(m.startswith("lm_head.") for m in miss_te), (miss_tr, miss_te, miss_vae)
    if cuda:
        torch.cuda.empty_cache()
    emit({"name": "load", "s": time.time() - t0, "construct_s": t_construct, "weights_s": s_tr + s_te + s_vae,
          "transformer_s": s_tr, "text_encoder_s": s_te, "vae_s": s_vae, "t0": t0, "t1": time.time(),
          "peak_alloc_gib": peak_gib(), "not_in_files": miss_te})
    sched = FlowMatchEulerDiscreteScheduler.from_config(FlowMatchEulerDiscreteScheduler.load_config(f"{cfg_dir}/scheduler"))
    pipe = QwenImageEditPlusPipeline(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, processor=proc,
                                     transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    emit({"name": "config", "attn_processor": type(next(iter(tr.attn_processors.values()))).__name__,
          "attention_backend": str(getattr(next(iter(tr.attn_processors.values())), "_attention_backend", None)),
          "vae_tiling": bool(getattr(vae, "use_tiling", False)), "scheduler": dict(sched.config)})

    img = Image.open(f"{a.work}/input.png").convert("RGB")
    size = a.size

    def bench(name, fn, warm, iters, **extra):
        t0 = time.time()
        reset_peak()
        for _ in range(warm):
            fn()
        sync(torch, dev)
        ts = []
        for _ in range(iters):
            t = time.time()
            fn()
            sync(torch, dev)
            ts.append((time.time() - t) * 1e3)
        ts.sort()
        emit({"name": name, "ms_median": ts[len(ts) // 2], "ms_min": ts[0], "ms_max": ts[-1], "iters": iters,
              "t0": t0, "t1": time.time(), "peak_alloc_gib": peak_gib(), **extra})

    with torch.no_grad():
        def edit(i):
            out = pipe(image=[img], prompt=INSTRUCTIONS[i % len(INSTRUCTIONS)], height=size, width=size,
                       num_inference_steps=STEPS, true_cfg_scale=1.0, generator=torch.Generator("cpu").manual_seed(i),
                       output_type="pil").images[0]
            sync(torch, dev)
            return out

        t0 = time.time()
        reset_peak()
        t = time.time()
        first = edit(0)
        first_s = time.time() - t
        arr = np.asarray(first, dtype=np.uint8)
        os.makedirs(a.save, exist_ok=True)
        saved = os.path.join(a.save, "edit.rgb")
        arr.tofile(saved)
        ts = []
        for _ in range(a.iters):
            t = time.time()
            edit(0)
            ts.append(time.time() - t)
        ts.sort()
        emit({"name": "edit", "first_s": first_s, "s_median": ts[len(ts) // 2], "s_min": ts[0], "s_max": ts[-1],
              "iters": a.iters, "t0": t0, "t1": time.time(), "peak_alloc_gib": peak_gib(), "saved": saved,
              "width": arr.shape[1], "height": arr.shape[0], "steps": STEPS})
        for n in VARIANT_COUNTS:
            t0 = time.time()
            reset_peak()
            per = []
            for i in range(n):
                t = time.time()
                edit(i)
                per.append(time.time() - t)
            emit({"name": f"variants_{n}", "s": time.time() - t0, "per_variant_s": per, "t0": t0, "t1": time.time(),
                  "peak_alloc_gib": peak_gib()})

        # components, after the edits (so that the edit's first call is the first use of every kernel)
        # text + vision encode of one input (what the pipeline does: resize, processor, text encoder)
        cw, ch = edit_plus.calculate_dimensions(a.condition_area, 1.0)
        cond = pipe.image_processor.resize(img, ch, cw)
        embeds, mask = pipe.encode_prompt(prompt=INSTRUCTIONS[0], image=[cond], device=dev)
        txt_len = int(embeds.shape[1])
        bench("encode_prompt", lambda: pipe.encode_prompt(prompt=INSTRUCTIONS[0], image=[cond], device=dev), 2, 5,
              txt_len=txt_len, condition_size=[cw, ch])
        # VAE at --size
        vw, vh = edit_plus.calculate_dimensions(a.vae_area, 1.0)
        x = torch.randn(1, 3, 1, vh, vw, device=dev, dtype=dt)
        bench("vae_encode", lambda: vae.encode(x).latent_dist.mode(), 2, 5, size=[vw, vh])
        f = pipe.vae_scale_factor
        z = torch.randn(1, vae.config.z_dim, 1, size // f, size // f, device=dev, dtype=dt)
        bench("vae_decode", lambda: vae.decode(z).sample, 2, 5, size=[size, size])
        # transformer step at the edit's shapes: target tokens + reference tokens, the real prompt length
        tgt = (size // f // 2) ** 2
        ref = (vh // f // 2) * (vw // f // 2)
        hs = torch.randn(1, tgt + ref, tr.config.in_channels, device=dev, dtype=dt)
        ehs = torch.randn(1, txt_len, tr.config.joint_attention_dim, device=dev, dtype=dt)
        ts_ = torch.full((1,), 0.9, device=dev, dtype=dt)
        shapes = [[(1, size // f // 2, size // f // 2), (1, vh // f // 2, vw // f // 2)]]
        bench("transformer_step",
              lambda: tr(hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=None, timestep=ts_,
                         img_shapes=shapes, return_dict=False)[0], 2, 5, tokens=[tgt, ref, txt_len])
        del hs, ehs, x, z
        if cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# driver


def py_read(files, passes=2):
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    out = []
    for i in range(passes):
        t = time.time()
        total = 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(mv):
                    total += n
        s = time.time() - t
        out.append({"name": f"py_read_pass{i}", "s": s, "bytes": total, "gb_per_s": total / s / 1e9})
        emit(out[-1])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=".bench/qwen_bench", help="our benchmark binary (examples/qwen_bench.rs)")
    ap.add_argument("--work", default="/tmp/qwen_bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", default="upcast,resident",
                    help="our settings, each in its own processes: an fp8 mode, optionally with the transformer "
                         "blocks' kernels after a colon (`upcast:qk+norm+res`, qwen_bench --kernels)")
    ap.add_argument("--sweep", default="",
                    help="kernel specs timed one after another in each fp8 mode's components process "
                         "(qwen_bench --sweep; the first is the reference of the output comparison)")
    ap.add_argument("--iters", type=int, default=3, help="steady-state edits after the first call")
    ap.add_argument("--skip-write", action="store_true", help="reuse the files already in --work")
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--skip-components", action="store_true", help="no `qwen_bench components` processes")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="folder with the bundled Qwen2 tokenizer.json")
    ap.add_argument("--fixtures", default=DEFAULT_FIXTURES, help="folder of common.py (--tiny)")
    ap.add_argument("--ours-config-dir", action="store_true",
                    help="our side builds from the written config.json files too (default: --tiny only)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs of fixtures/qwen/common.py on the CPU, fp32")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per process before it is killed")
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds for the whole run: each process gets at most what is left (minus 15 s for the "
                         "report), and a process is skipped when less than 30 s are left")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF of every process, both sides (the worker's default)")
    ap.add_argument("--profile", action="store_true",
                    help="the transformer step's kernel profile, ours and diffusers' (profile_qwen.py) instead of the "
                         "benchmark; writes only the transformer and the VAE")
    ap.add_argument("--txt-len", type=int, default=211,
                    help="prompt tokens of the profiled step (the benchmark measures the real prompt's instead)")
    ap.add_argument("--side", choices=["write", "diffusers", "profile"], help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--condition-area", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--vae-area", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    for k, v in (TINY_SIZES if a.tiny else REAL_SIZES).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.side == "write":
        return write_side(a)
    if a.side == "diffusers":
        return diffusers_side(a)
    if a.side == "profile":
        return profile_qwen.profile_side(a, emit, setup_torch, sync, load_weights, FILES)

    a.work, a.out = os.path.abspath(a.work), os.path.abspath(a.out)
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    imgs = os.path.join(a.work, "images")
    t_start = time.time()
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,memory.used,memory.total",
                              "--format=csv"], capture_output=True, text=True).stdout, flush=True)
    except FileNotFoundError:
        pass
    res = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    res_path = os.path.join(a.out, "qwen_results.json")

    def save():
        res["wall_s"] = time.time() - t_start
        with open(res_path, "w") as f:
            json.dump(res, f, indent=1)

    common = ["--work", a.work, "--tokenizer", a.tokenizer, "--fixtures", a.fixtures, "--iters", str(a.iters),
              "--size", str(a.size), "--condition-area", str(a.condition_area), "--vae-area", str(a.vae_area)]
    common += ["--tiny"] if a.tiny else []
    common += ["--profile"] if a.profile else []

    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf

    def time_left(tag):
        left = a.budget - (time.time() - t_start) - 15
        if left < 30:
            print(f"== {tag}: skipped, {left:.0f} s left of --budget", flush=True)
            res.setdefault("skipped", []).append(tag)
            save()
            return None
        return int(min(a.timeout, left))

    def py_side(side, extra=()):
        timeout = time_left(side)
        if timeout is None:
            return None, None, None
        r = run_sampled([sys.executable, "-u", os.path.abspath(__file__), "--side", side, *common, *extra],
                        os.path.join(a.out, f"diffusers_{side}.log"), env, timeout=timeout)
        print(f"== {side}: rc={r[2]} {r[1]}", flush=True)
        res[f"py_{side}"] = {"rows": r[0], "mem": r[1], "rc": r[2]}
        save()
        return r

    import torch  # only for the location of libtorch

    env["LD_LIBRARY_PATH"] = os.path.join(os.path.dirname(torch.__file__), "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
    ours_flags = ["--cpu"] if a.tiny else []

    def ours(tag, args):
        if not os.path.exists(a.bin):
            print(f"== ours {tag}: no binary at {a.bin}", flush=True)
            res[f"ours_{tag}"] = {"error": f"no binary at {a.bin}"}
            save()
            return None
        timeout = time_left(tag)
        if timeout is None:
            return None
        r = run_sampled([a.bin, *args, *ours_flags], os.path.join(a.out, f"ours_{tag}.log"), env, timeout=timeout)
        print(f"== ours {tag}: rc={r[2]} {r[1]}", flush=True)
        res[f"ours_{tag}"] = {"rows": r[0], "mem": r[1], "rc": r[2], "args": args}
        save()
        return r

    if not a.skip_write:
        r = py_side("write")
        if r[2] != 0:
            print("write failed; stopping", flush=True)
            return 1
    files = weight_files(a.work)
    src = ["--transformer", files[0], "--text-encoder", files[1], "--vae", files[2]]
    if a.tiny or a.ours_config_dir:  # real size: the engine's presets, as the studio loads these files
        src += ["--config-dir", os.path.join(a.work, "config")]
    sizes = ["--size", str(a.size), "--condition-area", str(a.condition_area), "--vae-area", str(a.vae_area)]
    modes = [m for m in a.modes.split(",") if m]
    if a.profile:
        return profile_qwen.drive(a, res, save, py_side, ours, src, sizes, modes)
    res["weight_bytes"] = {os.path.basename(f): os.path.getsize(f) for f in files}
    res["py_read"] = py_read(files, passes=1)  # (after the write: from the page cache)
    ours("read", ["read", *files])
    save()

    if not a.skip_diffusers:
        py_side("diffusers", ["--save", os.path.join(imgs, "diffusers")])
    drows = res.get("py_diffusers", {}).get("rows", {})
    txt_len = drows.get("encode_prompt", {}).get("txt_len", 216 if not a.tiny else 20)

    instructions = os.path.join(a.work, "instructions.json")
    with open(instructions, "w") as f:
        json.dump(INSTRUCTIONS, f)
    def settings(m):
        fp8, _, kernels = m.partition(":")
        return ["--fp8", fp8] + (["--kernels", kernels] if kernels else [])

    for m in modes:
        ours(f"pipeline_{m}", ["pipeline", *src, *sizes, *settings(m), "--input", os.path.join(a.work, "input.png"),
                               "--instructions", instructions,
                               "--iters", str(a.iters), "--save", os.path.join(imgs, m.replace(":", "_")),
                               "--variants", ",".join(map(str, VARIANT_COUNTS))])
    if not a.skip_components:
        sweep = ["--sweep", a.sweep] if a.sweep else []
        # With a sweep, one components process (the first mode's) times every spec.
        for m in modes[:1] if a.sweep else modes:
            ours(f"components_{m}", ["components", *src, *sizes, *settings(m), "--txt-len", str(txt_len), *sweep])

    # Image agreement: mean |ours - diffusers| of the seed-0 edit, RGB8.
    try:
        import numpy as np

        d = drows.get("edit", {})
        for m in modes:
            o = res.get(f"ours_pipeline_{m}", {}).get("rows", {}).get("edit", {})
            if d.get("saved") and o.get("saved") and os.path.exists(d["saved"]) and os.path.exists(o["saved"]):
                x = np.fromfile(d["saved"], dtype=np.uint8).astype(np.float64)
                y = np.fromfile(o["saved"], dtype=np.uint8).astype(np.float64)
                if x.shape == y.shape:
                    res.setdefault("image_mae", {})[m] = {
                        "mae": float(np.abs(x - y).mean()), "max": float(np.abs(x - y).max()),
                        "diffusers_mean": float(x.mean()), "ours_mean": float(y.mean()),
                        "diffusers_std": float(x.std()), "ours_std": float(y.std())}
                else:
                    res.setdefault("image_mae", {})[m] = {"error": f"sizes differ: {x.shape} vs {y.shape}"}
    except Exception as ex:  # noqa: BLE001 (secondary measurement)
        res["image_mae_error"] = repr(ex)

    # Settings against the first mode, per image: every variant of the largest count (instruction i,
    # seed i) of each later mode against the first's (an fp8 path against the bf16 one).
    try:
        import numpy as np

        first = modes[0].replace(":", "_") if modes else None
        for m in modes[1:]:
            per = []
            for i in range(max(VARIANT_COUNTS)):
                p0 = os.path.join(imgs, first, f"variant_{i}.rgb")
                p1 = os.path.join(imgs, m.replace(":", "_"), f"variant_{i}.rgb")
                if os.path.exists(p0) and os.path.exists(p1):
                    x = np.fromfile(p0, dtype=np.uint8).astype(np.float64)
                    y = np.fromfile(p1, dtype=np.uint8).astype(np.float64)
                    if x.shape == y.shape:
                        per.append({"variant": i, "mean": float(np.abs(x - y).mean()),
                                    "max": float(np.abs(x - y).max())})
            res.setdefault("image_vs_first_mode", {})[m] = per
    except Exception as ex:  # noqa: BLE001 (secondary measurement)
        res["image_vs_first_mode_error"] = repr(ex)

    table = make_table(res, modes) + sweep_table(res, modes)
    if res.get("image_vs_first_mode"):
        for m, per in res["image_vs_first_mode"].items():
            table += (f"\n\nPer image, `{m}` against `{modes[0]}` (variants of one input, instruction i, seed i), "
                      "mean (max) |difference| in 1/255: "
                      + ", ".join(f"{p['variant']}: {p['mean']:.2f} ({p['max']:.0f})" for p in per))
    res["table"] = table
    save()
    print("\n" + table, flush=True)
    with open(os.path.join(a.out, "qwen_table.md"), "w") as f:
        f.write(table + "\n")
    return 0


def sweep_table(res, modes):
    """The `--sweep` rows of each components process: step per kernel spec and round, ÷ diffusers'
    step in this run, and the output's difference from the first spec's."""
    d = (res.get("py_diffusers", {}).get("rows", {}) or {}).get("transformer_step", {}).get("ms_median")
    lines = []
    for m in modes:
        rows = (res.get(f"ours_components_{m}", {}).get("rows", {}) or {})
        sw = [r for n, r in rows.items() if n.startswith("transformer_step_sweep.")]
        if not sw:
            continue
        lines += ["", f"Kernel sweep, `{m}` components process (transformer step, median of 5 after 2; "
                      f"diffusers' step {d if d is None else round(d, 1)} ms):", "",
                  "| kernels | modulations | round | step (ms) | ÷ diffusers | output vs first spec, max / mean (rel. to mean abs) |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]
        for r in sw:
            vs = (f"{r['vs_first_max']:.2e} / {r['vs_first_mean']:.2e}" if "vs_first_max" in r
                  else "" if "modulations" in r else "reference")
            ratio = f"{r['ms_median'] / d:.3f}" if d else "n/a"
            mods = r.get("modulations", "in the step")
            lines.append(f"| `{r['kernels']}` | {mods} | {r['round']} | {r['ms_median']:.1f} | {ratio} | {vs} |")
    return "\n".join(lines)


def make_table(res, modes):
    def rows(key):
        return res.get(key, {}).get("rows", {}) or {}

    def num(r, name, key):
        x = r.get(name)
        return x.get(key) if x else None

    def f(x, digits):
        return "n/a" if x is None else f"{x:.{digits}f}"

    def ratio(o, d):
        return f"**{o / d:.2f}**" if o is not None and d else "n/a"

    d = rows("py_diffusers")
    dmem = res.get("py_diffusers", {}).get("mem", {})
    op = {m: rows(f"ours_pipeline_{m}") for m in modes}
    oc = {m: rows(f"ours_components_{m}") for m in modes}
    om = {m: res.get(f"ours_pipeline_{m}", {}).get("mem", {}) for m in modes}
    read_rust = num(rows("ours_read"), "read_files_pass1", "s")
    read_py = res["py_read"][-1]["s"] if res.get("py_read") else None
    total = sum(res.get("weight_bytes", {}).values())
    lines = [f"Weights: {total / 1e9:.2f} GB ({', '.join(f'{k} {v / 1e9:.2f}' for k, v in res.get('weight_bytes', {}).items())}). "
             f"Page-cache read: `qwen_bench read` (2nd pass) {f(read_rust, 2)} s, Python `readinto` {f(read_py, 2)} s.", "",
             "| measurement | diffusers | " + " | ".join(f"ours `{m}` | ÷" for m in modes) + " |",
             "| --- | ---: |" + " ---: | ---: |" * len(modes)]

    def row(label, dval, oval, digits):
        cells = [label, f(dval, digits)]
        for m in modes:
            o = oval(m)
            cells += [f(o, digits), ratio(o, dval)]
        lines.append("| " + " | ".join(cells) + " |")

    row("load from page cache (s)", num(d, "load", "s"), lambda m: num(op[m], "pipeline_load", "s"), 2)
    lines.append("| load ÷ `qwen_bench read` | " + ratio(num(d, "load", "s"), read_rust) + " | " + " | ".join(
        f"{ratio(num(op[m], 'pipeline_load', 's'), read_rust)} | " for m in modes) + " |")
    row("transformer step (ms)", num(d, "transformer_step", "ms_median"),
        lambda m: num(oc[m], "transformer_step", "ms_median"), 1)
    row("transformer step, modulations precomputed as the pipeline does (ms)", num(d, "transformer_step", "ms_median"),
        lambda m: num(oc[m], "transformer_step_precomputed", "ms_median"), 1)
    row("transformer step inside the edit, steady (ms)", None, lambda m: num(op[m], "edit", "denoise_step_ms"), 1)
    row("VAE encode (ms)", num(d, "vae_encode", "ms_median"), lambda m: num(oc[m], "vae_encode", "ms_median"), 1)
    row("VAE decode (ms)", num(d, "vae_decode", "ms_median"), lambda m: num(oc[m], "vae_decode", "ms_median"), 1)
    row("text+vision encode, diffusers `encode_prompt` (ms)", num(d, "encode_prompt", "ms_median"), lambda m: None, 1)
    row("ours `encode_inputs` (vision + VAE encode, ms)", None, lambda m: num(op[m], "encode_inputs", "ms_median"), 1)
    for part, what in [("condition_host", "condition image's host work (resizes, patches)"),
                       ("vision_tower", "vision tower"), ("vae", "RGB8 upload + VAE encode")]:
        row(f"ours `encode_inputs` part, {what} (ms)", None,
            lambda m, part=part: num(op[m], f"encode_part.{part}", "ms_median"), 1)
    row("ours per-edit prompt encode (ms)", None, lambda m: num(op[m], "edit", "encode_prompt_ms"), 1)
    de = (num(d, "encode_prompt", "ms_median") or 0) + (num(d, "vae_encode", "ms_median") or 0) or None
    row("encode of one input + prompt (diffusers encode_prompt + VAE encode; ours encode_inputs + prompt) (ms)", de,
        lambda m: (num(op[m], "encode_inputs", "ms_median") + num(op[m], "edit", "encode_prompt_ms"))
        if num(op[m], "encode_inputs", "ms_median") is not None and num(op[m], "edit", "encode_prompt_ms") is not None else None, 1)
    row("full 4-step edit, first call (s)", num(d, "edit", "first_s"), lambda m: num(op[m], "edit", "first_s"), 3)
    row("full 4-step edit, median (s)", num(d, "edit", "s_median"), lambda m: num(op[m], "edit", "s_median"), 3)
    for n in VARIANT_COUNTS:
        row(f"{n} variants of one input (s)", num(d, f"variants_{n}", "s"), lambda m, n=n: num(op[m], f"variants_{n}", "s"), 3)
    row("GPU memory, whole process: peak over idle (MiB)", dmem.get("peak_mib"), lambda m: om[m].get("peak_mib"), 0)
    for case in ["load", "edit", "variants_10"]:
        oname = "pipeline_load" if case == "load" else case
        row(f"GPU memory by the end of {case} (MiB)", num(d, case, "smi_peak_mib"), lambda m, c=oname: num(op[m], c, "smi_peak_mib"), 0)
    pk = [f"{c} {d[c]['peak_alloc_gib']:.2f}" for c in ["load", "encode_prompt", "vae_encode", "vae_decode",
                                                          "transformer_step", "edit", "variants_10"]
          if d.get(c, {}).get("peak_alloc_gib") is not None]
    if pk:
        lines += ["", "diffusers `torch.cuda.max_memory_allocated` (GiB, reset per case): " + ", ".join(pk)]
    cm = [f"`{m}` {res.get(f'ours_components_{m}', {}).get('mem', {}).get('peak_mib')}" for m in modes]
    lines += ["", "ours components processes (transformer + VAE only), peak over idle (MiB): " + ", ".join(cm)]
    de, ds = num(d, "edit", "s_median"), num(d, "encode_prompt", "ms_median")
    if de and ds:
        lines.append(f"diffusers encode share of one edit: {(ds + (num(d, 'vae_encode', 'ms_median') or 0)) / 1e3 / de:.1%}")
    if res.get("image_mae"):
        lines += ["", "Image agreement, seed-0 edit, mean |ours − diffusers| in 1/255 (max): " + "; ".join(
            f"`{m}` {v['mae']:.2f} ({v['max']:.0f})" if "mae" in v else f"`{m}` {v}" for m, v in res["image_mae"].items())]
    spread = []
    for name, r in [("diffusers", d)] + [(f"`{m}`", op[m]) for m in modes]:
        e = r.get("edit")
        if e and e.get("s_min") is not None:
            spread.append(f"{name} {e['s_min']:.3f}–{e['s_max']:.3f} ({e['iters']})")
    if spread:
        lines += ["", "edit min–max (iterations): " + "; ".join(spread)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
