//! The worker's model cache (DESIGN §7b): files of the model catalogue, fetched from the bucket
//! into a directory bounded in bytes, for the jobs that name them.
//!
//! What holds, and where it is kept:
//! - `dir/<sha256>` exists only with bytes that were verified against that hash: a fetch writes
//!   `dir/<sha256>.part` as the bytes arrive (resumed with ranged reads after a cut, see
//!   `Storage::get_into_file`), checks its length, its safetensors header and its sha256, and only
//!   then renames it into place.
//! - A file in use is never evicted: a job holds a [`Pinned`] guard for each file it uses until it
//!   is settled; a fetch that needs room removes the least recently used unpinned files, and fails
//!   when the pinned ones leave too little.
//! - One fetch per file however many jobs wait for it: fetches of one hash take turns on its lock,
//!   and each looks again once the lock is its own.
//! - A bad file (hash mismatch, shorter or longer than its entry, not a safetensors file, or one
//!   the engine could not use: [`ModelCache::condemn`]) is deleted, never cached, and remembered
//!   for the process's life, so the same hash fails at once after without a fetch and never
//!   reaches the engine twice.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Deserialize;
use vnfarm_proto::ModelFileRole;
use vnfarm_proto::catalogue::{ContentHash, ModelRef, blob_key};
use vnfarm_storage::{
    Catalogue, CatalogueError, HashError, Storage, StorageError, hash_safetensors,
};

/// The `[model_cache]` section of the worker's configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ModelCacheConfig {
    /// Where fetched catalogue files are kept (`<sha256>`, and `<sha256>.part` while one arrives).
    pub dir: PathBuf,
    /// The most bytes its files may take together.
    pub max_bytes: u64,
}

impl Default for ModelCacheConfig {
    fn default() -> Self {
        Self {
            dir: "vnfarm-models".into(),
            max_bytes: 100 << 30,
        }
    }
}

impl ModelCacheConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.dir.as_os_str().is_empty() {
            return Err("model_cache.dir: must not be empty".into());
        }
        if self.max_bytes == 0 {
            return Err("model_cache.max_bytes: must be at least 1".into());
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelCacheError {
    /// Neither a catalogue name nor a stored hash.
    #[error("`{0}` is not in the model catalogue")]
    Unknown(String),
    /// The file failed its checks (now or before): a permanent failure of the jobs naming it.
    #[error("model file sha256:{sha256} is bad: {reason}")]
    Bad { sha256: ContentHash, reason: String },
    #[error(
        "model file sha256:{sha256} ({size} bytes) does not fit in the model cache \
         (model_cache.max_bytes {max_bytes}, {pinned} bytes of it in use)"
    )]
    NoRoom {
        sha256: ContentHash,
        size: u64,
        max_bytes: u64,
        pinned: u64,
    },
    /// The name's entry is a file of another role than the job uses it as.
    #[error("`{name}` is a {} in the model catalogue, not a {}", role.as_str(), wanted.as_str())]
    WrongRole {
        name: String,
        role: ModelFileRole,
        wanted: ModelFileRole,
    },
    #[error(transparent)]
    Storage(StorageError),
    /// The catalogue's entry does not decode, or the cache's directory failed.
    #[error("model cache: {0}")]
    Failed(String),
}

/// A file of the cache held for a job: not evicted while this lives.
#[derive(Debug)]
pub struct Pinned {
    cache: ModelCache,
    sha256: ContentHash,
    path: PathBuf,
}

impl Pinned {
    pub fn sha256(&self) -> &ContentHash {
        &self.sha256
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut state = self.cache.state();
        let Some(held) = state.files.get_mut(&self.sha256) else {
            return;
        };
        held.pins = held.pins.saturating_sub(1);
        let unused = held.pins == 0;
        if unused && state.bad.contains_key(&self.sha256) {
            state.files.remove(&self.sha256);
            drop(state);
            self.cache.remove_file(&self.path);
        }
    }
}

