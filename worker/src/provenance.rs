//! The sha256 of the model files a worker reads, for its manifests. Hashing a 20 GB checkpoint takes
//! a minute, so it never stands between a worker and its first heartbeat: background threads (a few,
//! [`hash_threads`]) hash each file once, and the results are kept in memory and in
//! `<cache_dir>/model-hashes.json`, so a restarted worker does not hash again.
//!
//! A result is keyed by the file's canonical path, size and modification time: a file replaced or
//! rewritten since (another size or mtime) is hashed anew. The worker asks for its configured files
//! at start ([`FileHashes::prefetch`], in the order given); a caller that needs a hash awaits it
//! ([`FileHashes::hash`]): a file being hashed is awaited, not hashed again, and a file not started
//! yet goes before every prefetched one. So a fresh box's first generate waits for its own files,
//! not behind a 20 GB transformer it does not use (it waited 51 s for that on the H200, when one
//! thread took the files in order: docs/performance.md, "Runs 3 and 4").

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The name of the persisted cache in its folder.
pub const CACHE_FILE: &str = "model-hashes.json";

/// A file as it was hashed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hashed {
    /// Canonical.
    pub path: PathBuf,
    pub size: u64,
    /// Hex.
    pub sha256: String,
    /// A safetensors file's tensor data (after the header), hex: A1111's LoRA hash.
    pub data_sha256: Option<String>,
}

/// Threads that hash at once: up to 4, half the cores (a fresh box also loads its models then).
pub fn hash_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 4))
}

/// The hashing service: cheap to clone; the threads end when the last clone is dropped.
#[derive(Clone)]
pub struct FileHashes {
    shared: Arc<Shared>,
    /// Closes the queue when the last clone goes.
    _owner: Arc<Owner>,
}

struct Shared {
    known: Mutex<Cache>,
    /// Where the cache persists; `None` keeps it in memory only.
    file: Option<PathBuf>,
    /// Files hashed (not answered from the cache) since start.
    computed: AtomicU64,
    queue: Mutex<Queue>,
    ready: Condvar,
}

type Reply = tokio::sync::oneshot::Sender<Result<Hashed, String>>;

/// The files to hash, by canonical path.
#[derive(Default)]
struct Queue {
    /// Not started, asked for by callers, in the order asked: hashed before `prefetched`.
    asked: VecDeque<PathBuf>,
    /// Not started, prefetched, in the order given.
    prefetched: VecDeque<PathBuf>,
    /// Being hashed.
    running: HashSet<PathBuf>,
    /// Who awaits each file asked for.
    waiting: HashMap<PathBuf, Vec<Reply>>,
    closed: bool,
}

impl Queue {
    /// A caller awaits `path`: it joins the hashing under way, or a place among the files asked
    /// for (leaving the prefetched ones, where it was one). True when a thread has work to take.
    fn ask(&mut self, path: PathBuf, reply: Reply) -> bool {
        self.waiting.entry(path.clone()).or_default().push(reply);
        if self.running.contains(&path) || self.asked.contains(&path) {
            return false;
        }
        self.prefetched.retain(|p| *p != path);
        self.asked.push_back(path);
        true
    }

    /// `path` is hashed when nothing asked for waits, unless it is queued or under way already.
    fn prefetch(&mut self, path: PathBuf) -> bool {
        if self.running.contains(&path)
            || self.asked.contains(&path)
            || self.prefetched.contains(&path)
        {
            return false;
        }
        self.prefetched.push_back(path);
        true
    }

    /// The next file to hash, marked as under way.
    fn next(&mut self) -> Option<PathBuf> {
        let path = self
            .asked
            .pop_front()
            .or_else(|| self.prefetched.pop_front())?;
        self.running.insert(path.clone());
        Some(path)
    }

    /// `path` is hashed: who awaited it.
    fn done(&mut self, path: &Path) -> Vec<Reply> {
        self.running.remove(path);
        self.waiting.remove(path).unwrap_or_default()
    }
}

struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.queue().closed = true;
        self.0.ready.notify_all();
    }
}

/// The persisted form: canonical path → what was hashed.
#[derive(Default, Serialize, Deserialize)]
struct Cache {
    files: HashMap<String, Entry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    mtime_ns: u64,
    sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_sha256: Option<String>,
}

/// A file's canonical path, size and mtime: what a cached hash is valid for.
fn stamp(path: &Path) -> Result<(PathBuf, u64, u64), String> {
    let canonical = path
        .canonicalize()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = std::fs::metadata(&canonical).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a file", path.display()));
    }
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    Ok((canonical, meta.len(), mtime_ns))
}

impl FileHashes {
    /// Starts [`hash_threads`] hashing threads; `cache_dir` (created if missing) holds the
    /// persisted cache. An unreadable cache is logged and started afresh: it only saves time.
    pub fn start(cache_dir: Option<&Path>) -> anyhow::Result<Self> {
        Self::start_with(cache_dir, hash_threads())
    }

