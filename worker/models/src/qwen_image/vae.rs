//! The Qwen-Image VAE: diffusers `AutoencoderKLQwenImage`, a Wan-2.1 causal 3-D VAE, for single
//! images (one frame), as the equivalent 2-D network; with diffusers' tiled encode/decode.
//!
//! Ported from diffusers 0.42.1 `models/autoencoders/autoencoder_kl_qwenimage.py` (Apache-2.0,
//! Copyright 2025 The Qwen-Image Team, Wan Team and The HuggingFace Team). Keys are diffusers'
//! (`encoder.{conv_in,down_blocks,mid_block,norm_out,conv_out}`, `quant_conv`, `post_quant_conv`,
//! `decoder.{conv_in,mid_block,up_blocks,norm_out,conv_out}`); Wan 2.1 / ComfyUI names are mapped
//! to them in [`super::keys`].
//!
//! Why a 2-D network is exact for one frame (read off the reference, T = 1):
//! - `encode` runs the encoder once on `x[:, :, :1]` and `decode` the decoder once on frame 0,
//!   each right after `clear_cache()`, so every `feat_cache` entry is `None` on that call.
//! - `QwenImageCausalConv3d` pads time by `(2 * p_t, 0)` (front only) and, with a `None` cache,
//!   concatenates nothing: a 3x3x3 conv sees frames `[0, 0, x]` and yields one frame, so only the
//!   kernel's last temporal slice `weight[:, :, -1]` meets non-zero input; the spatial padding is
//!   the ordinary symmetric `p`. 1x1x1 convs (shortcuts, `quant_conv`, `post_quant_conv`) are
//!   their single slice. We load the 5-D weights and keep `weight[:, :, -1]` (contiguous).
//! - `QwenImageResample` `downsample3d`: with `feat_cache[idx] is None` it only stores the frame;
//!   `upsample3d`: it stores `"Rep"` and skips `time_conv`. So the `time_conv`s never run on the
//!   first chunk; their weights are still read (shape-checked, then dropped) so that a checkpoint
//!   of the wrong layout fails and every tensor of the file is accounted for.
//! - Attention and RMS norms act per frame already (`images=False` norms normalise over channels).
//!
//! Layers: `RMS_norm` (`F.normalize(x, dim=1) * sqrt(C) * gamma`, normalised in fp32 for half
//! inputs), SiLU, residual blocks with a 1x1 shortcut where channels change, a mid block of
//! resnet / single-head attention (1x1 conv `to_qkv` / `proj`) / resnet, downsampling by
//! `ZeroPad2d(0, 1, 0, 1)` + stride-2 conv, upsampling by `nearest-exact` x2 + conv to half the
//! channels. The decoder output is clamped to [-1, 1] (untiled path only, as in diffusers).

use tch::{Kind, Tensor};

use crate::error::{GenerateError, LoadError};
use crate::loading::weights::Weights;
use crate::nn::fused::NormKernels;
use crate::nn::tiling::{TileGrid, Tiling, tiled};
use crate::nn::{AttentionImpl, Conv2d, MemoryFormat, attention, channels_last};
use crate::qwen_image::kernels::vae_rms_norm;

/// `AutoencoderKLQwenImage` config fields, plus tiling settings (diffusers keeps those on the
/// model instance, not in the config).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QwenVaeConfig {
    pub base_dim: i64,
    pub z_dim: i64,
    pub dim_mult: Vec<i64>,
    pub num_res_blocks: i64,
    /// One entry per downsampling level (`dim_mult.len() - 1`); only its length matters for one
    /// frame (spatial factor `2^len`), the flags choose which resamplers own a `time_conv`.
    pub temperal_downsample: Vec<bool>,
    pub input_channels: i64,
    /// Per-channel latent statistics: the edit pipeline feeds `(z - mean) / std` to the
    /// transformer and decodes `z / (1 / std) + mean`.
    pub latents_mean: Vec<f64>,
    pub latents_std: Vec<f64>,
    /// `F.normalize`'s `eps` in the RMS norms.
    pub norm_eps: f64,
    /// diffusers `tile_sample_min_height` / `_width` (pixels).
    pub tile_sample_min_height: i64,
    pub tile_sample_min_width: i64,
    /// diffusers `tile_sample_stride_height` / `_width` (pixels).
    pub tile_sample_stride_height: i64,
    pub tile_sample_stride_width: i64,
    /// [`Tiling::Auto`] tiles images (or the pixel size of latents) with a side above this.
    pub tiling_threshold: i64,
}

