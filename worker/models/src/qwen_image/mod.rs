//! Qwen-Image-Edit-2509: the image side of the model family (diffusers `QwenImage*`), one file
//! per component mirroring diffusers.
//! - [`vae`]: `AutoencoderKLQwenImage` (Wan 2.1 causal VAE) for single images, with tiling.
//! - [`keys`]: Wan 2.1 / ComfyUI checkpoint names mapped to diffusers names.

pub mod keys;
pub mod vae;
