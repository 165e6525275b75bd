//! Single-file SDXL checkpoints in ldm key naming (A1111 / CivitAI / ComfyUI): maps every tensor of
//! the file onto the diffusers names the model code asks for, and reads the prediction-type flags.
//!
//! Prefixes: `model.diffusion_model.` (UNet), `first_stage_model.` (VAE),
//! `conditioner.embedders.0.transformer.` (CLIP-L, already transformers-named),
//! `conditioner.embedders.1.model.` (OpenCLIP bigG: `in_proj` split into q/k/v, `text_projection`
//! transposed). The rename rules follow diffusers `loaders/single_file_utils.py`
//! (`convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_open_clip_checkpoint`,
//! Apache-2.0); ComfyUI was consulted for key names only.

use std::sync::Arc;

use crate::loading::safetensors::SafetensorsFile;
use crate::loading::weights::{Transform, WeightStore};
use crate::schedulers::PredictionType;

pub const UNET_PREFIX: &str = "model.diffusion_model.";
pub const VAE_PREFIX: &str = "first_stage_model.";
pub const CLIP_L_PREFIX: &str = "conditioner.embedders.0.transformer.";
pub const CLIP_G_PREFIX: &str = "conditioner.embedders.1.model.";

/// Flags read from a single-file checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheckpointFlags {
    /// `Some` when the file says which prediction type it was trained for.
    pub prediction_type: Option<PredictionType>,
    /// A `ztsnr` key (zero terminal SNR training) is present. Reported, not applied.
    pub zero_terminal_snr: bool,
}

/// Reads the prediction-type flags: a `v_pred` tensor (ComfyUI's convention, used by NoobAI /
/// Illustrious v-pred merges), safetensors metadata `modelspec.prediction_type` (`"v"`,
/// `"v_prediction"` or `"epsilon"`) or kohya's `ss_v_parameterization` (`"True"`).
pub fn detect_flags(file: &SafetensorsFile) -> CheckpointFlags {
    let mut flags = CheckpointFlags {
        prediction_type: None,
        zero_terminal_snr: file.info("ztsnr").is_some(),
    };
    let meta = file.metadata();
    if file.info("v_pred").is_some() {
        flags.prediction_type = Some(PredictionType::VPrediction);
    } else if let Some(p) = meta.get("modelspec.prediction_type") {
        let p = p.to_ascii_lowercase();
        flags.prediction_type = Some(if p.starts_with('v') {
            PredictionType::VPrediction
        } else {
            PredictionType::Epsilon
        });
    } else if meta
        .get("ss_v_parameterization")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        flags.prediction_type = Some(PredictionType::VPrediction);
    }
    flags
}

fn resnet_unet(rest: &str) -> String {
    for (from, to) in [
        ("in_layers.0.", "norm1."),
        ("in_layers.2.", "conv1."),
        ("out_layers.0.", "norm2."),
        ("out_layers.3.", "conv2."),
        ("emb_layers.1.", "time_emb_proj."),
        ("skip_connection.", "conv_shortcut."),
    ] {
        if let Some(r) = rest.strip_prefix(from) {
            return format!("{to}{r}");
        }
    }
    rest.to_string()
}

/// `(block index, sub index, rest)` of `"{i}.{j}.rest"`.
fn split2(s: &str) -> Option<(usize, usize, &str)> {
    let mut it = s.splitn(3, '.');
    let i = it.next()?.parse().ok()?;
    let j = it.next()?.parse().ok()?;
    Some((i, j, it.next()?))
}

/// The diffusers name of an ldm UNet key (prefix stripped), for `layers_per_block` resnets per block.
pub fn unet_key(k: &str, layers_per_block: usize) -> Option<String> {
    let per = layers_per_block + 1;
    for (from, to) in [
        ("time_embed.0.", "time_embedding.linear_1."),
        ("time_embed.2.", "time_embedding.linear_2."),
        ("label_emb.0.0.", "add_embedding.linear_1."),
        ("label_emb.0.2.", "add_embedding.linear_2."),
        ("input_blocks.0.0.", "conv_in."),
        ("out.0.", "conv_norm_out."),
        ("out.2.", "conv_out."),
    ] {
        if let Some(r) = k.strip_prefix(from) {
            return Some(format!("{to}{r}"));
        }
    }
    if let Some(s) = k.strip_prefix("input_blocks.") {
        let (i, j, rest) = split2(s)?;
        let (b, l) = ((i - 1) / per, (i - 1) % per);
        return Some(match (j, rest.strip_prefix("op.")) {
            (0, Some(r)) => format!("down_blocks.{b}.downsamplers.0.conv.{r}"),
            (0, None) => format!("down_blocks.{b}.resnets.{l}.{}", resnet_unet(rest)),
            (1, _) => format!("down_blocks.{b}.attentions.{l}.{rest}"),
            _ => return None,
        });
    }
    if let Some(s) = k.strip_prefix("middle_block.") {
        let (j, rest) = s.split_once('.')?;
        return Some(match j {
            "0" => format!("mid_block.resnets.0.{}", resnet_unet(rest)),
            "1" => format!("mid_block.attentions.0.{rest}"),
            "2" => format!("mid_block.resnets.1.{}", resnet_unet(rest)),
            _ => return None,
        });
    }
    if let Some(s) = k.strip_prefix("output_blocks.") {
        let (i, j, rest) = split2(s)?;
        let (b, l) = (i / per, i % per);
        return Some(match (j, rest.strip_prefix("conv.")) {
            (0, _) => format!("up_blocks.{b}.resnets.{l}.{}", resnet_unet(rest)),
            (1 | 2, Some(r)) => format!("up_blocks.{b}.upsamplers.0.conv.{r}"),
            (1, None) => format!("up_blocks.{b}.attentions.{l}.{rest}"),
            _ => return None,
        });
    }
    None
}

