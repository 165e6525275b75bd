//! SDXL text-to-image, matching diffusers' `StableDiffusionXLPipeline` (compel's prompt weighting).
//!
//! Components: [`clip`] (CLIP-L and OpenCLIP bigG text encoders), [`unet_blocks`] and [`unet`]
//! (UNet2DConditionModel with text_time conditioning; [`unet_graph`]: its forward replayed from a
//! CUDA graph) built from [`resnet`] and [`attention`]
//! (spatial transformer), [`vae`] (AutoencoderKL with tiling). Key mapping: [`ldm`] (single-file
//! checkpoints). Prompt maths: [`conditioning`]. [`pipeline`]: `SdxlPipeline::load / generate /
//! generate_batch / warm_up`.

pub mod attention;
pub mod clip;
pub mod conditioning;
pub mod ldm;
pub mod pipeline;
pub mod resnet;
pub mod unet;
pub mod unet_blocks;
pub mod unet_graph;
pub mod vae;
