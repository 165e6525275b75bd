//! `vnfarm-models`: the farm's image models natively on `tch` (libtorch), numerically matching their
//! Python references (diffusers, transformers).
//!
//! Layout: the shared parts once, then one folder per model family with its components (one file
//! each, mirroring the reference implementation; weight names equal checkpoint keys), key mapping,
//! and pipeline.
//! - [`loading`]: memory-mapped safetensors, name tables and the `Weights` cursor, diffusers folders
//!   (shards, variants, configs).
//! - [`nn`]: layers (Linear, Conv2d, norms incl. RMSNorm, attention kernel choice), timestep
//!   embeddings, and what reaches libtorch's GPU side through the C++ shims of `csrc/` (built
//!   against a CUDA or a ROCm libtorch): graph capture, operators tch lacks, and the fused norm
//!   kernels (`nn/kernels/norms.cu`) compiled at run time by NVRTC or hiprtc.
//! - [`schedulers`]: Euler, Euler ancestral, DPM++ 2M Karras; [`noise`]: torch-identical seeded noise.
//! - [`text`]: the CLIP tokenizer and the A1111 prompt syntax.
//! - [`sdxl`]: SDXL text-to-image (CLIP-L + OpenCLIP bigG, UNet, VAE, compel weighting, pipeline).
//! - [`qwen2_5_vl`]: Qwen2.5-VL (Qwen-Image's text encoder): the vision tower.
//! - [`qwen_image`]: Qwen-Image-Edit-2509 (transformer, VAE, checkpoint key mapping).
//! - [`esrgan`]: Real-ESRGAN (RRDBNet from `.pth` or safetensors, key naming, tiling, the upscaler).
//! - [`imageops`]: image operations that must match their references byte for byte (Pillow's resize,
//!   OpenCV's Lanczos-4) and the images-to-tensors conversions of the VAEs.
//! - [`settings`]: each engine's runtime kernel and layout choices and their presets (kept out of
//!   the architecture configs).
//! - [`error`]: what callers branch on (`LoadError`, `GenerateError`).

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