/// diffusers' tiling defaults (`AutoencoderKLQwenImage.__init__`): 256 px tiles every 192 px.
const TILE_SAMPLE_MIN: i64 = 256;
const TILE_SAMPLE_STRIDE: i64 = 192;
/// Auto tiling only above 2048 px a side: the Edit pipeline works at about 1024x1024, where the
/// untiled VAE fits easily and tiling would change the numbers against diffusers' default (off).
const TILING_THRESHOLD: i64 = 2048;

impl QwenVaeConfig {
    /// Qwen/Qwen-Image-Edit-2509 `vae/config.json` (= `AutoencoderKLQwenImage()` defaults):
    /// base 96, z 16, dim_mult [1, 2, 4, 4], 2 res blocks, no attention scales, temporal
    /// downsampling [False, True, True] (spatial factor 8), and the real latent statistics.
    pub fn qwen_image() -> Self {
        Self {
            base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temperal_downsample: vec![false, true, true],
            input_channels: 3,
            latents_mean: vec![
                -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134,
                -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
            ],
            latents_std: vec![
                2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526,
                2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
            ],
            norm_eps: 1e-12,
            tile_sample_min_height: TILE_SAMPLE_MIN,
            tile_sample_min_width: TILE_SAMPLE_MIN,
            tile_sample_stride_height: TILE_SAMPLE_STRIDE,
            tile_sample_stride_width: TILE_SAMPLE_STRIDE,
            tiling_threshold: TILING_THRESHOLD,
        }
    }

    /// The test VAE of `fixtures/qwen/common.py` (`VAE_CONFIG`, after diffusers'
    /// `test_qwenimage_edit_plus.py`): base 24, z 4, dim_mult [1, 2, 4], 1 res block, temporal
    /// downsampling [False, True] (spatial factor 4), non-trivial latent statistics.
    pub fn tiny() -> Self {
        Self {
            base_dim: 24,
            z_dim: 4,
            dim_mult: vec![1, 2, 4],
            num_res_blocks: 1,
            temperal_downsample: vec![false, true],
            input_channels: 3,
            latents_mean: vec![-0.75, 0.375, 1.5, -0.125],
            latents_std: vec![2.5, 0.625, 1.75, 1.25],
            ..Self::qwen_image()
        }
    }

    /// Parses a diffusers `vae/config.json`; missing fields take `AutoencoderKLQwenImage`'s
    /// defaults, tiling takes diffusers' defaults. Rejects layouts this port does not cover
    /// (attention scales) and inconsistent lengths.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::qwen_image();
        let int = |k: &str, def: i64| match v.get(k) {
            None => Ok(def),
            Some(x) => x.as_i64().ok_or(format!("`{k}` is not an integer")),
        };
        fn list<T: serde::de::DeserializeOwned>(
            v: &serde_json::Value,
            k: &str,
            def: Vec<T>,
        ) -> Result<Vec<T>, String> {
            match v.get(k) {
                None => Ok(def),
                Some(x) => serde_json::from_value(x.clone()).map_err(|e| format!("`{k}`: {e}")),
            }
        }
        let attn_scales: Vec<f64> = list(&v, "attn_scales", vec![])?;
        if !attn_scales.is_empty() {
            return Err(format!(
                "`attn_scales` {attn_scales:?} is not supported (Qwen-Image uses [])"
            ));
        }
        let c = Self {
            base_dim: int("base_dim", d.base_dim)?,
            z_dim: int("z_dim", d.z_dim)?,
            dim_mult: list(&v, "dim_mult", d.dim_mult.clone())?,
            num_res_blocks: int("num_res_blocks", d.num_res_blocks)?,
            temperal_downsample: list(&v, "temperal_downsample", d.temperal_downsample.clone())?,
            input_channels: int("input_channels", d.input_channels)?,
            latents_mean: list(&v, "latents_mean", d.latents_mean.clone())?,
            latents_std: list(&v, "latents_std", d.latents_std.clone())?,
            ..d
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the invariants the model relies on (lengths, positive sizes, tile geometry).
    pub fn validate(&self) -> Result<(), String> {
        let levels = self.dim_mult.len();
        if levels < 1 || self.temperal_downsample.len() + 1 != levels {
            return Err(format!(
                "`temperal_downsample` has {} entries, `dim_mult` {levels}: expected one fewer",
                self.temperal_downsample.len()
            ));
        }
        if self.base_dim < 1
            || self.z_dim < 1
            || self.num_res_blocks < 0
            || self.input_channels < 1
            || self.dim_mult.iter().any(|&m| m < 1)
        {
            return Err("sizes must be positive".into());
        }
        for (name, l) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if l.len() as i64 != self.z_dim {
                return Err(format!(
                    "`{name}` has {} entries, z_dim is {}",
                    l.len(),
                    self.z_dim
                ));
            }
        }
        if self.latents_std.contains(&0.0) {
            return Err("`latents_std` has a zero".into());
        }
        let f = self.spatial_compression_ratio();
        for (tile, stride) in [
            (self.tile_sample_min_height, self.tile_sample_stride_height),
            (self.tile_sample_min_width, self.tile_sample_stride_width),
        ] {
            if stride < f || stride > tile || tile % f != 0 || stride % f != 0 {
                return Err(format!(
                    "tile {tile} / stride {stride}: need stride <= tile, both multiples of {f}"
                ));
            }
        }
        Ok(())
    }

