//! Text front ends: [`clip_tokenizer`] (CLIP BPE with the bundled vocabulary) and [`prompt`] (the
//! A1111 prompt syntax: weights and `BREAK`).

pub mod clip_tokenizer;
pub mod prompt;

use std::io::Read;
use std::path::Path;

use crate::error::LoadError;

/// A bundled file, gzipped in the crate, unpacked (`origin` names it in errors).
pub(crate) fn gunzip(gz: &[u8], origin: &Path) -> Result<Vec<u8>, LoadError> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut out)
        .map_err(|e| LoadError::Format {
            path: origin.to_path_buf(),
            reason: format!("cannot unpack: {e}"),
        })?;
    Ok(out)
}
