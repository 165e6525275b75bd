//! The handle every role of a scheduler is given: configuration, storage, metrics, the event
//! publisher of the current session, and each role's state in a type of its own: the replica of the
//! stream ([`crate::replica`]), leadership ([`crate::leader`]), the snapshot writer
//! ([`crate::snapshot`]). No field is public: a role reaches what it may touch through a method.
//! Here too the operations every scheduler performs whatever its role: publishing events,
//! cancelling, the gauges.

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard, RwLock};
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
    CancelRequest, Event, EventKind, FailureKind, ImageRef, JobId, ModelFamily, PersonEvent,
    Priority,
};
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::leader::Leadership;
use crate::metrics::{Metrics, WORKER_STATES};
use crate::registry::{CancelRefusal, Registry};
use crate::replica::Replica;
use crate::snapshot::SnapshotWriter;

/// How long an event published here (a token's, a queue control's) may take to come back from
/// the stream before the API answers 503.
const READ_BACK: Duration = Duration::from_secs(10);

/// A scheduler, cheap to clone (every HTTP handler and intake task holds one).
#[derive(Clone)]
pub struct Scheduler(Arc<Inner>);

struct Inner {
    config: Config,
    topology: vnfarm_proto::topology::Topology,
    storage: Storage,
    metrics: Metrics,
    replica: Replica,
    publisher: RwLock<Option<Publisher>>,
    /// The publisher of the API's requests (see [`Lane::Requests`]).
    requests: RwLock<Option<Publisher>>,
    /// Woken when dispatching may be possible (new job, freed slot, new worker).
    dispatch_wanted: Notify,
    leadership: Leadership,
    snapshots: SnapshotWriter,
    /// Cancelled at shutdown; long-lived HTTP streams end on it.
    shutdown: tokio_util::sync::CancellationToken,
    /// When it started: it has heard every live worker once a heartbeat timeout has passed.
    started: std::time::Instant,
}