    /// Pixels per latent along a side: `2^len(temperal_downsample)`.
    pub fn spatial_compression_ratio(&self) -> i64 {
        1 << self.temperal_downsample.len()
    }
}

/// A `QwenImageCausalConv3d` applied to one frame with an empty cache: a 2-D conv with the
/// kernel's last temporal slice and the spatial padding (see the file header).
#[derive(Debug)]
struct FrameConv {
    weight: Tensor,
    bias: Tensor,
    padding: i64,
}

impl FrameConv {
    /// `CausalConv3d(in_ch, out_ch, kernel, padding=kernel/2)` (kernel 3 or 1, cubic).
    fn new(w: &Weights, in_ch: i64, out_ch: i64, kernel: i64) -> Result<Self, LoadError> {
        let weight = w.get("weight", &[out_ch, in_ch, kernel, kernel, kernel])?;
        Ok(Self {
            weight: weight.select(2, kernel - 1).contiguous(),
            bias: w.get("bias", &[out_ch])?,
            padding: kernel / 2,
        })
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.weight]
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.conv2d(
            &self.weight,
            Some(&self.bias),
            [1, 1],
            [self.padding, self.padding],
            [1, 1],
            1,
        )
    }
}

/// `QwenImageRMS_norm` (no bias: diffusers builds them all with `bias=False`).
#[derive(Debug)]
struct RmsNorm {
    /// `[C, 1, 1]` (stored `[C, 1, 1, 1]` for video norms, `[C, 1, 1]` for image norms).
    gamma: Tensor,
    scale: f64,
    eps: f64,
    /// One kernel (`qwen_image::kernels::vae_rms_norm`) where it applies.
    fused: bool,
}

