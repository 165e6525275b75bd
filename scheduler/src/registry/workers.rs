//! What the scheduler knows about each worker: its latest heartbeat, the jobs dispatched to it
//! (counted at dispatch, not when the worker reports), the batch messages those jobs travel in
//! (each holds one of the worker's slots), and the affinity keys of the inputs whose encodings it
//! holds.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use vnfarm_proto::catalogue::ContentHash;
use vnfarm_proto::{Heartbeat, JobId, ModelFamily, WorkerId, WorkerState};

/// A key the worker no longer advertises is forgotten this long after it was last confirmed or
/// dispatched (a dispatch counts before the worker's next heartbeat can show it).
pub(super) const KEY_GRACE: Duration = Duration::from_secs(30);

/// Which workers may run a job: its model family and, for a generate that names one, the SDXL
/// checkpoint, with the catalogue's file it stood for at acceptance when no worker advertised
/// the name (then a worker that serves catalogue checkpoints may fetch it: `names.rs`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    pub model: ModelFamily,
    pub checkpoint: Option<String>,
    pub catalogue: Option<ContentHash>,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.checkpoint, &self.catalogue) {
            (Some(c), Some(_)) => write!(
                f,
                "{} checkpoint {c} or fetches the catalogue's checkpoints",
                self.model
            ),
            (Some(c), None) => write!(f, "{} checkpoint {c}", self.model),
            (None, _) => write!(f, "{}", self.model),
        }
    }
}

#[derive(Clone, Debug)]
pub struct WorkerRecord {
    pub(super) id: WorkerId,
    pub(super) last_heartbeat: Option<(Instant, Heartbeat)>,
    /// Jobs dispatched to it and not yet finished or returned, each with the first job of the
    /// message it travels in.
    pub(super) assigned: BTreeMap<JobId, JobId>,
    /// Messages on it (by their first job) with how many of their jobs are still assigned.
    pub(super) messages: HashMap<JobId, u32>,
    /// Affinity keys of what it holds, with when each was last confirmed by a heartbeat or a
    /// dispatch.
    pub(super) keys: HashMap<String, Instant>,
    /// Messages on it (by their first job) whose unstarted jobs this scheduler asked back (a
    /// yield), until the message's last job leaves it.
    pub(super) yields: HashSet<JobId>,
    /// Jobs that started here and that its beats no longer list, with the first beat that did not.
    pub(super) unheld: HashMap<JobId, Instant>,
}

impl WorkerRecord {
    pub(super) fn new(id: WorkerId) -> Self {
        Self {
            id,
            last_heartbeat: None,
            assigned: BTreeMap::new(),
            messages: HashMap::new(),
            keys: HashMap::new(),
            yields: HashSet::new(),
            unheld: HashMap::new(),
        }
    }

    pub fn id(&self) -> &WorkerId {
        &self.id
    }

