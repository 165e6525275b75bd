//! The model catalogue in the bucket (DESIGN §7b): model and LoRA files stored once by content and
//! found by name. A file's bytes are the object `models/sha256/<hex>` ([`blob_key`]); a name points
//! at them through the entry `models/catalogue/<name>.json` ([`entry_key`], a [`CatalogueEntry`]).
//! A job names a file by its catalogue name or by `sha256:<hex>` ([`ModelRef`]); a worker fetches
//! what it lacks into its model cache and verifies the bytes against the hash before any engine
//! reads them.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::manifest::ModelFileRole;

/// Where every file's bytes are kept, under its sha256.
pub const BLOB_PREFIX: &str = "models/sha256/";
/// Where the names are kept, one entry per name.
pub const ENTRY_PREFIX: &str = "models/catalogue/";

/// The lower-case hex sha256 of a file's bytes (64 digits), checked once where it is read.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
pub struct ContentHash(String);

impl ContentHash {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ContentHash {
    type Error = String;

    fn try_from(hex: String) -> Result<Self, String> {
        if hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(Self(hex))
        } else {
            Err(format!(
                "{hex:?} is not a sha256 (64 lower-case hex digits)"
            ))
        }
    }
}

impl From<ContentHash> for String {
    fn from(hash: ContentHash) -> String {
        hash.0
    }
}

impl std::fmt::Display for ContentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A name in the catalogue: what `models/catalogue/<name>.json` says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CatalogueEntry {
    /// A file name ([`crate::spec::is_file_name`]).
    pub name: String,
    pub sha256: ContentHash,
    pub role: ModelFileRole,
    /// Bytes.
    pub size: u64,
    pub added: DateTime<Utc>,
}

/// How a job names a file that may come from the catalogue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    /// A catalogue name (or, first, a file of the worker's own folder).
    Name(String),
    /// `sha256:<hex>`: the blob itself, whatever names point at it.
    Hash(ContentHash),
}

/// The prefix of a reference by hash.
pub const HASH_REF_PREFIX: &str = "sha256:";

impl ModelRef {
    /// `sha256:<64 hex>` is a hash; anything else a name. `None` for `sha256:` followed by
    /// something that is not a sha256 (a typo must not fall back to a name lookup).
    pub fn parse(reference: &str) -> Option<Self> {
        match reference.strip_prefix(HASH_REF_PREFIX) {
            Some(hex) => ContentHash::try_from(hex.to_owned())
                .ok()
                .map(ModelRef::Hash),
            None => Some(ModelRef::Name(reference.to_owned())),
        }
    }
}

/// The object holding the bytes of the file with this hash.
pub fn blob_key(sha256: &ContentHash) -> String {
    format!("{BLOB_PREFIX}{sha256}")
}

/// The object holding the catalogue entry of `name`.
pub fn entry_key(name: &str) -> String {
    format!("{ENTRY_PREFIX}{name}.json")
}

/// The name an entry key holds (`None` for keys that are not entries).
pub fn entry_name(key: &str) -> Option<&str> {
    key.strip_prefix(ENTRY_PREFIX)?.strip_suffix(".json")
}

/// Whether `bytes` begin like a safetensors file: an 8-byte little-endian header length that fits
/// in the file (`size` bytes in all), then a JSON object.
pub fn looks_like_safetensors(bytes: &[u8], size: u64) -> bool {
    let Some(len) = bytes.get(..8) else {
        return false;
    };
    let header = u64::from_le_bytes(len.try_into().expect("eight bytes"));
    header >= 2 && header.saturating_add(8) <= size && bytes.get(8) == Some(&b'{')
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn a_reference_is_a_hash_only_with_the_prefix_and_64_hex_digits() {
        let hash = ContentHash::try_from(HEX.to_owned()).unwrap();
        assert_eq!(
            ModelRef::parse(&format!("sha256:{HEX}")),
            Some(ModelRef::Hash(hash.clone()))
        );
        assert_eq!(
            ModelRef::parse("ink_style"),
            Some(ModelRef::Name("ink_style".into()))
        );
        assert_eq!(ModelRef::parse("sha256:abc"), None);
        assert_eq!(
            ModelRef::parse(&format!("sha256:{}", HEX.to_uppercase())),
            None
        );
        assert_eq!(blob_key(&hash), format!("models/sha256/{HEX}"));
        assert_eq!(entry_key("ink"), "models/catalogue/ink.json");
        assert_eq!(entry_name("models/catalogue/ink.json"), Some("ink"));
        assert_eq!(entry_name("models/sha256/x"), None);
    }

    #[test]
    fn an_entry_round_trips_and_refuses_a_bad_hash() {
        let entry = CatalogueEntry {
            name: "ink".into(),
            sha256: ContentHash::try_from(HEX.to_owned()).unwrap(),
            role: ModelFileRole::Lora,
            size: 4,
            added: "2026-12-03T06:00:00Z".parse().unwrap(),
        };
        let json = serde_json::to_string(&entry).unwrap();
        assert_eq!(
            serde_json::from_str::<CatalogueEntry>(&json).unwrap(),
            entry
        );
        let bad = json.replace(HEX, "xyz");
        assert!(serde_json::from_str::<CatalogueEntry>(&bad).is_err());
    }

    #[test]
    fn a_safetensors_header_is_recognised() {
        let mut file = 2u64.to_le_bytes().to_vec();
        file.extend_from_slice(b"{}");
        assert!(looks_like_safetensors(&file, file.len() as u64));
        assert!(!looks_like_safetensors(b"PK\x03\x04 a zip", 12));
        assert!(
            !looks_like_safetensors(&file, 9),
            "a header longer than the file"
        );
    }
}