impl RmsNorm {
    fn new(w: &Weights, dim: i64, images: bool, eps: f64) -> Result<Self, LoadError> {
        let gamma = if images {
            w.get("gamma", &[dim, 1, 1])?
        } else {
            w.get("gamma", &[dim, 1, 1, 1])?.view([dim, 1, 1])
        };
        Ok(Self {
            gamma,
            scale: (dim as f64).sqrt(),
            eps,
            fused: false,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.apply(x, false)
    }

    /// The norm, then SiLU (what every residual block and `norm_out` apply).
    fn forward_silu(&self, x: &Tensor) -> Tensor {
        self.apply(x, true)
    }

    fn apply(&self, x: &Tensor, silu: bool) -> Tensor {
        if self.fused
            && let Some(y) = vae_rms_norm(x, &self.gamma, self.scale, self.eps, silu)
        {
            return y;
        }
        let y = self.libtorch(x);
        if silu { y.silu() } else { y }
    }

    fn libtorch(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = match kind {
            Kind::Half | Kind::BFloat16 => x.to_kind(Kind::Float),
            _ => x.shallow_clone(),
        };
        // F.normalize: x / max(||x||_2, eps) over the channels.
        let denom = xf.norm_scalaropt_dim(2, [1], true).clamp_min(self.eps);
        let normalized = (xf / denom).to_kind(kind);
        normalized * self.scale * &self.gamma
    }
}

/// `QwenImageResidualBlock`.
#[derive(Debug)]
struct ResidualBlock {
    norm1: RmsNorm,
    conv1: FrameConv,
    norm2: RmsNorm,
    conv2: FrameConv,
    conv_shortcut: Option<FrameConv>,
}

impl ResidualBlock {
    fn new(w: &Weights, in_dim: i64, out_dim: i64, eps: f64) -> Result<Self, LoadError> {
        Ok(Self {
            norm1: RmsNorm::new(&w.pp("norm1"), in_dim, false, eps)?,
            conv1: FrameConv::new(&w.pp("conv1"), in_dim, out_dim, 3)?,
            norm2: RmsNorm::new(&w.pp("norm2"), out_dim, false, eps)?,
            conv2: FrameConv::new(&w.pp("conv2"), out_dim, out_dim, 3)?,
            conv_shortcut: if in_dim != out_dim {
                Some(FrameConv::new(&w.pp("conv_shortcut"), in_dim, out_dim, 1)?)
            } else {
                None
            },
        })
    }

    fn norms_mut(&mut self) -> [&mut RmsNorm; 2] {
        [&mut self.norm1, &mut self.norm2]
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        let mut out = self.conv1.weights_mut();
        out.extend(self.conv2.weights_mut());
        if let Some(c) = &mut self.conv_shortcut {
            out.extend(c.weights_mut());
        }
        out
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = match &self.conv_shortcut {
            Some(c) => c.forward(x),
            None => x.shallow_clone(),
        };
        let y = self.norm1.forward_silu(x);
        let y = self.conv1.forward(&y);
        let y = self.norm2.forward_silu(&y);
        self.conv2.forward(&y) + h
    }
}

/// `QwenImageAttentionBlock`: single-head self-attention over the pixels of a frame.
#[derive(Debug)]
struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: Conv2d,
    proj: Conv2d,
    imp: AttentionImpl,
}

impl AttentionBlock {
    fn new(w: &Weights, dim: i64, eps: f64, imp: AttentionImpl) -> Result<Self, LoadError> {
        Ok(Self {
            norm: RmsNorm::new(&w.pp("norm"), dim, true, eps)?,
            to_qkv: Conv2d::new(&w.pp("to_qkv"), dim, 3 * dim, 1, 1, 0)?,
            proj: Conv2d::new(&w.pp("proj"), dim, dim, 1, 1, 0)?,
            imp,
        })
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.to_qkv.weight, &mut self.proj.weight]
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let s = x.size();
        let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
        let qkv = self
            .to_qkv
            .forward(&self.norm.forward(x))
            .reshape([b, 1, 3 * c, h * w])
            .permute([0, 1, 3, 2])
            .contiguous();
        let qkv = qkv.chunk(3, -1);
        let o = attention(
            &qkv[0],
            &qkv[1],
            &qkv[2],
            None,
            1.0 / (c as f64).sqrt(),
            self.imp,
        );
        let o = o.squeeze_dim(1).permute([0, 2, 1]).reshape([b, c, h, w]);
        self.proj.forward(&o) + x
    }
}

/// `QwenImageMidBlock` with one attention layer: resnet, attention, resnet.
#[derive(Debug)]
struct MidBlock {
    resnets: [ResidualBlock; 2],
    attention: AttentionBlock,
}

impl MidBlock {
    fn new(w: &Weights, dim: i64, eps: f64, imp: AttentionImpl) -> Result<Self, LoadError> {
        let r = |i: i64| ResidualBlock::new(&w.pp("resnets").pp(i), dim, dim, eps);
        Ok(Self {
            resnets: [r(0)?, r(1)?],
            attention: AttentionBlock::new(&w.pp("attentions.0"), dim, eps, imp)?,
        })
    }

    fn norms_mut(&mut self) -> Vec<&mut RmsNorm> {
        let [r0, r1] = &mut self.resnets;
        let mut out: Vec<&mut RmsNorm> = r0.norms_mut().into();
        out.extend(r1.norms_mut());
        out.push(&mut self.attention.norm);
        out
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        let [r0, r1] = &mut self.resnets;
        let mut out = r0.weights_mut();
        out.extend(r1.weights_mut());
        out.extend(self.attention.weights_mut());
        out
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.resnets[0].forward(x);
        let h = self.attention.forward(&h);
        self.resnets[1].forward(&h)
    }
}

/// `QwenImageResample` on one frame (`time_conv` checked at load, never run).
#[derive(Debug)]
enum Resample {
    /// `ZeroPad2d((0, 1, 0, 1))` then a 3x3 stride-2 conv.
    Down(Conv2d),
    /// `nearest-exact` x2 then a 3x3 conv to half the channels.
    Up(Conv2d),
}

impl Resample {
    /// `downsample2d` / `downsample3d` (with `time_conv` `[dim, dim, 3, 1, 1]`).
    fn down(w: &Weights, dim: i64, temporal: bool) -> Result<Self, LoadError> {
        if temporal {
            check_time_conv(&w.pp("time_conv"), dim, dim)?;
        }
        Ok(Self::Down(Conv2d::new(
            &w.pp("resample.1"),
            dim,
            dim,
            3,
            2,
            0,
        )?))
    }

