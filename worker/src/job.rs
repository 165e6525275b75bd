//! One delivery, from message to acknowledgement: decode, run on the engine, store outputs and the
//! manifest, publish the events, then ack (DESIGN §4: ack only after the side effects are done).
//! A delivery of a job whose manifest is already stored is not run again: see
//! [`Worker::finished_before`].
//!
//! Every failure is classified once, in [`JobError::disposition`]: dead-letter (permanent), retry
//! (transient), report cancelled, give back (shutdown), or abandon (the broker is gone, so the message
//! will be redelivered anyway).

use std::time::Instant;

use bytes::Bytes;
use chrono::Utc;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use vnfarm_bus::headers::{dead_letter_headers, delivery_count};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher};
use vnfarm_proto::manifest::{ManifestOutput, Versions};
use vnfarm_proto::spec::MAX_UPSCALE_OUTPUT_SIDE;
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{
    Event, EventKind, FailureKind, ImageRef, JobId, MAX_MESSAGE_BYTES, Manifest, SCHEMA_VERSION,
    StageTimings, Task, WorkMessage, decode_json,
};
use vnfarm_storage::StorageError;

use crate::engine::{Cancel, CancelReason, EngineError, EngineJob, InputImage};
use crate::image_io::{decode_input_as_stored, encode_png, flatten_to_rgb8};
use crate::worker::Worker;

/// A delivery not yet settled. Settling consumes it, so a double ack cannot be written.
pub struct Pending(Delivery);

impl Pending {
    /// A failed ack means the channel is gone: the broker redelivers the message, and the session
    /// must end.
    async fn ack(self) -> Result<(), Lost> {
        let result = self.0.acker.ack(BasicAckOptions::default()).await;
        self.settled("ack", result)
    }

    /// Back to the queue; the broker counts a delivery and dead-letters past the limit.
    async fn requeue(self) -> Result<(), Lost> {
        let result = self
            .0
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            })
            .await;
        self.settled("requeue", result)
    }

    /// `Ok(false)` from lapin means the acker is poisoned: its channel closed or failed before the
    /// message was settled, so the broker will redeliver it (that the acker was already used cannot
    /// happen: settling consumes `Pending`). Either way the session is lost.
    fn settled(self, op: &'static str, result: Result<bool, lapin::Error>) -> Result<(), Lost> {
        let reason = match result {
            Ok(true) => return Ok(()),
            Ok(false) => "the channel closed before the delivery was settled".to_owned(),
            Err(e) => e.to_string(),
        };
        let message_id = self.0.properties.message_id().as_ref().map(|m| m.as_str());
        tracing::warn!(
            delivery_tag = self.0.delivery_tag,
            message_id = message_id.unwrap_or(""),
            op,
            error = %reason,
            "could not settle the delivery; the broker will redeliver it"
        );
        Err(Lost(reason))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("invalid job: {0}")]
    InvalidSpec(String),
    #[error("bad input image: {0}")]
    BadInput(String),
    #[error("deadline passed before the job started")]
    DeadlineExceeded,
    #[error(transparent)]
    Storage(StorageError),
    #[error(transparent)]
    Engine(EngineError),
    #[error("broker lost: {0}")]
    Broker(#[from] PublishError),
}

/// What happens to the message after a failure.
#[derive(Debug, PartialEq, Eq)]
enum Disposition {
    /// Permanent: to the dead-letter exchange with a final `failed` event.
    DeadLetter(FailureKind),
    /// Transient: a `failed` event with `retryable`, then back to the queue.
    Retry(FailureKind),
    Cancelled,
    /// Shutdown interrupted it: back to the queue without an event.
    GiveBack,
    /// The broker connection is gone: nothing can be settled; the broker redelivers.
    Abandon,
}

