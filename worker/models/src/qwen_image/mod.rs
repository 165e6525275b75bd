//! Qwen-Image-Edit-2509 (diffusers `QwenImageEditPlusPipeline`), one file per component
//! mirroring diffusers:
//! - [`transformer`]: the 20 B dual-stream diffusion transformer, with its 3-D RoPE in [`rope`].
//! - [`vae`]: `AutoencoderKLQwenImage` (Wan 2.1 causal VAE) for single images, with tiling.
//! - [`encodings`]: encoded input sets as bytes, shared between workers.
//! - [`keys`]: Wan 2.1 / ComfyUI checkpoint names mapped to diffusers names.

pub mod encodings;
pub mod keys;
pub mod pipeline;
pub mod rope;
pub mod transformer;
pub mod vae;
