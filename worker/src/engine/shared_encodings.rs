//! Encodings shared between workers through storage: the fleet's second tier behind each worker's
//! encode cache.
//!
//! A worker that encodes an edit's inputs publishes the encodings (a few MiB: the VAE latents and
//! the vision tower's features of a 1024² input) under
//! `encodings/<model>/<fingerprint>/<sha256 of the cache key>`; a worker that misses in its own
//! cache fetches them from there before it encodes. So an edit that runs away from its input's
//! holder (the holder was busy past the affinity bound, a hot input spilled, a job was yielded or
//! redelivered after a crash) costs a small read instead of an encode, and the fleet encodes each
//! input about once.
//!
//! - **Fingerprint**: each engine hashes what determines its encodings (the encoder weights, by
//!   sampled content, and the settings that change them), so workers of another model, dtype or
//!   resize area never read each other's encodings.
//! - **Never in the way**: a fetch is bounded (`fetch_timeout_ms`), a publish runs in the
//!   background while the edit denoises; a missing, slow, unreachable or damaged object only means
//!   the worker encodes itself (logged and counted), never a failed job.
//! - **Lifetime**: objects are not deleted by the worker; the bucket's lifecycle rule expires the
//!   `encodings/` prefix (deploy/README.md).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use prometheus::IntCounterVec;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use vnfarm_storage::{Storage, StorageError};

/// The worker's `[shared_encodings]` table; a key left out is [`SharedEncodingsConfig::default`]'s.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SharedEncodingsConfig {
    /// Publish and fetch encodings through storage. Off, each worker encodes what its own cache
    /// misses.
    pub enabled: bool,
    /// The longest a fetch may take before the worker encodes the inputs itself.
    pub fetch_timeout_ms: u64,
}

impl Default for SharedEncodingsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            fetch_timeout_ms: 2_000,
        }
    }
}

impl SharedEncodingsConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(10..=60_000).contains(&self.fetch_timeout_ms) {
            return Err("shared_encodings.fetch_timeout_ms: must be 10..=60000".into());
        }
        Ok(())
    }
}

/// Storage and the runtime to reach it from the engine thread, before an engine names its model.
/// The engine starts loading before the worker has opened storage, which is attached afterwards
/// ([`SharedEncodings::attach`]); jobs come only after that.
#[derive(Clone)]
pub struct SharedEncodings {
    storage: Arc<OnceLock<Storage>>,
    runtime: tokio::runtime::Handle,
    fetch_timeout: Duration,
    /// `vnfarm_worker_shared_encodings_total{op, result}`.
    counter: IntCounterVec,
}

/// What a fetch found.
#[derive(Debug)]
pub enum Fetched {
    Found(Bytes),
    /// Nobody published these encodings (yet).
    Missing,
    /// Storage failed or was too slow; the reason is logged.
    Failed,
}

impl SharedEncodings {
    pub fn new(
        config: &SharedEncodingsConfig,
        runtime: tokio::runtime::Handle,
        counter: IntCounterVec,
    ) -> Option<Self> {
        config.enabled.then(|| Self {
            storage: Arc::default(),
            runtime,
            fetch_timeout: Duration::from_millis(config.fetch_timeout_ms),
            counter,
        })
    }

    /// The worker's storage, once it is open.
    pub fn attach(&self, storage: Storage) {
        // A second call (none is made) would keep the first storage.
        let _ = self.storage.set(storage);
    }

    /// The store of one engine's encodings: `model` names the engine, `fingerprint` what its
    /// encodings depend on.
    pub fn for_model(&self, model: &str, fingerprint: &str) -> SharedStore {
        SharedStore {
            shared: self.clone(),
            prefix: format!("encodings/{model}/{fingerprint}/"),
        }
    }
}

/// One engine's shared encodings (see the module's note).
#[derive(Clone)]
pub struct SharedStore {
    shared: SharedEncodings,
    prefix: String,
}

/// Hex sha256.
pub fn hex_sha256(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    hex::encode(h.finalize())
}

impl SharedStore {
    fn object(&self, key: &str) -> String {
        format!("{}{}", self.prefix, hex_sha256(&[key.as_bytes()]))
    }

    fn count(&self, op: &str, result: &str) {
        self.shared.counter.with_label_values(&[op, result]).inc();
    }

