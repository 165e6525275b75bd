//! The model crate's integration tests, one binary (so libtorch is linked once): golden tests of
//! every component and pipeline against its Python reference (diffusers, transformers, compel,
//! Real-ESRGAN, Pillow, OpenCV), on the tiny fixtures under `fixtures/` and their generator
//! scripts, and the fused GPU kernels checked on the CPU. One module per model family or piece, its
//! tolerances in its own header:
//! - [`sdxl`], [`sdxl_lora`]: SDXL components, loaders, pipeline images; per-job LoRAs;
//! - [`qwen_text_encoder`], [`qwen_vision`], [`qwen_transformer`], [`qwen_vae`], [`qwen_pipeline`]:
//!   Qwen-Image-Edit-2509 component by component, then whole edits;
//! - [`flow_match`]: the flow-match scheduler; [`lora`]: LoRA fusing in every key style;
//! - [`esrgan`]: Real-ESRGAN networks and `enhance`; [`resample`]: Pillow-exact resizing;
//! - [`fused_kernels_emulated`], [`fused_kernels_hip_compile`]: the fused norm kernels run in a
//!   CPU emulation, and compiled as AMD device code; [`qwen_kernels_emulated`]: the Qwen block's
//!   fused kernels in the same emulation against libtorch.
//!
//! The modules share one process: anything that draws from libtorch's default generator holds it
//! through `noise::seed`, and scratch files are named per module.
//!
//! [`support`] (also used by the end-to-end tests) holds the error measures and the fixture files
//! derived at test time.

#[path = "../support/mod.rs"]
mod support;

mod esrgan;
mod flow_match;
mod fused_kernels_emulated;
mod fused_kernels_hip_compile;
mod lora;
mod qwen_fixtures;
mod qwen_kernels_emulated;
mod qwen_pipeline;
mod qwen_text_encoder;
mod qwen_transformer;
mod qwen_vae;
mod qwen_vision;
mod resample;
mod sdxl;
mod sdxl_lora;
