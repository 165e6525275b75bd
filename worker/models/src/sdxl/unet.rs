//! The SDXL UNet: diffusers `UNet2DConditionModel` with `addition_embed_type = "text_time"`
//! (pooled text embedding + Fourier features of the six size/crop ids added to the time embedding),
//! linear or conv proj_in/proj_out and any `transformer_layers_per_block` per block.
//!
//! After diffusers `models/unets/unet_2d_condition.py` (Apache-2.0); key names are diffusers'
//! (`conv_in`, `time_embedding`, `add_embedding`, `down_blocks`, `mid_block`, `up_blocks`,
//! `conv_norm_out`, `conv_out`). The ldm single-file names are mapped onto these by `ldm.rs`.

use tch::{Kind, Tensor};

use crate::error::LoadError;
use crate::loading::lora::{LoraModule, LoraTarget};
use crate::loading::weights::Weights;
use crate::nn::embeddings::{TimestepEmbedding, timestep_features};
use crate::nn::fused::{self, NormKernels};
use crate::nn::{AttentionImpl, Conv2d, FfGelu, GroupNorm, MemoryFormat, channels_last};
use crate::sdxl::unet_blocks::{BlockAttention, BlockCommon, DownBlock, MidBlock, UpBlock};

/// `UNet2DConditionModel` config fields SDXL uses. `attention_heads` is diffusers'
/// `num_attention_heads or attention_head_dim` (the latter is a legacy misnomer for the head count).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UNetConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: i64,
    /// Per down block: whether it is a `CrossAttnDownBlock2D`. Up blocks mirror it.
    pub cross_attention: Vec<bool>,
    pub attention_heads: Vec<i64>,
    pub transformer_layers_per_block: Vec<i64>,
    pub cross_attention_dim: i64,
    pub addition_time_embed_dim: i64,
    pub projection_class_embeddings_input_dim: i64,
    pub norm_num_groups: i64,
    pub norm_eps: f64,
    pub use_linear_projection: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub sample_size: i64,
}

impl UNetConfig {
    /// SDXL base 1.0 `unet/config.json` (stabilityai/stable-diffusion-xl-base-1.0; values also in
    /// diffusers `create_unet_diffusers_config_from_ldm`).
    pub fn sdxl_base() -> Self {
        Self {
            in_channels: 4,
            out_channels: 4,
            block_out_channels: vec![320, 640, 1280],
            layers_per_block: 2,
            cross_attention: vec![false, true, true],
            attention_heads: vec![5, 10, 20],
            transformer_layers_per_block: vec![1, 2, 10],
            cross_attention_dim: 2048,
            addition_time_embed_dim: 256,
            projection_class_embeddings_input_dim: 2816,
            norm_num_groups: 32,
            norm_eps: 1e-5,
            use_linear_projection: true,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            sample_size: 128,
        }
    }

    /// diffusers `tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py::get_dummy_components`.
    pub fn tiny() -> Self {
        Self {
            in_channels: 4,
            out_channels: 4,
            block_out_channels: vec![2, 4],
            layers_per_block: 2,
            cross_attention: vec![false, true],
            attention_heads: vec![2, 4],
            transformer_layers_per_block: vec![1, 2],
            cross_attention_dim: 64,
            addition_time_embed_dim: 8,
            projection_class_embeddings_input_dim: 80,
            norm_num_groups: 1,
            norm_eps: 1e-5,
            use_linear_projection: true,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            sample_size: 32,
        }
    }