    /// Jobs dispatched to it and not yet finished or returned.
    pub fn assigned(&self) -> impl Iterator<Item = JobId> + '_ {
        self.assigned.keys().copied()
    }

    /// Jobs on it: the load the policy balances.
    pub fn load(&self) -> usize {
        self.assigned.len()
    }

    pub fn last_heartbeat(&self) -> Option<&(Instant, Heartbeat)> {
        self.last_heartbeat.as_ref()
    }

    /// The protocol versions of work messages it decodes, from its latest heartbeat (version 1
    /// alone before its first: every worker reads that).
    pub fn protocols(&self) -> &[u32] {
        self.last_heartbeat
            .as_ref()
            .map_or(&[vnfarm_proto::MIN_PROTOCOL_VERSION][..], |(_, hb)| {
                &hb.protocols
            })
    }

    pub fn alive(&self, timeout: Duration) -> bool {
        self.last_heartbeat
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < timeout)
    }

    /// Ready, recently heard from, serving the route's model and checkpoint.
    pub(super) fn serves(&self, route: &Route, timeout: Duration) -> bool {
        self.last_heartbeat.as_ref().is_some_and(|(at, hb)| {
            at.elapsed() < timeout
                && hb.state == WorkerState::Ready
                && hb.models.contains(&route.model)
                && super::names::serves_checkpoint(hb, route)
        })
    }

    /// Its latest beat names the model (in any state: a warming worker will serve it).
    pub(super) fn advertises_model(&self, model: ModelFamily) -> bool {
        self.last_heartbeat
            .as_ref()
            .is_some_and(|(_, hb)| hb.models.contains(&model))
    }

    /// Has a free slot: fewer messages on it than its prefetch.
    pub(super) fn has_slot(&self) -> bool {
        self.last_heartbeat
            .as_ref()
            .is_some_and(|(_, hb)| (self.messages.len() as u32) < hb.slots)
    }

    /// Serves the route and has a free slot.
    pub(super) fn can_take(&self, route: &Route, timeout: Duration) -> bool {
        self.serves(route, timeout) && self.has_slot()
    }

    /// The most jobs one message to it may carry.
    pub(super) fn max_batch(&self) -> u32 {
        self.last_heartbeat
            .as_ref()
            .map_or(1, |(_, hb)| hb.max_batch.max(1))
    }

    /// The jobs still on it of the message that `lead` names.
    pub(super) fn jobs_of(&self, lead: JobId) -> impl Iterator<Item = JobId> + '_ {
        self.assigned
            .iter()
            .filter(move |(_, m)| **m == lead)
            .map(|(job, _)| *job)
    }

    /// Its latest beat lists the catalogue file in its model cache.
    pub(super) fn caches(&self, sha256: &str) -> bool {
        self.last_heartbeat.as_ref().is_some_and(|(_, hb)| {
            hb.model_cache
                .as_ref()
                .is_some_and(|held| held.iter().any(|h| h == sha256))
        })
    }

    pub(super) fn holds(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// Its latest beat lists the input's encodings (it holds them, not only the image it made).
    pub(super) fn has_encodings(&self, key: &str) -> bool {
        self.last_heartbeat
            .as_ref()
            .is_some_and(|(_, hb)| hb.encode_cache.iter().any(|k| k == key))
    }

    pub(super) fn assign(&mut self, job: JobId, message: JobId) {
        if let Some(old) = self.assigned.insert(job, message) {
            self.release(old);
        }
        *self.messages.entry(message).or_default() += 1;
    }

    /// Takes a job off it; its message's slot frees with the message's last job.
    pub(super) fn unassign(&mut self, job: JobId) {
        self.unheld.remove(&job);
        if let Some(message) = self.assigned.remove(&job) {
            self.release(message);
        }
    }

    /// Notes which of `running` (jobs started here, by the stream) its latest beat lists as held;
    /// a worker whose beats say nothing of what it holds (one before that field) is trusted.
    pub(super) fn check_held(&mut self, running: &[JobId], now: Instant) {
        let Some(holding) = self
            .last_heartbeat
            .as_ref()
            .and_then(|(_, hb)| hb.holding.as_ref())
        else {
            self.unheld.clear();
            return;
        };
        self.unheld.retain(|job, _| running.contains(job));
        for job in running {
            if holding.contains(job) {
                self.unheld.remove(job);
            } else {
                self.unheld.entry(*job).or_insert(now);
            }
        }
    }

    /// The jobs of `unheld` that no beat has listed for `grace`, by a beat newer than that.
    pub(super) fn unheld_for(&self, grace: Duration) -> impl Iterator<Item = JobId> + '_ {
        let latest = self.last_heartbeat.as_ref().map(|(at, _)| *at);
        self.unheld
            .iter()
            .filter(move |(_, since)| latest.is_some_and(|at| at >= **since + grace))
            .map(|(job, _)| *job)
    }

    fn release(&mut self, message: JobId) {
        if let Some(n) = self.messages.get_mut(&message) {
            *n -= 1;
            if *n == 0 {
                self.messages.remove(&message);
                self.yields.remove(&message);
            }
        }
    }

    pub(super) fn clear_assignments(&mut self) {
        self.assigned.clear();
        self.messages.clear();
        self.yields.clear();
    }

    /// Takes a heartbeat: its encode-cache keys are confirmed now, keys it no longer lists are
    /// forgotten once their grace has passed (they were evicted).
    pub(super) fn heartbeat(&mut self, hb: Heartbeat, now: Instant) {
        for key in &hb.encode_cache {
            self.keys.insert(key.clone(), now);
        }
        self.keys
            .retain(|_, at| now.saturating_duration_since(*at) < KEY_GRACE);
        self.last_heartbeat = Some((now, hb));
    }

    /// `ready`, `warming`, `draining` or `gone`.
    pub fn state_name(&self, timeout: Duration) -> &'static str {
        match &self.last_heartbeat {
            Some((at, hb)) if at.elapsed() < timeout => match hb.state {
                WorkerState::Ready => "ready",
                WorkerState::Warming => "warming",
                WorkerState::Draining => "draining",
            },
            _ => "gone",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::testing::worker;

    #[test]
    fn a_messages_slot_frees_with_its_last_job() {
        let mut w = WorkerRecord::new("a".parse().unwrap());
        w.heartbeat(worker("a", 1), Instant::now());
        let (lead, other) = (JobId::new(), JobId::new());
        w.assign(lead, lead);
        w.assign(other, lead);
        assert!(!w.has_slot(), "one message takes the one slot");
        assert_eq!(w.load(), 2);
        w.unassign(lead);
        assert!(!w.has_slot(), "its other job is still on the worker");
        w.unassign(other);
        assert!(w.has_slot());
        assert_eq!(w.load(), 0);
    }

    #[test]
    fn a_job_assigned_again_leaves_its_old_message() {
        let mut w = WorkerRecord::new("a".parse().unwrap());
        w.heartbeat(worker("a", 2), Instant::now());
        let (job, first, second) = (JobId::new(), JobId::new(), JobId::new());
        w.assign(job, first);
        w.assign(job, second);
        assert_eq!(w.load(), 1);
        assert_eq!(w.messages.len(), 1, "{:?}", w.messages);
        assert_eq!(w.jobs_of(second).collect::<Vec<_>>(), [job]);
    }

    #[test]
    fn a_key_the_worker_stops_listing_is_forgotten_after_its_grace() {
        let mut w = WorkerRecord::new("a".parse().unwrap());
        let now = Instant::now();
        let listing = Heartbeat {
            encode_cache: vec!["qwen_edit:k".into()],
            ..worker("a", 1)
        };
        w.heartbeat(listing, now);
        w.heartbeat(worker("a", 1), now + KEY_GRACE / 2);
        assert!(w.holds("qwen_edit:k"), "within its grace");
        w.heartbeat(worker("a", 1), now + KEY_GRACE);
        assert!(!w.holds("qwen_edit:k"));
    }
}
