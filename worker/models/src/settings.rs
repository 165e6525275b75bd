//! Runtime settings of each engine: the kernel and memory-layout choices that change how fast a
//! model runs on a device, never what it computes beyond float rounding. They are kept apart from
//! the architecture configs (`UNetConfig`, `VaeConfig`, …), which describe a checkpoint and stay
//! pure presets of the upstream `config.json` files, as candle keeps its presets.
//!
//! Each engine has one settings value with two named presets:
//! - [`Preset::Portable`]: plain ATen operators, NCHW UNet, no graph capture: what runs on any
//!   libtorch backend (CPU, CUDA, ROCm), and the default;
//! - [`Preset::Cuda`]: the combination measured fastest on the NVIDIA H200 (docs/performance.md,
//!   kernels attempts 6, 8, 10 and 11; Real-ESRGAN's tile sweep).
//!
//! A box does not have to guess between them: `vnfarm-worker check` measures every candidate on the
//! box's own device and writes the settings that won into a file the worker loads.

use serde::{Deserialize, Serialize};

use crate::loading::weights::Fp8Mode;
use crate::nn::fused::NormKernels;
use crate::nn::{AttentionImpl, FfGelu, MemoryFormat};
use crate::qwen_image::kernels::BlockKernels;

/// A named starting point for an engine's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// Plain ATen everywhere; any backend.
    #[default]
    Portable,
    /// Measured fastest on CUDA (H200); needs a binary built against a CUDA libtorch.
    Cuda,
}

impl Preset {
    pub const ALL: [Preset; 2] = [Preset::Portable, Preset::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Portable => "portable",
            Preset::Cuda => "cuda",
        }
    }
}

/// The SDXL engine's choices. Unset keys of a settings table are the portable preset's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SdxlSettings {
    /// Attention of the UNet and the VAE's mid block.
    pub attention: AttentionImpl,
    /// Replay the UNet forward from a graph captured per latent shape (CUDA: CFG step −5 to −7 %
    /// at 1024², bit-identical; a memory pool per shape, about 1 GiB at 1024²).
    pub cuda_graphs: bool,
    /// The feed-forwards' GELU: diffusers' erf GELU as its own kernel, or in the matmul's epilogue
    /// (tanh approximation; operator shim).
    pub ff_gelu: FfGelu,
    /// The UNet's activations NCHW (as diffusers) or NHWC.
    pub unet_memory_format: MemoryFormat,
    /// The UNet's normalisations as libtorch's operators or as fused kernels compiled at load.
    pub norm_kernels: NormKernels,
    /// Memory order of the VAE decoder after its mid block and of the encoder's input.
    pub vae_memory_format: MemoryFormat,
    /// Working memory (MiB, weights excluded) one image's VAE decode may take untiled; beyond it
    /// the seam-free tiled decode runs.
    pub vae_memory_budget_mib: u32,
}

/// The default VAE budget: 2048² decodes untiled in bf16 (about 10 GiB, measured on an H200,
/// docs/performance.md).
pub const DEFAULT_VAE_MEMORY_BUDGET_MIB: u32 = 12 * 1024;

impl SdxlSettings {
    pub fn preset(preset: Preset) -> Self {
        let portable = Self {
            attention: AttentionImpl::Sdpa,
            cuda_graphs: false,
            ff_gelu: FfGelu::Separate,
            unet_memory_format: MemoryFormat::Contiguous,
            norm_kernels: NormKernels::Aten,
            vae_memory_format: MemoryFormat::ChannelsLast,
            vae_memory_budget_mib: DEFAULT_VAE_MEMORY_BUDGET_MIB,
        };
        match preset {
            Preset::Portable => portable,
            // Runs 14-16 (docs/performance.md): UNet batch 8 0.78x diffusers, 20-step 1024²
            // generate 0.45x with graphs.
            Preset::Cuda => Self {
                cuda_graphs: true,
                ff_gelu: FfGelu::Epilogue,
                unet_memory_format: MemoryFormat::ChannelsLast,
                norm_kernels: NormKernels::Fused,
                ..portable
            },
        }
    }

    /// Whether these settings need the C++ shims of a CUDA (or, once ported, HIP) build.
    pub fn needs_shims(&self) -> bool {
        self.cuda_graphs
            || self.ff_gelu == FfGelu::Epilogue
            || self.norm_kernels == NormKernels::Fused
    }