    /// `upsample2d` / `upsample3d` (with `time_conv` `[2 dim, dim, 3, 1, 1]`).
    fn up(w: &Weights, dim: i64, temporal: bool) -> Result<Self, LoadError> {
        if temporal {
            check_time_conv(&w.pp("time_conv"), dim, 2 * dim)?;
        }
        Ok(Self::Up(Conv2d::new(
            &w.pp("resample.1"),
            dim,
            dim / 2,
            3,
            1,
            1,
        )?))
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            Self::Down(conv) | Self::Up(conv) => vec![&mut conv.weight],
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Down(conv) => conv.forward(&x.constant_pad_nd([0, 1, 0, 1])),
            Self::Up(conv) => {
                let s = x.size();
                // Nearest is exact in any dtype, so diffusers' fp32 round trip changes nothing.
                let up = x.internal_upsample_nearest_exact2d([2 * s[2], 2 * s[3]], 2.0, 2.0);
                conv.forward(&up)
            }
        }
    }
}

/// Reads a resampler's `time_conv` (`CausalConv3d(in, out, (3, 1, 1))`) to check its shape; a
/// single frame never uses it (see the file header).
fn check_time_conv(w: &Weights, in_dim: i64, out_dim: i64) -> Result<(), LoadError> {
    drop(w.get("weight", &[out_dim, in_dim, 3, 1, 1])?);
    drop(w.get("bias", &[out_dim])?);
    Ok(())
}

/// One entry of the encoder's flat `down_blocks` list.
#[derive(Debug)]
enum DownLayer {
    Residual(ResidualBlock),
    Resample(Resample),
}

/// `QwenImageEncoder3d` (no attention scales).
#[derive(Debug)]
struct Encoder {
    conv_in: FrameConv,
    down_blocks: Vec<DownLayer>,
    mid_block: MidBlock,
    norm_out: RmsNorm,
    conv_out: FrameConv,
}

impl Encoder {
    fn new(w: &Weights, c: &QwenVaeConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let eps = c.norm_eps;
        let dims: Vec<i64> = std::iter::once(1)
            .chain(c.dim_mult.iter().copied())
            .map(|m| c.base_dim * m)
            .collect();
        // diffusers keeps the encoder's residual blocks and resamplers in one flat list.
        let mut down_blocks = Vec::new();
        for i in 0..c.dim_mult.len() {
            let (mut in_dim, out_dim) = (dims[i], dims[i + 1]);
            for _ in 0..c.num_res_blocks {
                let lw = w.pp("down_blocks").pp(down_blocks.len());
                let r = ResidualBlock::new(&lw, in_dim, out_dim, eps)?;
                down_blocks.push(DownLayer::Residual(r));
                in_dim = out_dim;
            }
            if i + 1 != c.dim_mult.len() {
                let lw = w.pp("down_blocks").pp(down_blocks.len());
                let r = Resample::down(&lw, out_dim, c.temperal_downsample[i])?;
                down_blocks.push(DownLayer::Resample(r));
            }
        }
        let top = dims[dims.len() - 1];
        Ok(Self {
            conv_in: FrameConv::new(&w.pp("conv_in"), c.input_channels, dims[0], 3)?,
            down_blocks,
            mid_block: MidBlock::new(&w.pp("mid_block"), top, eps, imp)?,
            norm_out: RmsNorm::new(&w.pp("norm_out"), top, false, eps)?,
            conv_out: FrameConv::new(&w.pp("conv_out"), top, 2 * c.z_dim, 3)?,
        })
    }

    fn norms_mut(&mut self) -> Vec<&mut RmsNorm> {
        let mut out = Vec::new();
        for layer in &mut self.down_blocks {
            if let DownLayer::Residual(r) = layer {
                out.extend(r.norms_mut());
            }
        }
        out.extend(self.mid_block.norms_mut());
        out.push(&mut self.norm_out);
        out
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        let mut out = self.conv_in.weights_mut();
        for layer in &mut self.down_blocks {
            out.extend(match layer {
                DownLayer::Residual(r) => r.weights_mut(),
                DownLayer::Resample(r) => r.weights_mut(),
            });
        }
        out.extend(self.mid_block.weights_mut());
        out.extend(self.conv_out.weights_mut());
        out
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = self.conv_in.forward(x);
        for layer in &self.down_blocks {
            h = match layer {
                DownLayer::Residual(r) => r.forward(&h),
                DownLayer::Resample(r) => r.forward(&h),
            };
        }
        let h = self.mid_block.forward(&h);
        self.conv_out.forward(&self.norm_out.forward_silu(&h))
    }
}

/// `QwenImageUpBlock`: `num_res_blocks + 1` residual blocks and an optional upsampler.
#[derive(Debug)]
struct UpBlock {
    resnets: Vec<ResidualBlock>,
    upsampler: Option<Resample>,
}