    /// Parses a diffusers `unet/config.json`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let n_blocks = v
            .get("block_out_channels")
            .and_then(|b| b.as_array())
            .map(Vec::len)
            .ok_or("missing `block_out_channels`")?;
        let int = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_i64)
                .ok_or_else(|| format!("missing integer `{k}`"))
        };
        // An int or a per-block list.
        let per_block = |k: &str| -> Result<Option<Vec<i64>>, String> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Number(n)) => {
                    let n = n
                        .as_i64()
                        .ok_or_else(|| format!("`{k}` is not an integer"))?;
                    Ok(Some(vec![n; n_blocks]))
                }
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|x| x.as_i64().ok_or_else(|| format!("`{k}` has a non-integer")))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some),
                Some(_) => Err(format!("`{k}` is neither an integer nor a list")),
            }
        };
        if v.get("addition_embed_type").and_then(|a| a.as_str()) != Some("text_time") {
            return Err("only addition_embed_type = \"text_time\" (SDXL) is supported".into());
        }
        let down: Vec<String> = serde_json::from_value(
            v.get("down_block_types")
                .cloned()
                .ok_or("missing `down_block_types`")?,
        )
        .map_err(|e| e.to_string())?;
        let layers = per_block("layers_per_block")?.ok_or("missing `layers_per_block`")?;
        if layers.iter().any(|&l| l != layers[0]) {
            return Err("per-block layers_per_block is not supported".into());
        }
        let heads = match per_block("num_attention_heads")? {
            Some(h) => h,
            None => per_block("attention_head_dim")?.ok_or("missing `attention_head_dim`")?,
        };
        Ok(Self {
            in_channels: int("in_channels")?,
            out_channels: int("out_channels")?,
            block_out_channels: per_block("block_out_channels")?.unwrap_or_default(),
            layers_per_block: layers[0],
            cross_attention: down.iter().map(|t| t.starts_with("CrossAttn")).collect(),
            attention_heads: heads,
            transformer_layers_per_block: per_block("transformer_layers_per_block")?
                .unwrap_or(vec![1; n_blocks]),
            cross_attention_dim: int("cross_attention_dim")?,
            addition_time_embed_dim: int("addition_time_embed_dim")?,
            projection_class_embeddings_input_dim: int("projection_class_embeddings_input_dim")?,
            norm_num_groups: int("norm_num_groups").unwrap_or(32),
            norm_eps: v.get("norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-5),
            use_linear_projection: v
                .get("use_linear_projection")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            flip_sin_to_cos: v
                .get("flip_sin_to_cos")
                .and_then(|x| x.as_bool())
                .unwrap_or(true),
            freq_shift: v.get("freq_shift").and_then(|x| x.as_f64()).unwrap_or(0.0),
            sample_size: int("sample_size").unwrap_or(128),
        })
    }

    /// `time_embed_dim = block_out_channels[0] * 4`.
    pub fn time_embed_dim(&self) -> i64 {
        self.block_out_channels[0] * 4
    }
}

/// Extra SDXL conditioning: pooled text embedding and the six size/crop ids per sample.
#[derive(Debug)]
pub struct AddedCond<'a> {
    /// `[B, pooled_dim]`.
    pub text_embeds: &'a Tensor,
    /// `[B, 6]`: original (h, w), crop top-left (y, x), target (h, w).
    pub time_ids: &'a Tensor,
}

/// `UNet2DConditionModel` for SDXL.
#[derive(Debug)]
pub struct UNet2DConditionModel {
    conv_in: Conv2d,
    time_embedding: TimestepEmbedding,
    add_embedding: TimestepEmbedding,
    down_blocks: Vec<DownBlock>,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    config: UNetConfig,
    memory_format: MemoryFormat,
    norm_kernels: NormKernels,
}

