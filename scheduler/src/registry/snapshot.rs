//! The durable part of a registry (jobs, people, the queue's controls and people's GPU time
//! today, retention order, stream position) as a snapshot
//! writes and reads it (see [`crate::snapshot`]). People are in it because their events age out of
//! the stream like any other: a snapshot written after a token event keeps the token; the measured
//! rates of the estimates likewise (they are learned from events that age out).

use std::collections::VecDeque;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vnfarm_proto::JobId;

use super::people::People;
use super::record::JobRecord;
use super::shares::Shares;
use super::{Rates, Registry, Retention};

/// The durable part of a registry at a stream offset (see [`crate::snapshot`]).
#[derive(Debug, Deserialize)]
pub struct Snapshot {
    next_offset: u64,
    latest: Option<DateTime<Utc>>,
    jobs: Vec<JobRecord>,
    finished: Vec<(DateTime<Utc>, JobId)>,
    /// Absent from the snapshots of schedulers built before people.
    #[serde(default)]
    people: People,
    /// Absent from the snapshots of schedulers built before fair share.
    #[serde(default)]
    shares: Shares,
    /// Absent from the snapshots of schedulers built before estimates: they learn again.
    #[serde(default)]
    rates: Rates,
}

impl Snapshot {
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }
}

/// The durable part of a registry taken under its lock in O(jobs) pointer copies (job records are
/// shared, copied on write), to be serialized without the lock: the dispatcher never waits for a
/// snapshot to be written.
pub struct SnapshotView {
    next_offset: u64,
    latest: Option<DateTime<Utc>>,
    jobs: Vec<Arc<JobRecord>>,
    finished: VecDeque<(DateTime<Utc>, JobId)>,
    people: People,
    shares: Shares,
    rates: Rates,
}

impl SnapshotView {
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Writes it as JSON, in the shape [`Snapshot`] reads.
    pub fn write(&self, out: impl std::io::Write) -> serde_json::Result<()> {
        serde_json::to_writer(out, self)
    }
}

impl Serialize for SnapshotView {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Snapshot", 7)?;
        st.serialize_field("next_offset", &self.next_offset)?;
        st.serialize_field("latest", &self.latest)?;
        st.serialize_field("jobs", &JobsRef(&self.jobs))?;
        st.serialize_field("finished", &self.finished)?;
        st.serialize_field("people", &self.people)?;
        st.serialize_field("shares", &self.shares)?;
        st.serialize_field("rates", &self.rates)?;
        st.end()
    }
}

struct JobsRef<'a>(&'a [Arc<JobRecord>]);

impl Serialize for JobsRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|j| &**j))
    }
}
impl Registry {
    /// The durable part (jobs, retention order, stream position), to be written without the lock.
    pub fn snapshot(&self) -> SnapshotView {
        SnapshotView {
            next_offset: self.next_offset,
            latest: self.latest,
            jobs: self.jobs.shared(),
            finished: self.finished.clone(),
            people: self.people.clone(),
            shares: self.shares.clone(),
            rates: self.rates.clone(),
        }
    }

    /// A registry as a snapshot left it; the indexes are rebuilt.
    pub fn restore(snapshot: Snapshot, retention: Retention) -> Self {
        let mut r = Registry::new(retention);
        r.next_offset = snapshot.next_offset;
        r.latest = snapshot.latest;
        r.finished = snapshot.finished.into();
        r.people = snapshot.people;
        r.shares = snapshot.shares;
        r.rates = snapshot.rates;
        // Inputs before the jobs that take them: in stream order (a pipeline's jobs share their
        // pipeline's offset and have time-ordered ids made in order).
        let mut jobs = snapshot.jobs;
        jobs.sort_by_key(|j| (j.first_seq, j.id));
        for job in jobs {
            if let Some(key) = job
                .submission
                .as_ref()
                .and_then(|s| s.idempotency_key.clone())
            {
                r.idempotency.entry(key).or_insert(job.id);
            }
            r.insert(job);
        }
        r.owed.clear();
        r
    }
}
