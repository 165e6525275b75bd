//! The job records and the indexes the decisions use, behind one update function.
//!
//! Every index is a function of the records it holds: a job that waits for a worker (queued, its
//! inputs complete, nothing decided on it) sits in the ready index of its route or, when held for
//! its input's holder, in the holds by their end, and in its group by key; a dispatched job not yet
//! started sits among those awaiting start; every job counts in its state, a queued one in its
//! model's backlog. The rule that keeps them right — take a job out of the indexes its state puts it
//! in, change it, put it back — is not left to callers: a stored record changes only through
//! [`Jobs::update`] (or [`Entry::update`]), which does index-out, the copy-on-write of a record a
//! snapshot still shares, the change and index-in, so no change can forget an index.

use std::collections::btree_map::{self, BTreeMap};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use vnfarm_proto::http::JobState;
use vnfarm_proto::{JobId, ModelFamily, Priority};

use super::Route;
use super::record::{JobRecord, QueueKey};

/// The waiting jobs of one route, per owner, each in its queue order.
pub(super) type Queues = BTreeMap<String, BTreeSet<QueueKey>>;

/// The jobs in memory and their indexes.
#[derive(Default)]
pub(super) struct Jobs {
    /// Shared with snapshots being written; changed copy-on-write.
    records: BTreeMap<JobId, Arc<JobRecord>>,
    index: Index,
}

#[derive(Default)]
struct Index {
    /// Jobs not in a terminal state.
    active: BTreeSet<JobId>,
    /// Waiting jobs per route and owner, in queue order (interactive first, then moved to the
    /// front, then oldest); held jobs are not here.
    ready: BTreeMap<Route, Queues>,
    /// Per owner: jobs on workers or being dispatched ([`JobRecord::occupies`]).
    running: HashMap<String, usize>,
    /// Per owner: waiting jobs, held or not.
    waiting: HashMap<String, usize>,
    /// Waiting jobs (held or not) that may share a message, by group key.
    groups: HashMap<String, BTreeSet<(u8, JobId)>>,
    /// Held jobs by the end of their hold.
    holds: BTreeSet<(Instant, JobId)>,
    /// When each waiting job began waiting (for holds and coalescing windows).
    waiting_since: HashMap<JobId, Instant>,
    /// Jobs dispatched and not yet started (the watchdog's only concern).
    awaiting_start: BTreeSet<JobId>,
    counts: HashMap<JobState, usize>,
    backlog: HashMap<(ModelFamily, Priority), usize>,
}

/// A stored job, found: read it, change it through the indexes, or remove it.
pub(super) struct Entry<'a> {
    slot: btree_map::OccupiedEntry<'a, JobId, Arc<JobRecord>>,
    index: &'a mut Index,
}

impl Entry<'_> {
    pub(super) fn get(&self) -> &JobRecord {
        self.slot.get()
    }

    /// Changes the job, keeping the indexes right.
    pub(super) fn update<R>(mut self, f: impl FnOnce(&mut JobRecord) -> R) -> R {
        self.index.remove(self.slot.get());
        let out = f(Arc::make_mut(self.slot.get_mut()));
        self.index.add(self.slot.get());
        out
    }

    /// Takes the job out of memory and of every index.
    pub(super) fn remove(self) -> Arc<JobRecord> {
        self.index.remove(self.slot.get());
        self.index.waiting_since.remove(self.slot.key());
        self.slot.remove()
    }
}

impl Jobs {
    pub(super) fn get(&self, id: &JobId) -> Option<&JobRecord> {
        self.records.get(id).map(|j| &**j)
    }

    pub(super) fn contains_key(&self, id: &JobId) -> bool {
        self.records.contains_key(id)
    }

    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// Jobs in memory, newest first (job ids are time-ordered).
    pub(super) fn newest_first(&self) -> impl Iterator<Item = &JobRecord> {
        self.records.values().rev().map(|j| &**j)
    }

    /// Every record, shared (O(jobs) pointer copies), for a snapshot written without the lock.
    pub(super) fn shared(&self) -> Vec<Arc<JobRecord>> {
        self.records.values().cloned().collect()
    }