/// `QwenImageDecoder3d`.
#[derive(Debug)]
struct Decoder {
    conv_in: FrameConv,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: FrameConv,
}

impl Decoder {
    fn new(w: &Weights, c: &QwenVaeConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let eps = c.norm_eps;
        let levels = c.dim_mult.len();
        let dims: Vec<i64> = std::iter::once(c.dim_mult[levels - 1])
            .chain(c.dim_mult.iter().rev().copied())
            .map(|m| c.base_dim * m)
            .collect();
        let temperal_upsample: Vec<bool> = c.temperal_downsample.iter().rev().copied().collect();
        let mut up_blocks = Vec::with_capacity(levels);
        for i in 0..levels {
            // Every block but the first follows an upsampler that halved the channels.
            let in_dim = if i > 0 { dims[i] / 2 } else { dims[i] };
            let out_dim = dims[i + 1];
            let bw = w.pp("up_blocks").pp(i);
            let resnets = (0..=c.num_res_blocks)
                .map(|j| {
                    let cin = if j == 0 { in_dim } else { out_dim };
                    ResidualBlock::new(&bw.pp("resnets").pp(j), cin, out_dim, eps)
                })
                .collect::<Result<_, _>>()?;
            let upsampler = if i + 1 != levels {
                Some(Resample::up(
                    &bw.pp("upsamplers.0"),
                    out_dim,
                    temperal_upsample[i],
                )?)
            } else {
                None
            };
            up_blocks.push(UpBlock { resnets, upsampler });
        }
        let last = dims[dims.len() - 1];
        Ok(Self {
            conv_in: FrameConv::new(&w.pp("conv_in"), c.z_dim, dims[0], 3)?,
            mid_block: MidBlock::new(&w.pp("mid_block"), dims[0], eps, imp)?,
            up_blocks,
            norm_out: RmsNorm::new(&w.pp("norm_out"), last, false, eps)?,
            conv_out: FrameConv::new(&w.pp("conv_out"), last, c.input_channels, 3)?,
        })
    }

    fn norms_mut(&mut self) -> Vec<&mut RmsNorm> {
        let mut out = self.mid_block.norms_mut();
        for block in &mut self.up_blocks {
            for r in &mut block.resnets {
                out.extend(r.norms_mut());
            }
        }
        out.push(&mut self.norm_out);
        out
    }

    fn weights_mut(&mut self) -> Vec<&mut Tensor> {
        let mut out = self.conv_in.weights_mut();
        out.extend(self.mid_block.weights_mut());
        for block in &mut self.up_blocks {
            for r in &mut block.resnets {
                out.extend(r.weights_mut());
            }
            if let Some(u) = &mut block.upsampler {
                out.extend(u.weights_mut());
            }
        }
        out.extend(self.conv_out.weights_mut());
        out
    }

    fn forward(&self, z: &Tensor) -> Tensor {
        let mut h = self.conv_in.forward(z);
        h = self.mid_block.forward(&h);
        for block in &self.up_blocks {
            for r in &block.resnets {
                h = r.forward(&h);
            }
            if let Some(u) = &block.upsampler {
                h = u.forward(&h);
            }
        }
        self.conv_out.forward(&self.norm_out.forward_silu(&h))
    }
}

/// `AutoencoderKLQwenImage` for single images.
#[derive(Debug)]
pub struct QwenVae {
    encoder: Encoder,
    quant_conv: FrameConv,
    post_quant_conv: FrameConv,
    decoder: Decoder,
    config: QwenVaeConfig,
    tiling: Tiling,
    memory_format: MemoryFormat,
    norm_kernels: NormKernels,
}

impl QwenVae {
    /// Loads every tensor of the layout `config` describes (diffusers names) from `w`; the
    /// attention kernel is SDPA and tiling [`Tiling::Auto`] (see [`Self::new_with_attention`],
    /// [`Self::with_tiling`]).
    pub fn new(w: &Weights, config: &QwenVaeConfig) -> Result<Self, LoadError> {
        Self::new_with_attention(w, config, AttentionImpl::default())
    }

    pub fn new_with_attention(
        w: &Weights,
        config: &QwenVaeConfig,
        imp: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let z2 = 2 * config.z_dim;
        Ok(Self {
            encoder: Encoder::new(&w.pp("encoder"), config, imp)?,
            quant_conv: FrameConv::new(&w.pp("quant_conv"), z2, z2, 1)?,
            post_quant_conv: FrameConv::new(
                &w.pp("post_quant_conv"),
                config.z_dim,
                config.z_dim,
                1,
            )?,
            decoder: Decoder::new(&w.pp("decoder"), config, imp)?,
            config: config.clone(),
            tiling: Tiling::Auto,
            memory_format: MemoryFormat::Contiguous,
            norm_kernels: NormKernels::Aten,
        })
    }

