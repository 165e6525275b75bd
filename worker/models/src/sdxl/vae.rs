//! The SDXL VAE: diffusers `AutoencoderKL` (encoder to a diagonal Gaussian, decoder back to pixels),
//! with diffusers-compatible tiled encode/decode (overlapping tiles, linear blending) chosen
//! automatically above a configurable size.
//!
//! After diffusers `models/autoencoders/autoencoder_kl.py` and `autoencoders/vae.py` (Apache-2.0).
//! Keys: `encoder.{conv_in,down_blocks,mid_block,conv_norm_out,conv_out}`, `quant_conv`,
//! `post_quant_conv`, `decoder.{conv_in,mid_block,up_blocks,conv_norm_out,conv_out}`.

use tch::Tensor;

use crate::error::LoadError;
use crate::loading::weights::Weights;
use crate::nn::{AttentionImpl, Conv2d, GroupNorm, Linear, attention};
use crate::sdxl::resnet::{Downsample2D, ResnetBlock2D, Upsample2D};

/// Whether a call tiles (shared with the Qwen-Image VAE; re-exported so SDXL callers keep
/// `sdxl::vae::Tiling`).
pub use crate::nn::tiling::Tiling;

/// `AutoencoderKL` config fields, plus tiling settings (ours).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VaeConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub latent_channels: i64,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: i64,
    pub norm_num_groups: i64,
    /// Latents are divided by this before decoding (SDXL: 0.13025).
    pub scaling_factor: f64,
    /// Tile size in pixels (diffusers `tile_sample_min_size`, defaults to `sample_size`).
    pub tile_sample_size: i64,
    /// Fraction of a tile that overlaps its neighbour (diffusers `tile_overlap_factor` 0.25).
    pub tile_overlap_factor: f64,
    /// Images (or the pixel size of latents) with a side above this many pixels are tiled.
    pub tiling_threshold: i64,
}

impl VaeConfig {
    /// SDXL base `vae/config.json` (stabilityai/stable-diffusion-xl-base-1.0): 4 blocks, scaling
    /// factor 0.13025, `sample_size` 1024. Tiles at 1024 px with 0.25 overlap above 1024 px a side.
    pub fn sdxl() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            norm_num_groups: 32,
            scaling_factor: 0.13025,
            tile_sample_size: 1024,
            tile_overlap_factor: 0.25,
            tiling_threshold: 1024,
        }
    }

    /// diffusers' SDXL test VAE (`get_dummy_components`): blocks [32, 64], `AutoencoderKL`
    /// defaults otherwise (scaling factor 0.18215, sample_size 128).
    pub fn tiny() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels: vec![32, 64],
            layers_per_block: 1,
            norm_num_groups: 32,
            scaling_factor: 0.18215,
            tile_sample_size: 128,
            tile_overlap_factor: 0.25,
            tiling_threshold: 128,
        }
    }

    /// Parses a diffusers `vae/config.json`; tiling defaults to one tile of `sample_size`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let int = |k: &str, d: i64| v.get(k).and_then(serde_json::Value::as_i64).unwrap_or(d);
        let boc: Vec<i64> = serde_json::from_value(
            v.get("block_out_channels")
                .cloned()
                .ok_or("missing `block_out_channels`")?,
        )
        .map_err(|e| e.to_string())?;
        let sample = int("sample_size", 512);
        Ok(Self {
            in_channels: int("in_channels", 3),
            out_channels: int("out_channels", 3),
            latent_channels: int("latent_channels", 4),
            block_out_channels: boc,
            layers_per_block: int("layers_per_block", 1),
            norm_num_groups: int("norm_num_groups", 32),
            scaling_factor: v
                .get("scaling_factor")
                .and_then(|x| x.as_f64())
                .unwrap_or(0.18215),
            tile_sample_size: sample,
            tile_overlap_factor: 0.25,
            tiling_threshold: sample,
        })
    }

    /// Pixels per latent along a side: `2^(blocks-1)`.
    pub fn scale_factor(&self) -> i64 {
        1 << (self.block_out_channels.len() - 1)
    }
}

/// The VAE's single-head spatial self-attention (`Attention` with `group_norm`, biased q/k/v/out).
#[derive(Debug)]
struct VaeAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    imp: AttentionImpl,
}

