//! Text front ends: [`clip_tokenizer`] (CLIP BPE with the bundled vocabulary) and [`prompt`] (the
//! A1111 prompt syntax: weights and `BREAK`).

pub mod clip_tokenizer;
pub mod prompt;

use std::io::Read;
use std::path::Path;

use crate::error::LoadError;

/// A tokenizer bundled gzipped in the crate (the source tree travels to test machines, where size
/// counts), unpacked and parsed; `origin` names it in errors.
pub(crate) fn bundled_tokenizer(
    gz: &[u8],
    origin: &Path,
) -> Result<tokenizers::Tokenizer, LoadError> {
    let format = |reason: String| LoadError::Format {
        path: origin.to_path_buf(),
        reason,
    };
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut json)
        .map_err(|e| format(format!("cannot unpack: {e}")))?;
    tokenizers::Tokenizer::from_bytes(json).map_err(|e| format(e.to_string()))
}
