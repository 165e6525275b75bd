//! `vnfarm-models`: the farm's image models natively on `tch` (libtorch), numerically matching their
//! Python references (diffusers, transformers, Real-ESRGAN, Pillow, OpenCV).
//!
//! Layout: the shared parts once, then one folder per model family with its components (one file
//! each, mirroring the reference implementation; weight names equal checkpoint keys), key mapping,
//! and pipeline.
//! - [`loading`]: getting weights to the device: `safetensors.rs` (mmap, header, bounds, staged
//!   copies), `pth.rs` + `pickle.rs` + `zip.rs` (PyTorch checkpoints, tensors and plain containers
//!   only), `weights.rs` (name tables, the `Weights` cursor, fp8 modes), `diffusers.rs` (component
//!   folders: configs, shards, variants), `lora.rs` (LoRA files fused, reported, restored).
//! - [`nn`]: `mod.rs` (Linear, Conv2d, GroupNorm, LayerNorm, RmsNorm, attention kernel choice),
//!   `embeddings.rs` (timestep embeddings), `rope.rs` (applying RoPE), `tiling.rs` (VAE
//!   tile-and-blend), and what reaches libtorch's GPU side through the C++ shims of `csrc/` (built
//!   against a CUDA or a ROCm libtorch): `cuda_graph.rs` (graph capture, `csrc/graph.cpp`),
//!   `ops.rs` (operators tch lacks and the run-time compiler, `csrc/ops.cpp`, `csrc/rtc.cpp`),
//!   `fused.rs` (the fused norm kernels of `nn/kernels/norms.cu`, compiled by NVRTC or hiprtc).
//! - [`dtype`]: the fp8 kinds the loaders and the layers both branch on.
//! - [`schedulers`]: `mod.rs` (the training schedule, the `Scheduler` enum), `euler.rs`,
//!   `euler_ancestral.rs`, `dpm_solver.rs` (DPM++ 2M Karras), `flow_match.rs` (Qwen-Image's);
//!   [`noise`]: torch-identical seeded noise.
//! - [`text`]: `clip_tokenizer.rs` (bundled CLIP BPE) and `prompt.rs` (the A1111 prompt syntax).
//! - [`sdxl`]: SDXL text-to-image: `clip.rs` (CLIP-L, OpenCLIP bigG), `resnet.rs`, `attention.rs`,
//!   `unet_blocks.rs`, `unet.rs`, `unet_graph.rs` (its forward replayed from a CUDA graph),
//!   `vae.rs`, `ldm.rs` (single-file keys), `conditioning.rs` (compel weighting), `pipeline.rs`.
//! - [`qwen2_5_vl`]: Qwen2.5-VL, Qwen-Image's text encoder: `config.rs`, `vision.rs` (the vision
//!   tower), `language_model.rs`, `rope.rs` (M-RoPE ids), `processor.rs`, `tokenizer.rs`,
//!   `text_encoder.rs` (the Edit-Plus prompt encoding).
//! - [`qwen_image`]: Qwen-Image-Edit-2509: `transformer.rs` + `rope.rs`, `vae.rs`, `keys.rs` (Wan /
//!   ComfyUI names), `pipeline.rs`, `encoded.rs` (an input set encoded once), `encodings.rs` (that
//!   set as bytes for other workers).
//! - [`esrgan`]: Real-ESRGAN: `config.rs`, `rrdbnet.rs`, `keys.rs` (`.pth` or safetensors),
//!   `tiling.rs`, `upscaler.rs`.
//! - [`imageops`]: image operations that must match their references byte for byte: `resample.rs`
//!   (Pillow's resize), `lanczos4.rs` (OpenCV's Lanczos-4), and in `mod.rs` the images-to-tensors
//!   conversions of the VAEs.
//! - [`settings`]: each engine's runtime kernel and layout choices and their presets (kept out of
//!   the architecture configs).
//! - [`error`]: what callers branch on (`LoadError`, `GenerateError`).
//!
//! Tests: unit tests beside the code; `tests/parity/` (one binary) against the Python references
//! on the tiny fixtures of `fixtures/`, whose generator scripts sit beside them.

pub mod dtype;
pub mod error;
pub mod esrgan;
pub mod imageops;
pub mod loading;
pub mod nn;
pub mod noise;
pub mod qwen2_5_vl;
pub mod qwen_image;
pub mod schedulers;
pub mod sdxl;
pub mod settings;
pub mod text;
