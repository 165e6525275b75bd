//! CLIP BPE tokenization through the `tokenizers` crate, from a diffusers folder's
//! `tokenizer*/tokenizer.json` or from the copy bundled in this crate (single-file checkpoints
//! carry no tokenizer).
//!
//! The bundled `tokenizer/clip/tokenizer.json` is built by `tokenizer/make_clip_tokenizer.py` from
//! CLIP's `bpe_simple_vocab_16e6.txt.gz` as shipped in the `open_clip_torch` wheel (MIT); see
//! `tokenizer/README.md`. Framing (BOS, EOS, padding to 77) is done by the callers, as compel does.

use std::path::Path;

use crate::error::LoadError;

/// The bundled CLIP tokenizer (49408 tokens).
/// Gzipped (see [`crate::text::bundled_tokenizer`]).
const BUNDLED_GZ: &[u8] = include_bytes!("../../tokenizer/clip/tokenizer.json.gz");

/// A CLIP tokenizer with its special ids.
pub struct ClipTokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: i64,
    pub eos: i64,
    pub pad: i64,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .finish()
    }
}

/// Tokens per 77-token window (BOS + 75 + EOS).
pub const MAX_LENGTH: usize = 77;
/// Content tokens per window.
pub const CHUNK: usize = MAX_LENGTH - 2;

impl ClipTokenizer {
    fn with_pad(inner: tokenizers::Tokenizer, pad: &str, origin: &Path) -> Result<Self, LoadError> {
        let id = |t: &str| {
            inner
                .token_to_id(t)
                .map(i64::from)
                .ok_or_else(|| LoadError::Format {
                    path: origin.to_path_buf(),
                    reason: format!("tokenizer has no token {t:?}"),
                })
        };
        Ok(Self {
            bos: id("<|startoftext|>")?,
            eos: id("<|endoftext|>")?,
            pad: id(pad)?,
            inner,
        })
    }

    /// The bundled tokenizer padding with `pad` (`"<|endoftext|>"` for SDXL's tokenizer 1, `"!"`
    /// for tokenizer 2).
    pub fn bundled(pad: &str) -> Result<Self, LoadError> {
        let origin = Path::new("<bundled tokenizer/clip/tokenizer.json.gz>");
        let inner = crate::text::bundled_tokenizer(BUNDLED_GZ, origin)?;
        Self::with_pad(inner, pad, origin)
    }

    /// A diffusers `tokenizer/` or `tokenizer_2/` folder: its `tokenizer.json` if present, else the
    /// bundled CLIP tokenizer (folders such as the original SDXL base repository ship only
    /// `vocab.json`/`merges.txt` of the same CLIP vocabulary). The pad token comes from
    /// `tokenizer_config.json` or `special_tokens_map.json`, else `default_pad`.
    pub fn from_dir(dir: &Path, default_pad: &str) -> Result<Self, LoadError> {
        let mut pad = default_pad.to_string();
        for name in ["tokenizer_config.json", "special_tokens_map.json"] {
            let Ok(text) = std::fs::read_to_string(dir.join(name)) else {
                continue;
            };
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| LoadError::Format {
                    path: dir.join(name),
                    reason: e.to_string(),
                })?;
            let p = v.get("pad_token");
            if let Some(s) = p
                .and_then(|p| p.as_str())
                .or_else(|| p.and_then(|p| p.get("content")).and_then(|c| c.as_str()))
            {
                pad = s.to_string();
                break;
            }
        }
        let file = dir.join("tokenizer.json");
        if !file.exists() {
            return Self::bundled(&pad);
        }
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| LoadError::Format {
            path: file.clone(),
            reason: e.to_string(),
        })?;
        Self::with_pad(inner, &pad, &file)
    }

    /// Token ids of `text` without BOS/EOS.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, String> {
        let enc = self.inner.encode(text, false).map_err(|e| e.to_string())?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Token ids of `text` with BOS/EOS, as `transformers.CLIPTokenizer(text).input_ids`.
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<i64>, String> {
        let enc = self.inner.encode(text, true).map_err(|e| e.to_string())?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// The vocabulary string of `id` (e.g. `".</w>"`).
    pub fn token(&self, id: i64) -> Option<String> {
        u32::try_from(id)
            .ok()
            .and_then(|i| self.inner.id_to_token(i))
    }
}
