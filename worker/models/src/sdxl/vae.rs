//! The SDXL VAE: diffusers `AutoencoderKL` (encoder to a diagonal Gaussian, decoder back to pixels),
//! with two tiled decodes: diffusers' (overlapping tiles, each normalised with its own GroupNorm
//! statistics, linearly blended: `Tiling::Always`), and a seam-free one that `Tiling::Auto` uses
//! when an untiled decode would not fit the memory budget ([`AutoencoderKL::decode_tiled`]).
//!
//! After diffusers `models/autoencoders/autoencoder_kl.py` and `autoencoders/vae.py` (Apache-2.0).
//! The seam-free decode follows the idea of the tiled-VAE implementations for Stable Diffusion
//! (for instance pkuliyi2015's multidiffusion-upscaler "Tiled VAE"): every tile is normalised with
//! GroupNorm statistics of the whole image, estimated from a subsampled decode. Written anew here;
//! see `docs/performance.md` for its measured difference from the untiled decode.
//! Keys: `encoder.{conv_in,down_blocks,mid_block,conv_norm_out,conv_out}`, `quant_conv`,
//! `post_quant_conv`, `decoder.{conv_in,mid_block,up_blocks,conv_norm_out,conv_out}`.

use tch::{Kind, Tensor};

use crate::error::LoadError;
use crate::loading::weights::Weights;
use crate::nn::{
    AttentionImpl, Conv2d, GroupNorm, GroupStats, Linear, MemoryFormat, attention, channels_last,
    is_channels_last,
};
use crate::sdxl::resnet::{Downsample2D, ResnetBlock2D, Upsample2D};

/// Whether a call tiles (shared with the Qwen-Image VAE; re-exported so SDXL callers keep
/// `sdxl::vae::Tiling`).
pub use crate::nn::tiling::Tiling;

/// `AutoencoderKL` config fields, plus the tile geometry (ours). How a decode uses memory is a
/// runtime choice, [`VaeRuntime`], not part of the architecture.
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
}

/// How an [`AutoencoderKL`] runs on its device (from [`crate::settings::SdxlSettings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VaeRuntime {
    /// Working memory (MiB, weights excluded) one image's decode or encode may take under
    /// `Tiling::Auto`: untiled when [`VaeConfig::decode_bytes`] fits, tiled beyond.
    pub memory_budget_mib: u32,
    /// Memory order of the decoder after its mid block and of the encoder's input. Channels-last
    /// is what diffusers' decoder runs in after the mid-block attention (its output is a
    /// transposed view); `contiguous` makes both NCHW throughout (for backends whose NHWC
    /// convolutions are slow, e.g. MIOpen without `PYTORCH_MIOPEN_SUGGEST_NHWC=1`).
    pub memory_format: MemoryFormat,
}

impl Default for VaeRuntime {
    fn default() -> Self {
        Self {
            memory_budget_mib: DEFAULT_VAE_MEMORY_BUDGET_MIB,
            memory_format: MemoryFormat::ChannelsLast,
        }
    }
}

impl VaeRuntime {
    fn budget_bytes(&self) -> i64 {
        i64::from(self.memory_budget_mib) << 20
    }
}

/// `x` in `format`'s memory order (a no-op when it already is).
fn in_layout(x: Tensor, format: MemoryFormat) -> Tensor {
    match format {
        MemoryFormat::ChannelsLast if is_channels_last(&x) => x,
        MemoryFormat::ChannelsLast => channels_last(&x),
        MemoryFormat::Contiguous => x.contiguous(),
    }
}

pub use crate::settings::DEFAULT_VAE_MEMORY_BUDGET_MIB;

