//! Qwen-Image-Edit-2509 (diffusers `QwenImageEditPlusPipeline`): [`transformer`] (the 20 B
//! dual-stream diffusion transformer) with its 3-D RoPE in [`rope`].

pub mod rope;
pub mod transformer;