#[derive(Clone, Debug)]
pub struct ModelCache(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    max_bytes: u64,
    storage: Storage,
    catalogue: Catalogue,
    state: Mutex<State>,
    /// One lock per hash being fetched: the fetch and the jobs waiting for it.
    fetches: Mutex<HashMap<ContentHash, Arc<tokio::sync::Mutex<()>>>>,
    /// Downloads begun.
    downloads: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    files: HashMap<ContentHash, Held>,
    /// Bytes promised to fetches under way.
    reserved: u64,
    /// Ticks on every use: the order of least recent use.
    clock: u64,
    /// Hashes that failed their checks, with why.
    bad: HashMap<ContentHash, String>,
}

#[derive(Debug)]
struct Held {
    size: u64,
    used: u64,
    pins: u32,
}

impl ModelCache {
    /// The cache in `config.dir` (created), holding the verified files already there (least
    /// recently modified first), trimmed to the budget. Partial downloads are kept to resume.
    pub fn open(config: &ModelCacheConfig, storage: Storage) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        std::fs::create_dir_all(&config.dir)
            .with_context(|| format!("creating model_cache.dir {}", config.dir.display()))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&config.dir)
            .with_context(|| format!("reading model_cache.dir {}", config.dir.display()))?
        {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(sha256) = ContentHash::try_from(name) else {
                continue;
            };
            let meta = entry.metadata()?;
            found.push((meta.modified().ok(), sha256, meta.len()));
        }
        found.sort();
        let mut state = State::default();
        for (_, sha256, size) in found {
            state.clock += 1;
            let used = state.clock;
            state.files.insert(
                sha256,
                Held {
                    size,
                    used,
                    pins: 0,
                },
            );
        }
        let cache = Self(Arc::new(Inner {
            dir: config.dir.clone(),
            max_bytes: config.max_bytes,
            catalogue: Catalogue::new(storage.clone()),
            storage,
            state: Mutex::new(state),
            fetches: Mutex::default(),
            downloads: AtomicU64::new(0),
        }));
        let evicted = make_room(&mut cache.state(), &cache.0.dir, cache.0.max_bytes);
        cache.remove_all(evicted);
        Ok(cache)
    }

    /// The file a job names (a catalogue name, or `sha256:<hex>`) as a file of `role`: a name
    /// whose entry has another role is refused before anything is fetched (a LoRA handed to the
    /// engine as a checkpoint would fail there and be condemned for it). A `sha256:` reference
    /// names no role.
    pub async fn fetch_as(
        &self,
        reference: &str,
        role: ModelFileRole,
    ) -> Result<Pinned, ModelCacheError> {
        self.fetch_checked(reference, Some(role)).await
    }

    /// The file a job names (a catalogue name, or `sha256:<hex>`), fetched unless it is here,
    /// pinned for the job.
    pub async fn fetch(&self, reference: &str) -> Result<Pinned, ModelCacheError> {
        self.fetch_checked(reference, None).await
    }

    async fn fetch_checked(
        &self,
        reference: &str,
        role: Option<ModelFileRole>,
    ) -> Result<Pinned, ModelCacheError> {
        let unknown = || ModelCacheError::Unknown(reference.to_owned());
        let (sha256, size) = match ModelRef::parse(reference).ok_or_else(unknown)? {
            ModelRef::Hash(sha256) => {
                if let Some(pinned) = self.pin_if_held(&sha256)? {
                    return Ok(pinned);
                }
                let size = self
                    .0
                    .storage
                    .head(&blob_key(&sha256))
                    .await
                    .map_err(ModelCacheError::Storage)?
                    .ok_or_else(unknown)?;
                (sha256, size)
            }
            ModelRef::Name(name) => {
                let entry = match self.0.catalogue.entry(&name).await {
                    Ok(Some(entry)) => entry,
                    Ok(None) => return Err(unknown()),
                    Err(CatalogueError::Storage(e)) => return Err(ModelCacheError::Storage(e)),
                    Err(e) => return Err(ModelCacheError::Failed(e.to_string())),
                };
                if let Some(wanted) = role.filter(|r| *r != entry.role) {
                    return Err(ModelCacheError::WrongRole {
                        name,
                        role: entry.role,
                        wanted,
                    });
                }
                (entry.sha256, entry.size)
            }
        };
        self.get(&sha256, size).await
    }

    /// The file with this hash and size, fetched unless it is here, pinned.
    pub async fn get(&self, sha256: &ContentHash, size: u64) -> Result<Pinned, ModelCacheError> {
        if let Some(pinned) = self.pin_if_held(sha256)? {
            return Ok(pinned);
        }
        let turn = self.fetches().entry(sha256.clone()).or_default().clone();
        let fetched = {
            let _turn = turn.lock().await;
            match self.pin_if_held(sha256) {
                Ok(Some(pinned)) => Ok(pinned),
                Ok(None) => self.download(sha256, size).await,
                Err(e) => Err(e),
            }
        };
        let mut fetches = self.fetches();
        // Waiters hold clones (taken under this map's lock): the lock goes with the last of them.
        if fetches.get(sha256).is_some_and(|t| Arc::ptr_eq(t, &turn))
            && Arc::strong_count(&turn) <= 2
        {
            fetches.remove(sha256);
        }
        fetched
    }

    /// Marks a held file bad (the engine could not use it): it is removed once no job holds it,
    /// and the hash fails at once from now on.
    pub fn condemn(&self, sha256: &ContentHash, reason: String) {
        tracing::warn!(sha256 = %sha256, reason, "model file condemned; removing it from the cache");
        let mut state = self.state();
        state.bad.insert(sha256.clone(), reason);
        if state.files.get(sha256).is_some_and(|h| h.pins == 0) {
            state.files.remove(sha256);
            drop(state);
            self.remove_file(&self.path_of(sha256));
        }
    }

    /// The hashes of the files held, least recently used first (for the heartbeat).
    pub fn hashes(&self) -> Vec<String> {
        let state = self.state();
        let mut files: Vec<(&ContentHash, u64)> =
            state.files.iter().map(|(h, held)| (h, held.used)).collect();
        files.sort_by_key(|&(_, used)| used);
        files.into_iter().map(|(h, _)| h.to_string()).collect()
    }

    /// Downloads begun since the cache opened.
    pub fn downloads(&self) -> u64 {
        self.0.downloads.load(Ordering::Relaxed)
    }

    /// Bytes the held files take.
    pub fn bytes(&self) -> u64 {
        self.state().files.values().map(|h| h.size).sum()
    }

    fn path_of(&self, sha256: &ContentHash) -> PathBuf {
        self.0.dir.join(sha256.as_str())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section only moves numbers and map entries; a panic in one cannot leave
        // the state half-changed, so a poisoned lock is still sound.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fetches(&self) -> MutexGuard<'_, HashMap<ContentHash, Arc<tokio::sync::Mutex<()>>>> {
        self.0.fetches.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pin on the file when it is here; its remembered failure when it is bad.
    fn pin_if_held(&self, sha256: &ContentHash) -> Result<Option<Pinned>, ModelCacheError> {
        let mut state = self.state();
        if let Some(reason) = state.bad.get(sha256) {
            return Err(ModelCacheError::Bad {
                sha256: sha256.clone(),
                reason: reason.clone(),
            });
        }
        state.clock += 1;
        let now = state.clock;
        let Some(held) = state.files.get_mut(sha256) else {
            return Ok(None);
        };
        held.used = now;
        held.pins += 1;
        Ok(Some(Pinned {
            cache: self.clone(),
            sha256: sha256.clone(),
            path: self.path_of(sha256),
        }))
    }

    /// Fetches, checks and keeps the file; called in the hash's turn.
    async fn download(&self, sha256: &ContentHash, size: u64) -> Result<Pinned, ModelCacheError> {
        let evicted = {
            let mut state = self.state();
            let pinned: u64 = state
                .files
                .values()
                .filter(|h| h.pins > 0)
                .map(|h| h.size)
                .sum();
            if pinned + state.reserved + size > self.0.max_bytes {
                return Err(ModelCacheError::NoRoom {
                    sha256: sha256.clone(),
                    size,
                    max_bytes: self.0.max_bytes,
                    pinned: pinned + state.reserved,
                });
            }
            state.reserved += size;
            make_room(&mut state, &self.0.dir, self.0.max_bytes)
        };
        self.remove_all(evicted);
        let part = self.0.dir.join(format!("{sha256}.part"));
        self.0.downloads.fetch_add(1, Ordering::Relaxed);
        tracing::info!(sha256 = %sha256, size, "fetching a model file from the catalogue");
        let fetched = self
            .0
            .storage
            .get_into_file(&blob_key(sha256), &part, size)
            .await;
        let checked = match fetched {
            // A cut connection after the retries: the part stays, the next fetch resumes it.
            Err(e) => Err(ModelCacheError::Storage(e)),
            Ok(got) => {
                let (expected, part) = (sha256.clone(), part.clone());
                tokio::task::spawn_blocking(move || check(&part, &expected, size, got))
                    .await
                    .unwrap_or_else(|e| Err(format!("the check panicked: {e}")))
                    .map_err(|reason| ModelCacheError::Bad {
                        sha256: sha256.clone(),
                        reason,
                    })
            }
        };
        let kept = match checked {
            Ok(()) => std::fs::rename(&part, self.path_of(sha256))
                .map_err(|e| ModelCacheError::Failed(format!("keeping {}: {e}", part.display()))),
            Err(e) => Err(e),
        };
        let mut state = self.state();
        state.reserved -= size;
        match kept {
            Ok(()) => {
                state.files.insert(
                    sha256.clone(),
                    Held {
                        size,
                        used: 0,
                        pins: 0,
                    },
                );
                drop(state);
                Ok(self
                    .pin_if_held(sha256)?
                    .expect("the file was inserted under the state lock just now"))
            }
            Err(ModelCacheError::Bad { sha256, reason }) => {
                tracing::warn!(sha256 = %sha256, reason, "a fetched model file is bad; not keeping it");
                state.bad.insert(sha256.clone(), reason.clone());
                drop(state);
                self.remove_file(&part);
                Err(ModelCacheError::Bad { sha256, reason })
            }
            Err(e) => Err(e),
        }
    }

    fn remove_all(&self, paths: Vec<PathBuf>) {
        for path in paths {
            self.remove_file(&path);
        }
    }

    fn remove_file(&self, path: &Path) {
        if let Err(e) = std::fs::remove_file(path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a model cache file");
        }
    }
}