    /// The encodings published under `key`, waiting at most the fetch timeout. Blocking: called
    /// from the engine thread, never from the runtime's.
    pub fn fetch(&self, key: &str) -> Fetched {
        let object = self.object(key);
        // Not attached yet: no job runs before the worker has opened storage, so this is only a
        // formality.
        let Some(storage) = self.shared.storage.get().cloned() else {
            return Fetched::Missing;
        };
        let timeout = self.shared.fetch_timeout;
        let read = {
            let object = object.clone();
            // The timer is made inside `block_on`, where the runtime's context is entered.
            async move { tokio::time::timeout(timeout, storage.get(&object)).await }
        };
        let found = self.shared.runtime.block_on(read);
        match found {
            Ok(Ok(bytes)) => {
                self.count("fetch", "found");
                Fetched::Found(bytes)
            }
            Ok(Err(StorageError::NotFound { .. })) => {
                self.count("fetch", "missing");
                Fetched::Missing
            }
            Ok(Err(e)) => {
                tracing::warn!(%object, error = %e, "fetching shared encodings failed; encoding here");
                self.count("fetch", "error");
                Fetched::Failed
            }
            Err(_) => {
                tracing::warn!(
                    %object,
                    timeout_ms = self.shared.fetch_timeout.as_millis() as u64,
                    "fetching shared encodings timed out; encoding here"
                );
                self.count("fetch", "timeout");
                Fetched::Failed
            }
        }
    }

    /// Counts fetched bytes the engine could not use (damaged, or not this model's); it encodes and
    /// publishes over them.
    pub fn unusable(&self, key: &str, reason: &str) {
        tracing::warn!(object = %self.object(key), reason, "shared encodings unusable; encoding here");
        self.count("fetch", "invalid");
    }

    /// Publishes encodings in the background; a failure is logged and counted, nothing waits.
    pub fn publish(&self, key: &str, bytes: Vec<u8>) {
        let object = self.object(key);
        let Some(storage) = self.shared.storage.get().cloned() else {
            return;
        };
        let this = self.clone();
        self.shared.runtime.spawn(async move {
            let stored = storage
                .put(&object, Bytes::from(bytes), "application/octet-stream")
                .await;
            match stored {
                Ok(()) => this.count("publish", "ok"),
                Err(e) => {
                    tracing::warn!(%object, error = %e, "publishing shared encodings failed");
                    this.count("publish", "error");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// From a thread outside the runtime, as the engine's: nothing published is missing, what is
    /// published is found byte for byte, and another model's prefix does not see it.
    #[test]
    fn published_encodings_are_fetched_from_the_engine_thread() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = runtime
            .block_on(Storage::open(&vnfarm_storage::StorageConfig::Local {
                root: dir.path().to_path_buf(),
            }))
            .unwrap();
        let counter =
            IntCounterVec::new(prometheus::Opts::new("shared", "test"), &["op", "result"]).unwrap();
        let shared = SharedEncodings::new(
            &SharedEncodingsConfig::default(),
            runtime.handle().clone(),
            counter.clone(),
        )
        .expect("enabled by default");
        shared.attach(storage);
        let store = shared.for_model("qwen_edit", "f1");
        let other = shared.for_model("qwen_edit", "f2");
        std::thread::spawn(move || {
            assert!(matches!(store.fetch("k"), Fetched::Missing));
            store.publish("k", vec![7; 5000]);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                match store.fetch("k") {
                    Fetched::Found(bytes) => {
                        assert_eq!(&bytes[..], &[7; 5000][..]);
                        break;
                    }
                    Fetched::Missing if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    other => panic!("not published: {other:?}"),
                }
            }
            assert!(matches!(other.fetch("k"), Fetched::Missing));
        })
        .join()
        .unwrap();
        assert_eq!(counter.with_label_values(&["publish", "ok"]).get(), 1);
        assert!(counter.with_label_values(&["fetch", "found"]).get() >= 1);
    }

    #[test]
    fn fetch_timeout_is_validated() {
        let mut c = SharedEncodingsConfig::default();
        assert!(c.enabled);
        c.validate().unwrap();
        c.fetch_timeout_ms = 0;
        assert!(c.validate().is_err());
    }
}