    pub(super) fn entry(&mut self, id: JobId) -> Option<Entry<'_>> {
        match self.records.entry(id) {
            btree_map::Entry::Occupied(slot) => Some(Entry {
                slot,
                index: &mut self.index,
            }),
            btree_map::Entry::Vacant(_) => None,
        }
    }

    /// Changes a stored job, keeping the indexes right; `None` for a job not in memory.
    pub(super) fn update<R>(
        &mut self,
        id: JobId,
        f: impl FnOnce(&mut JobRecord) -> R,
    ) -> Option<R> {
        self.entry(id).map(|entry| entry.update(f))
    }

    /// Stores a job (replacing one of the same id, which the callers never hold) and indexes it.
    pub(super) fn insert(&mut self, record: JobRecord) {
        if let Some(old) = self.records.get(&record.id) {
            self.index.remove(old);
        }
        self.index.add(&record);
        self.records.insert(record.id, Arc::new(record));
    }

    // ----- the indexes, for reading -----

    pub(super) fn is_active(&self, id: &JobId) -> bool {
        self.index.active.contains(id)
    }

    pub(super) fn active(&self) -> &BTreeSet<JobId> {
        &self.index.active
    }

    pub(super) fn ready(&self) -> &BTreeMap<Route, Queues> {
        &self.index.ready
    }

    pub(super) fn running(&self, owner: &str) -> usize {
        self.index.running.get(owner).copied().unwrap_or(0)
    }

    /// Everyone with jobs waiting or on workers.
    pub(super) fn owners(&self) -> impl Iterator<Item = &str> {
        self.index
            .running
            .keys()
            .chain(self.index.waiting.keys())
            .map(String::as_str)
    }

    pub(super) fn waiting_of(&self, owner: &str) -> usize {
        self.index.waiting.get(owner).copied().unwrap_or(0)
    }

    pub(super) fn group(&self, key: &str) -> Option<&BTreeSet<(u8, JobId)>> {
        self.index.groups.get(key)
    }

    pub(super) fn holds(&self) -> &BTreeSet<(Instant, JobId)> {
        &self.index.holds
    }

    pub(super) fn waiting_since(&self, id: &JobId) -> Option<Instant> {
        self.index.waiting_since.get(id).copied()
    }

    pub(super) fn awaiting_start(&self) -> &BTreeSet<JobId> {
        &self.index.awaiting_start
    }

    pub(super) fn count(&self, state: JobState) -> usize {
        self.index.counts.get(&state).copied().unwrap_or(0)
    }

    pub(super) fn backlog(&self, model: ModelFamily, priority: Priority) -> usize {
        self.index
            .backlog
            .get(&(model, priority))
            .copied()
            .unwrap_or(0)
    }
}

impl std::ops::Index<&JobId> for Jobs {
    type Output = JobRecord;

    /// The job, which the caller knows to be stored (an id taken from an index).
    fn index(&self, id: &JobId) -> &JobRecord {
        &self.records[id]
    }
}

/// One fewer for `owner`, forgetting an owner at nothing.
fn decrement(counts: &mut HashMap<String, usize>, owner: &str) {
    if let Some(n) = counts.get_mut(owner) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(owner);
        }
    }
}

impl Index {
    /// Takes a job out of the indexes its current state puts it in.
    fn remove(&mut self, job: &JobRecord) {
        let (id, state, model, priority, rank) =
            (job.id, job.state, job.model(), job.priority(), job.rank());
        self.active.remove(&id);
        if let Some(n) = self.counts.get_mut(&state) {
            *n = n.saturating_sub(1);
        }
        if let (JobState::Queued, Some(m)) = (state, model)
            && let Some(n) = self.backlog.get_mut(&(m, priority))
        {
            *n = n.saturating_sub(1);
        }
        if job.occupies() {
            decrement(&mut self.running, job.owner());
        }
        if job.waiting() {
            decrement(&mut self.waiting, job.owner());
            match (job.local.hold_until, job.route()) {
                (Some(until), _) => {
                    self.holds.remove(&(until, id));
                }
                (None, Some(route)) => {
                    if let Some(queues) = self.ready.get_mut(&route) {
                        if let Some(queue) = queues.get_mut(job.owner()) {
                            queue.remove(&job.queue_key());
                            if queue.is_empty() {
                                queues.remove(job.owner());
                            }
                        }
                        if queues.is_empty() {
                            self.ready.remove(&route);
                        }
                    }
                }
                (None, None) => {}
            }
            if let Some(key) = job.group_key()
                && let Some(set) = self.groups.get_mut(&key)
            {
                set.remove(&rank);
                if set.is_empty() {
                    self.groups.remove(&key);
                }
            }
        }
        if job.awaiting_start() {
            self.awaiting_start.remove(&id);
        }
    }

    /// Puts a job into the indexes its state puts it in.
    fn add(&mut self, job: &JobRecord) {
        let (id, state, model, priority, rank) =
            (job.id, job.state, job.model(), job.priority(), job.rank());
        if !state.is_terminal() {
            self.active.insert(id);
        }
        *self.counts.entry(state).or_default() += 1;
        if let (JobState::Queued, Some(m)) = (state, model) {
            *self.backlog.entry((m, priority)).or_default() += 1;
        }
        if job.occupies() {
            *self.running.entry(job.owner().to_owned()).or_default() += 1;
        }
        if job.waiting() {
            *self.waiting.entry(job.owner().to_owned()).or_default() += 1;
            match (job.local.hold_until, job.route()) {
                (Some(until), _) => {
                    self.holds.insert((until, id));
                }
                (None, Some(route)) => {
                    self.ready
                        .entry(route)
                        .or_default()
                        .entry(job.owner().to_owned())
                        .or_default()
                        .insert(job.queue_key());
                }
                (None, None) => {}
            }
            if let Some(key) = job.group_key() {
                self.groups.entry(key).or_default().insert(rank);
            }
            // Kept across changes while it waits: its wait began when it first did.
            self.waiting_since.entry(id).or_insert_with(Instant::now);
        } else {
            self.waiting_since.remove(&id);
        }
        if job.awaiting_start() {
            self.awaiting_start.insert(id);
        }
    }
}
