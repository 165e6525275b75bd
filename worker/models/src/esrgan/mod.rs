//! Real-ESRGAN upscaling (RRDBNet), one file per component mirroring the references:
//! - [`config`]: network sizes, presets of the released models, detection from a checkpoint;
//! - [`rrdbnet`]: the network (BasicSR `rrdbnet_arch.py`);
//! - [`keys`]: BasicSR / original ESRGAN names, opening `.pth` and `.safetensors` checkpoints;
//! - [`tiling`]: Real-ESRGAN's tile grid with a hard-cut or feathered merge, batched tiles and
//!   bounded device memory;
//! - [`upscaler`]: [`upscaler::Upscaler`], Real-ESRGAN's `RealESRGANer.enhance` (alpha, greyscale,
//!   16-bit images, outscale by Lanczos resampling).
//!
//! Learned from Real-ESRGAN (xinntao/Real-ESRGAN, `realesrgan/utils.py`) and BasicSR
//! (XPixelGroup/BasicSR, `basicsr/archs/rrdbnet_arch.py`), both BSD-3-Clause; the code here is
//! written anew.

pub mod config;
pub mod keys;
pub mod rrdbnet;
pub mod tiling;
pub mod upscaler;
