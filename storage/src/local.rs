//! A directory as an object store. Writes go to a temporary file renamed into place, so a reader
//! never sees half an object and a re-run replaces the old one atomically.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};

use crate::StorageError;

#[derive(Clone, Debug)]
pub struct LocalStore {
    root: PathBuf,
}

pub(crate) fn unavailable(op: &'static str, key: &str, e: std::io::Error) -> StorageError {
    StorageError::Unavailable {
        op,
        key: key.to_owned(),
        message: e.to_string(),
    }
}

impl LocalStore {
    pub async fn open(root: PathBuf) -> Result<Self, StorageError> {
        tokio::fs::create_dir_all(&root)
            .await
            .map_err(|e| unavailable("open", &root.display().to_string(), e))?;
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), StorageError> {
        let path = self.root.join(key);
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| unavailable("put", key, e))?;
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        tokio::fs::write(&tmp, &body)
            .await
            .map_err(|e| unavailable("put", key, e))?;
        tokio::fs::rename(&tmp, &path)
            .await
            .map_err(|e| unavailable("put", key, e))
    }

    /// Copies the file at `path` in as `key` (streamed by the kernel, renamed into place whole).
    pub async fn put_file(&self, key: &str, path: &Path) -> Result<(), StorageError> {
        let target = self.root.join(key);
        if let Some(dir) = target.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| unavailable("put", key, e))?;
        }
        let tmp = target.with_extension(format!("tmp-{}", std::process::id()));
        tokio::fs::copy(path, &tmp)
            .await
            .map_err(|e| unavailable("put", key, e))?;
        tokio::fs::rename(&tmp, &target)
            .await
            .map_err(|e| unavailable("put", key, e))
    }

    pub async fn head(&self, key: &str) -> Result<Option<u64>, StorageError> {
        match tokio::fs::metadata(self.root.join(key)).await {
            Ok(meta) if meta.is_file() => Ok(Some(meta.len())),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(unavailable("head", key, e)),
        }
    }

    /// Appends bytes `offset..=last` of `key` (fewer where it is shorter) to `file`; the bytes
    /// written.
    pub async fn get_range_into(
        &self,
        key: &str,
        offset: u64,
        last: u64,
        file: &mut tokio::fs::File,
    ) -> Result<u64, StorageError> {
        let mut source = match tokio::fs::File::open(self.root.join(key)).await {
            Ok(source) => source,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StorageError::NotFound {
                    key: key.to_owned(),
                });
            }
            Err(e) => return Err(unavailable("get", key, e)),
        };
        source
            .seek(std::io::SeekFrom::Start(offset))
            .await
            .map_err(|e| unavailable("get", key, e))?;
        let wanted = (last + 1).saturating_sub(offset);
        tokio::io::copy(&mut source.take(wanted), file)
            .await
            .map_err(|e| unavailable("get", key, e))
    }

    pub async fn get(&self, key: &str) -> Result<Bytes, StorageError> {
        match tokio::fs::read(self.root.join(key)).await {
            Ok(data) => Ok(Bytes::from(data)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(StorageError::NotFound {
                key: key.to_owned(),
            }),
            Err(e) => Err(unavailable("get", key, e)),
        }
    }

    pub async fn exists(&self, key: &str) -> Result<bool, StorageError> {
        match tokio::fs::metadata(self.root.join(key)).await {
            Ok(meta) => Ok(meta.is_file()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(unavailable("head", key, e)),
        }
    }

    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        let mut keys = Vec::new();
        let mut dirs = vec![self.root.clone()];
        while let Some(dir) = dirs.pop() {
            let mut entries = match tokio::fs::read_dir(&dir).await {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(unavailable("list", prefix, e)),
            };
            while let Some(entry) = entries
                .next_entry()
                .await
                .map_err(|e| unavailable("list", prefix, e))?
            {
                let path = entry.path();
                if entry
                    .file_type()
                    .await
                    .map_err(|e| unavailable("list", prefix, e))?
                    .is_dir()
                {
                    dirs.push(path);
                    continue;
                }
                let Ok(rel) = path.strip_prefix(&self.root) else {
                    continue;
                };
                let key = rel
                    .to_string_lossy()
                    .replace(std::path::MAIN_SEPARATOR, "/");
                if key.starts_with(prefix) && !key.contains(".tmp-") {
                    keys.push(key);
                }
            }
        }
        Ok(keys)
    }

    pub async fn check(&self) -> Result<(), StorageError> {
        tokio::fs::metadata(&self.root)
            .await
            .map(|_| ())
            .map_err(|e| unavailable("check", "", e))
    }
}
