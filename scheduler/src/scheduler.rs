//! The scheduler's shared state: configuration, the registry behind its lock, the broker publishers
//! of the current session, whether this scheduler is the active one, and the operations every
//! scheduler performs whatever its role: publishing events, applying the stream, cancelling, the
//! gauges.
//!
//! The registry sits behind a `std::sync::Mutex` that is never held across an `.await`: decisions
//! are taken under the lock, then published without it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use base64::Engine as _;
use lapin::BasicProperties;
use tokio::sync::{Notify, broadcast};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher};
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::http::JobState;
use vnfarm_proto::topology::CANCEL_ROUTING_KEY;
use vnfarm_proto::{
    CancelRequest, Event, EventKind, FailureKind, ImageRef, JobId, ModelFamily, Priority,
};
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::metrics::{Metrics, WORKER_STATES};
use crate::registry::{CancelRefusal, Registry};

#[derive(Clone)]
pub struct Scheduler(Arc<Inner>);

struct Inner {
    config: Config,
    topology: vnfarm_proto::topology::Topology,
    storage: Storage,
    metrics: Metrics,
    registry: Mutex<Registry>,
    publisher: RwLock<Option<Publisher>>,
    snapshot_publisher: RwLock<Option<Publisher>>,
    /// Every event applied from the stream, for live SSE clients.
    events: broadcast::Sender<SequencedEvent>,
    /// Woken on every applied event (submitters wait for their job to appear).
    applied: Notify,
    /// Woken when dispatching may be possible (new job, freed slot, new worker).
    dispatch_wanted: Notify,
    /// The event stream has been read up to this process's marker at least once.
    ready: AtomicBool,
    /// This scheduler holds the leader token (see [`crate::leader`]).
    active: AtomicBool,
    /// Markers this process has read back from the stream (the most recent few), with their
    /// offsets.
    markers: Mutex<VecDeque<(String, Option<u64>)>>,
    /// The current term's number while this scheduler leads: the stream offset of the marker its
    /// term began with, so a later term always has a larger one (0: none yet).
    term: AtomicU64,
    /// Events applied since the last snapshot was written.
    since_snapshot: AtomicU64,
    last_snapshot: Mutex<Option<std::time::Instant>>,
    /// Cancelled at shutdown; long-lived HTTP streams end on it.
    shutdown: tokio_util::sync::CancellationToken,
}

