//! The encode cache: encodings of edit inputs an engine keeps for later edits of the same inputs,
//! least recently used first out, within a budget (bytes of device memory, or entries).
//!
//! Entries are keyed by what they encode (the engine's own key, e.g. the inputs' sha256); each also
//! remembers the affinity keys ([`vnfarm_proto::Task::affinity_key`]) of the jobs that used it, and
//! those are what the worker advertises in its heartbeats (`encode_cache`): the scheduler routes and
//! coalesces edits by affinity key, and cannot know the bytes behind a key before a worker fetched
//! them. An evicted entry takes its affinity keys with it; an affinity key that comes to mean other
//! content (an input object overwritten) moves to the entry of that content.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Affinity keys remembered per entry: many names for one content are rare (the same image stored
/// under several keys); the most recently used ones are kept.
const AFFINITY_KEYS_PER_ENTRY: usize = 8;

/// Whether a job's input encodings were found in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLookup {
    Hit,
    /// Encoded for this job (and kept for the next ones).
    Miss,
    /// Not in this worker's cache; another worker's encodings, read from shared storage.
    Fetched,
}

impl CacheLookup {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheLookup::Hit => "hit",
            CacheLookup::Miss => "miss",
            CacheLookup::Fetched => "fetched",
        }
    }

    /// The stage timing of the job that paid for its inputs' encodings: `encode`, or
    /// `fetch_encodings` for encodings read from shared storage.
    pub fn stage(self) -> &'static str {
        match self {
            CacheLookup::Fetched => "fetch_encodings",
            CacheLookup::Hit | CacheLookup::Miss => "encode",
        }
    }
}

/// The affinity keys an engine's cache holds, least recently used first; shared between the engine
/// thread (which writes them) and the heartbeat (which reads them).
#[derive(Clone, Debug, Default)]
pub struct AdvertisedKeys(Arc<Mutex<Vec<String>>>);

impl AdvertisedKeys {
    pub fn get(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, keys: Vec<String>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = keys;
    }
}

struct Entry<V> {
    key: String,
    value: V,
    cost: usize,
    /// Most recently used last.
    affinity: VecDeque<String>,
}

pub struct EncodeCache<V> {
    /// Least recently used first.
    entries: VecDeque<Entry<V>>,
    budget: usize,
    advertised: AdvertisedKeys,
}

impl<V> EncodeCache<V> {
    /// A cache holding entries whose costs add up to at most `budget` (the newest entry is kept even
    /// when it alone exceeds it: the job that made it needs it).
    pub fn new(budget: usize, advertised: AdvertisedKeys) -> Self {
        Self {
            entries: VecDeque::new(),
            budget,
            advertised,
        }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.iter().any(|e| e.key == key)
    }

    /// The entry for `key`, now the most recently used, with `affinity` (the using job's key)
    /// recorded on it.
    pub fn get(&mut self, key: &str, affinity: Option<&str>) -> Option<&V> {
        let at = self.entries.iter().position(|e| e.key == key)?;
        let entry = self.entries.remove(at)?;
        self.entries.push_back(entry);
        if let Some(affinity) = affinity {
            self.record(affinity);
        }
        self.publish();
        self.entries.back().map(|e| &e.value)
    }

    /// Stores an entry as the most recently used, evicting the least recently used ones beyond the
    /// budget.
    pub fn insert(&mut self, key: String, value: V, cost: usize, affinity: Option<&str>) {
        self.entries.retain(|e| e.key != key);
        self.entries.push_back(Entry {
            key,
            value,
            cost,
            affinity: VecDeque::new(),
        });
        if let Some(affinity) = affinity {
            self.record(affinity);
        }
        let mut total: usize = self.entries.iter().map(|e| e.cost).sum();
        while total > self.budget.max(cost) && self.entries.len() > 1 {
            if let Some(old) = self.entries.pop_front() {
                total -= old.cost;
            }
        }
        self.publish();
    }

    /// Puts `affinity` on the most recently used entry (and off any other).
    fn record(&mut self, affinity: &str) {
        for entry in &mut self.entries {
            entry.affinity.retain(|k| k != affinity);
        }
        if let Some(newest) = self.entries.back_mut() {
            newest.affinity.push_back(affinity.to_owned());
            if newest.affinity.len() > AFFINITY_KEYS_PER_ENTRY {
                newest.affinity.pop_front();
            }
        }
    }

    fn publish(&self) {
        let keys = self
            .entries
            .iter()
            .flat_map(|e| e.affinity.iter().cloned())
            .collect();
        self.advertised.set(keys);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(budget: usize) -> (EncodeCache<u32>, AdvertisedKeys) {
        let keys = AdvertisedKeys::default();
        (EncodeCache::new(budget, keys.clone()), keys)
    }

    #[test]
    fn advertises_the_affinity_keys_of_what_it_holds_least_recently_used_first() {
        let (mut c, keys) = cache(3);
        c.insert("sha-a".into(), 1, 1, Some("qwen-edit:job:a/0"));
        c.insert("sha-b".into(), 2, 1, Some("qwen-edit:stored:inputs/b.png"));
        // The same bytes under another name: one entry, two keys.
        assert_eq!(
            c.get("sha-a", Some("qwen-edit:stored:inputs/a.png")),
            Some(&1)
        );
        assert_eq!(
            keys.get(),
            [
                "qwen-edit:stored:inputs/b.png",
                "qwen-edit:job:a/0",
                "qwen-edit:stored:inputs/a.png"
            ]
        );
        // An encoding without a name (an inline input) is cached but not advertised.
        c.insert("sha-c".into(), 3, 1, None);
        assert!(c.contains("sha-c"));
        assert_eq!(keys.get().len(), 3);
    }

    #[test]
    fn an_evicted_entry_takes_its_keys_with_it() {
        let (mut c, keys) = cache(2);
        c.insert("sha-a".into(), 1, 1, Some("k-a"));
        c.insert("sha-b".into(), 2, 1, Some("k-b"));
        assert!(c.get("sha-a", None).is_some(), "a is now the most recent");
        c.insert("sha-c".into(), 3, 1, Some("k-c"));
        assert!(!c.contains("sha-b"), "the least recently used went");
        assert_eq!(keys.get(), ["k-a", "k-c"]);
        assert_eq!(c.get("sha-b", Some("k-b")), None);
        assert_eq!(keys.get(), ["k-a", "k-c"], "a miss advertises nothing");
    }

    #[test]
    fn an_entry_over_the_budget_stays_until_the_next_one() {
        let (mut c, keys) = cache(100);
        c.insert("small".into(), 1, 10, Some("k-small"));
        c.insert("huge".into(), 2, 500, Some("k-huge"));
        assert!(c.contains("huge") && !c.contains("small"));
        assert_eq!(keys.get(), ["k-huge"]);
        c.insert("small".into(), 1, 10, Some("k-small"));
        assert_eq!(keys.get(), ["k-small"]);
    }

    #[test]
    fn a_key_that_names_new_content_moves_to_it() {
        let (mut c, keys) = cache(10);
        c.insert("old-bytes".into(), 1, 1, Some("stored:inputs/x.png"));
        c.insert("new-bytes".into(), 2, 1, Some("stored:inputs/x.png"));
        assert_eq!(keys.get(), ["stored:inputs/x.png"], "advertised once");
        c.insert("other".into(), 3, 1, Some("k-other"));
        assert!(c.get("old-bytes", None).is_some());
        assert_eq!(keys.get(), ["stored:inputs/x.png", "k-other"]);
    }
}
