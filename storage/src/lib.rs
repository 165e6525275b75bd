//! Result storage (DESIGN §7): an S3-compatible bucket through `aws-sdk-s3`, or a local directory
//! (the embedded default for one box). Both take the same keys (`results/<job>/<n>.png`, `inputs/..`);
//! writes replace whole objects, so a re-run overwrites rather than forks. Every operation goes
//! through one retry policy ([`Retries`], `retry.rs`) whichever the store. Large files (the model
//! catalogue's, DESIGN §7b) go between a file on disk and the store without passing through
//! memory: [`Storage::put_file`], and [`Storage::get_into_file`], which resumes with ranged reads.

pub mod catalogue;
mod local;
mod retry;
mod s3;

use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde::Deserialize;

pub use catalogue::{Catalogue, CatalogueError, HashError, hash_safetensors, lora_tensors};
pub use local::LocalStore;
use local::unavailable as io_unavailable;
pub use retry::Retries;
pub use s3::{MULTIPART_PART, S3Store};

/// Where results go, and how its operations are retried ([`Retries`]).
#[derive(Clone, Debug)]
pub struct Storage {
    store: Store,
    retries: Retries,
}

/// The stores: a closed set, so an enum rather than a trait object.
#[derive(Clone, Debug)]
enum Store {
    S3(S3Store),
    Local(LocalStore),
}

/// Storage configuration as it appears in the scheduler's and the worker's config files.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "backend", rename_all = "snake_case", deny_unknown_fields)]
pub enum StorageConfig {
    S3 {
        bucket: String,
        /// Custom endpoint (MinIO, s3s-fs); omit for AWS.
        #[serde(default)]
        endpoint: Option<String>,
        #[serde(default = "default_region")]
        region: String,
        /// Path-style addressing (`endpoint/bucket/key`), which MinIO and most S3 servers want.
        #[serde(default = "yes")]
        path_style: bool,
        /// Credentials; when absent, the AWS default chain (environment, profile) is used.
        #[serde(default)]
        access_key_id: Option<String>,
        #[serde(default)]
        secret_access_key: Option<String>,
        /// Create the bucket at start when it does not exist.
        #[serde(default)]
        create_bucket: bool,
        /// The endpoint browsers reach the bucket at, for presigned URLs, when it differs from
        /// `endpoint` (a MinIO behind an internal name). A presigned URL signs its host, so it is
        /// signed for this one. Omitted: `endpoint`.
        #[serde(default)]
        public_endpoint: Option<String>,
    },
    Local {
        root: PathBuf,
    },
}

// Field defaults rather than a variant-wide `#[serde(default)]`: `bucket` is required.
fn default_region() -> String {
    "us-east-1".into()
}
fn yes() -> bool {
    true
}

