//! Strict JSON decoding for untrusted input: the error names the path of the field that failed.

/// A payload that could not be decoded into the expected type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct DecodeError {
    /// Dotted path of the offending field (`job.width`), or `.` for the document itself.
    pub field: String,
    pub message: String,
}

/// Decodes `bytes` as `T`, reporting the path of the first field that does not fit.
pub fn decode_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        DecodeError {
            field: path,
            message: e.into_inner().to_string(),
        }
    })
}