impl VaeAttention {
    fn new(w: &Weights, ch: i64, groups: i64, imp: AttentionImpl) -> Result<Self, LoadError> {
        Ok(Self {
            group_norm: GroupNorm::new(&w.pp("group_norm"), groups, ch, 1e-6)?,
            to_q: Linear::new(&w.pp("to_q"), ch, ch, true)?,
            to_k: Linear::new(&w.pp("to_k"), ch, ch, true)?,
            to_v: Linear::new(&w.pp("to_v"), ch, ch, true)?,
            to_out: Linear::new(&w.pp("to_out.0"), ch, ch, true)?,
            imp,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, c, h, w) = x.size4().expect("VAE attention input is [B, C, H, W]");
        let s = self
            .group_norm
            .forward(x)
            .view([b, c, h * w])
            .transpose(1, 2);
        let q = self.to_q.forward(&s).unsqueeze(1);
        let k = self.to_k.forward(&s).unsqueeze(1);
        let v = self.to_v.forward(&s).unsqueeze(1);
        let o = attention(&q, &k, &v, None, 1.0 / (c as f64).sqrt(), self.imp).squeeze_dim(1);
        let o = self
            .to_out
            .forward(&o)
            .transpose(1, 2)
            .reshape([b, c, h, w]);
        o + x
    }
}

/// `UNetMidBlock2D` of the VAE: resnet, attention, resnet.
#[derive(Debug)]
struct VaeMidBlock {
    resnets: [ResnetBlock2D; 2],
    attention: VaeAttention,
}

impl VaeMidBlock {
    fn new(w: &Weights, ch: i64, groups: i64, imp: AttentionImpl) -> Result<Self, LoadError> {
        let r = |i: i64| ResnetBlock2D::new(&w.pp("resnets").pp(i), ch, ch, None, groups, 1e-6);
        Ok(Self {
            resnets: [r(0)?, r(1)?],
            attention: VaeAttention::new(&w.pp("attentions.0"), ch, groups, imp)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.resnets[0].forward(x, None);
        let h = self.attention.forward(&h);
        self.resnets[1].forward(&h, None)
    }
}

/// A `DownEncoderBlock2D` or `UpDecoderBlock2D`.
#[derive(Debug)]
struct VaeBlock {
    resnets: Vec<ResnetBlock2D>,
    down: Option<Downsample2D>,
    up: Option<Upsample2D>,
}

/// `Encoder` of `autoencoders/vae.py`.
#[derive(Debug)]
struct Encoder {
    conv_in: Conv2d,
    down_blocks: Vec<VaeBlock>,
    mid_block: VaeMidBlock,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    fn new(w: &Weights, c: &VaeConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let boc = &c.block_out_channels;
        let g = c.norm_num_groups;
        let mut down_blocks = Vec::new();
        let mut out_ch = boc[0];
        for (i, &ch) in boc.iter().enumerate() {
            let in_ch = out_ch;
            out_ch = ch;
            let bw = w.pp("down_blocks").pp(i);
            let resnets = (0..c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { in_ch } else { out_ch };
                    ResnetBlock2D::new(&bw.pp("resnets").pp(j), cin, out_ch, None, g, 1e-6)
                })
                .collect::<Result<_, _>>()?;
            let down = if i + 1 < boc.len() {
                Some(Downsample2D::new(&bw.pp("downsamplers.0"), out_ch, 0)?)
            } else {
                None
            };
            down_blocks.push(VaeBlock {
                resnets,
                down,
                up: None,
            });
        }
        let top = boc[boc.len() - 1];
        Ok(Self {
            conv_in: Conv2d::new(&w.pp("conv_in"), c.in_channels, boc[0], 3, 1, 1)?,
            down_blocks,
            mid_block: VaeMidBlock::new(&w.pp("mid_block"), top, g, imp)?,
            conv_norm_out: GroupNorm::new(&w.pp("conv_norm_out"), g, top, 1e-6)?,
            conv_out: Conv2d::new(&w.pp("conv_out"), top, 2 * c.latent_channels, 3, 1, 1)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = self.conv_in.forward(x);
        for block in &self.down_blocks {
            for r in &block.resnets {
                h = r.forward(&h, None);
            }
            if let Some(d) = &block.down {
                h = d.forward(&h);
            }
        }
        h = self.mid_block.forward(&h);
        let a = self.conv_norm_out.forward(&h).silu_();
        drop(h);
        self.conv_out.forward(&a)
    }
}

/// `Decoder` of `autoencoders/vae.py`.
#[derive(Debug)]
struct Decoder {
    conv_in: Conv2d,
    mid_block: VaeMidBlock,
    up_blocks: Vec<VaeBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    fn new(w: &Weights, c: &VaeConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let rev: Vec<i64> = c.block_out_channels.iter().rev().copied().collect();
        let g = c.norm_num_groups;
        let mut up_blocks = Vec::new();
        let mut out_ch = rev[0];
        for (i, &ch) in rev.iter().enumerate() {
            let prev = out_ch;
            out_ch = ch;
            let bw = w.pp("up_blocks").pp(i);
            let resnets = (0..=c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out_ch };
                    ResnetBlock2D::new(&bw.pp("resnets").pp(j), cin, out_ch, None, g, 1e-6)
                })
                .collect::<Result<_, _>>()?;
            let up = if i + 1 < rev.len() {
                Some(Upsample2D::new(&bw.pp("upsamplers.0"), out_ch)?)
            } else {
                None
            };
            up_blocks.push(VaeBlock {
                resnets,
                down: None,
                up,
            });
        }
        let last = rev[rev.len() - 1];
        Ok(Self {
            conv_in: Conv2d::new(&w.pp("conv_in"), c.latent_channels, rev[0], 3, 1, 1)?,
            mid_block: VaeMidBlock::new(&w.pp("mid_block"), rev[0], g, imp)?,
            up_blocks,
            conv_norm_out: GroupNorm::new(&w.pp("conv_norm_out"), g, last, 1e-6)?,
            conv_out: Conv2d::new(&w.pp("conv_out"), last, c.out_channels, 3, 1, 1)?,
        })
    }

    fn forward(&self, z: &Tensor) -> Tensor {
        let mut h = self.conv_in.forward(z);
        h = self.mid_block.forward(&h);
        for block in &self.up_blocks {
            for r in &block.resnets {
                h = r.forward(&h, None);
            }
            if let Some(u) = &block.up {
                h = u.forward(&h, None);
            }
        }
        let a = self.conv_norm_out.forward(&h).silu_();
        drop(h);
        self.conv_out.forward(&a)
    }
}

/// The encoder's output distribution.
#[derive(Debug)]
pub struct DiagonalGaussian {
    pub mean: Tensor,
    /// Clamped to [-30, 20] as diffusers does.
    pub logvar: Tensor,
}

impl DiagonalGaussian {
    /// `mean + exp(0.5 logvar) * noise` with `noise ~ N(0, 1)` drawn by the caller.
    pub fn sample_with(&self, noise: &Tensor) -> Tensor {
        &self.mean + (&self.logvar * 0.5).exp() * noise
    }
}

/// `AutoencoderKL`.
#[derive(Debug)]
pub struct AutoencoderKL {
    encoder: Encoder,
    quant_conv: Conv2d,
    post_quant_conv: Conv2d,
    decoder: Decoder,
    config: VaeConfig,
}

impl AutoencoderKL {
    pub fn new(w: &Weights, c: &VaeConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let l2 = 2 * c.latent_channels;
        Ok(Self {
            encoder: Encoder::new(&w.pp("encoder"), c, imp)?,
            quant_conv: Conv2d::new(&w.pp("quant_conv"), l2, l2, 1, 1, 0)?,
            post_quant_conv: Conv2d::new(
                &w.pp("post_quant_conv"),
                c.latent_channels,
                c.latent_channels,
                1,
                1,
                0,
            )?,
            decoder: Decoder::new(&w.pp("decoder"), c, imp)?,
            config: c.clone(),
        })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    fn tile_latent_size(&self) -> i64 {
        self.config.tile_sample_size / self.config.scale_factor()
    }

    /// Encodes images in [-1, 1] `[B, 3, H, W]`.
    pub fn encode(&self, x: &Tensor, tiling: Tiling) -> DiagonalGaussian {
        let (_, _, h, w) = x.size4().expect("VAE input is [B, C, H, W]");
        let tile = match tiling {
            Tiling::Always => true,
            Tiling::Never => false,
            Tiling::Auto => h.max(w) > self.config.tiling_threshold,
        };
        let moments = if tile {
            let c = &self.config;
            tiled(
                x,
                c.tile_sample_size,
                (c.tile_sample_size as f64 * (1.0 - c.tile_overlap_factor)) as i64,
                (self.tile_latent_size() as f64 * c.tile_overlap_factor) as i64,
                self.tile_latent_size(),
                |t| self.quant_conv.forward(&self.encoder.forward(t)),
            )
        } else {
            self.quant_conv.forward(&self.encoder.forward(x))
        };
        let parts = moments.chunk(2, 1);
        DiagonalGaussian {
            mean: parts[0].shallow_clone(),
            logvar: parts[1].clamp(-30.0, 20.0),
        }
    }

    /// Decodes raw latents (already divided by the scaling factor) to images in about [-1, 1].
    pub fn decode(&self, z: &Tensor, tiling: Tiling) -> Tensor {
        let (_, _, h, w) = z.size4().expect("latents are [B, C, h, w]");
        let f = self.config.scale_factor();
        let tile = match tiling {
            Tiling::Always => true,
            Tiling::Never => false,
            Tiling::Auto => h.max(w) * f > self.config.tiling_threshold,
        };
        if tile {
            let c = &self.config;
            let tl = self.tile_latent_size();
            tiled(
                z,
                tl,
                (tl as f64 * (1.0 - c.tile_overlap_factor)) as i64,
                (c.tile_sample_size as f64 * c.tile_overlap_factor) as i64,
                c.tile_sample_size,
                |t| self.decoder.forward(&self.post_quant_conv.forward(t)),
            )
        } else {
            self.decoder.forward(&self.post_quant_conv.forward(z))
        }
    }
}

/// diffusers' tiling scheme (`tiled_encode`/`tiled_decode`): input tiles of `tile_in` every `stride`
/// along each axis, each mapped by `f`; every output tile is blended linearly over `blend` rows with
/// the (already blended) tile above and columns with the tile to its left, then cropped to
/// `tile_out - blend` and the crops are concatenated.
fn tiled(
    x: &Tensor,
    tile_in: i64,
    stride: i64,
    blend: i64,
    tile_out: i64,
    f: impl Fn(&Tensor) -> Tensor,
) -> Tensor {
    let (_, _, h, w) = x.size4().expect("tiled input is [B, C, H, W]");
    let stride = stride.max(1);
    let mut rows: Vec<Vec<Tensor>> = Vec::new();
    for i in (0..h).step_by(stride as usize) {
        let mut row = Vec::new();
        for j in (0..w).step_by(stride as usize) {
            let t = x
                .narrow(2, i, tile_in.min(h - i))
                .narrow(3, j, tile_in.min(w - j));
            row.push(f(&t));
        }
        rows.push(row);
    }
    let limit = tile_out - blend;
    let mut out_rows = Vec::new();
    for i in 0..rows.len() {
        let mut out_row = Vec::new();
        for j in 0..rows[i].len() {
            let mut t = rows[i][j].shallow_clone();
            if i > 0 {
                t = blend_axis(&rows[i - 1][j], &t, blend, 2);
            }
            if j > 0 {
                t = blend_axis(&rows[i][j - 1], &t, blend, 3);
            }
            rows[i][j] = t.shallow_clone();
            let th = t.size()[2].min(limit);
            let tw = t.size()[3].min(limit);
            out_row.push(t.narrow(2, 0, th).narrow(3, 0, tw));
        }
        out_rows.push(Tensor::cat(&out_row, 3));
    }
    Tensor::cat(&out_rows, 2)
}

/// diffusers `blend_v` (axis 2) / `blend_h` (axis 3): the first `extent` rows of `b` become
/// `a[-extent + y] * (1 - y/extent) + b[y] * (y/extent)`.
fn blend_axis(a: &Tensor, b: &Tensor, extent: i64, axis: i64) -> Tensor {
    let extent = extent
        .min(a.size()[axis as usize])
        .min(b.size()[axis as usize]);
    if extent <= 0 {
        return b.shallow_clone();
    }
    let na = a.size()[axis as usize];
    let nb = b.size()[axis as usize];
    let mut parts = Vec::with_capacity(extent as usize + 1);
    for y in 0..extent {
        let r = y as f64 / extent as f64;
        parts.push(a.narrow(axis, na - extent + y, 1) * (1.0 - r) + b.narrow(axis, y, 1) * r);
    }
    parts.push(b.narrow(axis, extent, nb - extent));
    Tensor::cat(&parts, axis)
}
