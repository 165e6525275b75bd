//! Where the events of a message's run go while it runs (`started`, `progress`): the broker's events
//! exchange for a worker on its queue, or a local record for `vnfarm-worker bench`, which runs the
//! same path from dequeue to upload without a broker. The set is closed, so an enum.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use vnfarm_bus::{PublishError, Publisher};
use vnfarm_proto::{EventKind, JobId};

use crate::worker::Worker;

#[derive(Clone)]
pub(crate) enum Outbox {
    /// Published to the events exchange (a failed publish is the caller's to handle).
    Bus(Publisher),
    /// Counted by kind, for the benchmark's report and its test.
    Local(LocalEvents),
}

impl Outbox {
    pub(crate) async fn publish(
        &self,
        worker: &Worker,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        match self {
            Outbox::Bus(publisher) => worker.publish_event(publisher, job_id, kind).await,
            Outbox::Local(events) => {
                events.record(kind.name());
                Ok(())
            }
        }
    }

    /// Whether this run can no longer report: its channel missed a confirm
    /// ([`Publisher::is_stuck`]) or was lost with its connection ([`Publisher::is_open`]), so its
    /// delivery comes back to run again; a local record always can.
    pub(crate) fn is_stuck(&self) -> bool {
        match self {
            Outbox::Bus(publisher) => publisher.is_stuck() || !publisher.is_open(),
            Outbox::Local(_) => false,
        }
    }
}

/// Events counted by kind name.
#[derive(Clone, Default)]
pub struct LocalEvents(Arc<Mutex<BTreeMap<&'static str, u64>>>);

impl LocalEvents {
    pub(crate) fn record(&self, kind: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default() += 1;
    }

    /// Each kind seen, with how many times.
    pub fn counts(&self) -> BTreeMap<&'static str, u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