    /// The memory order the convolutions run in: `Contiguous` (NCHW weights, inputs taken in
    /// the layout given, as diffusers: an image converted from RGB8 arrives with NHWC strides
    /// there and here, and libtorch then runs the encoder NHWC; the default) or `ChannelsLast`,
    /// where every convolution weight is stored NHWC and encode and decode make their input NHWC,
    /// so that cuDNN runs its NHWC kernels without converting the weights or the activations
    /// around each convolution and the RMS norms reduce over contiguous channels. Outputs are the
    /// same values, in the layout they come out in (NHWC strides with `ChannelsLast`).
    pub fn set_memory_format(&mut self, format: MemoryFormat) {
        self.memory_format = format;
        let _guard = tch::no_grad_guard();
        let convs = [
            self.encoder.weights_mut(),
            self.quant_conv.weights_mut(),
            self.post_quant_conv.weights_mut(),
            self.decoder.weights_mut(),
        ];
        for weight in convs.into_iter().flatten() {
            *weight = match format {
                MemoryFormat::ChannelsLast => channels_last(weight),
                MemoryFormat::Contiguous => weight.contiguous(),
            };
        }
    }

    pub fn memory_format(&self) -> MemoryFormat {
        self.memory_format
    }

    /// The RMS norms (and the SiLU after them) from now on: libtorch's operators (`Aten`, the
    /// default, as diffusers) or one kernel per norm (`Fused`, CUDA or HIP, bf16 only: other
    /// devices and dtypes keep libtorch's). Fused kernels are compiled for the device here, so
    /// that a device the run-time compiler cannot serve is an error now.
    pub fn set_norm_kernels(&mut self, kernels: NormKernels) -> Result<(), String> {
        let fused = kernels == NormKernels::Fused;
        if fused && !crate::nn::ops::BUILT_IN {
            return Err(crate::nn::ops::NOT_BUILT_IN.into());
        }
        if fused {
            crate::qwen_image::kernels::prepare(self.post_quant_conv.weight.device())?;
        }
        for norm in self
            .encoder
            .norms_mut()
            .into_iter()
            .chain(self.decoder.norms_mut())
        {
            norm.fused = fused;
        }
        self.norm_kernels = kernels;
        Ok(())
    }

    pub fn norm_kernels(&self) -> NormKernels {
        self.norm_kernels
    }

    /// `x` in the memory order the convolutions run in.
    /// With the fused norms and NCHW weights, an input with NHWC strides (an image converted from
    /// RGB8) is made NCHW: the norm kernel runs on NCHW activations only (`vae_rms_norm`), and
    /// an NHWC input would keep the whole encoder NHWC on libtorch's norms.
    fn laid_out(&self, x: &Tensor) -> Tensor {
        match self.memory_format {
            MemoryFormat::ChannelsLast => channels_last(x),
            MemoryFormat::Contiguous if self.norm_kernels == NormKernels::Fused => x.contiguous(),
            MemoryFormat::Contiguous => x.shallow_clone(),
        }
    }

    /// Chooses when encode/decode tile: [`Tiling::Never`]; [`Tiling::Always`] is diffusers'
    /// `enable_tiling()` (tiles whenever a side exceeds one tile); [`Tiling::Auto`] does the same
    /// only when a side (in pixels) exceeds `tiling_threshold`.
    pub fn with_tiling(mut self, tiling: Tiling) -> Self {
        self.tiling = tiling;
        self
    }

    pub fn config(&self) -> &QwenVaeConfig {
        &self.config
    }

    fn tiles(&self, h_px: i64, w_px: i64) -> bool {
        let c = &self.config;
        let above_tile = w_px > c.tile_sample_min_width || h_px > c.tile_sample_min_height;
        match self.tiling {
            Tiling::Never => false,
            Tiling::Always => above_tile,
            Tiling::Auto => above_tile && h_px.max(w_px) > c.tiling_threshold,
        }
    }