impl JobError {
    fn disposition(&self) -> Disposition {
        match self {
            JobError::Malformed(_) => Disposition::DeadLetter(FailureKind::Malformed),
            JobError::InvalidSpec(_) => Disposition::DeadLetter(FailureKind::InvalidSpec),
            JobError::BadInput(_) => Disposition::DeadLetter(FailureKind::BadInput),
            JobError::DeadlineExceeded => Disposition::DeadLetter(FailureKind::DeadlineExceeded),
            JobError::Storage(StorageError::NotFound { .. }) => {
                Disposition::DeadLetter(FailureKind::BadInput)
            }
            JobError::Storage(StorageError::InvalidKey { .. }) => {
                Disposition::DeadLetter(FailureKind::InvalidSpec)
            }
            JobError::Storage(StorageError::Unavailable { .. }) => {
                Disposition::Retry(FailureKind::Storage)
            }
            JobError::Engine(EngineError::Cancelled(CancelReason::User)) => Disposition::Cancelled,
            JobError::Engine(EngineError::Cancelled(CancelReason::Shutdown)) => {
                Disposition::GiveBack
            }
            JobError::Engine(EngineError::OutOfMemory(_)) => {
                Disposition::Retry(FailureKind::OutOfMemory)
            }
            JobError::Engine(EngineError::InvalidInput(_)) => {
                Disposition::DeadLetter(FailureKind::BadInput)
            }
            JobError::Engine(EngineError::Failed(_)) => {
                Disposition::DeadLetter(FailureKind::Engine)
            }
            // Not the job's fault: another worker tries it (this one stops, see `device_lost`).
            JobError::Engine(EngineError::DeviceLost(_)) => Disposition::Retry(FailureKind::Engine),
            JobError::Engine(EngineError::Unsupported(_)) => {
                Disposition::DeadLetter(FailureKind::NoWorker)
            }
            JobError::Broker(_) => Disposition::Abandon,
        }
    }
}

struct Done {
    outputs: Vec<String>,
    manifest: String,
    timings: StageTimings,
}

/// Decodes a delivery into a work message; on failure returns the job id if one can be recovered.
fn parse(delivery: &Delivery) -> Result<WorkMessage, (Option<JobId>, String)> {
    let id_from_props = delivery
        .properties
        .message_id()
        .as_ref()
        .and_then(|m| m.as_str().parse::<JobId>().ok());
    if delivery.data.len() > MAX_MESSAGE_BYTES {
        return Err((
            id_from_props,
            format!(
                "message of {} bytes exceeds {MAX_MESSAGE_BYTES}",
                delivery.data.len()
            ),
        ));
    }
    let msg: WorkMessage =
        decode_json(&delivery.data).map_err(|e| (id_from_props, e.to_string()))?;
    if msg.schema_version != SCHEMA_VERSION {
        return Err((
            Some(msg.job_id),
            format!("schema_version: {} is not supported", msg.schema_version),
        ));
    }
    Ok(msg)
}

impl Worker {
    /// Handles one delivery to the end. `Err` means the broker session is lost.
    pub(crate) async fn handle(
        &self,
        publisher: &Publisher,
        delivery: Delivery,
    ) -> Result<(), Lost> {
        let started = Instant::now();
        let attempt = u32::try_from(delivery_count(&delivery.properties))
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        let body = delivery.data.clone();
        let pending = Pending(delivery);
        let msg = match parse(&pending.0) {
            Ok(msg) => msg,
            Err((job_id, reason)) => {
                self.metrics.malformed_messages_total.inc();
                tracing::warn!(job_id = ?job_id, %reason, "dead-lettering a malformed work message");
                return self
                    .dead_letter(
                        publisher,
                        pending,
                        &body,
                        job_id,
                        FailureKind::Malformed,
                        &reason,
                    )
                    .await;
            }
        };
        let job_id = msg.job_id;
        let kind = msg.task.kind_name();
        let span = tracing::info_span!("job", job_id = %job_id, kind, attempt);
        if self.is_cancelled(job_id) {
            tracing::info!(job_id = %job_id, "skipping a job cancelled before it started");
            self.publish_event(
                publisher,
                job_id,
                EventKind::Cancelled {
                    reason: "cancelled before it started".into(),
                },
            )
            .await
            .map_err(broker)?;
            self.metrics
                .jobs_total
                .with_label_values(&[kind, "cancelled"])
                .inc();
            return pending.ack().await;
        }
        match self.finished_before(job_id).instrument(span.clone()).await {
            Ok(None) => {}
            Ok(Some(manifest)) => {
                return self
                    .report_finished(publisher, pending, kind, manifest)
                    .instrument(span)
                    .await;
            }
            Err(e) => {
                return self
                    .settle_failure(publisher, pending, &body, &msg, e)
                    .instrument(span)
                    .await;
            }
        }

        let cancel = Cancel::default();
        self.set_running(Some((job_id, cancel.clone())));
        let result = self
            .execute(publisher, &msg, &cancel, attempt)
            .instrument(span)
            .await;
        self.set_running(None);
        self.metrics
            .job_seconds
            .with_label_values(&[kind])
            .observe(started.elapsed().as_secs_f64());

        match result {
            Ok(done) => {
                let event = EventKind::Completed {
                    outputs: done.outputs,
                    manifest: done.manifest,
                    worker: Some(self.id.clone()),
                    timings: done.timings,
                };
                self.publish_event(publisher, job_id, event)
                    .await
                    .map_err(broker)?;
                pending.ack().await?;
                self.metrics
                    .jobs_total
                    .with_label_values(&[kind, "completed"])
                    .inc();
                tracing::info!(job_id = %job_id, seconds = started.elapsed().as_secs_f64(), "job completed");
                Ok(())
            }
            Err(e) => {
                self.settle_failure(publisher, pending, &body, &msg, e)
                    .await
            }
        }
    }