    /// [`FileHashes::start`] with `threads` hashing threads (at least one).
    pub fn start_with(cache_dir: Option<&Path>, threads: usize) -> anyhow::Result<Self> {
        let file = cache_dir.map(|dir| dir.join(CACHE_FILE));
        let known = match &file {
            Some(path) => match std::fs::read(path) {
                Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                    tracing::warn!(path = %path.display(), error = %e, "model hash cache is unreadable; starting afresh");
                    Cache::default()
                }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Cache::default(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "model hash cache is unreadable; starting afresh");
                    Cache::default()
                }
            },
            None => Cache::default(),
        };
        let shared = Arc::new(Shared {
            known: Mutex::new(known),
            file,
            computed: AtomicU64::new(0),
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        for n in 0..threads.max(1) {
            let thread = shared.clone();
            std::thread::Builder::new()
                .name(format!("model-hashes-{n}"))
                .spawn(move || thread.work())?;
        }
        Ok(Self {
            _owner: Arc::new(Owner(shared.clone())),
            shared,
        })
    }

    /// Starts hashing `paths` in the background, in this order after what is queued (those not
    /// hashed, queued or being hashed already). A file that cannot be read is logged.
    pub fn prefetch(&self, paths: impl IntoIterator<Item = PathBuf>) {
        for path in paths {
            match stamp(&path) {
                Ok((canonical, size, mtime_ns)) => {
                    if self.shared.cached(&canonical, size, mtime_ns).is_none() {
                        self.shared.enqueue(canonical, None);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot hash a configured model file"),
            }
        }
    }

    /// The file's hash as it is now: from the cache when its size and mtime are unchanged; else
    /// once it is hashed: by the hashing of it under way, or after the files other callers asked
    /// for before it, before every prefetched one.
    pub async fn hash(&self, path: &Path) -> Result<Hashed, String> {
        let (canonical, size, mtime_ns) = stamp(path)?;
        if let Some(hit) = self.shared.cached(&canonical, size, mtime_ns) {
            return Ok(hit);
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.shared.enqueue(canonical, Some(reply));
        answer
            .await
            .map_err(|_| "the model hashing threads are gone".to_string())?
    }

    /// Files hashed since start (not answered from the cache).
    pub fn computed(&self) -> u64 {
        self.shared.computed.load(Ordering::Relaxed)
    }
}

impl Shared {
    fn known(&self) -> std::sync::MutexGuard<'_, Cache> {
        // Plain data: a panic elsewhere cannot leave it half-written.
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks for `canonical`: for a caller (`reply`) or as a prefetch ([`Queue`]).
    fn enqueue(&self, canonical: PathBuf, reply: Option<Reply>) {
        let mut queue = self.queue();
        let work = match reply {
            Some(reply) => queue.ask(canonical, reply),
            None => queue.prefetch(canonical),
        };
        drop(queue);
        if work {
            self.ready.notify_one();
        }
    }

    /// A hashing thread: the next file, until the queue closes.
    fn work(&self) {
        loop {
            let path = {
                let mut queue = self.queue();
                loop {
                    if queue.closed {
                        return;
                    }
                    if let Some(path) = queue.next() {
                        break path;
                    }
                    queue = self.ready.wait(queue).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = self.hash_now(&path);
            let waiting = self.queue().done(&path);
            if waiting.is_empty()
                && let Err(e) = &result
            {
                tracing::warn!(error = %e, "cannot hash a configured model file");
            }
            for reply in waiting {
                // Nobody waits any more (the job's future was dropped): nothing to do.
                drop(reply.send(result.clone()));
            }
        }
    }

    fn cached(&self, canonical: &Path, size: u64, mtime_ns: u64) -> Option<Hashed> {
        let known = self.known();
        let entry = known.files.get(&*canonical.to_string_lossy())?;
        (entry.size == size && entry.mtime_ns == mtime_ns).then(|| Hashed {
            path: canonical.to_owned(),
            size,
            sha256: entry.sha256.clone(),
            data_sha256: entry.data_sha256.clone(),
        })
    }

    /// On a hashing thread: from the cache (the file was hashed since it was asked for), else read
    /// through, remembered and persisted.
    fn hash_now(&self, path: &Path) -> Result<Hashed, String> {
        let (canonical, size, mtime_ns) = stamp(path)?;
        if let Some(hit) = self.cached(&canonical, size, mtime_ns) {
            return Ok(hit);
        }
        let started = std::time::Instant::now();
        let mut file =
            std::fs::File::open(&canonical).map_err(|e| format!("{}: {e}", path.display()))?;
        // One read for both hashes, each on its own thread (a sha256 runs at ~1.4 GB/s a core, so
        // one thread doing both halved a file's rate): this thread reads and hashes the file; the
        // data hash starts after the 8-byte header length and the header, on a scoped thread fed
        // the same chunks. `None` until the length is read, and for files that are not safetensors.
        let (file_sha, data_sha, read) = std::thread::scope(|scope| {
            let (to_data, chunks) = std::sync::mpsc::sync_channel::<(Arc<Vec<u8>>, usize)>(4);
            let data = is_safetensors(&canonical).then(|| {
                scope.spawn(move || {
                    let mut hasher = Sha256::new();
                    for (chunk, from) in chunks {
                        hasher.update(&chunk[from..]);
                    }
                    hasher.finalize()
                })
            });
            let mut hasher = Sha256::new();
            let mut data_start = None::<u64>;
            let mut read = 0u64;
            let outcome = loop {
                let mut buf = vec![0u8; 8 << 20];
                let n = match file.read(&mut buf) {
                    Ok(0) => break Ok(()),
                    Ok(n) => n,
                    Err(e) => break Err(format!("{}: {e}", path.display())),
                };
                buf.truncate(n);
                if data_start.is_none() && read == 0 && n >= 8 {
                    let len = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                    data_start = Some(8u64.saturating_add(len));
                }
                let chunk = Arc::new(buf);
                if let (Some(start), Some(_)) = (data_start, &data) {
                    let from = start.saturating_sub(read).min(n as u64) as usize;
                    // The receiver lives until this sender is dropped below.
                    let _ = to_data.send((chunk.clone(), from));
                }
                hasher.update(&chunk[..]);
                read += n as u64;
            };
            drop(to_data);
            let data_sha = data.map(|h| h.join().expect("the data hash thread does not panic"));
            outcome.map(|()| {
                let data_sha = data_sha
                    .zip(data_start)
                    .filter(|&(_, start)| start <= read)
                    .map(|(d, _)| d);
                (hasher.finalize(), data_sha, read)
            })
        })?;
        // A file named .safetensors whose header length runs past its end has no data hash (its
        // loader refuses it; its file hash still names it).
        let data_sha256 = data_sha.map(hex::encode);
        if read != size || stamp(&canonical)? != (canonical.clone(), size, mtime_ns) {
            return Err(format!(
                "{}: the file changed while it was hashed",
                path.display()
            ));
        }
        let sha256 = hex::encode(file_sha);
        self.computed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            path = %canonical.display(),
            bytes = size,
            seconds = started.elapsed().as_secs_f64(),
            "model file hashed"
        );
        let entry = Entry {
            size,
            mtime_ns,
            sha256: sha256.clone(),
            data_sha256: data_sha256.clone(),
        };
        {
            // Persisted under the lock: two threads never write the file at once.
            let mut known = self.known();
            known
                .files
                .insert(canonical.to_string_lossy().into_owned(), entry);
            let persisted =
                serde_json::to_vec_pretty(&*known).expect("the hash cache serializes to JSON");
            if let Some(file) = &self.file
                && let Err(e) = persist(file, &persisted)
            {
                tracing::warn!(path = %file.display(), error = %e, "cannot save the model hash cache");
            }
        }
        Ok(Hashed {
            path: canonical,
            size,
            sha256,
            data_sha256,
        })
    }
}

fn is_safetensors(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

/// Write-then-rename, so a reader never sees half a cache.
fn persist(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "vnfarm-provenance-{name}-{}-{}",
            std::process::id(),
            vnfarm_proto::JobId::new()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn sha(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    #[tokio::test]
    async fn a_file_is_hashed_once_until_it_changes_and_the_cache_survives_a_restart() {
        let root = dir("cache");
        let cache = root.join("cache");
        let model = root.join("model.safetensors");
        std::fs::write(&model, b"weights v1").unwrap();

        let hashes = FileHashes::start(Some(&cache)).unwrap();
        let first = hashes.hash(&model).await.unwrap();
        assert_eq!(first.sha256, sha(b"weights v1"));
        assert_eq!(first.size, 10);
        assert_eq!(first.path, model.canonicalize().unwrap());
        let again = hashes.hash(&model).await.unwrap();
        assert_eq!(again, first);
        assert_eq!(hashes.computed(), 1, "a second lookup does not hash again");

        // Another size (and mtime): hashed anew.
        std::fs::write(&model, b"weights version 2").unwrap();
        let changed = hashes.hash(&model).await.unwrap();
        assert_eq!(changed.sha256, sha(b"weights version 2"));
        assert_eq!(changed.size, 17);
        assert_eq!(hashes.computed(), 2);
        drop(hashes);

        // A restarted worker reads the persisted cache and hashes nothing.
        assert!(cache.join(CACHE_FILE).is_file());
        let restarted = FileHashes::start(Some(&cache)).unwrap();
        assert_eq!(restarted.hash(&model).await.unwrap(), changed);
        assert_eq!(restarted.computed(), 0);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[tokio::test]
    async fn a_safetensors_file_also_gets_the_hash_of_its_data_after_the_header() {
        let root = dir("data-hash");
        let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&data);
        let lora = root.join("style.safetensors");
        std::fs::write(&lora, &bytes).unwrap();
        let other = root.join("style.pt");
        std::fs::write(&other, &bytes).unwrap();
        let hashes = FileHashes::start(None).unwrap();
        let hashed = hashes.hash(&lora).await.unwrap();
        assert_eq!(hashed.sha256, sha(&bytes));
        assert_eq!(hashed.data_sha256, Some(sha(&data)));
        assert_eq!(hashes.hash(&other).await.unwrap().data_sha256, None);
        // A .safetensors file too short for its header has no data hash.
        std::fs::write(&lora, b"weights v1").unwrap();
        assert_eq!(hashes.hash(&lora).await.unwrap().data_sha256, None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[tokio::test]
    async fn a_prefetched_file_is_hashed_once_and_a_missing_file_is_an_error() {
        let root = dir("prefetch");
        let lora = root.join("style.safetensors");
        std::fs::write(&lora, b"lora").unwrap();
        let hashes = FileHashes::start(None).unwrap();
        hashes.prefetch([lora.clone(), lora.clone()]);
        // Asked for while prefetched (or being hashed): hashed once all the same.
        assert_eq!(hashes.hash(&lora).await.unwrap().sha256, sha(b"lora"));
        assert_eq!(hashes.computed(), 1);
        let missing = hashes.hash(&root.join("gone.safetensors")).await;
        assert!(missing.unwrap_err().contains("gone.safetensors"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A caller's file goes before the prefetched ones (a fresh box's first generate waits for
    /// its UNet, not behind the edit model's 20 GB transformer), and a file asked for while it is
    /// queued or hashed is not queued again.
    #[test]
    fn files_asked_for_go_before_prefetched_ones_and_each_is_hashed_once() {
        let p = |name: &str| PathBuf::from(format!("/models/{name}"));
        let reply = || tokio::sync::oneshot::channel().0;
        let mut queue = Queue::default();
        for name in ["transformer", "text_encoder", "unet"] {
            assert!(queue.prefetch(p(name)));
        }
        assert!(!queue.prefetch(p("unet")), "prefetched twice");
        assert_eq!(queue.next(), Some(p("transformer")));
        // A generate asks for the UNet (prefetched, last) and an edit for the transformer
        // (being hashed): the UNet comes next, the edit joins the hashing under way.
        assert!(queue.ask(p("unet"), reply()));
        assert!(!queue.ask(p("transformer"), reply()));
        assert!(!queue.ask(p("unet"), reply()), "asked for twice");
        assert!(!queue.prefetch(p("unet")));
        assert!(queue.ask(p("vae"), reply()));
        assert_eq!(queue.next(), Some(p("unet")));
        assert_eq!(queue.next(), Some(p("vae")), "asked for after the UNet");
        assert_eq!(queue.next(), Some(p("text_encoder")));
        assert_eq!(queue.next(), None);
        assert_eq!(queue.done(&p("transformer")).len(), 1);
        assert_eq!(queue.done(&p("unet")).len(), 2);
        assert!(queue.done(&p("text_encoder")).is_empty());
        assert!(queue.running.contains(&p("vae")));
    }

    #[tokio::test]
    async fn threads_hash_files_at_once_each_once_and_persist_every_one() {
        let root = dir("threads");
        let cache = root.join("cache");
        let files: Vec<PathBuf> = (0..6u8)
            .map(|n| {
                let path = root.join(format!("part{n}.safetensors"));
                std::fs::write(&path, vec![n; 1 << 20]).unwrap();
                path
            })
            .collect();
        let hashes = FileHashes::start_with(Some(&cache), 3).unwrap();
        hashes.prefetch(files.clone());
        let asked = files.iter().chain(files.iter().rev());
        let answers = futures::future::join_all(asked.clone().map(|f| hashes.hash(f))).await;
        for (file, answer) in asked.zip(answers) {
            let n = files.iter().position(|f| f == file).unwrap() as u8;
            assert_eq!(answer.unwrap().sha256, sha(&vec![n; 1 << 20]));
        }
        assert_eq!(hashes.computed(), 6, "a file was hashed twice");
        drop(hashes);
        // Written by three threads, the persisted cache holds all six.
        let restarted = FileHashes::start_with(Some(&cache), 1).unwrap();
        for (n, file) in files.iter().enumerate() {
            let hashed = restarted.hash(file).await.unwrap();
            assert_eq!(hashed.sha256, sha(&vec![n as u8; 1 << 20]));
        }
        assert_eq!(restarted.computed(), 0);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
