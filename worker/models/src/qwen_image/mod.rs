//! Qwen-Image-Edit-2509 (diffusers `QwenImageEditPlusPipeline`), one file per component
//! mirroring diffusers:
//! - [`transformer`]: the 20 B dual-stream diffusion transformer, with its 3-D RoPE in [`rope`].
//! - [`vae`]: `AutoencoderKLQwenImage` (Wan 2.1 causal VAE) for single images, with tiling.
//! - [`pipeline`]: the Edit-Plus pipeline (encode the inputs once, edit per variant).
//! - [`encoded`]: an input set encoded once ([`encoded::EncodedInputs`]), which every variant reads.
//! - [`encodings`]: encoded input sets as bytes, shared between workers.
//! - [`kernels`]: the block's elementwise work as libtorch operators or fused kernels of our own.
//! - [`keys`]: Wan 2.1 / ComfyUI checkpoint names mapped to diffusers names.

pub mod encoded;
pub mod encodings;
pub mod kernels;
pub mod keys;
pub mod pipeline;
pub mod rope;
pub mod transformer;
pub mod vae;