    /// Why these settings cannot run together, if they cannot.
    pub fn validate(&self) -> Result<(), String> {
        // `norm_kernels = fused` with an NCHW UNet is valid: the LayerNorm kernel runs either way,
        // the GroupNorm and bias kernels only on NHWC activations.
        if self.vae_memory_budget_mib > 1 << 24 {
            return Err("vae_memory_budget_mib: at most 16777216 (16 TiB)".into());
        }
        Ok(())
    }
}

impl Default for SdxlSettings {
    fn default() -> Self {
        Self::preset(Preset::Portable)
    }
}

/// The Qwen-Image-Edit engine's choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QwenSettings {
    /// Attention of the transformer, the text encoder and the vision tower.
    pub attention: AttentionImpl,
    /// fp8 weight files dequantised at load (`upcast`, faster) or kept fp8 on the device
    /// (`resident`, about half the memory).
    pub fp8: Fp8Mode,
    /// The transformer blocks' q/k RMSNorm, RoPE and joint text+image concatenation: libtorch's
    /// operators, or one fused kernel per stream writing the joint buffers (compiled at load).
    pub qk_norm_rope: NormKernels,
    /// The blocks' LayerNorm with the adaLN shift and scale: libtorch's or one fused pass.
    pub ada_norm: NormKernels,
    /// The blocks' gated residuals: libtorch's or one fused pass (carrying LayerNorm 2 when
    /// `ada_norm` is fused too).
    pub gated_residual: NormKernels,
    /// The feed-forwards' GELU-tanh: its own kernel, or in the FF-up GEMM's epilogue (CUDA).
    pub ff_gelu: FfGelu,
    /// Each stream's q, k, v projections as one GEMM over weights concatenated at load (the
    /// three keep views of it: no memory added; `upcast` only, fp8-resident weights keep three).
    pub fused_qkv: bool,
    /// The image stream's q/k/v, FF-up and FF-down projections as fp8 GEMMs (e4m3fn weights with
    /// per-channel scales, activations quantised per token by the kernels before them). CUDA
    /// with fp8 tensor cores only (Hopper, Ada); needs the fused `ada_norm` and `gated_residual`
    /// to pay. Holds the fp8 weights beside the bf16 ones (about 6.8 GB for the real model). Not
    /// in any preset: the box check keeps it where its images agree and it is faster.
    pub fp8_gemm: bool,
    /// The VAE's convolutions NCHW (`contiguous`, as diffusers) or NHWC (`channels_last`:
    /// weights stored NHWC, encode and decode inputs made NHWC). MIOpen's NHWC convolutions can
    /// be slower than its NCHW ones, so the box check measures it.
    pub vae_memory_format: MemoryFormat,
    /// The VAE's RMS norms and the SiLU after them: libtorch's operators, or one kernel per norm
    /// (compiled at load; bf16 on CUDA or HIP).
    pub vae_norm: NormKernels,
}

impl QwenSettings {
    pub fn preset(preset: Preset) -> Self {
        // H200: upcast 1.57 s per 4-step 1024² edit against 1.83 s resident (docs/performance.md,
        // 2026-11-30), so both presets dequantise at load.
        let portable = Self {
            attention: AttentionImpl::Sdpa,
            fp8: Fp8Mode::Upcast,
            qk_norm_rope: NormKernels::Aten,
            ada_norm: NormKernels::Aten,
            gated_residual: NormKernels::Aten,
            ff_gelu: FfGelu::Separate,
            fused_qkv: false,
            fp8_gemm: false,
            vae_memory_format: MemoryFormat::Contiguous,
            vae_norm: NormKernels::Aten,
        };
        match preset {
            Preset::Portable => portable,
            // H200, 2026-12-04 (docs/performance.md, "fused kernels of step 13"): transformer step
            // 366 → 285 ms (0.77× diffusers' 372), 4-step 1024² edit 1.63 → 1.31 s (0.73×), images
            // 0.57/255 from diffusers' as before.
            Preset::Cuda => Self {
                qk_norm_rope: NormKernels::Fused,
                ada_norm: NormKernels::Fused,
                gated_residual: NormKernels::Fused,
                ff_gelu: FfGelu::Epilogue,
                fused_qkv: true,
                ..portable
            },
        }
    }