/// Takes the least recently used unpinned files out of the books until the held and reserved
/// bytes fit in `max_bytes` (or nothing unpinned is left); the caller deletes the returned paths
/// once the lock is released.
fn make_room(state: &mut State, dir: &Path, max_bytes: u64) -> Vec<PathBuf> {
    let mut order: Vec<(u64, ContentHash)> = state
        .files
        .iter()
        .filter(|(_, h)| h.pins == 0)
        .map(|(sha, h)| (h.used, sha.clone()))
        .collect();
    order.sort();
    let mut held: u64 = state.files.values().map(|h| h.size).sum();
    let mut evicted = Vec::new();
    for (_, sha256) in order {
        if held + state.reserved <= max_bytes {
            break;
        }
        let size = state.files.remove(&sha256).map_or(0, |h| h.size);
        held -= size;
        tracing::info!(sha256 = %sha256, size, "evicting a model file from the cache");
        evicted.push(dir.join(sha256.as_str()));
    }
    evicted
}

/// Why a downloaded file of `got` bytes is not the catalogue's `size` bytes hashing to
/// `expected`, if it is not.
fn check(part: &Path, expected: &ContentHash, size: u64, got: u64) -> Result<(), String> {
    if got < size {
        return Err(format!(
            "truncated: the stored object has {got} of its {size} bytes"
        ));
    }
    if got > size {
        return Err(format!(
            "the stored object is longer than the catalogue's {size} bytes"
        ));
    }
    let (actual, _) = hash_safetensors(part).map_err(|e| match e {
        HashError::Io(e) => format!("reading {}: {e}", part.display()),
        HashError::NotSafetensors => "not a safetensors file".into(),
    })?;
    if actual != *expected {
        return Err(format!("its bytes hash to {actual}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use vnfarm_proto::ModelFileRole;
    use vnfarm_proto::catalogue::{CatalogueEntry, entry_key};
    use vnfarm_storage::StorageConfig;

    use sha2::{Digest as _, Sha256};

    use super::*;

    /// A safetensors file of `n` bytes in all, its data bytes from `seed`.
    fn weights(n: usize, seed: u8) -> Vec<u8> {
        let mut file = 8u64.to_le_bytes().to_vec();
        file.extend_from_slice(b"{}      ");
        file.extend((0..n - 16).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
        file
    }

    fn sha(bytes: &[u8]) -> ContentHash {
        ContentHash::try_from(hex::encode(Sha256::digest(bytes))).unwrap()
    }

    struct Setup {
        dir: tempfile::TempDir,
        storage: Storage,
    }

    impl Setup {
        async fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let storage = Storage::open(&StorageConfig::Local {
                root: dir.path().join("bucket"),
            })
            .await
            .unwrap();
            Self { dir, storage }
        }

        fn cache(&self, max_bytes: u64) -> ModelCache {
            let config = ModelCacheConfig {
                dir: self.dir.path().join("cache"),
                max_bytes,
            };
            ModelCache::open(&config, self.storage.clone()).unwrap()
        }

        /// Names `bytes` `name` in the catalogue, claiming `size` and `sha256`, and stores `blob`
        /// under that hash.
        async fn name(&self, name: &str, sha256: &ContentHash, size: u64, blob: &[u8]) {
            let entry = CatalogueEntry {
                name: name.into(),
                sha256: sha256.clone(),
                role: ModelFileRole::Lora,
                size,
                added: chrono::Utc::now(),
            };
            self.storage
                .put(
                    &entry_key(name),
                    Bytes::from(serde_json::to_vec(&entry).unwrap()),
                    "application/json",
                )
                .await
                .unwrap();
            self.storage
                .put(&blob_key(sha256), Bytes::from(blob.to_vec()), "x")
                .await
                .unwrap();
        }

        /// A good file of `n` bytes under `name`; its hash.
        async fn push(&self, name: &str, n: usize, seed: u8) -> ContentHash {
            let bytes = weights(n, seed);
            let hash = sha(&bytes);
            self.name(name, &hash, n as u64, &bytes).await;
            hash
        }

        fn cached(&self) -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(self.dir.path().join("cache"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    #[tokio::test]
    async fn the_byte_budget_evicts_the_least_recently_used_file() {
        let s = Setup::new().await;
        let (a, b, c) = (
            s.push("a", 1000, 1).await,
            s.push("b", 1000, 2).await,
            s.push("c", 1000, 3).await,
        );
        let cache = s.cache(2500);
        let pinned = cache.fetch("a").await.unwrap();
        assert_eq!(std::fs::read(pinned.path()).unwrap(), weights(1000, 1));
        drop(pinned);
        drop(cache.fetch("b").await.unwrap());
        // `a` used again: `b` is now the least recently used.
        drop(cache.fetch("a").await.unwrap());
        drop(cache.fetch("c").await.unwrap());
        assert_eq!(cache.hashes(), [a.to_string(), c.to_string()]);
        assert_eq!(cache.bytes(), 2000);
        let mut on_disk = vec![a.to_string(), c.to_string()];
        on_disk.sort();
        assert_eq!(s.cached(), on_disk);
        assert_eq!(cache.downloads(), 3);

        // A worker restarted finds its files and needs no download for them.
        drop(cache);
        let again = s.cache(2500);
        let hashes: std::collections::BTreeSet<String> = again.hashes().into_iter().collect();
        assert_eq!(hashes, [a.to_string(), c.to_string()].into());
        drop(again.fetch(&format!("sha256:{c}")).await.unwrap());
        assert_eq!(again.downloads(), 0);
        // By hash, a file no name points at any more.
        drop(again.fetch(&format!("sha256:{b}")).await.unwrap());
        assert_eq!(again.downloads(), 1);
    }

    #[tokio::test]
    async fn a_pinned_file_survives_eviction_and_a_full_cache_refuses_clearly() {
        let s = Setup::new().await;
        let a = s.push("a", 1000, 1).await;
        s.push("b", 1000, 2).await;
        let c = s.push("c", 1000, 3).await;
        let cache = s.cache(2000);
        let in_use = cache.fetch("a").await.unwrap();
        drop(cache.fetch("b").await.unwrap());
        let held_c = cache.fetch("c").await.unwrap();
        assert_eq!(cache.hashes(), [a.to_string(), c.to_string()]);
        assert!(in_use.path().is_file(), "the pinned file is still there");
        // Both held: no room for a third.
        let full = cache.fetch("b").await;
        assert!(
            matches!(&full, Err(ModelCacheError::NoRoom { pinned: 2000, .. })),
            "{full:?}"
        );
        drop(held_c);
        drop(cache.fetch("b").await.unwrap());
        assert!(in_use.path().is_file());
        let huge = s.push("huge", 3000, 4).await;
        let too_big = cache.fetch("huge").await;
        assert!(
            matches!(&too_big, Err(ModelCacheError::NoRoom { sha256, .. }) if *sha256 == huge),
            "{too_big:?}"
        );
        assert!(matches!(
            cache.fetch("nothing").await,
            Err(ModelCacheError::Unknown(_))
        ));
        assert!(matches!(
            cache.fetch("sha256:0123").await,
            Err(ModelCacheError::Unknown(_))
        ));
    }

    #[tokio::test]
    async fn a_cut_download_resumes_from_what_arrived() {
        let s = Setup::new().await;
        let bytes = weights(10_000, 5);
        let hash = sha(&bytes);
        // The first 4000 bytes arrived before the cut; the store's copy of them is then spoilt,
        // so only a fetch that reads on from byte 4000 ends with the right hash.
        let mut spoilt = bytes.clone();
        spoilt[100..4000].fill(0);
        s.name("big", &hash, 10_000, &spoilt).await;
        let cache = s.cache(1 << 20);
        std::fs::write(
            s.dir.path().join("cache").join(format!("{hash}.part")),
            &bytes[..4000],
        )
        .unwrap();
        let pinned = cache.fetch("big").await.unwrap();
        assert_eq!(std::fs::read(pinned.path()).unwrap(), bytes);
        assert_eq!(s.cached(), [hash.to_string()]);
    }

    #[tokio::test]
    async fn bad_files_fail_clearly_are_not_kept_and_are_not_fetched_again() {
        let s = Setup::new().await;
        let good = weights(1000, 1);
        // The entry's hash is not the stored bytes'.
        let claimed = sha(b"something else");
        s.name("mismatch", &claimed, 1000, &good).await;
        // Fewer bytes stored than the entry says.
        let truncated = sha(&good);
        s.name("truncated", &truncated, 1000, &good[..600]).await;
        // The right hash, but not a safetensors file.
        let zip = b"PK\x03\x04 an archive, not weights".to_vec();
        let zip_hash = sha(&zip);
        s.name("zip", &zip_hash, zip.len() as u64, &zip).await;
        let cache = s.cache(1 << 20);

        for (name, hash, why) in [
            ("mismatch", &claimed, "hash to"),
            ("truncated", &truncated, "truncated"),
            ("zip", &zip_hash, "not a safetensors file"),
        ] {
            let failed = cache.fetch(name).await;
            assert!(
                matches!(&failed, Err(ModelCacheError::Bad { sha256, reason }) if sha256 == hash && reason.contains(why)),
                "{name}: {failed:?}"
            );
        }
        assert!(s.cached().is_empty(), "{:?}", s.cached());
        assert_eq!(cache.downloads(), 3);
        // Fixed in the bucket, the same hash still fails here at once, without a fetch.
        s.name("mismatch", &claimed, 1000, &good).await;
        let again = cache.fetch("mismatch").await;
        assert!(
            matches!(again, Err(ModelCacheError::Bad { .. })),
            "{again:?}"
        );
        assert_eq!(cache.downloads(), 3);

        // A file the engine refused is removed when its job lets go, and fails from then on.
        let used = s.push("unusable", 1000, 9).await;
        let pinned = cache.fetch("unusable").await.unwrap();
        cache.condemn(&used, "matches no module".into());
        assert!(pinned.path().is_file(), "not while the job holds it");
        let path = pinned.path().to_owned();
        drop(pinned);
        assert!(!path.exists());
        assert!(matches!(
            cache.fetch("unusable").await,
            Err(ModelCacheError::Bad { .. })
        ));
        assert!(cache.hashes().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn jobs_waiting_for_one_file_share_one_fetch() {
        let s = Setup::new().await;
        let hash = s.push("shared", 200_000, 7).await;
        let cache = s.cache(1 << 20);
        let waiting: Vec<_> = (0..8)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move { cache.fetch("shared").await })
            })
            .collect();
        let mut pins = Vec::new();
        for waiter in waiting {
            pins.push(waiter.await.unwrap().unwrap());
        }
        assert!(pins.iter().all(|p| *p.sha256() == hash));
        assert_eq!(cache.downloads(), 1);
        assert!(
            cache.fetches().is_empty(),
            "the turn went with the last waiter"
        );
    }
}
