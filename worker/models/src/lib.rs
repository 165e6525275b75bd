//! `vnfarm-models`: SDXL text-to-image natively on `tch` (libtorch), numerically matching diffusers.
//!
//! Layout (one component per file, mirroring diffusers; weight names equal checkpoint keys):
//! - loading: [`safetensors`] (mmap, header parsing, bounds checks), [`weights`] (name tables and a
//!   cursor with prefix/device/dtype), [`ldm`] (single-file ldm key mapping, v-pred flags),
//!   [`error`] (typed errors).
//! - layers: [`nn`] (Linear, Conv2d, norms, attention kernel choice), [`embeddings`], [`resnet`],
//!   [`attention`] (spatial transformer).
//! - components: [`clip`] (CLIP-L and OpenCLIP bigG text encoders), [`unet_blocks`] and [`unet`]
//!   (UNet2DConditionModel with text_time conditioning), [`vae`] (AutoencoderKL with tiling).
//! - sampling: [`schedulers`] (Euler, Euler ancestral, DPM++ 2M Karras), [`noise`] (torch-identical
//!   seeded noise).
//! - text: [`tokenizer`] (CLIP BPE, bundled files), [`prompt`] (A1111 syntax), [`conditioning`]
//!   (compel's weighting maths).
//! - [`pipeline`]: `SdxlPipeline::load` / `generate` / `warm_up`.

pub mod attention;
pub mod clip;
pub mod conditioning;
pub mod embeddings;
pub mod error;
pub mod ldm;
pub mod nn;
pub mod noise;
pub mod pipeline;
pub mod prompt;
pub mod resnet;
pub mod safetensors;
pub mod schedulers;
pub mod tokenizer;
pub mod unet;
pub mod unet_blocks;
pub mod vae;
pub mod weights;