impl UNet2DConditionModel {
    pub fn new(w: &Weights, c: &UNetConfig, imp: AttentionImpl) -> Result<Self, LoadError> {
        let boc = &c.block_out_channels;
        let n = boc.len();
        let ted = c.time_embed_dim();
        let common = BlockCommon {
            temb_channels: ted,
            groups: c.norm_num_groups,
            eps: c.norm_eps,
            context_dim: c.cross_attention_dim,
            use_linear_projection: c.use_linear_projection,
        };
        let attn_of = |i: usize, cross: bool| {
            cross.then(|| BlockAttention {
                heads: c.attention_heads[i],
                layers: c.transformer_layers_per_block[i],
            })
        };
        let mut down_blocks = Vec::with_capacity(n);
        let mut out_ch = boc[0];
        for (i, &ch) in boc.iter().enumerate() {
            let in_ch = out_ch;
            out_ch = ch;
            down_blocks.push(DownBlock::new(
                &w.pp("down_blocks").pp(i),
                &common,
                in_ch,
                out_ch,
                c.layers_per_block,
                attn_of(i, c.cross_attention[i]),
                i + 1 < n,
                imp,
            )?);
        }
        let mid_block = MidBlock::new(
            &w.pp("mid_block"),
            &common,
            boc[n - 1],
            BlockAttention {
                heads: c.attention_heads[n - 1],
                layers: c.transformer_layers_per_block[n - 1],
            },
            imp,
        )?;
        let mut up_blocks = Vec::with_capacity(n);
        let rev: Vec<i64> = boc.iter().rev().copied().collect();
        let mut out_ch = rev[0];
        for i in 0..n {
            let prev = out_ch;
            out_ch = rev[i];
            let in_ch = rev[(i + 1).min(n - 1)];
            let src = n - 1 - i;
            up_blocks.push(UpBlock::new(
                &w.pp("up_blocks").pp(i),
                &common,
                in_ch,
                prev,
                out_ch,
                c.layers_per_block + 1,
                attn_of(src, c.cross_attention[src]),
                i + 1 < n,
                imp,
            )?);
        }
        Ok(Self {
            conv_in: Conv2d::new(&w.pp("conv_in"), c.in_channels, boc[0], 3, 1, 1)?,
            time_embedding: TimestepEmbedding::new(&w.pp("time_embedding"), boc[0], ted)?,
            add_embedding: TimestepEmbedding::new(
                &w.pp("add_embedding"),
                c.projection_class_embeddings_input_dim,
                ted,
            )?,
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out: GroupNorm::new(
                &w.pp("conv_norm_out"),
                c.norm_num_groups,
                boc[0],
                c.norm_eps,
            )?,
            conv_out: Conv2d::new(&w.pp("conv_out"), boc[0], c.out_channels, 3, 1, 1)?,
            config: c.clone(),
            memory_format: MemoryFormat::Contiguous,
            norm_kernels: NormKernels::Aten,
        })
    }

    pub fn config(&self) -> &UNetConfig {
        &self.config
    }

    /// `sample` `[B, 4, h, w]`, `timestep` a scalar or `[B]` tensor, `context` `[B, L, 2048]`.
    pub fn forward(
        &self,
        sample: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        added: &AddedCond<'_>,
    ) -> Tensor {
        let c = &self.config;
        let b = sample.size()[0];
        let kind = sample.kind();
        let t = timestep
            .to_device(sample.device())
            .reshape([-1])
            .expand([b], false);
        let t_emb = timestep_features(
            &t,
            c.block_out_channels[0],
            c.flip_sin_to_cos,
            c.freq_shift,
            1.0,
        )
        .to_kind(kind);
        let emb = self.time_embedding.forward(&t_emb);
        let time_ids = added.time_ids.reshape([-1]);
        let time_embeds = timestep_features(
            &time_ids,
            c.addition_time_embed_dim,
            c.flip_sin_to_cos,
            c.freq_shift,
            1.0,
        )
        .reshape([b, -1]);
        let add =
            Tensor::cat(&[added.text_embeds.to_kind(Kind::Float), time_embeds], -1).to_kind(kind);
        let emb = emb + self.add_embedding.forward(&add);

        let sample = match self.memory_format {
            MemoryFormat::ChannelsLast => channels_last(sample),
            MemoryFormat::Contiguous => sample.shallow_clone(),
        };
        let mut h = self.conv_in.forward(&sample);
        let mut skips = vec![h.shallow_clone()];
        for block in &self.down_blocks {
            h = block.forward(&h, &emb, context, &mut skips);
        }
        h = self.mid_block.forward(&h, &emb, context);
        let n = self.up_blocks.len();
        for (i, block) in self.up_blocks.iter().enumerate() {
            // The skip that follows this block's own skips sets the upsampled size.
            let upsample_size = if i + 1 < n {
                let next = skips.len() - block.num_layers() - 1;
                let s = skips[next].size();
                Some([s[2], s[3]])
            } else {
                None
            };
            h = block.forward(&h, &emb, context, &mut skips, upsample_size);
        }
        let a = fused::group_norm(&self.conv_norm_out, &h, None, true, self.norm_kernels);
        drop(h);
        self.conv_out.forward(&a).contiguous()
    }
}

impl UNet2DConditionModel {
    /// The memory order the UNet's activations run in (default `Contiguous`, NCHW as diffusers).
    /// `ChannelsLast` stores every convolution weight NHWC and makes the input NHWC: cuDNN then
    /// runs its NHWC kernels without converting each convolution's input and output, GroupNorm
    /// takes its NHWC path and the spatial transformers' reshapes become views
    /// (docs/performance.md, kernels attempt 10). The output is NCHW either way.
    pub fn memory_format(&self) -> MemoryFormat {
        self.memory_format
    }

