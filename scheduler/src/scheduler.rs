//! The scheduler's shared state and its operations: accepting submissions, dispatching, cancelling,
//! handling jobs that come back from worker queues, and applying the event stream.
//!
//! The registry sits behind a `std::sync::Mutex` that is never held across an `.await`: decisions are
//! taken under the lock, then published without it.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use lapin::BasicProperties;
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, broadcast};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher};
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::spec::{MAX_INLINE_IMAGE_BYTES, MAX_INPUT_SIDE, PipelineImage};
use vnfarm_proto::topology::{CANCEL_ROUTING_KEY, Topology, input_key};
use vnfarm_proto::{
    CancelRequest, EditSpec, Event, EventKind, FailureKind, ImageRef, JobId, JobSpec,
    SCHEMA_VERSION, Submission, Task, UpscaleSpec, ValidationError, WorkMessage,
};
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::registry::{FollowUp, JobState, Registry};

#[derive(Clone)]
pub struct Scheduler(Arc<Inner>);

pub struct Inner {
    pub config: Config,
    pub topology: Topology,
    pub storage: Storage,
    pub metrics: Metrics,
    registry: Mutex<Registry>,
    publisher: RwLock<Option<Publisher>>,
    /// Every event applied from the stream, for live SSE clients.
    pub events: broadcast::Sender<SequencedEvent>,
    /// Woken on every applied event (submitters wait for their job to appear).
    pub applied: Notify,
    /// Woken when dispatching may be possible (new job, freed slot, new worker).
    pub dispatch_wanted: Notify,
    ready: std::sync::atomic::AtomicBool,
    /// Cancelled at shutdown; long-lived HTTP streams end on it.
    pub shutdown: tokio_util::sync::CancellationToken,
}

impl std::ops::Deref for Scheduler {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// Why a submission was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    /// The broker or storage is unavailable; the client may retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
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
        Self(Arc::new(Inner {
            config,
            topology,
            storage,
            metrics,
            registry: Mutex::new(Registry::default()),
            publisher: RwLock::new(None),
            events,
            applied: Notify::new(),
            dispatch_wanted: Notify::new(),
            ready: std::sync::atomic::AtomicBool::new(false),
            shutdown,
        }))
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        // Registry updates do not panic midway (no user code runs under the lock); keep serving.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn set_ready(&self) {
        self.ready.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn set_publisher(&self, publisher: Option<Publisher>) {
        *self.publisher.write().unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    fn publisher(&self) -> Result<Publisher, PublishError> {
        self.publisher
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(PublishError::Broker(lapin::Error::from(
                lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed),
            )))
    }

    pub(crate) async fn publish_event(
        &self,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        let event = Event::now(job_id, kind);
        self.publisher()?
            .publish_json(
                &self.topology.events_exchange(),
                &event.routing_key(),
                &event,
                json_properties(),
            )
            .await
    }

    fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.config.heartbeat_timeout_ms)
    }

    /// Validates, stores inline inputs, expands pipelines and records the job(s) as `queued` in the
    /// event stream. Returns the job id and whether it is new (false: an idempotent resubmission).
    pub async fn accept(&self, submission: Submission) -> Result<(JobId, bool), AcceptError> {
        let mut submission = submission.validate(&mut || rand::random::<u64>() >> 11)?;
        {
            let reg = self.registry();
            if let Some(id) = submission
                .idempotency_key
                .as_ref()
                .and_then(|k| reg.idempotency.get(k))
            {
                return Ok((*id, false));
            }
            if let Some(id) = submission.job_id.filter(|id| reg.jobs.contains_key(id)) {
                return Ok((id, false));
            }
        }
        match &mut submission.job {
            JobSpec::Edit(edit) => {
                for input in edit.images_mut() {
                    self.store_inline(input).await?
                }
            }
            JobSpec::Upscale(UpscaleSpec { input, .. }) => self.store_inline(input).await?,
            JobSpec::Pipeline(p) => {
                for edit in &mut p.edits {
                    for input in &mut edit.references {
                        self.store_inline(input).await?
                    }
                }
            }
            JobSpec::Generate(_) => {}
        }
        let id = submission.job_id.unwrap_or_default();
        submission.job_id = Some(id);
        let kind = submission.job.kind_name();
        let children = expand_pipeline(&submission);
        // Children first, the pipeline last: the pipeline's `queued` event is the commit point, and a
        // child is only dispatched once its pipeline is known.
        for child in &children {
            let child_id = child.job_id.expect("expand_pipeline sets ids");
            self.publish_event(
                child_id,
                EventKind::Queued {
                    submission: Box::new(child.clone()),
                    parent: Some(id),
                    children: vec![],
                },
            )
            .await
            .map_err(|e| AcceptError::Unavailable(e.to_string()))?;
        }
        let child_ids = children.iter().filter_map(|c| c.job_id).collect();
        self.publish_event(
            id,
            EventKind::Queued {
                submission: Box::new(submission),
                parent: None,
                children: child_ids,
            },
        )
        .await
        .map_err(|e| AcceptError::Unavailable(e.to_string()))?;
        self.metrics
            .jobs_submitted_total
            .with_label_values(&[kind])
            .inc();
        tracing::info!(job_id = %id, kind, jobs = 1 + children.len(), "job accepted");
        Ok((id, true))
    }

    /// Replaces an inline image by a stored one under `inputs/` (content-addressed), after checking
    /// that it is an image of an accepted format and size.
    async fn store_inline(&self, input: &mut ImageRef) -> Result<(), AcceptError> {
        let Some(decoded) = input.inline_bytes() else {
            return Ok(());
        };
        let invalid = |message: String| {
            AcceptError::Invalid(ValidationError {
                field: "job.input.inline".into(),
                message,
            })
        };
        let bytes = decoded.map_err(|e| invalid(format!("not valid base64: {e}")))?;
        if bytes.len() > MAX_INLINE_IMAGE_BYTES {
            return Err(invalid("image is larger than 8 MiB".into()));
        }
        let reader = image::ImageReader::new(std::io::Cursor::new(&bytes))
            .with_guessed_format()
            .map_err(|e| invalid(e.to_string()))?;
        let ext = match reader.format() {
            Some(image::ImageFormat::Png) => "png",
            Some(image::ImageFormat::Jpeg) => "jpg",
            Some(image::ImageFormat::WebP) => "webp",
            _ => return Err(invalid("not a PNG, JPEG or WebP image".into())),
        };
        let (w, h) = reader
            .into_dimensions()
            .map_err(|e| invalid(format!("cannot read the image header: {e}")))?;
        if w > MAX_INPUT_SIDE || h > MAX_INPUT_SIDE {
            return Err(invalid(format!(
                "image is {w}x{h}; at most {MAX_INPUT_SIDE} pixels a side"
            )));
        }
        let key = input_key(&hex::encode(Sha256::digest(&bytes)), ext);
        let content_type = format!("image/{}", if ext == "jpg" { "jpeg" } else { ext });
        self.storage
            .put(&key, Bytes::from(bytes), &content_type)
            .await
            .map_err(|e| AcceptError::Unavailable(e.to_string()))?;
        *input = ImageRef::Stored(key);
        Ok(())
    }

    /// Waits until the registry holds `id` (its `queued` event came back from the stream).
    pub async fn wait_for_job(&self, id: JobId, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.applied.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.registry().jobs.contains_key(&id) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Applies one event from the stream; publishes nothing (see [`Scheduler::settle`]).
    pub(crate) fn apply(&self, ev: SequencedEvent, live: bool) {
        let mut reg = self.registry();
        if live {
            self.observe(&reg, &ev);
        }
        reg.apply(ev.clone());
        drop(reg);
        self.metrics.events_applied_total.inc();
        let _ = self.events.send(ev);
        self.applied.notify_waiters();
    }

    /// Metrics for an event about to be applied live.
    fn observe(&self, reg: &Registry, ev: &SequencedEvent) {
        let Some(job) = reg.jobs.get(&ev.event.job_id) else {
            return;
        };
        if job.state.is_terminal() {
            return;
        }
        let kind = job.kind();
        match &ev.event.kind {
            EventKind::Started { .. } => {
                let wait = (ev.event.at - job.created_at).num_milliseconds().max(0) as f64 / 1000.0;
                self.metrics
                    .queue_wait_seconds
                    .with_label_values(&[kind])
                    .observe(wait);
            }
            EventKind::Completed { .. } => {
                if let Some(started) = job
                    .events
                    .iter()
                    .rev()
                    .find(|e| matches!(e.event.kind, EventKind::Started { .. }))
                {
                    let run =
                        (ev.event.at - started.event.at).num_milliseconds().max(0) as f64 / 1000.0;
                    self.metrics
                        .job_run_seconds
                        .with_label_values(&[kind])
                        .observe(run);
                }
                self.metrics
                    .jobs_finished_total
                    .with_label_values(&[kind, "completed"])
                    .inc();
            }
            EventKind::Failed {
                retryable: false, ..
            } => self
                .metrics
                .jobs_finished_total
                .with_label_values(&[kind, "failed"])
                .inc(),
            EventKind::Cancelled { .. } => self
                .metrics
                .jobs_finished_total
                .with_label_values(&[kind, "cancelled"])
                .inc(),
            _ => {}
        }
    }

    /// Publishes what the registry owes (finished pipelines, failed dependents), then dispatches.
    pub(crate) async fn settle(&self) -> Result<(), PublishError> {
        let follow_ups = self.registry().follow_ups();
        for FollowUp::Event(id, kind) in follow_ups {
            self.publish_event(id, kind).await?;
        }
        self.dispatch().await
    }

    /// Sends every dispatchable job to the least-loaded worker that can take it.
    pub(crate) async fn dispatch(&self) -> Result<(), PublishError> {
        let plan = self.registry().plan_dispatch(self.heartbeat_timeout());
        for (job_id, worker) in plan {
            let message = {
                let reg = self.registry();
                let job = &reg.jobs[&job_id];
                let sub = job
                    .submission
                    .as_ref()
                    .expect("planned jobs have a submission");
                let task = match &sub.job {
                    JobSpec::Generate(g) => Task::Generate(g.clone()),
                    JobSpec::Edit(e) => Task::Edit(e.clone()),
                    JobSpec::Upscale(u) => Task::Upscale(u.clone()),
                    JobSpec::Pipeline(_) => {
                        unreachable!("pipelines have no model and are never planned")
                    }
                };
                WorkMessage {
                    schema_version: SCHEMA_VERSION,
                    job_id,
                    priority: sub.priority,
                    deadline: sub.deadline,
                    task,
                }
            };
            let queue = self.topology.worker_queue(&worker);
            let props = json_properties()
                .with_message_id(job_id.to_string().into())
                .with_expiration(self.config.dispatch_ttl_ms.to_string().into());
            // The event goes first, so the stream never shows `started` before `dispatched`. If the
            // message then cannot be sent, the job goes back to the backlog; if the scheduler dies in
            // between, the stale-dispatch watchdog ([`Registry::stale_dispatches`]) requeues it.
            let sent = async {
                self.publish_event(
                    job_id,
                    EventKind::Dispatched {
                        queue: queue.clone(),
                        worker: Some(worker.clone()),
                    },
                )
                .await?;
                if let Err(e) = self
                    .publisher()?
                    .publish_json("", &queue, &message, props)
                    .await
                {
                    let _ = self
                        .publish_event(
                            job_id,
                            EventKind::Requeued {
                                reason: format!("dispatch failed: {e}"),
                            },
                        )
                        .await;
                    return Err(e);
                }
                Ok(())
            }
            .await;
            match sent {
                Ok(()) => {
                    self.metrics
                        .dispatches_total
                        .with_label_values(&["least_loaded"])
                        .inc();
                    tracing::info!(job_id = %job_id, worker = %worker, "job dispatched");
                }
                Err(e) => {
                    self.registry().dispatch_failed(job_id, &worker);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Requeues jobs that were dispatched long ago and never started: their message was lost between
    /// the `dispatched` event and the publish (a scheduler crash). A live worker starts a dispatched
    /// job at once and a dead worker's queue returns it after `dispatch_ttl_ms`, so twice that plus a
    /// heartbeat timeout is conservative; at worst a job runs twice, which is harmless.
    pub(crate) async fn requeue_stale(&self) -> Result<(), PublishError> {
        let threshold = Duration::from_millis(
            2 * self.config.dispatch_ttl_ms + self.config.heartbeat_timeout_ms,
        );
        let stale = self
            .registry()
            .stale_dispatches(chrono::Utc::now(), threshold);
        for id in stale {
            tracing::warn!(job_id = %id, "dispatched job never started; requeueing it");
            self.publish_event(
                id,
                EventKind::Requeued {
                    reason: "dispatched but never started".into(),
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Cancels a job (and a pipeline's unfinished jobs). Queued jobs are cancelled at once; jobs on a
    /// worker are stopped there between steps, and the worker reports `cancelled`.
    pub async fn cancel(&self, id: JobId) -> Result<(), CancelError> {
        let targets = {
            let mut reg = self.registry();
            let job = reg.jobs.get(&id).ok_or(CancelError::NotFound(id))?;
            if job.state.is_terminal() {
                return Err(CancelError::Finished(id, job.state));
            }
            let mut ids = job.children.clone();
            ids.push(id);
            let mut targets = Vec::new();
            for t in ids {
                if let Some(j) = reg.jobs.get_mut(&t)
                    && !j.state.is_terminal()
                {
                    j.cancel_requested = true;
                    // Not on a worker yet: nothing else will report it, so the scheduler does.
                    let here = j.state == JobState::Queued && !j.dispatch_pending
                        || !j.children.is_empty();
                    targets.push((t, here));
                }
            }
            targets
        };
        let unavailable = |e: PublishError| CancelError::Unavailable(e.to_string());
        for (t, here) in targets {
            let publisher = self.publisher().map_err(unavailable)?;
            let request = CancelRequest { job_id: t };
            let props = json_properties().with_delivery_mode(1);
            match publisher
                .publish_json(
                    &self.topology.events_exchange(),
                    CANCEL_ROUTING_KEY,
                    &request,
                    props,
                )
                .await
            {
                Ok(()) | Err(PublishError::Unroutable { .. }) => {}
                Err(e) => return Err(unavailable(e)),
            }
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

    /// A job came back from a worker queue (the message expired there or hit the delivery limit).
    pub(crate) async fn returned(
        &self,
        body: &[u8],
        props: &BasicProperties,
        reason: &str,
    ) -> Result<(), PublishError> {
        let Ok(msg) = vnfarm_proto::decode_json::<WorkMessage>(body) else {
            self.metrics.malformed_messages_total.inc();
            let headers = vnfarm_bus::headers::dead_letter_headers(
                "undecodable message returned from a worker queue",
                "malformed",
                None,
            );
            return self.dead_letter(body, headers).await;
        };
        let id = msg.job_id;
        self.metrics
            .requeues_total
            .with_label_values(&[if reason == "expired" {
                "expired"
            } else {
                "delivery_limit"
            }])
            .inc();
        let (known, terminal, dispatches) = {
            let reg = self.registry();
            match reg.jobs.get(&id) {
                Some(j) => (true, j.state.is_terminal(), j.dispatches),
                None => (false, false, 0),
            }
        };
        if !known || terminal {
            tracing::info!(job_id = %id, known, "ignoring a returned message for a finished or unknown job");
            return Ok(());
        }
        let count = vnfarm_bus::headers::delivery_count(props);
        if reason != "expired" || dispatches >= self.config.max_dispatches {
            let message = format!(
                "gave up after {dispatches} dispatches and {count} deliveries (last: {reason})"
            );
            tracing::warn!(job_id = %id, %message, "job failed");
            let id_text = id.to_string();
            let headers = vnfarm_bus::headers::dead_letter_headers(
                &message,
                FailureKind::DeliveryLimit.as_str(),
                Some(&id_text),
            );
            self.dead_letter(body, headers).await?;
            return self
                .publish_event(
                    id,
                    EventKind::Failed {
                        failure: FailureKind::DeliveryLimit,
                        message,
                        retryable: false,
                    },
                )
                .await;
        }
        tracing::warn!(job_id = %id, "job not taken by its worker in time; dispatching it again");
        self.publish_event(
            id,
            EventKind::Requeued {
                reason: format!("returned from a worker queue ({reason})"),
            },
        )
        .await
    }

    pub(crate) async fn dead_letter(
        &self,
        body: &[u8],
        headers: lapin::types::FieldTable,
    ) -> Result<(), PublishError> {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        self.publisher()?
            .publish(&self.topology.dead_exchange(), "", body, props)
            .await
    }

    /// Refreshes the gauges derived from the registry.
    pub(crate) fn update_gauges(&self) {
        let reg = self.registry();
        let timeout = self.heartbeat_timeout();
        for state in ["queued", "dispatched", "running", "retrying"] {
            self.metrics.jobs.with_label_values(&[state]).set(0);
        }
        for (state, n) in reg.counts_by_state() {
            let label = serde_json::to_value(state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            self.metrics.jobs.with_label_values(&[&label]).set(n as i64);
        }
        for model in vnfarm_proto::ModelFamily::ALL {
            let n = reg
                .active
                .iter()
                .filter(|id| {
                    reg.jobs[id].state == JobState::Queued && reg.jobs[id].model() == Some(model)
                })
                .count();
            self.metrics
                .backlog
                .with_label_values(&[model.as_str()])
                .set(n as i64);
        }
        let mut counts = std::collections::HashMap::from([
            ("ready", 0),
            ("warming", 0),
            ("draining", 0),
            ("gone", 0),
        ]);
        for w in reg.workers.values() {
            let state = match &w.last_heartbeat {
                Some((at, hb)) if at.elapsed() < timeout => match hb.state {
                    vnfarm_proto::WorkerState::Ready => "ready",
                    vnfarm_proto::WorkerState::Warming => "warming",
                    vnfarm_proto::WorkerState::Draining => "draining",
                },
                _ => "gone",
            };
            *counts.entry(state).or_default() += 1;
        }
        for (state, n) in counts {
            self.metrics.workers.with_label_values(&[state]).set(n);
        }
    }
}

/// The jobs a pipeline expands into: its base generate, the edits of the base image, the upscales.
/// Each gets its own id; edits and upscales take their input from the job they depend on.
fn expand_pipeline(submission: &Submission) -> Vec<Submission> {
    let JobSpec::Pipeline(p) = &submission.job else {
        return Vec::new();
    };
    let child = |job: JobSpec| Submission {
        schema_version: SCHEMA_VERSION,
        job_id: Some(JobId::new()),
        idempotency_key: None,
        priority: submission.priority,
        deadline: submission.deadline,
        job,
    };
    let base = child(JobSpec::Generate(p.base.clone()));
    let base_id = base.job_id.expect("child sets an id");
    let mut out = vec![base];
    let mut edit_ids = Vec::new();
    for e in &p.edits {
        // Picture 1 is the base; the variants keep its size (floored to the model's multiple of 16),
        // so a pipeline's images line up.
        let inputs: Vec<ImageRef> = std::iter::once(ImageRef::JobOutput {
            job: base_id,
            index: 0,
        })
        .chain(e.references.iter().cloned())
        .collect();
        let edit = child(JobSpec::Edit(EditSpec {
            input: None,
            inputs,
            width: Some(p.base.width / 16 * 16),
            height: Some(p.base.height / 16 * 16),
            instruction: e.instruction.clone(),
            steps: e.steps,
            cfg: e.cfg,
            seed: e.seed,
            loras: e.loras.clone(),
        }));
        edit_ids.push(edit.job_id.expect("child sets an id"));
        out.push(edit);
    }
    for u in &p.upscales {
        let source = match u.of {
            PipelineImage::Base => base_id,
            PipelineImage::Edit(n) => edit_ids[n],
        };
        out.push(child(JobSpec::Upscale(UpscaleSpec {
            input: ImageRef::JobOutput {
                job: source,
                index: 0,
            },
            scale: u.scale,
            tile: u.tile,
            tile_overlap: u.tile_overlap,
        })));
    }
    out
}

/// Base64 of bytes, for tests and tools that build inline inputs.
pub fn inline_image(bytes: &[u8]) -> ImageRef {
    ImageRef::Inline(base64::engine::general_purpose::STANDARD.encode(bytes))
}