/// Working memory of an untiled decode, in activations of the last up block's input width
/// (256 channels for SDXL) at the output size: the upsampled input, its normalised copy, the
/// convolutions' outputs and workspaces. Calibrated on an H200 in bf16 against
/// `torch.cuda.max_memory_allocated` of diffusers' decode at 1024² to 2048² (docs/performance.md).
const DECODE_ACTIVATIONS: f64 = 5.0;
/// The same for an encode, in activations of the first down block's width (128 for SDXL).
const ENCODE_ACTIVATIONS: f64 = 6.5;
/// Largest `softmax(q kᵀ)` block the `matmul` attention of the VAE's mid block materialises at
/// once (queries are processed in chunks beyond it): 65536 tokens (2048²) would need 8 GiB whole.
const MATMUL_ATTENTION_CHUNK_BYTES: i64 = 512 << 20;

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
        })
    }

    /// Pixels per latent along a side: `2^(blocks-1)`.
    pub fn scale_factor(&self) -> i64 {
        1 << (self.block_out_channels.len() - 1)
    }

    /// Estimated working memory (bytes) of one image's untiled decode to `height × width` pixels
    /// in `kind`.
    pub fn decode_bytes(&self, height: i64, width: i64, kind: Kind) -> i64 {
        let width_channels = self.block_out_channels[1.min(self.block_out_channels.len() - 1)];
        let per_pixel =
            DECODE_ACTIVATIONS * width_channels as f64 * kind.elt_size_in_bytes() as f64;
        (per_pixel * (height * width) as f64) as i64
    }

    /// Estimated working memory (bytes) of one image's untiled encode from `height × width`.
    pub fn encode_bytes(&self, height: i64, width: i64, kind: Kind) -> i64 {
        let per_pixel = ENCODE_ACTIVATIONS
            * self.block_out_channels[0] as f64
            * kind.elt_size_in_bytes() as f64;
        (per_pixel * (height * width) as f64) as i64
    }

    /// The up block before whose upsampler [`AutoencoderKL::decode_tiled`] starts tiling: the
    /// third block from the end (SDXL: block 1, at twice the latent's size, 512 channels), so the
    /// last two blocks, where an untiled decode's memory goes, are tiled, and everything before
    /// runs on the whole image with exact statistics.
    pub fn tiling_block(&self) -> usize {
        self.block_out_channels.len().saturating_sub(3)
    }

    /// Pixels of [`VaeConfig::tiling_block`]'s size around a tile that reach its centre through
    /// the tiled part of the decoder (every 3x3 convolution at `2^i` times that size reaches
    /// `2^-i` pixels), plus one for the nearest-neighbour upsampling's alignment: a tile with this
    /// margin decodes its centre exactly as the whole image does, given the same GroupNorm
    /// statistics.
    pub fn tiled_receptive_radius(&self) -> i64 {
        let n = self.block_out_channels.len();
        let k = self.tiling_block();
        let convs_per_block = 2.0 * (self.layers_per_block + 1) as f64;
        let mut r = if k + 1 < n { 0.5 } else { 0.0 }; // block k's upsampler conv
        for i in k + 1..n {
            let scale = (1u32 << (i - k)) as f64;
            r += convs_per_block / scale;
            if i + 1 < n {
                r += 1.0 / (2.0 * scale);
            }
        }
        r += 1.0 / (1u32 << (n - 1 - k)) as f64; // conv_out
        r.ceil() as i64 + 1
    }
}

