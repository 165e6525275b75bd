//! The UNet's down, mid and up blocks (`DownBlock2D`/`CrossAttnDownBlock2D`,
//! `UNetMidBlock2DCrossAttn`, `UpBlock2D`/`CrossAttnUpBlock2D`), after diffusers
//! `models/unets/unet_2d_blocks.py` (Apache-2.0). A block with `attentions` is the cross-attention
//! variant; skip connections flow from down blocks to up blocks through a stack.

use tch::Tensor;

use crate::error::LoadError;
use crate::loading::lora::LoraModule;
use crate::loading::weights::Weights;
use crate::nn::AttentionImpl;
use crate::nn::fused::NormKernels;
use crate::sdxl::attention::{Transformer2DConfig, Transformer2DModel};
use crate::sdxl::resnet::{Downsample2D, ResnetBlock2D, Upsample2D};

/// Sizes shared by the blocks of one UNet.
#[derive(Debug, Clone, Copy)]
pub struct BlockCommon {
    pub temb_channels: i64,
    pub groups: i64,
    pub eps: f64,
    pub context_dim: i64,
    pub use_linear_projection: bool,
}

/// Cross-attention settings of one block: `None` for a plain block.
#[derive(Debug, Clone, Copy)]
pub struct BlockAttention {
    pub heads: i64,
    pub layers: i64,
}

fn transformer(
    w: &Weights,
    common: &BlockCommon,
    channels: i64,
    a: BlockAttention,
    imp: AttentionImpl,
) -> Result<Transformer2DModel, LoadError> {
    Transformer2DModel::new(
        w,
        Transformer2DConfig {
            channels,
            heads: a.heads,
            layers: a.layers,
            context_dim: common.context_dim,
            groups: common.groups,
            use_linear_projection: common.use_linear_projection,
        },
        imp,
    )
}

/// `DownBlock2D` or `CrossAttnDownBlock2D`.
#[derive(Debug)]
pub struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    downsampler: Option<Downsample2D>,
}

impl DownBlock {
    /// Which kernels the block's ResNets and transformers normalise with.
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        set_norm_kernels(&mut self.resnets, &mut self.attentions, k);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        w: &Weights,
        common: &BlockCommon,
        in_ch: i64,
        out_ch: i64,
        layers: i64,
        attn: Option<BlockAttention>,
        add_downsample: bool,
        imp: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let mut resnets = Vec::new();
        let mut attentions = Vec::new();
        for i in 0..layers {
            let cin = if i == 0 { in_ch } else { out_ch };
            resnets.push(ResnetBlock2D::new(
                &w.pp("resnets").pp(i),
                cin,
                out_ch,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )?);
            if let Some(a) = attn {
                attentions.push(transformer(
                    &w.pp("attentions").pp(i),
                    common,
                    out_ch,
                    a,
                    imp,
                )?);
            }
        }
        let downsampler = if add_downsample {
            Some(Downsample2D::new(&w.pp("downsamplers.0"), out_ch, 1)?)
        } else {
            None
        };
        Ok(Self {
            resnets,
            attentions,
            downsampler,
        })
    }

    /// Runs the block, pushing every intermediate output onto `skips`.
    pub fn forward(
        &self,
        x: &Tensor,
        temb: &Tensor,
        context: &Tensor,
        skips: &mut Vec<Tensor>,
    ) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            h = resnet.forward(&h, Some(temb));
            if let Some(attn) = self.attentions.get(i) {
                h = attn.forward(&h, context);
            }
            skips.push(h.shallow_clone());
        }
        if let Some(down) = &self.downsampler {
            h = down.forward(&h);
            skips.push(h.shallow_clone());
        }
        h
    }
}

/// `UNetMidBlock2DCrossAttn`: resnet, then (transformer, resnet) pairs.
#[derive(Debug)]
pub struct MidBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
}

impl MidBlock {
    /// Which kernels the block's ResNets and transformers normalise with.
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        set_norm_kernels(&mut self.resnets, &mut self.attentions, k);
    }

    pub fn new(
        w: &Weights,
        common: &BlockCommon,
        channels: i64,
        attn: BlockAttention,
        imp: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let resnet = |i: i64| {
            ResnetBlock2D::new(
                &w.pp("resnets").pp(i),
                channels,
                channels,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )
        };
        Ok(Self {
            resnets: vec![resnet(0)?, resnet(1)?],
            attentions: vec![transformer(
                &w.pp("attentions.0"),
                common,
                channels,
                attn,
                imp,
            )?],
        })
    }

    pub fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor) -> Tensor {
        let mut h = self.resnets[0].forward(x, Some(temb));
        for (attn, resnet) in self.attentions.iter().zip(&self.resnets[1..]) {
            h = attn.forward(&h, context);
            h = resnet.forward(&h, Some(temb));
        }
        h
    }
}