    /// The manifest of this job, if one is stored: then an earlier delivery ran the job to the end
    /// and it must not run again (a redelivery after the worker died or lost the broker between
    /// storing the results and the ack, or a second dispatch).
    ///
    /// Sound because the manifest is the last thing a run stores ([`Worker::execute`] puts every
    /// output first), and a put is atomic in both stores (an S3 PUT; write-then-rename on disk): a
    /// manifest is there only when every output it names is. A manifest that does not decode (or
    /// names another job) proves nothing, so the job runs again and overwrites it. Storage that
    /// cannot answer is a transient failure like any other: the job is retried, not guessed about.
    async fn finished_before(&self, job_id: JobId) -> Result<Option<Manifest>, JobError> {
        let key = manifest_key(job_id);
        // `NotFound` is the usual answer here, not a storage error: it is a value for the retries.
        let stored = self
            .with_storage_retries("get", &key, || async {
                match self.storage.get(&key).await {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(StorageError::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .await?;
        let Some(bytes) = stored else {
            return Ok(None);
        };
        match manifest_of(job_id, &bytes) {
            Ok(manifest) => Ok(Some(manifest)),
            Err(reason) => {
                tracing::warn!(job_id = %job_id, key, %reason, "stored manifest is unreadable; running the job again");
                Ok(None)
            }
        }
    }

    /// Reports a job an earlier delivery finished (see [`Worker::finished_before`]): `completed`
    /// rebuilt from its manifest, then the ack. The engine does not run and no `started` is sent.
    async fn report_finished(
        &self,
        publisher: &Publisher,
        pending: Pending,
        kind: &'static str,
        manifest: Manifest,
    ) -> Result<(), Lost> {
        let job_id = manifest.job_id;
        let made_by = manifest.worker.clone();
        self.publish_event(publisher, job_id, completed_from(manifest))
            .await
            .map_err(broker)?;
        pending.ack().await?;
        self.metrics
            .jobs_total
            .with_label_values(&[kind, "already_completed"])
            .inc();
        tracing::info!(job_id = %job_id, made_by = %made_by, "job already completed; not running it again");
        Ok(())
    }

    async fn settle_failure(
        &self,
        publisher: &Publisher,
        pending: Pending,
        body: &[u8],
        msg: &WorkMessage,
        error: JobError,
    ) -> Result<(), Lost> {
        let job_id = msg.job_id;
        let kind = msg.task.kind_name();
        if let JobError::Engine(EngineError::DeviceLost(reason)) = &error {
            // Stop taking jobs before this one is given back, so it goes to another worker.
            self.device_lost(reason);
        }
        match error.disposition() {
            Disposition::DeadLetter(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job failed permanently");
                self.metrics
                    .jobs_total
                    .with_label_values(&[kind, "failed"])
                    .inc();
                self.dead_letter(
                    publisher,
                    pending,
                    body,
                    Some(job_id),
                    failure,
                    &error.to_string(),
                )
                .await
            }
            Disposition::Retry(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job failed, will be retried");
                self.metrics
                    .jobs_total
                    .with_label_values(&[kind, "requeued"])
                    .inc();
                let event = EventKind::Failed {
                    failure,
                    message: error.to_string(),
                    retryable: true,
                };
                self.publish_event(publisher, job_id, event)
                    .await
                    .map_err(broker)?;
                // Back off before giving it back, so a broken dependency is not hammered.
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                pending.requeue().await
            }
            Disposition::Cancelled => {
                tracing::info!(job_id = %job_id, "job cancelled while running");
                self.metrics
                    .jobs_total
                    .with_label_values(&[kind, "cancelled"])
                    .inc();
                self.publish_event(
                    publisher,
                    job_id,
                    EventKind::Cancelled {
                        reason: "cancelled while running".into(),
                    },
                )
                .await
                .map_err(broker)?;
                pending.ack().await
            }
            Disposition::GiveBack => {
                tracing::info!(job_id = %job_id, "shutdown interrupted the job; giving it back");
                self.metrics
                    .jobs_total
                    .with_label_values(&[kind, "requeued"])
                    .inc();
                pending.requeue().await
            }
            Disposition::Abandon => {
                tracing::warn!(job_id = %job_id, error = %error, "broker lost mid-job; it will be redelivered");
                Err(Lost(error.to_string()))
            }
        }
    }

    /// Copies the message to the dead-letter exchange with the reason, publishes `failed`, then acks.
    async fn dead_letter(
        &self,
        publisher: &Publisher,
        pending: Pending,
        body: &[u8],
        job_id: Option<JobId>,
        failure: FailureKind,
        reason: &str,
    ) -> Result<(), Lost> {
        let id = job_id.map(|j| j.to_string());
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(dead_letter_headers(reason, failure.as_str(), id.as_deref()));
        if let Err(e) = publisher
            .publish(&self.topology.dead_exchange(), "", body, props)
            .await
        {
            tracing::warn!(job_id = ?job_id, error = %e, "could not dead-letter the message; it stays unsettled");
            return Err(broker(e));
        }
        if let Some(job_id) = job_id {
            let event = EventKind::Failed {
                failure,
                message: reason.to_owned(),
                retryable: false,
            };
            self.publish_event(publisher, job_id, event)
                .await
                .map_err(broker)?;
        }
        pending.ack().await
    }

    pub(crate) async fn publish_event(
        &self,
        publisher: &Publisher,
        job_id: JobId,
        kind: EventKind,
    ) -> Result<(), PublishError> {
        let event = Event::now(job_id, kind);
        let result = publisher
            .publish_json(
                &self.topology.events_exchange(),
                &event.routing_key(),
                &event,
                json_properties(),
            )
            .await;
        if let Err(e) = &result {
            tracing::warn!(job_id = %job_id, event = event.kind.name(), error = %e, "event not published");
        }
        result
    }

    async fn execute(
        &self,
        publisher: &Publisher,
        msg: &WorkMessage,
        cancel: &Cancel,
        attempt: u32,
    ) -> Result<Done, JobError> {
        let job_id = msg.job_id;
        if msg.deadline.is_some_and(|d| d < Utc::now()) {
            return Err(JobError::DeadlineExceeded);
        }
        self.publish_event(
            publisher,
            job_id,
            EventKind::Started {
                worker: self.id.clone(),
                attempt,
            },
        )
        .await?;
        let kind = msg.task.kind_name();
        let mut timings = StageTimings::default();

        let started = Instant::now();
        let inputs = match &msg.task {
            Task::Generate(_) => Vec::new(),
            Task::Edit(e) => {
                let mut inputs = Vec::new();
                for input in e.images() {
                    inputs.push(self.fetch_input(input, Layout::Rgb8).await?);
                }
                inputs
            }
            Task::Upscale(u) => {
                let input = self.fetch_input(&u.input, Layout::AsStored).await?;
                let img = &input.image;
                let longest = img.width().max(img.height()).saturating_mul(u.scale);
                if longest > MAX_UPSCALE_OUTPUT_SIDE {
                    return Err(JobError::InvalidSpec(format!(
                        "scale: output side {longest} exceeds {MAX_UPSCALE_OUTPUT_SIDE} for a {}x{} input",
                        img.width(),
                        img.height()
                    )));
                }
                vec![input]
            }
        };
        if !inputs.is_empty() {
            timings.add("download", started.elapsed().as_secs_f64());
        }

        // Progress events go out from their own task, so the engine never waits on the broker.
        // Progress is advisory: after a failed publish (logged in `publish_event`) the rest of this
        // job's progress is dropped rather than sent into a broken channel, and the job goes on; its
        // final event, which must arrive, meets the same broker and ends the session if it is gone.
        let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel();
        let forwarder = {
            let publisher = publisher.clone();
            let this = self.clone();
            tokio::spawn(async move {
                while let Some(p) = progress_rx.recv().await {
                    let p: crate::engine::Progress = p;
                    let progress = EventKind::Progress {
                        step: p.step,
                        total: p.total,
                    };
                    if this
                        .publish_event(&publisher, job_id, progress)
                        .await
                        .is_err()
                    {
                        tracing::warn!(job_id = %job_id, "no more progress events for this job");
                        break;
                    }
                }
            })
        };
        let engine_started = Instant::now();
        self.metrics.busy.set(1);
        let output = self
            .engine
            .run(
                EngineJob {
                    job_id,
                    task: msg.task.clone(),
                    inputs,
                },
                progress_tx,
                cancel.clone(),
            )
            .await;
        self.metrics.busy.set(0);
        self.metrics
            .busy_seconds_total
            .inc_by(engine_started.elapsed().as_secs_f64());
        if let Err(e) = forwarder.await {
            tracing::warn!(job_id = %job_id, error = %e, "progress forwarder failed");
        }
        let output = output.map_err(JobError::Engine)?;
        for (stage, seconds) in &output.timings.0 {
            timings.add(stage, *seconds);
        }

        // PNG encoding is CPU work: off the async runtime.
        let started = Instant::now();
        let parameters = parameters_text(job_id, &msg.task);
        let images = output.images;
        let encoded = tokio::task::spawn_blocking(move || {
            images
                .iter()
                .map(|img| (img.width(), img.height(), encode_png(img, &parameters)))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| JobError::Engine(EngineError::Failed(format!("PNG encoder panicked: {e}"))))?;
        timings.add("encode_png", started.elapsed().as_secs_f64());

        let started = Instant::now();
        let mut outputs = Vec::new();
        let mut manifest_outputs = Vec::new();
        for (n, ((width, height, png), seed)) in encoded.into_iter().zip(output.seeds).enumerate() {
            let key = output_key(job_id, n as u32);
            let sha256 = hex::encode(Sha256::digest(&png));
            self.put_with_retries(&key, Bytes::from(png), "image/png")
                .await?;
            manifest_outputs.push(ManifestOutput {
                key: key.clone(),
                width,
                height,
                seed,
                sha256,
            });
            outputs.push(key);
        }
        timings.add("upload", started.elapsed().as_secs_f64());
        for (stage, seconds) in &timings.0 {
            self.metrics
                .stage_seconds
                .with_label_values(&[kind, stage])
                .observe(*seconds);
        }
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: msg.task.clone(),
            outputs: manifest_outputs,
            worker: self.id.clone(),
            attempt,
            engine: self.engine.name().to_owned(),
            model_files: Vec::new(),
            timings: timings.clone(),
            versions: Versions {
                vnfarm: env!("CARGO_PKG_VERSION").to_owned(),
            },
            finished_at: Utc::now(),
        };
        // The manifest goes last, after every output: a stored manifest is what `finished_before`
        // takes as proof that the job is done, so it must never exist before its outputs do.
        let key = manifest_key(job_id);
        let body = serde_json::to_vec_pretty(&manifest).expect("manifests serialize to JSON");
        self.put_with_retries(&key, Bytes::from(body), "application/json")
            .await?;
        Ok(Done {
            outputs,
            manifest: key,
            timings,
        })
    }

    /// Downloads (or decodes inline) one input image, with the sha256 of its bytes.
    async fn fetch_input(&self, input: &ImageRef, layout: Layout) -> Result<InputImage, JobError> {
        let bytes =
            match input {
                ImageRef::Stored(key) => self.get_with_retries(key).await?,
                ImageRef::JobOutput { job, index } => {
                    self.get_with_retries(&output_key(*job, *index)).await?
                }
                ImageRef::Inline(_) => {
                    let Some(decoded) = input.inline_bytes() else {
                        unreachable!("inline_bytes is Some for Inline")
                    };
                    Bytes::from(decoded.map_err(|e| {
                        JobError::BadInput(format!("inline image is not base64: {e}"))
                    })?)
                }
            };
        let decoded = tokio::task::spawn_blocking(move || {
            decode_input_as_stored(&bytes).map(|decoded| {
                let keep = layout == Layout::AsStored
                    && !matches!(decoded, image::DynamicImage::ImageRgb8(_));
                let (image, stored) = if keep {
                    (flatten_to_rgb8(decoded.clone()), Some(decoded))
                } else {
                    (flatten_to_rgb8(decoded), None)
                };
                InputImage {
                    image,
                    stored,
                    sha256: hex::encode(Sha256::digest(&bytes)),
                }
            })
        })
        .await
        .map_err(|e| {
            JobError::Engine(EngineError::Failed(format!("image decoder panicked: {e}")))
        })?;
        decoded.map_err(|e| JobError::BadInput(e.to_string()))
    }

    async fn get_with_retries(&self, key: &str) -> Result<Bytes, JobError> {
        self.with_storage_retries("get", key, || self.storage.get(key))
            .await
    }

    async fn put_with_retries(
        &self,
        key: &str,
        body: Bytes,
        content_type: &str,
    ) -> Result<(), JobError> {
        self.with_storage_retries("put", key, || {
            self.storage.put(key, body.clone(), content_type)
        })
        .await
    }

    /// Retries `attempt` while storage is unavailable, with exponential backoff (200 ms doubling to
    /// 5 s), up to `storage_attempts` times; other errors and the last failure are returned.
    async fn with_storage_retries<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut attempt: F,
    ) -> Result<T, JobError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StorageError>>,
    {
        let mut delay = std::time::Duration::from_millis(200);
        let mut tries = 1;
        loop {
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    self.metrics
                        .storage_errors_total
                        .with_label_values(&[op])
                        .inc();
                    let transient = matches!(e, StorageError::Unavailable { .. });
                    if !transient || tries >= self.config.storage_attempts {
                        return Err(JobError::Storage(e));
                    }
                    tracing::warn!(key, op, error = %e, "storage operation failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(5));
                    tries += 1;
                }
            }
        }
    }
}

/// The broker connection is gone (or refused an event): the session must end and reconnect.
#[derive(Debug, thiserror::Error)]
#[error("broker session lost: {0}")]
pub struct Lost(pub String);

/// What an input image is decoded to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// 8-bit RGB with alpha flattened onto white (the generative models).
    Rgb8,
    /// Also as stored: alpha, greyscale and 16-bit samples kept (upscales).
    AsStored,
}

fn broker(e: PublishError) -> Lost {
    Lost(e.to_string())
}

/// Decodes a stored manifest and checks that it is `job_id`'s.
fn manifest_of(job_id: JobId, bytes: &[u8]) -> Result<Manifest, String> {
    let manifest: Manifest = decode_json(bytes).map_err(|e| e.to_string())?;
    if manifest.job_id != job_id {
        return Err(format!("job_id: {} is another job's", manifest.job_id));
    }
    Ok(manifest)
}

/// The `completed` event of a job an earlier delivery finished, as that run would have published
/// it: credited to the worker that made the outputs (the manifest's), not the one republishing it.
fn completed_from(manifest: Manifest) -> EventKind {
    EventKind::Completed {
        outputs: manifest.outputs.into_iter().map(|o| o.key).collect(),
        manifest: manifest_key(manifest.job_id),
        worker: Some(manifest.worker),
        timings: manifest.timings,
    }
}

/// Generation parameters for the PNG text chunk: A1111's layout for generates, JSON otherwise.
fn parameters_text(job_id: JobId, task: &Task) -> String {
    match task {
        Task::Generate(g) => format!(
            "{}\nNegative prompt: {}\nSteps: {}, Sampler: {:?}, CFG scale: {}, Seed: {}, Size: {}x{}, vnfarm job: {job_id}",
            g.prompt,
            g.negative_prompt,
            g.steps,
            g.sampler,
            g.cfg,
            g.seed.unwrap_or_default(),
            g.width,
            g.height
        ),
        other => format!(
            "{}\nvnfarm job: {job_id}",
            serde_json::to_string(other).expect("tasks serialize to JSON")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(job_id: JobId) -> Manifest {
        let mut timings = StageTimings::default();
        timings.add("denoise", 1.5);
        Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: decode_json(br#"{"kind": "generate", "prompt": "a lighthouse"}"#)
                .expect("a valid task"),
            outputs: (0..2)
                .map(|n| ManifestOutput {
                    key: output_key(job_id, n),
                    width: 512,
                    height: 512,
                    seed: Some(7 + u64::from(n)),
                    sha256: "00".repeat(32),
                })
                .collect(),
            worker: "w-first".parse().expect("a valid worker id"),
            attempt: 1,
            engine: "test-pattern".into(),
            model_files: Vec::new(),
            timings,
            versions: Versions {
                vnfarm: "0.0.0".into(),
            },
            finished_at: Utc::now(),
        }
    }

    #[test]
    fn a_stored_manifest_counts_only_for_its_own_job_and_only_when_whole() {
        let id = JobId::new();
        let stored = manifest(id);
        let bytes = serde_json::to_vec_pretty(&stored).unwrap();
        assert_eq!(manifest_of(id, &bytes), Ok(stored));
        let other = manifest_of(JobId::new(), &bytes).unwrap_err();
        assert!(other.starts_with("job_id"), "{other}");
        let truncated = manifest_of(id, &bytes[..bytes.len() / 2]);
        assert!(truncated.is_err(), "{truncated:?}");
        assert!(manifest_of(id, b"").is_err());
    }

    #[test]
    fn completed_is_rebuilt_from_the_manifest_and_credits_the_worker_that_made_it() {
        let id = JobId::new();
        let stored = manifest(id);
        let EventKind::Completed {
            outputs,
            manifest: key,
            worker,
            timings,
        } = completed_from(stored.clone())
        else {
            panic!("a completed event")
        };
        assert_eq!(outputs, [output_key(id, 0), output_key(id, 1)]);
        assert_eq!(key, manifest_key(id));
        assert_eq!(worker, Some(stored.worker.clone()));
        assert_eq!(timings, stored.timings);
    }

    #[test]
    fn every_error_has_one_disposition() {
        let unavailable = StorageError::Unavailable {
            op: "put",
            key: "k".into(),
            message: "down".into(),
        };
        assert_eq!(
            JobError::Storage(unavailable).disposition(),
            Disposition::Retry(FailureKind::Storage)
        );
        assert_eq!(
            JobError::BadInput("x".into()).disposition(),
            Disposition::DeadLetter(FailureKind::BadInput)
        );
        assert_eq!(
            JobError::Storage(StorageError::NotFound { key: "k".into() }).disposition(),
            Disposition::DeadLetter(FailureKind::BadInput)
        );
        assert_eq!(
            JobError::Engine(EngineError::Cancelled(CancelReason::Shutdown)).disposition(),
            Disposition::GiveBack
        );
        assert_eq!(
            JobError::Engine(EngineError::Cancelled(CancelReason::User)).disposition(),
            Disposition::Cancelled
        );
        assert_eq!(
            JobError::Engine(EngineError::OutOfMemory("x".into())).disposition(),
            Disposition::Retry(FailureKind::OutOfMemory)
        );
        assert_eq!(
            JobError::Engine(EngineError::DeviceLost("CUDA error".into())).disposition(),
            Disposition::Retry(FailureKind::Engine),
            "a device failure is not the job's fault"
        );
        assert_eq!(
            JobError::Engine(EngineError::Failed("bug".into())).disposition(),
            Disposition::DeadLetter(FailureKind::Engine)
        );
    }
}