/// Why a cancellation was refused.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("job {0} not found")]
    NotFound(JobId),
    #[error("job {0} already finished ({1:?})")]
    Finished(JobId, JobState),
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl Scheduler {
    pub fn new(
        config: Config,
        storage: Storage,
        metrics: Metrics,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        let topology = config.amqp.topology();
        let (events, _) = broadcast::channel(4096);
        let registry = Registry::new(config.retention());
        Self(Arc::new(Inner {
            config,
            topology,
            storage,
            metrics,
            registry: Mutex::new(registry),
            publisher: RwLock::new(None),
            snapshot_publisher: RwLock::new(None),
            events,
            applied: Notify::new(),
            dispatch_wanted: Notify::new(),
            ready: AtomicBool::new(false),
            active: AtomicBool::new(false),
            markers: Mutex::new(VecDeque::new()),
            term: AtomicU64::new(0),
            since_snapshot: AtomicU64::new(0),
            last_snapshot: Mutex::new(None),
            shutdown,
        }))
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }

    /// The broker names of this installation (its prefix applied).
    pub fn topology(&self) -> &vnfarm_proto::topology::Topology {
        &self.0.topology
    }

    pub fn storage(&self) -> &Storage {
        &self.0.storage
    }

    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// Cancelled at shutdown; long-lived HTTP streams end on it.
    pub fn shutdown(&self) -> &tokio_util::sync::CancellationToken {
        &self.0.shutdown
    }

    /// Every event applied from the stream from now on, for a live SSE client.
    pub fn subscribe(&self) -> broadcast::Receiver<SequencedEvent> {
        self.0.events.subscribe()
    }

    /// Woken on every applied event (submitters wait for their job to appear).
    pub(crate) fn applied(&self) -> &Notify {
        &self.0.applied
    }

    /// Woken when dispatching may be possible (new job, freed slot, new worker).
    pub(crate) fn dispatch_wanted(&self) -> &Notify {
        &self.0.dispatch_wanted
    }

    /// Events applied since the last snapshot was written.
    pub(crate) fn since_snapshot(&self) -> &AtomicU64 {
        &self.0.since_snapshot
    }

    /// When the last snapshot was written.
    pub(crate) fn last_snapshot(&self) -> &Mutex<Option<std::time::Instant>> {
        &self.0.last_snapshot
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        // Registry updates do not panic midway (no user code runs under the lock); keep serving.
        self.0.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the registry (a snapshot loaded before the first replay).
    pub(crate) fn set_registry(&self, registry: Registry) {
        *self.registry() = registry;
    }

    pub fn is_ready(&self) -> bool {
        self.0.ready.load(Ordering::SeqCst)
    }

    pub(crate) fn set_ready(&self) {
        self.0.ready.store(true, Ordering::SeqCst);
    }

    pub fn is_active(&self) -> bool {
        self.0.active.load(Ordering::SeqCst)
    }

    pub(crate) fn set_active(&self, active: bool) {
        self.0.active.store(active, Ordering::SeqCst);
        self.metrics().scheduler_active.set(i64::from(active));
    }

    pub(crate) fn set_publisher(&self, publisher: Option<Publisher>) {
        *self.0.publisher.write().unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    pub(crate) fn set_snapshot_publisher(&self, publisher: Option<Publisher>) {
        *self
            .0
            .snapshot_publisher
            .write()
            .unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    pub(crate) fn publisher(&self) -> Result<Publisher, PublishError> {
        current(&self.0.publisher)
    }

    pub(crate) fn snapshot_publisher(&self) -> Result<Publisher, PublishError> {
        current(&self.0.snapshot_publisher)
    }

    pub(crate) async fn publish_event(
        &self,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        let event = Event::now(job_id, kind);
        self.publisher()?
            .publish_json(
                &self.topology().events_exchange(),
                &event.routing_key(),
                &event,
                json_properties(),
            )
            .await
    }

    pub(crate) fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.config().heartbeat_timeout_ms)
    }

    /// Applies one event from the stream. `live`: read after this process's first catch-up, so it
    /// feeds the metrics (replayed history does not).
    pub(crate) fn apply(&self, ev: SequencedEvent, live: bool) {
        let applied = {
            let mut reg = self.registry();
            if live {
                self.observe(&reg, &ev);
            }
            reg.apply(ev.clone())
        };
        self.metrics().events_applied_total.inc();
        self.0.since_snapshot.fetch_add(1, Ordering::Relaxed);
        if applied {
            // No SSE client listening is fine.
            let _ = self.0.events.send(ev);
        }
        self.0.applied.notify_waiters();
        self.0.dispatch_wanted.notify_one();
    }

    /// A marker came back from the stream.
    pub(crate) fn marker_seen(&self, routing_key: &str, seq: Option<u64>) {
        if let Some(seq) = seq {
            self.registry().skip(seq);
        }
        let mut markers = self.0.markers.lock().unwrap_or_else(|p| p.into_inner());
        markers.push_back((routing_key.to_owned(), seq));
        if markers.len() > 64 {
            markers.pop_front();
        }
        drop(markers);
        self.0.applied.notify_waiters();
    }

    /// Waits until the stream has been read up to the marker with `routing_key`; returns the
    /// marker's offset in the stream.
    pub(crate) async fn wait_marker(&self, routing_key: &str) -> Option<u64> {
        loop {
            let notified = self.0.applied.notified();
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

    /// Begins a term numbered `term` (see [`Inner::term`]).
    pub(crate) fn set_term(&self, term: u64) {
        self.0.term.store(term, Ordering::SeqCst);
    }

    /// The current term's number, recorded on every `dispatched` event of the term.
    pub(crate) fn current_term(&self) -> Option<u64> {
        Some(self.0.term.load(Ordering::SeqCst)).filter(|t| *t > 0)
    }

    /// Metrics for an event about to be applied live.
    fn observe(&self, reg: &Registry, ev: &SequencedEvent) {
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
            EventKind::Started { .. } => self
                .metrics()
                .queue_wait_seconds
                .with_label_values(&[kind])
                .observe(seconds(job.created_at())),
            EventKind::Completed { .. } => {
                if let Some(started) = job.started_at() {
                    self.metrics()
                        .job_run_seconds
                        .with_label_values(&[kind])
                        .observe(seconds(started));
                }
                self.metrics()
                    .jobs_finished_total
                    .with_label_values(&[kind, "completed"])
                    .inc();
            }
            EventKind::Failed {
                retryable: false, ..
            } => self
                .metrics()
                .jobs_finished_total
                .with_label_values(&[kind, "failed"])
                .inc(),
            EventKind::Cancelled { .. } => self
                .metrics()
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

    /// Cancels a job (and a pipeline's unfinished jobs). Queued jobs are cancelled at once; jobs on a
    /// worker are stopped there between steps, and the worker reports `cancelled`. Any scheduler may
    /// cancel: the stream's first terminal event wins, and a worker that gets a cancelled job later
    /// skips it.
    pub async fn cancel(&self, id: JobId) -> Result<(), CancelError> {
        let targets = self.registry().request_cancel(id).map_err(|r| match r {
            CancelRefusal::NotFound => CancelError::NotFound(id),
            CancelRefusal::Finished(state) => CancelError::Finished(id, state),
        })?;
        let unavailable = |e: PublishError| CancelError::Unavailable(e.to_string());
        for (t, here) in targets {
            let publisher = self.publisher().map_err(unavailable)?;
            let request = CancelRequest::new(t);
            let props = json_properties().with_delivery_mode(1);
            // With no worker connected nobody hears it, and none has the job.
            publisher
                .broadcast_json(
                    &self.topology().events_exchange(),
                    CANCEL_ROUTING_KEY,
                    &request,
                    props,
                )
                .await
                .map_err(unavailable)?;
            if here {
                self.publish_event(
                    t,
                    EventKind::Cancelled {
                        reason: "cancelled by request".into(),
                    },
                )
                .await
                .map_err(unavailable)?;
            }
        }
        Ok(())
    }

    /// Sends `body` to the dead-letter exchange; `failure` is the one its headers name.
    pub(crate) async fn dead_letter(
        &self,
        body: &[u8],
        failure: FailureKind,
        headers: lapin::types::FieldTable,
    ) -> Result<(), PublishError> {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        self.publisher()?
            .publish(&self.topology().dead_exchange(), "", body, props)
            .await?;
        self.metrics()
            .dead_letters_total
            .with_label_values(&[failure.as_str()])
            .inc();
        Ok(())
    }

    /// Refreshes the gauges derived from the registry. O(models × priorities + workers).
    pub(crate) fn update_gauges(&self) {
        let reg = self.registry();
        let timeout = self.heartbeat_timeout();
        for state in JobState::ALL.into_iter().filter(|s| !s.is_terminal()) {
            self.metrics()
                .jobs
                .with_label_values(&[state.as_str()])
                .set(reg.count(state) as i64);
        }
        self.metrics().registry_jobs.set(reg.len() as i64);
        for model in ModelFamily::ALL {
            for (priority, label) in [
                (Priority::Interactive, "interactive"),
                (Priority::Batch, "batch"),
            ] {
                self.metrics()
                    .backlog
                    .with_label_values(&[model.as_str(), label])
                    .set(reg.backlog(model, priority) as i64);
            }
        }
        let mut counts: HashMap<&str, i64> = WORKER_STATES.iter().map(|s| (*s, 0)).collect();
        let mut by_model: HashMap<(ModelFamily, &str), i64> = HashMap::new();
        for w in reg.workers() {
            let state = w.state_name(timeout);
            *counts.entry(state).or_default() += 1;
            for model in w.last_heartbeat().map_or(&[][..], |(_, hb)| &hb.models) {
                *by_model.entry((*model, state)).or_default() += 1;
            }
        }
        for (state, n) in counts {
            self.metrics().workers.with_label_values(&[state]).set(n);
        }
        for model in ModelFamily::ALL {
            for state in WORKER_STATES {
                let n = by_model.get(&(model, state)).copied().unwrap_or(0);
                self.metrics()
                    .model_workers
                    .with_label_values(&[model.as_str(), state])
                    .set(n);
            }
        }
    }
}

/// The publisher of the current session, or the error a publish on a closed connection gives.
fn current(publisher: &RwLock<Option<Publisher>>) -> Result<Publisher, PublishError> {
    publisher
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or(PublishError::Broker(lapin::Error::from(
            lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed),
        )))
}

/// Base64 of bytes, for tests and tools that build inline inputs.
pub fn inline_image(bytes: &[u8]) -> ImageRef {
    ImageRef::Inline(base64::engine::general_purpose::STANDARD.encode(bytes))
}