/// Which of the session's publishers a publish goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// What the scheduler decides and the active one's work (dispatches, intake, follow-ups,
    /// markers): a publish that gets no confirm in time ends the session, which reads the stream
    /// again before it decides anything more (`PublishError::Untrusted`).
    Session,
    /// The HTTP API's requests (a submission's `queued` event, a cancellation): each stands alone
    /// and its client is told when it was not confirmed (503), so a publish that gets no confirm
    /// in time costs this lane a fresh channel, not the session. A standby whose API published
    /// into a stream whose leader was on a box just cut off lost its session to that publish's
    /// 10 s timeout exactly when the leader token came free (the three-box test's takeovers of
    /// 14–22 s).
    Requests,
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
        let registry = Registry::new(crate::registry::Retention::of(&config));
        let snapshots = SnapshotWriter::new(
            config.snapshot_every_events,
            topology.snapshot_stream(),
            metrics.clone(),
        );
        let leadership = Leadership::new(metrics.scheduler_active.clone());
        Self(Arc::new(Inner {
            config,
            topology,
            storage,
            metrics,
            replica: Replica::new(registry),
            publisher: RwLock::new(None),
            requests: RwLock::new(None),
            dispatch_wanted: Notify::new(),
            leadership,
            snapshots,
            shutdown,
            started: std::time::Instant::now(),
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
        self.0.replica.subscribe()
    }

    /// Woken on every applied event (submitters wait for their job to appear).
    pub(crate) fn applied(&self) -> &Notify {
        self.0.replica.applied()
    }

    /// Woken when dispatching may be possible (new job, freed slot, new worker).
    pub(crate) fn dispatch_wanted(&self) -> &Notify {
        &self.0.dispatch_wanted
    }

    /// The copy of the stream every scheduler keeps.
    pub(crate) fn replica(&self) -> &Replica {
        &self.0.replica
    }

    pub(crate) fn snapshots(&self) -> &SnapshotWriter {
        &self.0.snapshots
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.0.replica.registry()
    }

    /// Replaces the registry (a snapshot loaded before the first replay).
    pub(crate) fn set_registry(&self, registry: Registry) {
        self.0.replica.replace(registry);
    }

    pub fn is_ready(&self) -> bool {
        self.0.replica.is_ready()
    }

    /// Whether it has been listening to heartbeats long enough to have heard every live worker
    /// (what the workers advertise is complete).
    pub(crate) fn has_heard_the_fleet(&self) -> bool {
        self.0.started.elapsed() >= self.heartbeat_timeout()
    }

    pub(crate) fn set_ready(&self) {
        self.0.replica.set_ready();
    }

    /// Whether this scheduler holds the leader token (see [`crate::leader`]).
    pub fn is_active(&self) -> bool {
        self.0.leadership.is_active()
    }

    pub(crate) fn leadership(&self) -> &Leadership {
        &self.0.leadership
    }

    pub(crate) fn set_publisher(&self, publisher: Option<Publisher>) {
        *self.0.publisher.write().unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    pub(crate) fn publisher(&self) -> Result<Publisher, PublishError> {
        current(&self.0.publisher)
    }

    /// The session's publisher for the API's requests (see [`Lane::Requests`]); the session
    /// replaces it when it stops confirming.
    pub(crate) fn set_requests_publisher(&self, publisher: Option<Publisher>) {
        *self.0.requests.write().unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    pub(crate) fn publisher_on(&self, lane: Lane) -> Result<Publisher, PublishError> {
        match lane {
            Lane::Session => self.publisher(),
            Lane::Requests => current(&self.0.requests),
        }
    }

    pub(crate) async fn publish_event(
        &self,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        self.publish_event_on(Lane::Session, job_id, kind).await
    }

    pub(crate) async fn publish_event_on(
        &self,
        lane: Lane,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        let event = Event::now(job_id, kind);
        self.publish_to_stream(lane, &event.routing_key(), &event)
            .await
    }

    /// A person's event (a token made or revoked, a cancel asked for) on the API's lane.
    pub(crate) async fn publish_person(&self, event: &PersonEvent) -> Result<(), PublishError> {
        self.publish_to_stream(Lane::Requests, &event.routing_key(), event)
            .await
    }

    /// Waits until `found` finds what an event published here did to the registry: `None` when
    /// it has not come back from the stream within [`READ_BACK`].
    pub(crate) async fn read_back_event<T>(
        &self,
        found: impl Fn(&Registry) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + READ_BACK;
        loop {
            let notified = self.applied().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(t) = found(&self.registry()) {
                return Some(t);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// Publishes to the events exchange, whose stream every scheduler reads.
    async fn publish_to_stream(
        &self,
        lane: Lane,
        routing_key: &str,
        body: &impl serde::Serialize,
    ) -> Result<(), PublishError> {
        self.publisher_on(lane)?
            .publish_json(
                &self.topology().events_exchange(),
                routing_key,
                body,
                json_properties(),
            )
            .await
    }

    pub(crate) fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.config().heartbeat_timeout_ms)
    }

    /// Applies one event from the stream (see [`Replica::apply`]), owes the snapshot writer one
    /// more event and wakes the dispatcher.
    pub(crate) fn apply(&self, ev: SequencedEvent, live: bool) {
        self.0.replica.apply(ev, live, &self.0.metrics);
        self.0.snapshots.event_applied();
        self.0.dispatch_wanted.notify_one();
    }

    /// Applies a person's event from the stream and owes the snapshot writer one more event (a
    /// snapshot must carry the token before its event ages out of the stream); wakes the
    /// dispatcher (a resume or a move to the front changes what goes next).
    pub(crate) fn apply_person(&self, seq: u64, ev: &PersonEvent) {
        self.0.replica.apply_person(seq, ev);
        self.0.snapshots.event_applied();
        self.0.dispatch_wanted.notify_one();
    }

    /// A marker came back from the stream.
    pub(crate) fn marker_seen(&self, routing_key: &str, seq: Option<u64>) {
        self.0.replica.marker_seen(routing_key, seq);
    }

    /// The current term's number, recorded on every `dispatched` event of the term.
    pub(crate) fn current_term(&self) -> Option<u64> {
        self.0.leadership.current_term()
    }

    /// Cancels a job (and a pipeline's unfinished jobs). Queued jobs are cancelled at once; jobs on a
    /// worker are stopped there between steps, and the worker reports `cancelled`. Any scheduler may
    /// cancel: the stream's first terminal event wins, and a worker that gets a cancelled job later
    /// skips it. `by` is the person asking, named in the `cancelled` events this scheduler writes.
    pub async fn cancel(&self, id: JobId, by: &str) -> Result<(), CancelError> {
        let targets = self
            .registry()
            .request_cancel(id, by)
            .map_err(|r| match r {
                CancelRefusal::NotFound => CancelError::NotFound(id),
                CancelRefusal::Finished(state) => CancelError::Finished(id, state),
            })?;
        let unavailable = |e: PublishError| CancelError::Unavailable(e.to_string());
        for (t, here) in targets {
            if !here {
                // Its worker writes the `cancelled` event, which cannot name `by`: record who
                // asked first, where every scheduler reads it.
                let asked = PersonEvent::now(
                    by,
                    vnfarm_proto::PersonEventKind::CancelRequested { job_id: t },
                );
                self.publish_person(&asked).await.map_err(unavailable)?;
            }
            let publisher = self.publisher_on(Lane::Requests).map_err(unavailable)?;
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
                self.publish_event_on(
                    Lane::Requests,
                    t,
                    EventKind::Cancelled {
                        reason: "cancelled by request".into(),
                        by: Some(by.to_owned()),
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
