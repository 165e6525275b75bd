//! The model catalogue in the bucket (DESIGN §7b; keys and types in `vnfarm_proto::catalogue`):
//! pushing a file (hashed as it is read, uploaded once under its sha256, then named), reading a
//! name's entry, listing the names. The blob goes in before the entry that points at it, so every
//! entry a reader sees names bytes that are there.

use std::io::Read as _;
use std::path::Path;

use bytes::Bytes;
use sha2::{Digest as _, Sha256};
use vnfarm_proto::catalogue::{
    CatalogueEntry, ContentHash, ENTRY_PREFIX, blob_key, entry_key, entry_name,
    looks_like_safetensors,
};
use vnfarm_proto::{ModelFileRole, decode_json};

use crate::{Storage, StorageError};

#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{path} is not a safetensors file")]
    NotSafetensors { path: String },
    #[error("{name:?} is not a catalogue name ([A-Za-z0-9._-], not starting with '.')")]
    BadName { name: String },
    #[error("the catalogue entry {key} is unreadable: {message}")]
    BadEntry { key: String, message: String },
}

/// The catalogue of one store.
#[derive(Clone, Debug)]
pub struct Catalogue {
    storage: Storage,
}

impl Catalogue {
    pub fn new(storage: Storage) -> Self {
        Self { storage }
    }

    /// Stores the file at `path` as `name` (by default its file name without `.safetensors`):
    /// hashed as it is read, its blob uploaded unless one of that size is there already, then the
    /// entry written (replacing what the name pointed at before).
    pub async fn push(
        &self,
        path: &Path,
        role: ModelFileRole,
        name: Option<&str>,
    ) -> Result<CatalogueEntry, CatalogueError> {
        let name = match name {
            Some(name) => name.to_owned(),
            None => default_name(path),
        };
        if !vnfarm_proto::spec::is_file_name(&name) {
            return Err(CatalogueError::BadName { name });
        }
        let (sha256, size) = {
            let path = path.to_owned();
            tokio::task::spawn_blocking(move || hash_file(&path))
                .await
                .map_err(|e| CatalogueError::File {
                    path: String::new(),
                    message: format!("the hashing thread failed: {e}"),
                })??
        };
        let key = blob_key(&sha256);
        if self.storage.head(&key).await? != Some(size) {
            self.storage
                .put_file(&key, path, "application/octet-stream")
                .await?;
        }
        let entry = CatalogueEntry {
            name,
            sha256,
            role,
            size,
            added: chrono::Utc::now(),
        };
        let json = serde_json::to_vec_pretty(&entry).expect("an entry serializes");
        self.storage
            .put(
                &entry_key(&entry.name),
                Bytes::from(json),
                "application/json",
            )
            .await?;
        Ok(entry)
    }

    /// The entry of `name`, `None` when the catalogue has no such name.
    pub async fn entry(&self, name: &str) -> Result<Option<CatalogueEntry>, CatalogueError> {
        if !vnfarm_proto::spec::is_file_name(name) {
            return Ok(None);
        }
        let key = entry_key(name);
        let bytes = match self.storage.get(&key).await {
            Ok(bytes) => bytes,
            Err(StorageError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let entry: CatalogueEntry = decode_json(&bytes).map_err(|e| CatalogueError::BadEntry {
            key: key.clone(),
            message: e.to_string(),
        })?;
        if entry.name != name {
            return Err(CatalogueError::BadEntry {
                key,
                message: format!("it names {:?}", entry.name),
            });
        }
        Ok(Some(entry))
    }

    /// Every entry, by name.
    pub async fn list(&self) -> Result<Vec<CatalogueEntry>, CatalogueError> {
        let mut entries = Vec::new();
        for key in self.storage.list(ENTRY_PREFIX).await? {
            let Some(name) = entry_name(&key) else {
                continue;
            };
            if let Some(entry) = self.entry(name).await? {
                entries.push(entry);
            }
        }
        Ok(entries)
    }
}

/// A file's name without its `.safetensors` extension.
fn default_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match file.strip_suffix(".safetensors") {
        Some(stem) if !stem.is_empty() => stem.to_owned(),
        _ => file,
    }
}

/// Why a file has no safetensors hash.
#[derive(Debug, thiserror::Error)]
pub enum HashError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("not a safetensors file")]
    NotSafetensors,
}