fn vae_resnet(rest: &str) -> String {
    match rest.strip_prefix("nin_shortcut.") {
        Some(r) => format!("conv_shortcut.{r}"),
        None => rest.to_string(),
    }
}

fn vae_mid(rest: &str) -> Option<String> {
    if let Some(r) = rest.strip_prefix("block_1.") {
        return Some(format!("mid_block.resnets.0.{}", vae_resnet(r)));
    }
    if let Some(r) = rest.strip_prefix("block_2.") {
        return Some(format!("mid_block.resnets.1.{}", vae_resnet(r)));
    }
    let r = rest.strip_prefix("attn_1.")?;
    let (part, tail) = r.split_once('.')?;
    let to = match part {
        "norm" => "group_norm",
        "q" => "to_q",
        "k" => "to_k",
        "v" => "to_v",
        "proj_out" => "to_out.0",
        _ => return None,
    };
    Some(format!("mid_block.attentions.0.{to}.{tail}"))
}

/// The diffusers name of an ldm VAE key (prefix stripped), for a VAE with `n_blocks` levels.
pub fn vae_key(k: &str, n_blocks: usize) -> Option<String> {
    let (side, rest) = k.split_once('.')?;
    match side {
        "quant_conv" | "post_quant_conv" => return Some(k.to_string()),
        "encoder" | "decoder" => {}
        _ => return None,
    }
    let mapped = if rest.starts_with("conv_in.") || rest.starts_with("conv_out.") {
        rest.to_string()
    } else if let Some(r) = rest.strip_prefix("norm_out.") {
        format!("conv_norm_out.{r}")
    } else if let Some(r) = rest.strip_prefix("mid.") {
        vae_mid(r)?
    } else if let Some(s) = rest.strip_prefix("down.") {
        let (i, r) = s.split_once('.')?;
        if let Some(r) = r.strip_prefix("downsample.conv.") {
            format!("down_blocks.{i}.downsamplers.0.conv.{r}")
        } else {
            let r = r.strip_prefix("block.")?;
            let (j, r) = r.split_once('.')?;
            format!("down_blocks.{i}.resnets.{j}.{}", vae_resnet(r))
        }
    } else if let Some(s) = rest.strip_prefix("up.") {
        let (i, r) = s.split_once('.')?;
        let b = n_blocks.checked_sub(1 + i.parse::<usize>().ok()?)?;
        if let Some(r) = r.strip_prefix("upsample.conv.") {
            format!("up_blocks.{b}.upsamplers.0.conv.{r}")
        } else {
            let r = r.strip_prefix("block.")?;
            let (j, r) = r.split_once('.')?;
            format!("up_blocks.{b}.resnets.{j}.{}", vae_resnet(r))
        }
    } else {
        return None;
    };
    Some(format!("{side}.{mapped}"))
}

/// The diffusers name(s) of an OpenCLIP key (prefix stripped), with the transform each needs.
pub fn open_clip_keys(k: &str) -> Vec<(String, Transform)> {
    let simple = |s: &str| vec![(s.to_string(), Transform::Identity)];
    match k {
        "token_embedding.weight" => return simple("text_model.embeddings.token_embedding.weight"),
        "positional_embedding" => return simple("text_model.embeddings.position_embedding.weight"),
        "text_projection" => return vec![("text_projection.weight".into(), Transform::Transpose)],
        _ => {}
    }
    if let Some(r) = k.strip_prefix("ln_final.") {
        return simple(&format!("text_model.final_layer_norm.{r}"));
    }
    let Some(s) = k.strip_prefix("transformer.resblocks.") else {
        return Vec::new();
    };
    let Some((n, rest)) = s.split_once('.') else {
        return Vec::new();
    };
    let base = format!("text_model.encoder.layers.{n}");
    for (suffix, kind) in [
        ("attn.in_proj_weight", "weight"),
        ("attn.in_proj_bias", "bias"),
    ] {
        if rest == suffix {
            return ["q_proj", "k_proj", "v_proj"]
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    (
                        format!("{base}.self_attn.{p}.{kind}"),
                        Transform::Chunk {
                            index: i as i64,
                            parts: 3,
                        },
                    )
                })
                .collect();
        }
    }
    for (from, to) in [
        ("ln_1.", "layer_norm1."),
        ("ln_2.", "layer_norm2."),
        ("attn.out_proj.", "self_attn.out_proj."),
        ("mlp.c_fc.", "mlp.fc1."),
        ("mlp.c_proj.", "mlp.fc2."),
    ] {
        if let Some(r) = rest.strip_prefix(from) {
            return simple(&format!("{base}.{to}{r}"));
        }
    }
    Vec::new()
}