/// How [`AutoencoderKL::decode_tiled`] cuts the image, in pixels of the decoder's activations
/// where tiling starts ([`VaeConfig::tiling_block`]; SDXL: twice the latent's size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledDecode {
    /// Side of the part of a tile that is kept (edge tiles are smaller).
    pub core: i64,
    /// Pixels of context decoded around each core and dropped
    /// ([`VaeConfig::tiled_receptive_radius`] makes the result exact).
    pub margin: i64,
    /// The GroupNorm statistics are taken from the whole image subsampled by this factor along
    /// each side (1: exact, an untiled decode's memory; 2: a quarter of it).
    pub stats_stride: i64,
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
        let scale = 1.0 / (c as f64).sqrt();
        let l = h * w;
        let scores = l * l * x.kind().elt_size_in_bytes() as i64;
        let o = if self.imp == AttentionImpl::Matmul && scores > MATMUL_ATTENTION_CHUNK_BYTES {
            // Row blocks of the score matrix one at a time (softmax is per query row).
            let rows =
                (MATMUL_ATTENTION_CHUNK_BYTES / (l * x.kind().elt_size_in_bytes() as i64)).max(1);
            let parts: Vec<Tensor> = q
                .split(rows, 2)
                .iter()
                .map(|qc| attention(qc, &k, &v, None, scale, self.imp))
                .collect();
            Tensor::cat(&parts, 2).squeeze_dim(1)
        } else {
            attention(&q, &k, &v, None, scale, self.imp).squeeze_dim(1)
        };
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

    fn forward(&self, x: &Tensor, format: MemoryFormat) -> Tensor {
        let mut h = self.conv_in.forward(&in_layout(x.shallow_clone(), format));
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

    fn forward(&self, z: &Tensor, format: MemoryFormat) -> Tensor {
        self.up(&in_layout(self.latent_part(z), format), &mut |norm, t| {
            norm.forward(t)
        })
    }

    /// `conv_in` and the mid block: everything at the latent's size (attention included).
    fn latent_part(&self, z: &Tensor) -> Tensor {
        self.mid_block.forward(&self.conv_in.forward(z))
    }

    /// The up blocks, `conv_norm_out` and `conv_out`.
    fn up(&self, h: &Tensor, norm: &mut dyn FnMut(&GroupNorm, &Tensor) -> Tensor) -> Tensor {
        self.up_tail(&self.up_head(h, 0), 0, norm)
    }

    /// Up blocks `0..=split`, but not block `split`'s upsampler.
    fn up_head(&self, h: &Tensor, split: usize) -> Tensor {
        let mut h = h.shallow_clone();
        for (i, block) in self.up_blocks.iter().enumerate().take(split + 1) {
            for r in &block.resnets {
                h = r.forward(&h, None);
            }
            if let (true, Some(u)) = (i < split, &block.up) {
                h = u.forward(&h, None);
            }
        }
        h
    }

    /// The rest after [`Decoder::up_head`]: block `split`'s upsampler, the later blocks,
    /// `conv_norm_out` and `conv_out`, with every GroupNorm applied by `norm` (in order: each
    /// resnet's `norm1`, `norm2`, then `conv_norm_out`).
    fn up_tail(
        &self,
        h: &Tensor,
        split: usize,
        norm: &mut dyn FnMut(&GroupNorm, &Tensor) -> Tensor,
    ) -> Tensor {
        let mut h = h.shallow_clone();
        for (i, block) in self.up_blocks.iter().enumerate().skip(split) {
            if i > split {
                for r in &block.resnets {
                    h = r.forward_normed(&h, None, norm);
                }
            }
            if let Some(u) = &block.up {
                h = u.forward(&h, None);
            }
        }
        let a = norm(&self.conv_norm_out, &h).silu_();
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
    runtime: VaeRuntime,
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
            runtime: VaeRuntime::default(),
        })
    }

    /// The same VAE run with `runtime`'s memory budget and layout.
    pub fn with_runtime(mut self, runtime: VaeRuntime) -> Self {
        self.runtime = runtime;
        self
    }

    pub fn set_runtime(&mut self, runtime: VaeRuntime) {
        self.runtime = runtime;
    }

    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    pub fn runtime(&self) -> VaeRuntime {
        self.runtime
    }

    fn tile_latent_size(&self) -> i64 {
        self.config.tile_sample_size / self.config.scale_factor()
    }

    /// Encodes images in [-1, 1] `[B, 3, H, W]`.
    pub fn encode(&self, x: &Tensor, tiling: Tiling) -> DiagonalGaussian {
        let (_, _, h, w) = x.size4().expect("VAE input is [B, C, H, W]");
        let c = &self.config;
        let tile = match tiling {
            Tiling::Always => true,
            Tiling::Never => false,
            Tiling::Auto => c.encode_bytes(h, w, x.kind()) > self.runtime.budget_bytes(),
        };
        let moments = if tile {
            tiled(
                x,
                c.tile_sample_size,
                (c.tile_sample_size as f64 * (1.0 - c.tile_overlap_factor)) as i64,
                (self.tile_latent_size() as f64 * c.tile_overlap_factor) as i64,
                self.tile_latent_size(),
                |t| {
                    self.quant_conv
                        .forward(&self.encoder.forward(t, self.runtime.memory_format))
                },
            )
        } else {
            self.quant_conv
                .forward(&self.encoder.forward(x, self.runtime.memory_format))
        };
        let parts = moments.chunk(2, 1);
        DiagonalGaussian {
            mean: parts[0].shallow_clone(),
            logvar: parts[1].clamp(-30.0, 20.0),
        }
    }

    /// Decodes raw latents (already divided by the scaling factor) to images in about [-1, 1].
    /// `Tiling::Auto` decodes untiled when [`VaeConfig::decode_bytes`] of one image fits the
    /// memory budget, else with [`AutoencoderKL::decode_tiled`] as planned by
    /// [`AutoencoderKL::tiled_plan`]; `Tiling::Always` is diffusers' tiled decode.
    pub fn decode(&self, z: &Tensor, tiling: Tiling) -> Tensor {
        let (_, _, h, w) = z.size4().expect("latents are [B, C, h, w]");
        let c = &self.config;
        let f = c.scale_factor();
        match tiling {
            Tiling::Never => self
                .decoder
                .forward(&self.post_quant_conv.forward(z), self.runtime.memory_format),
            Tiling::Auto
                if c.decode_bytes(h * f, w * f, z.kind()) <= self.runtime.budget_bytes() =>
            {
                self.decoder
                    .forward(&self.post_quant_conv.forward(z), self.runtime.memory_format)
            }
            Tiling::Auto => self.decode_tiled(z, self.tiled_plan(h, w, z.kind())),
            Tiling::Always => {
                let tl = self.tile_latent_size();
                tiled(
                    z,
                    tl,
                    (tl as f64 * (1.0 - c.tile_overlap_factor)) as i64,
                    (c.tile_sample_size as f64 * c.tile_overlap_factor) as i64,
                    c.tile_sample_size,
                    |t| {
                        self.decoder
                            .forward(&self.post_quant_conv.forward(t), self.runtime.memory_format)
                    },
                )
            }
        }
    }

    /// The tiling that fits the memory budget for an `h × w` latent: the largest core (a multiple
    /// of 8 pixels, at least 16) whose tile with its margin fits, and the smallest subsampling
    /// (2, 4 or 8) whose statistics decode fits.
    pub fn tiled_plan(&self, h: i64, w: i64, kind: Kind) -> TiledDecode {
        let c = &self.config;
        let up = 1i64 << c.tiling_block();
        let g = c.scale_factor() / up; // output pixels per pixel where tiling starts
        let (hs, ws) = (h * up, w * up);
        let budget = self.runtime.budget_bytes();
        let margin = c.tiled_receptive_radius();
        let mut core = 16;
        while core + 8 < hs.max(ws) {
            let side = (core + 8 + 2 * margin) * g;
            if c.decode_bytes(side, side, kind) > budget {
                break;
            }
            core += 8;
        }
        let mut stats_stride = 2;
        while stats_stride < 8
            && c.decode_bytes(hs * g / stats_stride, ws * g / stats_stride, kind) > budget
        {
            stats_stride *= 2;
        }
        TiledDecode {
            core,
            margin,
            stats_stride,
        }
    }

    /// Seam-free tiled decode. The decoder runs on the whole image up to
    /// [`VaeConfig::tiling_block`]'s upsampler (`conv_in`, the mid block with its attention, the
    /// first up blocks: small activations, exact statistics). The GroupNorm statistics of the
    /// rest are taken once from that activation subsampled by `plan.stats_stride` (nearest:
    /// every n-th pixel) and decoded whole; then every tile is decoded through the rest with
    /// those statistics and `plan.margin` pixels of context, and only its core kept. Tiles
    /// therefore differ from the untiled decode only as much as the estimated statistics differ
    /// from the exact ones, and equally everywhere: no seams, and no blending. `stats_stride` 1
    /// gives the untiled result up to float rounding.
    pub fn decode_tiled(&self, z: &Tensor, plan: TiledDecode) -> Tensor {
        let (b, _, _, _) = z.size4().expect("latents are [B, C, h, w]");
        let c = &self.config;
        let split = c.tiling_block();
        let g = c.scale_factor() >> split;
        let head = self.decoder.up_head(
            &in_layout(
                self.decoder.latent_part(&self.post_quant_conv.forward(z)),
                self.runtime.memory_format,
            ),
            split,
        );
        let (hs, ws) = (head.size()[2], head.size()[3]);
        let mut stats: Vec<GroupStats> = Vec::new();
        {
            let s = plan.stats_stride.max(1);
            let small = head.slice(2, 0, hs, s).slice(3, 0, ws, s);
            let _ = self.decoder.up_tail(&small, split, &mut |norm, t| {
                let st = norm.stats(t);
                let y = norm.forward_with(t, &st);
                stats.push(st);
                y
            });
        }
        let out = Tensor::empty([b, c.out_channels, hs * g, ws * g], (z.kind(), z.device()));
        for t in tile_grid(hs, ws, plan) {
            let mut next = stats.iter();
            let decoded = self
                .decoder
                .up_tail(&t.input(&head), split, &mut |norm, x| {
                    let st = next
                        .next()
                        .expect("a tile passes the same GroupNorms as the statistics pass");
                    norm.forward_with(x, st)
                });
            out.narrow(2, t.core_at.0 * g, t.core.0 * g)
                .narrow(3, t.core_at.1 * g, t.core.1 * g)
                .copy_(
                    &decoded.narrow(2, t.core_offset.0 * g, t.core.0 * g).narrow(
                        3,
                        t.core_offset.1 * g,
                        t.core.1 * g,
                    ),
                );
        }
        out
    }
}