/// The sha256 and size of a safetensors file (its header checked on the first piece), read in
/// 1 MiB pieces: what a push names a file by and what a worker checks a download against.
pub fn hash_safetensors(path: &Path) -> Result<(ContentHash, u64), HashError> {
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut first = true;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        if std::mem::take(&mut first) && !looks_like_safetensors(&buf[..n], size) {
            return Err(HashError::NotSafetensors);
        }
        hasher.update(&buf[..n]);
    }
    if first {
        return Err(HashError::NotSafetensors);
    }
    let hash = ContentHash::try_from(hex::encode(hasher.finalize()))
        .expect("a sha256 digest is 64 hex digits");
    Ok((hash, size))
}

/// The largest safetensors header [`lora_tensors`] reads (a LoRA's is a few hundred KiB).
const MAX_HEADER: u64 = 100 << 20;

/// How many tensors of the safetensors file at `path` are LoRA weights by their names (kohya's
/// and LyCORIS LoCon's `lora_down`/`lora_up`, diffusers/PEFT's `lora_A`/`lora_B`, any name with
/// `lora`): zero for a checkpoint or another model's file. An error says why the header cannot
/// be read.
pub fn lora_tensors(path: &Path) -> Result<usize, String> {
    let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| "shorter than a safetensors header".to_owned())?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER || len + 8 > size {
        return Err(format!(
            "its header claims {len} bytes (file {size} bytes, at most {MAX_HEADER})"
        ));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let tensors: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| format!("its header is not JSON: {e}"))?;
    Ok(tensors
        .keys()
        .filter(|k| *k != "__metadata__" && k.to_ascii_lowercase().contains("lora"))
        .count())
}

/// [`hash_safetensors`] for a push, its errors naming the file.
fn hash_file(path: &Path) -> Result<(ContentHash, u64), CatalogueError> {
    hash_safetensors(path).map_err(|e| match e {
        HashError::Io(e) => CatalogueError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        },
        HashError::NotSafetensors => CatalogueError::NotSafetensors {
            path: path.display().to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StorageConfig;

    /// A minimal safetensors file: an 8-byte header length, `{}` padded, and `data`.
    pub(crate) fn safetensors(data: &[u8]) -> Vec<u8> {
        let mut file = 8u64.to_le_bytes().to_vec();
        file.extend_from_slice(b"{}      ");
        file.extend_from_slice(data);
        file
    }

    #[tokio::test]
    async fn a_pushed_file_is_stored_once_by_hash_and_found_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(&StorageConfig::Local {
            root: dir.path().join("store"),
        })
        .await
        .unwrap();
        let catalogue = Catalogue::new(storage.clone());
        let file = dir.path().join("ink_style.safetensors");
        let bytes = safetensors(b"weights");
        std::fs::write(&file, &bytes).unwrap();

        let entry = catalogue
            .push(&file, ModelFileRole::Lora, None)
            .await
            .unwrap();
        assert_eq!(entry.name, "ink_style");
        assert_eq!(entry.size, bytes.len() as u64);
        assert_eq!(
            entry.sha256.as_str(),
            hex::encode(Sha256::digest(&bytes)).as_str()
        );
        assert_eq!(
            storage.get(&blob_key(&entry.sha256)).await.unwrap(),
            Bytes::from(bytes)
        );
        let again = catalogue
            .push(&file, ModelFileRole::Lora, Some("ink_v2"))
            .await
            .unwrap();
        assert_eq!(again.sha256, entry.sha256);
        let names: Vec<String> = catalogue
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["ink_style", "ink_v2"]);
        assert_eq!(storage.list("models/sha256/").await.unwrap().len(), 1);
        assert_eq!(
            catalogue.entry("ink_style").await.unwrap(),
            Some(entry.clone())
        );
        assert_eq!(catalogue.entry("nope").await.unwrap(), None);
        assert_eq!(catalogue.entry("../x").await.unwrap(), None);

        let zip = dir.path().join("x.zip");
        std::fs::write(&zip, b"PK\x03\x04 not weights").unwrap();
        assert!(matches!(
            catalogue.push(&zip, ModelFileRole::Lora, None).await,
            Err(CatalogueError::NotSafetensors { .. })
        ));
        assert!(matches!(
            catalogue.push(&file, ModelFileRole::Lora, Some(".x")).await,
            Err(CatalogueError::BadName { .. })
        ));
    }
}
