//! The Qwen2 byte-level BPE tokenizer of Qwen2.5-VL through the `tokenizers` crate, from a diffusers
//! folder's `tokenizer/tokenizer.json` or from the copy bundled in this crate (ComfyUI's single-file
//! text encoders carry no tokenizer).
//!
//! The bundled `tokenizer/qwen2/tokenizer.json` is derived by `tokenizer/make_qwen2_tokenizer.py` from
//! Qwen's rank file (Apache-2.0); see `tokenizer/qwen2/README.md`. Qwen adds no BOS/EOS: encoding
//! is `tokenizer(text, add_special_tokens=False)`; the special tokens of the chat template
//! (`<|im_start|>`, `<|vision_start|>`, `<|image_pad|>`, …) are matched as whole tokens.

use std::path::Path;

use crate::error::LoadError;

/// The bundled Qwen2 tokenizer (151643 regular tokens + 22 added tokens).
/// Gzipped (see [`crate::text::bundled_tokenizer`]).
const BUNDLED_GZ: &[u8] = include_bytes!("../../tokenizer/qwen2/tokenizer.json.gz");

/// The padding token of Qwen2's tokenizer (`pad_token`).
pub const PAD_TOKEN: &str = "<|endoftext|>";

/// A Qwen2 tokenizer with its padding id.
pub struct QwenTokenizer {
    inner: tokenizers::Tokenizer,
    /// Id of [`PAD_TOKEN`] (right padding of batches).
    pub pad: i64,
}

impl std::fmt::Debug for QwenTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenTokenizer")
            .field("pad", &self.pad)
            .finish()
    }
}

impl QwenTokenizer {
    fn with_inner(inner: tokenizers::Tokenizer, origin: &Path) -> Result<Self, LoadError> {
        let pad = inner
            .token_to_id(PAD_TOKEN)
            .map(i64::from)
            .ok_or_else(|| LoadError::Format {
                path: origin.to_path_buf(),
                reason: format!("tokenizer has no token {PAD_TOKEN:?}"),
            })?;
        Ok(Self { inner, pad })
    }

    /// The bundled tokenizer.
    pub fn bundled() -> Result<Self, LoadError> {
        let origin = Path::new("<bundled tokenizer/qwen2/tokenizer.json.gz>");
        let inner = crate::text::bundled_tokenizer(BUNDLED_GZ, origin)?;
        Self::with_inner(inner, origin)
    }

    /// `dir/tokenizer.json` (a diffusers `tokenizer/` folder) if present, else the bundled one.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let file = dir.join("tokenizer.json");
        if !file.exists() {
            return Self::bundled();
        }
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| LoadError::Format {
            path: file.clone(),
            reason: e.to_string(),
        })?;
        Self::with_inner(inner, &file)
    }

    /// Token ids of `text` (`add_special_tokens=False`; special tokens in the text are matched).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, String> {
        let enc = self.inner.encode(text, false).map_err(|e| e.to_string())?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// The id of a vocabulary or added token.
    pub fn token_to_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    /// The string of token `id`.
    pub fn id_to_token(&self, id: i64) -> Option<String> {
        u32::try_from(id)
            .ok()
            .and_then(|i| self.inner.id_to_token(i))
    }
}