/// One tile of [`AutoencoderKL::decode_tiled`], in pixels where tiling starts, as
/// `(rows, columns)`.
#[derive(Debug, Clone, Copy)]
struct Tile {
    /// Where the input (core and margin) starts, and its size.
    start: (i64, i64),
    rows: (i64, i64),
    /// Where the core lies in the latent, where in the input, and its size.
    core_at: (i64, i64),
    core_offset: (i64, i64),
    core: (i64, i64),
}

impl Tile {
    fn input(&self, x: &Tensor) -> Tensor {
        x.narrow(2, self.start.0, self.rows.0)
            .narrow(3, self.start.1, self.rows.1)
    }
}

fn tile_grid(h: i64, w: i64, plan: TiledDecode) -> Vec<Tile> {
    let core = plan.core.max(1);
    let mut tiles = Vec::new();
    for i in (0..h).step_by(core as usize) {
        for j in (0..w).step_by(core as usize) {
            let (i0, j0) = ((i - plan.margin).max(0), (j - plan.margin).max(0));
            let (i1, j1) = (
                (i + core + plan.margin).min(h),
                (j + core + plan.margin).min(w),
            );
            tiles.push(Tile {
                start: (i0, j0),
                rows: (i1 - i0, j1 - j0),
                core_at: (i, j),
                core_offset: (i - i0, j - j0),
                core: (core.min(h - i), core.min(w - j)),
            });
        }
    }
    tiles
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