    /// The transformer's part of these settings.
    pub fn block_kernels(&self) -> BlockKernels {
        BlockKernels {
            qk_norm_rope: self.qk_norm_rope,
            ada_norm: self.ada_norm,
            gated_residual: self.gated_residual,
            ff_gelu: self.ff_gelu,
            fused_qkv: self.fused_qkv,
            fp8_gemm: self.fp8_gemm,
        }
    }

    /// Whether these settings need the C++ shims of a CUDA (or HIP) build.
    pub fn needs_shims(&self) -> bool {
        self.block_kernels().needs_shims() || self.vae_norm == NormKernels::Fused
    }
}

impl Default for QwenSettings {
    fn default() -> Self {
        Self::preset(Preset::Portable)
    }
}

/// The Real-ESRGAN engine's choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EsrganSettings {
    /// NHWC weights and activations, or NCHW as Real-ESRGAN runs.
    pub memory_format: MemoryFormat,
    /// Tile side in input pixels for jobs that do not say (and for the warm-up).
    pub tile: u32,
    /// Context around each tile in input pixels, at most a quarter of the tile.
    pub tile_overlap: u32,
}

impl EsrganSettings {
    pub fn preset(_preset: Preset) -> Self {
        // Both presets: tile 1024 / overlap 16 channels-last, the fastest measured on the H200 (at
        // 2048² 0.64 s and 6.7 GB against 0.62 s and 21.8 GB for the full frame). Channels-last is
        // plain ATen; whether MIOpen runs it natively (`PYTORCH_MIOPEN_SUGGEST_NHWC=1`) is for a
        // ROCm box's check to measure against `contiguous`.
        Self {
            memory_format: MemoryFormat::ChannelsLast,
            tile: 1024,
            tile_overlap: 16,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(32..=4096).contains(&self.tile) {
            return Err("tile: must be 32..=4096".into());
        }
        if self.tile_overlap > self.tile / 4 {
            return Err("tile_overlap: at most a quarter of the tile".into());
        }
        Ok(())
    }
}

impl Default for EsrganSettings {
    fn default() -> Self {
        Self::preset(Preset::Portable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_settings_table_is_the_portable_preset() {
        let s: SdxlSettings = serde_json::from_str("{}").unwrap();
        assert_eq!(s, SdxlSettings::preset(Preset::Portable));
        assert!(!s.needs_shims());
        let s: SdxlSettings =
            serde_json::from_str(r#"{"unet_memory_format":"channels_last"}"#).unwrap();
        assert_eq!(s.unet_memory_format, MemoryFormat::ChannelsLast);
        assert_eq!(s.norm_kernels, NormKernels::Aten);
    }

    #[test]
    fn the_cuda_preset_is_the_measured_fastest_combination() {
        let s = SdxlSettings::preset(Preset::Cuda);
        assert!(s.cuda_graphs && s.needs_shims());
        assert_eq!(s.norm_kernels, NormKernels::Fused);
        assert_eq!(s.unet_memory_format, MemoryFormat::ChannelsLast);
        assert_eq!(s.ff_gelu, FfGelu::Epilogue);
    }

    #[test]
    fn the_qwen_presets_are_the_portable_path_and_the_measured_fastest_kernels() {
        let portable = QwenSettings::preset(Preset::Portable);
        assert_eq!(portable, QwenSettings::default());
        assert!(!portable.needs_shims());
        assert_eq!(portable.block_kernels(), BlockKernels::default());
        let s: QwenSettings = serde_json::from_str("{}").unwrap();
        assert_eq!(s, portable);
        let cuda = QwenSettings::preset(Preset::Cuda);
        assert!(cuda.needs_shims() && cuda.block_kernels().any_fused());
        assert_eq!(cuda.fp8, portable.fp8);
        let s: QwenSettings = serde_json::from_str(r#"{"qk_norm_rope":"fused"}"#).unwrap();
        assert_eq!(s.qk_norm_rope, NormKernels::Fused);
        assert_eq!(s.ada_norm, NormKernels::Aten);
    }

    #[test]
    fn unknown_settings_keys_are_refused() {
        let e = serde_json::from_str::<SdxlSettings>(r#"{"cuda_graph":true}"#).unwrap_err();
        assert!(e.to_string().contains("cuda_graph"), "{e}");
    }
}
