//! SDXL checkpoints from the model catalogue (DESIGN §7b, "Checkpoints from the catalogue"): a
//! worker with `catalogue_checkpoints = N` (0: off) takes generates naming a checkpoint that the
//! catalogue holds and no worker advertises. The async side fetches the file into the model cache
//! and pins it for the job ([`FetchedCheckpoint`]); the engine keeps at most `N` of them loaded
//! besides its own ([`LoadedCheckpoints`]), by hash, least recently used out first. The one a
//! group of jobs runs on is the most recently used, so it is never the one evicted, and the
//! configured checkpoint is not in the set at all: it always stays.

use std::path::PathBuf;

use vnfarm_proto::ModelFileRole;
use vnfarm_proto::catalogue::ContentHash;

use super::UsedFile;

/// A job's checkpoint from the model catalogue: the job's name for it (a catalogue name or
/// `sha256:<hex>`), its hash and the verified file in the model cache, pinned by the async side
/// until the job is settled.
#[derive(Clone, Debug, PartialEq)]
pub struct FetchedCheckpoint {
    pub name: String,
    pub sha256: ContentHash,
    pub path: PathBuf,
}

impl FetchedCheckpoint {
    /// The checkpoint as a file the job's images are made from, by the job's name for it.
    pub fn used_file(&self) -> UsedFile {
        UsedFile {
            name: self.name.clone(),
            path: self.path.clone(),
            role: ModelFileRole::Checkpoint,
            strength: None,
        }
    }
}

/// At most `max` loaded models of catalogue checkpoints, by hash, least recently used first.
pub struct LoadedCheckpoints<M> {
    max: usize,
    loaded: Vec<(ContentHash, M)>,
}

impl<M> LoadedCheckpoints<M> {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            loaded: Vec::new(),
        }
    }

    /// The hashes loaded, least recently used first.
    pub fn hashes(&self) -> Vec<&ContentHash> {
        self.loaded.iter().map(|(h, _)| h).collect()
    }

    /// The loaded model of `sha256`, made most recently used.
    pub fn touch(&mut self, sha256: &ContentHash) -> Option<&mut M> {
        let at = self.loaded.iter().position(|(h, _)| h == sha256)?;
        let entry = self.loaded.remove(at);
        self.loaded.push(entry);
        self.loaded.last_mut().map(|(_, m)| m)
    }

    /// The loaded model of `sha256`, without changing the order of use.
    pub fn get(&self, sha256: &ContentHash) -> Option<&M> {
        self.loaded
            .iter()
            .find(|(h, _)| h == sha256)
            .map(|(_, m)| m)
    }

    /// The model of `sha256`: the loaded one, else `load`'s, after the least recently used ones
    /// beyond room for it were dropped (before the load, so their memory is free for it). A load
    /// that fails leaves nothing of it; with `max` 0 nothing is loaded.
    pub fn get_or_load<E>(
        &mut self,
        sha256: &ContentHash,
        load: impl FnOnce() -> Result<M, E>,
    ) -> Result<Option<&mut M>, E> {
        if self.get(sha256).is_some() {
            return Ok(self.touch(sha256));
        }
        if self.max == 0 {
            return Ok(None);
        }
        while self.loaded.len() >= self.max {
            let (evicted, model) = self.loaded.remove(0);
            drop(model);
            tracing::info!(sha256 = %evicted, "catalogue checkpoint unloaded (least recently used)");
        }
        let model = load()?;
        self.loaded.push((sha256.clone(), model));
        Ok(self.loaded.last_mut().map(|(_, m)| m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(c: char) -> ContentHash {
        ContentHash::try_from(c.to_string().repeat(64)).unwrap()
    }

    #[test]
    fn at_most_max_stay_loaded_and_the_least_recently_used_goes_first() {
        let mut loaded = LoadedCheckpoints::new(2);
        let loads = std::cell::Cell::new(0);
        let get = |loaded: &mut LoadedCheckpoints<char>, c: char| {
            *loaded
                .get_or_load(&hash(c), || {
                    loads.set(loads.get() + 1);
                    Ok::<_, ()>(c)
                })
                .unwrap()
                .unwrap()
        };
        assert_eq!(get(&mut loaded, 'a'), 'a');
        assert_eq!(get(&mut loaded, 'b'), 'b');
        assert_eq!(get(&mut loaded, 'a'), 'a', "loaded already");
        assert_eq!(get(&mut loaded, 'c'), 'c');
        assert_eq!(
            loaded.hashes(),
            [&hash('a'), &hash('c')],
            "b was used least recently"
        );
        assert_eq!(loads.get(), 3);
    }

    #[test]
    fn a_failed_load_keeps_nothing_and_zero_loads_nothing() {
        let mut loaded = LoadedCheckpoints::<u8>::new(1);
        let failed = loaded.get_or_load(&hash('a'), || Err("bad file"));
        assert_eq!(failed.err(), Some("bad file"));
        assert!(loaded.hashes().is_empty());
        let mut off = LoadedCheckpoints::<u8>::new(0);
        let none = off.get_or_load(&hash('a'), || Ok::<_, ()>(1)).unwrap();
        assert!(none.is_none());
    }
}