    /// Sets the memory order [`UNet2DConditionModel::memory_format`] describes and puts every
    /// convolution weight in it; weights already in it are left as they are.
    pub fn set_memory_format(&mut self, format: MemoryFormat) {
        self.memory_format = format;
        for (_, module) in self.lora_modules() {
            if let LoraModule::Conv2d(c) = module {
                c.weight = match format {
                    MemoryFormat::ChannelsLast => channels_last(&c.weight),
                    MemoryFormat::Contiguous => c.weight.contiguous(),
                };
            }
        }
    }

    /// How every transformer block's feed-forward computes its GELU ([`FfGelu`]; default
    /// `Separate`, diffusers' erf GELU).
    pub fn set_ff_gelu(&mut self, gelu: FfGelu) {
        let down = self.down_blocks.iter_mut().map(|b| b.attentions_mut());
        let up = self.up_blocks.iter_mut().map(|b| b.attentions_mut());
        let mid = std::iter::once(self.mid_block.attentions_mut());
        for t in down.chain(mid).chain(up).flatten() {
            t.set_ff_gelu(gelu);
        }
    }

    /// Which kernels normalise the UNet's activations ([`NormKernels`]; default `Aten`,
    /// libtorch's operators as diffusers). `Fused` runs the GroupNorms (with their SiLU and the
    /// time embedding), the ResNets' bias + residual and the transformer blocks' residual-add +
    /// LayerNorm pairs as kernels of our own ([`fused`]; docs/performance.md, kernels attempt
    /// 11): the first two only with [`MemoryFormat::ChannelsLast`], the LayerNorms in either
    /// layout.
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        self.norm_kernels = k;
        for b in &mut self.down_blocks {
            b.set_norm_kernels(k);
        }
        self.mid_block.set_norm_kernels(k);
        for b in &mut self.up_blocks {
            b.set_norm_kernels(k);
        }
    }
}

/// Every Linear and Conv2d of the UNet by diffusers module name, for LoRA fusing; kohya's
/// sd-scripts trains SDXL on the sgm UNet, so its files name modules the ldm way, given here as
/// aliases.
impl LoraTarget for UNet2DConditionModel {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        let mut out: Vec<(String, LoraModule<'_>)> = vec![
            ("conv_in".into(), (&mut self.conv_in).into()),
            (
                "time_embedding.linear_1".into(),
                (&mut self.time_embedding.linear_1).into(),
            ),
            (
                "time_embedding.linear_2".into(),
                (&mut self.time_embedding.linear_2).into(),
            ),
            (
                "add_embedding.linear_1".into(),
                (&mut self.add_embedding.linear_1).into(),
            ),
            (
                "add_embedding.linear_2".into(),
                (&mut self.add_embedding.linear_2).into(),
            ),
            ("conv_out".into(), (&mut self.conv_out).into()),
        ];
        for (i, b) in self.down_blocks.iter_mut().enumerate() {
            b.lora_modules(&format!("down_blocks.{i}."), &mut out);
        }
        self.mid_block.lora_modules("mid_block.", &mut out);
        for (i, b) in self.up_blocks.iter_mut().enumerate() {
            b.lora_modules(&format!("up_blocks.{i}."), &mut out);
        }
        out
    }

    fn lora_aliases(&mut self) -> Vec<(String, String)> {
        let per = self.config.layers_per_block as usize + 1;
        let up_attention: Vec<bool> = self.up_blocks.iter().map(|b| b.has_attention()).collect();
        self.lora_modules()
            .into_iter()
            .filter_map(|(name, _)| {
                ldm_module_name(&name, per, &up_attention).map(|ldm| (ldm, name))
            })
            .collect()
    }
}