impl StorageConfig {
    /// Checks what can be checked without I/O; the error names the field.
    pub fn validate(&self, at: &str) -> Result<(), String> {
        match self {
            StorageConfig::S3 {
                bucket,
                endpoint,
                public_endpoint,
                access_key_id,
                secret_access_key,
                ..
            } => {
                if bucket.len() < 3 || bucket.len() > 63 {
                    return Err(format!("{at}.bucket: must be 3-63 characters"));
                }
                for (name, value) in [("endpoint", endpoint), ("public_endpoint", public_endpoint)]
                {
                    if let Some(e) = value
                        && !(e.starts_with("http://") || e.starts_with("https://"))
                    {
                        return Err(format!("{at}.{name}: must start with http:// or https://"));
                    }
                }
                if access_key_id.is_some() != secret_access_key.is_some() {
                    return Err(format!(
                        "{at}.secret_access_key: access_key_id and secret_access_key go together"
                    ));
                }
                Ok(())
            }
            StorageConfig::Local { root } => {
                if root.as_os_str().is_empty() {
                    return Err(format!("{at}.root: must not be empty"));
                }
                Ok(())
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("object {key} not found")]
    NotFound { key: String },
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    /// The store could not be reached or failed; worth retrying.
    #[error("storage unavailable during {op} {key}: {message}")]
    Unavailable {
        op: &'static str,
        key: String,
        message: String,
    },
}

impl Storage {
    /// Opens the store, with [`Retries::DEFAULT`].
    pub async fn open(config: &StorageConfig) -> Result<Self, StorageError> {
        let store = match config {
            StorageConfig::S3 { .. } => Store::S3(S3Store::open(config).await?),
            StorageConfig::Local { root } => Store::Local(LocalStore::open(root.clone()).await?),
        };
        Ok(Self {
            store,
            retries: Retries::DEFAULT,
        })
    }

    /// This store with another retry policy.
    pub fn with_retries(self, retries: Retries) -> Self {
        Self { retries, ..self }
    }

    pub async fn put(
        &self,
        key: &str,
        body: Bytes,
        content_type: &str,
    ) -> Result<(), StorageError> {
        check_key(key)?;
        self.retries
            .run("put", key, || async {
                match &self.store {
                    Store::S3(s) => s.put(key, body.clone(), content_type).await,
                    Store::Local(l) => l.put(key, body.clone()).await,
                }
            })
            .await
    }

    pub async fn get(&self, key: &str) -> Result<Bytes, StorageError> {
        check_key(key)?;
        self.retries
            .run("get", key, || async {
                match &self.store {
                    Store::S3(s) => s.get(key).await,
                    Store::Local(l) => l.get(key).await,
                }
            })
            .await
    }

    /// Uploads the file at `path` as `key`, read from disk as it is sent (a multipart upload for
    /// a large file on S3), so a file of any size never passes through memory; its size in bytes.
    pub async fn put_file(
        &self,
        key: &str,
        path: &Path,
        content_type: &str,
    ) -> Result<u64, StorageError> {
        check_key(key)?;
        let size = tokio::fs::metadata(path)
            .await
            .map_err(|e| io_unavailable("put", key, e))?
            .len();
        self.retries
            .run("put", key, || async {
                match &self.store {
                    Store::S3(s) => s.put_file(key, path, size, content_type).await,
                    Store::Local(l) => l.put_file(key, path).await,
                }
            })
            .await?;
        Ok(size)
    }

    /// The size in bytes of the object under `key`, `None` when there is none.
    pub async fn head(&self, key: &str) -> Result<Option<u64>, StorageError> {
        check_key(key)?;
        self.retries
            .run("head", key, || async {
                match &self.store {
                    Store::S3(s) => s.head(key).await,
                    Store::Local(l) => l.head(key).await,
                }
            })
            .await
    }

    /// Downloads `key` into the file at `path`, written as it arrives and resumed from what the
    /// file already holds: every attempt (a retry after a cut connection, or a later call after
    /// the retries ran out) reads on from the file's end with a ranged read. At most `limit + 1`
    /// bytes are kept, so that an object longer than the caller expects shows without filling the
    /// disk. Returns the file's length; checking the bytes is the caller's business.
    pub async fn get_into_file(
        &self,
        key: &str,
        path: &Path,
        limit: u64,
    ) -> Result<u64, StorageError> {
        check_key(key)?;
        self.retries
            .run("get", key, || async {
                let mut file = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .await
                    .map_err(|e| io_unavailable("get", key, e))?;
                let offset = file
                    .metadata()
                    .await
                    .map_err(|e| io_unavailable("get", key, e))?
                    .len();
                if offset > limit {
                    return Ok(offset);
                }
                let read = match &self.store {
                    Store::S3(s) => s.get_range_into(key, offset, limit, &mut file).await,
                    Store::Local(l) => l.get_range_into(key, offset, limit, &mut file).await,
                };
                // What arrived before a failure stays: the next attempt starts after it.
                let flushed = file
                    .sync_data()
                    .await
                    .map_err(|e| io_unavailable("get", key, e));
                let written = read?;
                flushed?;
                Ok(offset + written)
            })
            .await
    }

    /// Whether an object is stored under `key` (without reading it).
    pub async fn exists(&self, key: &str) -> Result<bool, StorageError> {
        check_key(key)?;
        self.retries
            .run("head", key, || async {
                match &self.store {
                    Store::S3(s) => s.exists(key).await,
                    Store::Local(l) => l.exists(key).await,
                }
            })
            .await
    }

    /// Where a browser can fetch `key` until `expires_in` has passed, without the farm's
    /// credentials: a presigned GET URL of the bucket, or `None` for a local directory (the
    /// scheduler serves those itself, see its API). Signing makes no request, so nothing is retried.
    pub async fn presigned_get(
        &self,
        key: &str,
        expires_in: std::time::Duration,
    ) -> Result<Option<String>, StorageError> {
        check_key(key)?;
        match &self.store {
            Store::S3(s) => s.presigned_get(key, expires_in).await.map(Some),
            Store::Local(_) => Ok(None),
        }
    }

    /// Keys under `prefix`, sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        let mut keys = self
            .retries
            .run("list", prefix, || async {
                match &self.store {
                    Store::S3(s) => s.list(prefix).await,
                    Store::Local(l) => l.list(prefix).await,
                }
            })
            .await?;
        keys.sort();
        Ok(keys)
    }

    /// Cheap reachability check (for readiness and start-up).
    pub async fn check(&self) -> Result<(), StorageError> {
        self.retries
            .run("check", "", || async {
                match &self.store {
                    Store::S3(s) => s.check().await,
                    Store::Local(l) => l.check().await,
                }
            })
            .await
    }

    /// A human-readable location, e.g. `s3://bucket` or `/var/lib/vnfarm`.
    pub fn describe(&self) -> String {
        match &self.store {
            Store::S3(s) => format!("s3://{}", s.bucket()),
            Store::Local(l) => l.root().display().to_string(),
        }
    }
}

/// Keys are relative, `/`-separated, with no empty, `.` or `..` segment: safe as paths and as S3 keys.
fn check_key(key: &str) -> Result<(), StorageError> {
    let bad = |reason| {
        Err(StorageError::InvalidKey {
            key: key.to_owned(),
            reason,
        })
    };
    if key.is_empty() || key.len() > 1024 {
        return bad("must be 1-1024 bytes");
    }
    if key
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return bad("has an empty, '.' or '..' segment");
    }
    if key.chars().any(|c| c.is_control() || c == '\\') {
        return bad("has a control character or backslash");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(check_key("results/a/0.png").is_ok());
        for bad in ["", "/abs", "a//b", "a/../b", "a/./b", "a\\b", "a/b/"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_file_goes_in_streamed_and_comes_back_resumed_from_what_arrived() {
        let dir = tempfile::tempdir().unwrap();
        let store = Storage::open(&StorageConfig::Local {
            root: dir.path().join("store"),
        })
        .await
        .unwrap();
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let source = dir.path().join("model.safetensors");
        std::fs::write(&source, &bytes).unwrap();
        let size = store
            .put_file("models/sha256/x", &source, "application/octet-stream")
            .await
            .unwrap();
        assert_eq!(size, 10_000);
        assert_eq!(store.head("models/sha256/x").await.unwrap(), Some(10_000));
        assert_eq!(store.head("models/sha256/y").await.unwrap(), None);

        // A download cut after 4000 bytes goes on from there.
        let part = dir.path().join("x.part");
        std::fs::write(&part, &bytes[..4000]).unwrap();
        let got = store
            .get_into_file("models/sha256/x", &part, 10_000)
            .await
            .unwrap();
        assert_eq!(got, 10_000);
        assert_eq!(std::fs::read(&part).unwrap(), bytes);
        // Whole already: nothing more is read.
        let again = store.get_into_file("models/sha256/x", &part, 10_000).await;
        assert_eq!(again.unwrap(), 10_000);

        // One byte past the limit shows a longer object; the rest is not read.
        let short = dir.path().join("short.part");
        let got = store
            .get_into_file("models/sha256/x", &short, 99)
            .await
            .unwrap();
        assert_eq!(got, 100);
        let missing = dir.path().join("missing.part");
        assert!(matches!(
            store.get_into_file("models/sha256/y", &missing, 99).await,
            Err(StorageError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn local_store_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let store = Storage::open(&StorageConfig::Local {
            root: dir.path().join("store"),
        })
        .await
        .unwrap();
        store
            .put("results/j/0.png", Bytes::from_static(b"one"), "image/png")
            .await
            .unwrap();
        store
            .put("results/j/0.png", Bytes::from_static(b"two"), "image/png")
            .await
            .unwrap();
        store
            .put(
                "results/j/manifest.json",
                Bytes::from_static(b"{}"),
                "application/json",
            )
            .await
            .unwrap();
        assert_eq!(
            store.get("results/j/0.png").await.unwrap(),
            Bytes::from_static(b"two")
        );
        assert_eq!(
            store.list("results/j/").await.unwrap(),
            ["results/j/0.png", "results/j/manifest.json"]
        );
        assert!(matches!(
            store.get("results/j/1.png").await,
            Err(StorageError::NotFound { .. })
        ));
        assert!(matches!(
            store.get("../x").await,
            Err(StorageError::InvalidKey { .. })
        ));
    }
}