    /// Checks `x` is `[B, channels, H, W]` with sides that are positive multiples of `multiple`.
    fn check_input(
        x: &Tensor,
        what: &str,
        channels: i64,
        multiple: i64,
    ) -> Result<(i64, i64), GenerateError> {
        match x.size().as_slice() {
            &[b, c, h, w] if b > 0 && c == channels && h > 0 && w > 0 => {
                if h % multiple != 0 || w % multiple != 0 {
                    return Err(GenerateError::InvalidRequest(format!(
                        "VAE {what} of {h}x{w}: sides must be multiples of {multiple}"
                    )));
                }
                Ok((h, w))
            }
            s => Err(GenerateError::InvalidRequest(format!(
                "VAE {what} has shape {s:?}, expected [B, {channels}, H, W]"
            ))),
        }
    }

    /// The encoder's moments `[B, 2 z, h, w]` (`_encode` for one frame).
    fn moments(&self, x: &Tensor) -> Result<Tensor, GenerateError> {
        let c = &self.config;
        let f = c.spatial_compression_ratio();
        let (h, w) = Self::check_input(x, "input", c.input_channels, f)?;
        let x = &self.laid_out(x);
        let run = |t: &Tensor| self.quant_conv.forward(&self.encoder.forward(t));
        if !self.tiles(h, w) {
            return Ok(run(x));
        }
        let tile = [c.tile_sample_min_height / f, c.tile_sample_min_width / f];
        let stride = [
            c.tile_sample_stride_height / f,
            c.tile_sample_stride_width / f,
        ];
        let grid = TileGrid {
            tile: [c.tile_sample_min_height, c.tile_sample_min_width],
            stride: [c.tile_sample_stride_height, c.tile_sample_stride_width],
            blend: [tile[0] - stride[0], tile[1] - stride[1]],
            crop: stride,
            out: [h / f, w / f],
        };
        Ok(tiled(x, &grid, run))
    }

    /// `vae.encode(x).latent_dist.mode()` for images in [-1, 1] `[B, 3, H, W]` (sides multiples
    /// of the spatial factor): the raw (not normalised) latent mean `[B, z, H/f, W/f]`.
    pub fn encode_mean(&self, x: &Tensor) -> Result<Tensor, GenerateError> {
        Ok(self.moments(x)?.narrow(1, 0, self.config.z_dim))
    }

    /// `vae.decode(z).sample` for raw latents `[B, z, h, w]`: images `[B, 3, h f, w f]`, clamped
    /// to [-1, 1] when untiled (diffusers' tiled decode does not clamp).
    pub fn decode(&self, z: &Tensor) -> Result<Tensor, GenerateError> {
        let c = &self.config;
        let f = c.spatial_compression_ratio();
        let (h, w) = Self::check_input(z, "latents", c.z_dim, 1)?;
        let z = &self.laid_out(z);
        let run = |t: &Tensor| self.decoder.forward(&self.post_quant_conv.forward(t));
        if !self.tiles(h * f, w * f) {
            return Ok(run(z).clamp(-1.0, 1.0));
        }
        let grid = TileGrid {
            tile: [c.tile_sample_min_height / f, c.tile_sample_min_width / f],
            stride: [
                c.tile_sample_stride_height / f,
                c.tile_sample_stride_width / f,
            ],
            blend: [
                c.tile_sample_min_height - c.tile_sample_stride_height,
                c.tile_sample_min_width - c.tile_sample_stride_width,
            ],
            crop: [c.tile_sample_stride_height, c.tile_sample_stride_width],
            out: [h * f, w * f],
        };
        Ok(tiled(z, &grid, run))
    }

    /// `latents_mean` and `latents_std` as `[1, z, 1, 1]` fp32 tensors on `like`'s device.
    fn stats(&self, like: &Tensor) -> (Tensor, Tensor) {
        let c = &self.config;
        let t = |v: &[f64]| {
            Tensor::from_slice(&v.iter().map(|&x| x as f32).collect::<Vec<f32>>())
                .view([1, c.z_dim, 1, 1])
                .to_device(like.device())
        };
        (t(&c.latents_mean), t(&c.latents_std))
    }

    /// Raw latents to the transformer's space, as the edit pipeline's `_encode_vae_image`:
    /// `(z - mean) / std`, with mean and std cast to `z`'s dtype.
    pub fn normalize(&self, z: &Tensor) -> Tensor {
        let (mean, std) = self.stats(z);
        (z - mean.to_kind(z.kind())) / std.to_kind(z.kind())
    }

    /// The inverse before decoding, as the pipeline writes it: `z / (1 / std) + mean` (the
    /// reciprocal taken in fp32, then cast to `z`'s dtype).
    pub fn denormalize(&self, z: &Tensor) -> Tensor {
        let (mean, std) = self.stats(z);
        let inv_std = std.reciprocal().to_kind(z.kind());
        z / inv_std + mean.to_kind(z.kind())
    }
}