/// The sgm/ldm name of a UNet module (diffusers name without `.weight`), `per` resnets per up
/// block (`layers_per_block + 1`): the inverse of [`crate::sdxl::ldm::unet_key`] for modules.
fn ldm_module_name(name: &str, per: usize, up_attention: &[bool]) -> Option<String> {
    let resnet = |rest: &str| -> Option<String> {
        let ldm = match rest {
            "conv1" => "in_layers.2",
            "conv2" => "out_layers.3",
            "time_emb_proj" => "emb_layers.1",
            "conv_shortcut" => "skip_connection",
            _ => return None,
        };
        Some(ldm.to_string())
    };
    let top = match name {
        "conv_in" => Some("input_blocks.0.0"),
        "time_embedding.linear_1" => Some("time_embed.0"),
        "time_embedding.linear_2" => Some("time_embed.2"),
        "add_embedding.linear_1" => Some("label_emb.0.0"),
        "add_embedding.linear_2" => Some("label_emb.0.2"),
        "conv_out" => Some("out.2"),
        _ => None,
    };
    if let Some(top) = top {
        return Some(top.to_string());
    }
    let parts: Vec<&str> = name.splitn(5, '.').collect();
    let int = |i: usize| parts.get(i).and_then(|p| p.parse::<usize>().ok());
    match parts.first().copied()? {
        "down_blocks" => {
            let (b, kind, l) = (int(1)?, *parts.get(2)?, int(3)?);
            let rest = *parts.get(4)?;
            match kind {
                "resnets" => Some(format!(
                    "input_blocks.{}.0.{}",
                    b * per + l + 1,
                    resnet(rest)?
                )),
                "attentions" => Some(format!("input_blocks.{}.1.{rest}", b * per + l + 1)),
                "downsamplers" => Some(format!("input_blocks.{}.0.op", b * per + per)),
                _ => None,
            }
        }
        "mid_block" => {
            let parts: Vec<&str> = name.splitn(4, '.').collect();
            let i: usize = parts.get(2)?.parse().ok()?;
            let rest = *parts.get(3)?;
            match *parts.get(1)? {
                "resnets" => Some(format!("middle_block.{}.{}", 2 * i, resnet(rest)?)),
                "attentions" => Some(format!("middle_block.1.{rest}")),
                _ => None,
            }
        }
        "up_blocks" => {
            let (b, kind, l) = (int(1)?, *parts.get(2)?, int(3)?);
            let rest = *parts.get(4)?;
            match kind {
                "resnets" => Some(format!("output_blocks.{}.0.{}", b * per + l, resnet(rest)?)),
                "attentions" => Some(format!("output_blocks.{}.1.{rest}", b * per + l)),
                "upsamplers" => Some(format!(
                    "output_blocks.{}.{}.conv",
                    b * per + per - 1,
                    if *up_attention.get(b)? { 2 } else { 1 }
                )),
                _ => None,
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sdxl::ldm::unet_key;

    /// Every module's ldm alias maps back onto it through the single-file key map.
    #[test]
    fn ldm_module_names_invert_the_single_file_key_map() {
        let c = UNetConfig::sdxl_base();
        let per = c.layers_per_block as usize + 1;
        // SDXL base: up blocks 0 and 1 have cross-attention, up block 2 none.
        let up_attention = [true, true, false];
        let names = [
            "conv_in",
            "time_embedding.linear_2",
            "add_embedding.linear_1",
            "conv_out",
            "down_blocks.0.resnets.1.conv2",
            "down_blocks.0.downsamplers.0.conv",
            "down_blocks.1.resnets.0.conv_shortcut",
            "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k",
            "down_blocks.1.attentions.0.proj_in",
            "mid_block.resnets.1.time_emb_proj",
            "mid_block.attentions.0.transformer_blocks.3.ff.net.0.proj",
            "up_blocks.0.resnets.2.conv1",
            "up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_out.0",
            "up_blocks.0.upsamplers.0.conv",
            "up_blocks.1.upsamplers.0.conv",
            "up_blocks.2.resnets.0.conv_shortcut",
        ];
        for name in names {
            let ldm = ldm_module_name(name, per, &up_attention).expect(name);
            assert_eq!(
                unet_key(&format!("{ldm}.weight"), c.layers_per_block as usize),
                Some(format!("{name}.weight")),
                "{name} -> {ldm}"
            );
        }
        assert_eq!(
            ldm_module_name("up_blocks.1.upsamplers.0.conv", per, &up_attention).as_deref(),
            Some("output_blocks.5.2.conv")
        );
        assert_eq!(
            ldm_module_name("down_blocks.2.attentions.1.proj_out", per, &up_attention).as_deref(),
            Some("input_blocks.8.1.proj_out")
        );
    }
}
