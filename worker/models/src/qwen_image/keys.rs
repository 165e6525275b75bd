//! Checkpoint names of the Qwen-Image VAE: the original Wan 2.1 names (ComfyUI's
//! `qwen_image_vae.safetensors`) mapped to diffusers' `AutoencoderKLQwenImage` names, and a
//! [`WeightStore`] over a VAE file in either naming.
//!
//! The mapping is diffusers' `convert_wan_vae_to_diffusers` (`loaders/single_file_utils.py`,
//! diffusers 0.42.1, Apache-2.0), which hard-codes the real layout (decoder `upsamples` in groups of
//! four: three residual blocks and an upsampler); here it is written for any `num_res_blocks`
//! (groups of `num_res_blocks + 2`), so the tiny test VAE maps too. On the real layout the two
//! agree (checked by `fixtures/qwen/make_qwen_fixtures.py` on every run, and by the `qwen_vae`
//! tests against the real key list).
//!
//! | Wan 2.1 | diffusers |
//! |---|---|
//! | `conv1` / `conv2` | `quant_conv` / `post_quant_conv` |
//! | `{encoder,decoder}.conv1` | `….conv_in` |
//! | `….head.0` / `….head.2` | `….norm_out` / `….conv_out` |
//! | `….middle.{0,1,2}` | `….mid_block.{resnets.0, attentions.0, resnets.1}` |
//! | `encoder.downsamples.N` | `encoder.down_blocks.N` (same flat list) |
//! | `decoder.upsamples.M`, `M = b (n + 2) + r` | `decoder.up_blocks.b.resnets.r` (`r <= n`), else `….upsamplers.0` |
//!
//! and inside residual blocks `residual.{0,2,3,6}` → `norm1`, `conv1`, `norm2`, `conv2`,
//! `shortcut` → `conv_shortcut` (`n` = `num_res_blocks`).

use std::path::Path;
use std::sync::Arc;

use crate::error::LoadError;
use crate::loading::safetensors::SafetensorsFile;
use crate::loading::weights::WeightStore;

/// Which names a VAE file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaeNaming {
    /// diffusers `AutoencoderKLQwenImage` (`vae/diffusion_pytorch_model.safetensors`).
    Diffusers,
    /// Wan 2.1 / ComfyUI (`qwen_image_vae.safetensors`).
    Wan,
}

impl VaeNaming {
    /// Wan when any key is one only Wan files have (`encoder.conv1.*`, `….middle.*`,
    /// `encoder.downsamples.*`, `decoder.upsamples.*`), else diffusers.
    pub fn detect<'a>(mut keys: impl Iterator<Item = &'a str>) -> Self {
        let wan = keys.any(|k| {
            k.starts_with("encoder.conv1.")
                || k.starts_with("encoder.middle.")
                || k.starts_with("decoder.middle.")
                || k.starts_with("encoder.downsamples.")
                || k.starts_with("decoder.upsamples.")
        });
        if wan { Self::Wan } else { Self::Diffusers }
    }
}

/// The diffusers name of Wan 2.1 VAE tensor `key` for a VAE with `num_res_blocks` residual blocks
/// per encoder level; `None` for keys that are not part of the VAE.
pub fn wan_vae_key(key: &str, num_res_blocks: i64) -> Option<String> {
    if let Some(rest) = key.strip_prefix("conv1.") {
        return Some(format!("quant_conv.{rest}"));
    }
    if let Some(rest) = key.strip_prefix("conv2.") {
        return Some(format!("post_quant_conv.{rest}"));
    }
    let (side, rest) = key.split_once('.')?;
    if side != "encoder" && side != "decoder" {
        return None;
    }
    if let Some(t) = rest.strip_prefix("conv1.") {
        return Some(format!("{side}.conv_in.{t}"));
    }
    if let Some(t) = rest.strip_prefix("head.0.") {
        return Some(format!("{side}.norm_out.{t}"));
    }
    if let Some(t) = rest.strip_prefix("head.2.") {
        return Some(format!("{side}.conv_out.{t}"));
    }
    if let Some(t) = rest.strip_prefix("middle.") {
        let (n, tail) = index(t)?;
        return if n % 2 == 0 {
            Some(format!(
                "{side}.mid_block.resnets.{}.{}",
                n / 2,
                residual(tail)?
            ))
        } else {
            Some(format!("{side}.mid_block.attentions.{}.{tail}", n / 2))
        };
    }
    if side == "encoder" {
        let (n, tail) = index(rest.strip_prefix("downsamples.")?)?;
        // Resamplers (`resample.1.*`, `time_conv.*`) keep their names.
        let tail = residual(tail).unwrap_or_else(|| tail.to_string());
        return Some(format!("encoder.down_blocks.{n}.{tail}"));
    }
    let (m, tail) = index(rest.strip_prefix("upsamples.")?)?;
    let per = num_res_blocks + 2;
    let (b, r) = (m / per, m % per);
    if r <= num_res_blocks {
        Some(format!(
            "decoder.up_blocks.{b}.resnets.{r}.{}",
            residual(tail)?
        ))
    } else {
        Some(format!("decoder.up_blocks.{b}.upsamplers.0.{tail}"))
    }
}

/// `"12.rest"` → `(12, "rest")`.
fn index(s: &str) -> Option<(i64, &str)> {
    let (n, tail) = s.split_once('.')?;
    Some((n.parse().ok()?, tail))
}

/// A residual block's Wan tensor name (`residual.N.*`, `shortcut.*`) in diffusers naming.
fn residual(tail: &str) -> Option<String> {
    const MAP: [(&str, &str); 5] = [
        ("residual.0.", "norm1."),
        ("residual.2.", "conv1."),
        ("residual.3.", "norm2."),
        ("residual.6.", "conv2."),
        ("shortcut.", "conv_shortcut."),
    ];
    MAP.iter()
        .find_map(|(wan, diffusers)| tail.strip_prefix(wan).map(|t| format!("{diffusers}{t}")))
}

/// A store over the VAE file at `path`, in diffusers naming whichever naming the file uses
/// ([`VaeNaming::detect`]); `num_res_blocks` is the config's (it places the decoder's Wan
/// indices).
pub fn vae_weight_store(path: &Path, num_res_blocks: i64) -> Result<WeightStore, LoadError> {
    let file = Arc::new(SafetensorsFile::open(path)?);
    Ok(match VaeNaming::detect(file.names()) {
        VaeNaming::Diffusers => WeightStore::identity(file),
        VaeNaming::Wan => WeightStore::renamed(file, |k| wan_vae_key(k, num_res_blocks)),
    })
}