/// Name tables for the four components of one single-file checkpoint.
#[derive(Debug)]
pub struct LdmStores {
    pub unet: WeightStore,
    pub vae: WeightStore,
    pub clip_l: WeightStore,
    pub clip_g: WeightStore,
}

/// Builds the four name tables of `file`. Unknown keys are ignored (EMA copies, `logit_scale`,
/// `position_ids`, flags); a key the model needs and the file lacks fails later, by name.
pub fn stores(
    file: Arc<SafetensorsFile>,
    unet_layers_per_block: usize,
    vae_blocks: usize,
) -> LdmStores {
    let mut s = LdmStores {
        unet: WeightStore::default(),
        vae: WeightStore::default(),
        clip_l: WeightStore::default(),
        clip_g: WeightStore::default(),
    };
    let (u, v, l, g) = (
        s.unet.add_file(file.clone()),
        s.vae.add_file(file.clone()),
        s.clip_l.add_file(file.clone()),
        s.clip_g.add_file(file.clone()),
    );
    for key in file.names() {
        if let Some(k) = key.strip_prefix(UNET_PREFIX) {
            if let Some(name) = unet_key(k, unet_layers_per_block) {
                s.unet.insert(name, u, key.to_string(), Transform::Identity);
            }
        } else if let Some(k) = key.strip_prefix(VAE_PREFIX) {
            if let Some(name) = vae_key(k, vae_blocks) {
                s.vae.insert(name, v, key.to_string(), Transform::Identity);
            }
        } else if let Some(k) = key.strip_prefix(CLIP_L_PREFIX) {
            if let Some(name) = crate::sdxl::clip::canonical_key(k) {
                s.clip_l
                    .insert(name, l, key.to_string(), Transform::Identity);
            }
        } else if let Some(k) = key.strip_prefix(CLIP_G_PREFIX) {
            for (name, t) in open_clip_keys(k) {
                s.clip_g.insert(name, g, key.to_string(), t);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_keys_follow_diffusers() {
        let cases = [
            (
                "input_blocks.1.0.in_layers.0.weight",
                "down_blocks.0.resnets.0.norm1.weight",
            ),
            (
                "input_blocks.3.0.op.weight",
                "down_blocks.0.downsamplers.0.conv.weight",
            ),
            (
                "input_blocks.4.1.proj_in.weight",
                "down_blocks.1.attentions.0.proj_in.weight",
            ),
            (
                "input_blocks.8.0.skip_connection.bias",
                "down_blocks.2.resnets.1.conv_shortcut.bias",
            ),
            (
                "middle_block.1.transformer_blocks.3.attn2.to_k.weight",
                "mid_block.attentions.0.transformer_blocks.3.attn2.to_k.weight",
            ),
            (
                "middle_block.2.emb_layers.1.weight",
                "mid_block.resnets.1.time_emb_proj.weight",
            ),
            (
                "output_blocks.2.1.conv.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.5.2.conv.bias",
                "up_blocks.1.upsamplers.0.conv.bias",
            ),
            (
                "output_blocks.4.1.norm.weight",
                "up_blocks.1.attentions.1.norm.weight",
            ),
            (
                "output_blocks.8.0.out_layers.3.weight",
                "up_blocks.2.resnets.2.conv2.weight",
            ),
            ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(unet_key(ldm, 2).as_deref(), Some(diffusers), "{ldm}");
        }
    }

    #[test]
    fn vae_keys_follow_diffusers() {
        let cases = [
            (
                "decoder.up.0.block.2.nin_shortcut.weight",
                "decoder.up_blocks.3.resnets.2.conv_shortcut.weight",
            ),
            (
                "decoder.up.3.upsample.conv.bias",
                "decoder.up_blocks.0.upsamplers.0.conv.bias",
            ),
            (
                "encoder.mid.attn_1.proj_out.weight",
                "encoder.mid_block.attentions.0.to_out.0.weight",
            ),
            (
                "encoder.down.1.downsample.conv.weight",
                "encoder.down_blocks.1.downsamplers.0.conv.weight",
            ),
            ("encoder.norm_out.bias", "encoder.conv_norm_out.bias"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(vae_key(ldm, 4).as_deref(), Some(diffusers), "{ldm}");
        }
    }
}