/// `UpBlock2D` or `CrossAttnUpBlock2D`.
#[derive(Debug)]
pub struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    upsampler: Option<Upsample2D>,
}

impl UpBlock {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        w: &Weights,
        common: &BlockCommon,
        in_ch: i64,
        prev_out_ch: i64,
        out_ch: i64,
        layers: i64,
        attn: Option<BlockAttention>,
        add_upsample: bool,
        imp: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let mut resnets = Vec::new();
        let mut attentions = Vec::new();
        for i in 0..layers {
            let skip_ch = if i == layers - 1 { in_ch } else { out_ch };
            let cin = if i == 0 { prev_out_ch } else { out_ch };
            resnets.push(ResnetBlock2D::new(
                &w.pp("resnets").pp(i),
                cin + skip_ch,
                out_ch,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )?);
            if let Some(a) = attn {
                attentions.push(transformer(
                    &w.pp("attentions").pp(i),
                    common,
                    out_ch,
                    a,
                    imp,
                )?);
            }
        }
        let upsampler = if add_upsample {
            Some(Upsample2D::new(&w.pp("upsamplers.0"), out_ch)?)
        } else {
            None
        };
        Ok(Self {
            resnets,
            attentions,
            upsampler,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.resnets.len()
    }

    /// Consumes one skip per resnet from the top of `skips`; upsamples to `upsample_size` (the
    /// spatial size of the next skip) when given.
    pub fn forward(
        &self,
        x: &Tensor,
        temb: &Tensor,
        context: &Tensor,
        skips: &mut Vec<Tensor>,
        upsample_size: Option<[i64; 2]>,
    ) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            let skip = skips.pop().expect(
                "the UNet pushes one skip per down resnet/downsampler, as many as up resnets",
            );
            h = resnet.forward(&Tensor::cat(&[&h, &skip], 1), Some(temb));
            if let Some(attn) = self.attentions.get(i) {
                h = attn.forward(&h, context);
            }
        }
        if let Some(up) = &self.upsampler {
            h = up.forward(&h, upsample_size);
        }
        h
    }
}

fn set_norm_kernels(
    resnets: &mut [ResnetBlock2D],
    attentions: &mut [Transformer2DModel],
    k: NormKernels,
) {
    for r in resnets {
        r.set_norm_kernels(k);
    }
    for a in attentions {
        a.set_norm_kernels(k);
    }
}

/// Resnets and attentions of one block under `prefix` (`down_blocks.1.`).
fn block_lora_modules<'a>(
    prefix: &str,
    resnets: &'a mut [ResnetBlock2D],
    attentions: &'a mut [Transformer2DModel],
    out: &mut Vec<(String, LoraModule<'a>)>,
) {
    for (i, r) in resnets.iter_mut().enumerate() {
        r.lora_modules(&format!("{prefix}resnets.{i}."), out);
    }
    for (i, a) in attentions.iter_mut().enumerate() {
        a.lora_modules(&format!("{prefix}attentions.{i}."), out);
    }
}

impl DownBlock {
    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel] {
        &mut self.attentions
    }

    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        block_lora_modules(prefix, &mut self.resnets, &mut self.attentions, out);
        if let Some(d) = &mut self.downsampler {
            d.lora_modules(&format!("{prefix}downsamplers.0."), out);
        }
    }
}

impl MidBlock {
    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel] {
        &mut self.attentions
    }

    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        block_lora_modules(prefix, &mut self.resnets, &mut self.attentions, out);
    }
}

impl UpBlock {
    /// Which kernels the block's ResNets and transformers normalise with.
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        set_norm_kernels(&mut self.resnets, &mut self.attentions, k);
    }

    /// Whether the block has cross-attention (its upsampler's ldm index depends on it).
    pub fn has_attention(&self) -> bool {
        !self.attentions.is_empty()
    }

    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel] {
        &mut self.attentions
    }

    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        block_lora_modules(prefix, &mut self.resnets, &mut self.attentions, out);
        if let Some(u) = &mut self.upsampler {
            u.lora_modules(&format!("{prefix}upsamplers.0."), out);
        }
    }
}
