//! The replica: what every scheduler, active or standby, keeps as its copy of the event stream. The
//! registry behind its lock, the broadcast of applied events to live SSE clients, the notify that
//! submitters wait on, whether the stream has been read up to this process's marker once, and the
//! markers read back. The session feeds it (events through [`Replica::apply`], markers through
//! [`Replica::marker_seen`]); every other role only reads it or takes decisions under its lock.
//!
//! The registry sits behind a `std::sync::Mutex` that is never held across an `.await`: decisions
//! are taken under the lock, then published without it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::{Notify, broadcast};
use vnfarm_bus::Publisher;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::topology::{MARKER_ROUTING_PREFIX, Topology};
use vnfarm_proto::{EventKind, JobId, PersonEvent};

use crate::metrics::Metrics;
use crate::registry::Registry;

/// How many of the markers read back are remembered (a term's start waits for its own).
const MARKERS_KEPT: usize = 64;

pub(crate) struct Replica {
    registry: Mutex<Registry>,
    /// Every event applied from the stream, for live SSE clients.
    events: broadcast::Sender<SequencedEvent>,
    /// Woken on every applied event and marker (submitters wait for their job to appear).
    applied: Notify,
    /// The event stream has been read up to this process's marker at least once.
    ready: AtomicBool,
    /// Markers this process has read back from the stream (the most recent few), with their
    /// offsets.
    markers: Mutex<VecDeque<(String, Option<u64>)>>,
}

impl Replica {
    pub(crate) fn new(registry: Registry) -> Self {
        let (events, _) = broadcast::channel(4096);
        Self {
            registry: Mutex::new(registry),
            events,
            applied: Notify::new(),
            ready: AtomicBool::new(false),
            markers: Mutex::new(VecDeque::new()),
        }
    }

    pub(crate) fn registry(&self) -> MutexGuard<'_, Registry> {
        // Registry updates do not panic midway (no user code runs under the lock); keep serving.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the registry (a snapshot loaded before the first replay).
    pub(crate) fn replace(&self, registry: Registry) {
        *self.registry() = registry;
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The stream has been read up to this process's marker.
    pub(crate) fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    /// Every event applied from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<SequencedEvent> {
        self.events.subscribe()
    }

    /// Woken on every applied event and marker.
    pub(crate) fn applied(&self) -> &Notify {
        &self.applied
    }

    /// Applies one event from the stream. `live`: read after this process's first catch-up, so it
    /// feeds the metrics (replayed history does not).
    pub(crate) fn apply(&self, ev: SequencedEvent, live: bool, metrics: &Metrics) {
        let applied = {
            let mut reg = self.registry();
            if live {
                observe(metrics, &reg, &ev);
            }
            reg.apply(ev.clone())
        };
        metrics.events_applied_total.inc();
        if applied {
            // No SSE client listening is fine.
            let _ = self.events.send(ev);
        }
        self.applied.notify_waiters();
    }

    /// Applies a person's event from the stream: from the moment this returns, this scheduler
    /// takes or refuses their token as the event says (or knows who asked for a cancel).
    pub(crate) fn apply_person(&self, seq: u64, ev: &PersonEvent) {
        let changed = self.registry().apply_person(seq, ev);
        if changed {
            tracing::info!(person = %ev.person, event = ev.routing_key(), "a person's event applied");
        }
        self.applied.notify_waiters();
    }

    /// A marker came back from the stream.
    pub(crate) fn marker_seen(&self, routing_key: &str, seq: Option<u64>) {
        if let Some(seq) = seq {
            self.registry().skip(seq);
        }
        let mut markers = self.markers.lock().unwrap_or_else(|p| p.into_inner());
        markers.push_back((routing_key.to_owned(), seq));
        if markers.len() > MARKERS_KEPT {
            markers.pop_front();
        }
        drop(markers);
        self.applied.notify_waiters();
    }

    /// Waits until the stream has been read up to the marker with `routing_key`; returns the
    /// marker's offset in the stream.
    pub(crate) async fn wait_marker(&self, routing_key: &str) -> Option<u64> {
        loop {
            let notified = self.applied.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some((_, seq)) = self
                .markers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|(m, _)| m == routing_key)
            {
                return *seq;
            }
            notified.await;
        }
    }
}

/// Metrics for an event about to be applied live.
fn observe(metrics: &Metrics, reg: &Registry, ev: &SequencedEvent) {
    let Some(job) = reg.job(ev.event.job_id) else {
        return;
    };
    if job.state().is_terminal() {
        return;
    }
    let kind = job.kind();
    let seconds = |from: chrono::DateTime<chrono::Utc>| {
        (ev.event.at - from).num_milliseconds().max(0) as f64 / 1000.0
    };
    match &ev.event.kind {
        EventKind::Started { .. } => metrics
            .queue_wait_seconds
            .with_label_values(&[kind])
            .observe(seconds(job.created_at())),
        EventKind::Completed { .. } => {
            if let Some(started) = job.started_at() {
                metrics
                    .job_run_seconds
                    .with_label_values(&[kind])
                    .observe(seconds(started));
            }
            metrics
                .jobs_finished_total
                .with_label_values(&[kind, "completed"])
                .inc();
        }
        EventKind::Failed {
            retryable: false, ..
        } => metrics
            .jobs_finished_total
            .with_label_values(&[kind, "failed"])
            .inc(),
        EventKind::Cancelled { .. } => metrics
            .jobs_finished_total
            .with_label_values(&[kind, "cancelled"])
            .inc(),
        EventKind::Queued { .. }
        | EventKind::Dispatched { .. }
        | EventKind::Requeued { .. }
        | EventKind::Progress { .. }
        | EventKind::Failed { .. } => {}
    }
}

/// Publishes a marker to the event stream and returns its routing key: once the replica has read
/// it back ([`Replica::wait_marker`]), it holds every event published before.
pub(crate) async fn publish_marker(
    publisher: &Publisher,
    topology: &Topology,
) -> anyhow::Result<String> {
    let key = format!("{MARKER_ROUTING_PREFIX}.{}", JobId::new());
    publisher
        .publish(&topology.events_exchange(), &key, b"{}", json_properties())
        .await?;
    Ok(key)
}
