//! Intake: accepting a submission (validation, inline images into storage, the `queued` event), the
//! expansion of a pipeline into its jobs, and the intake-queue consumer for producers that publish
//! over AMQP.
//!
//! Accepting is all or nothing: a job, or a whole pipeline, becomes known through exactly one
//! `queued` event. A pipeline's event lists its jobs' ids, and their specs are derived from the
//! pipeline's own spec by [`vnfarm_proto::pipeline_jobs`] wherever the event is read, so a scheduler killed while
//! accepting leaves either nothing or the complete pipeline. Idempotency holds under concurrency
//! because the stream decides: the first `queued` event with a key wins and later ones create
//! nothing (`Registry::apply`); the caller learns which job its key names once its own event has
//! come back.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use sha2::{Digest, Sha256};
use tokio::task::JoinSet;
use tracing::Instrument;
use vnfarm_bus::connect::Backoff;
use vnfarm_bus::headers::{dead_letter_headers, delivery_count};
use vnfarm_bus::publisher::PublishError;
use vnfarm_proto::spec::{MAX_INLINE_IMAGE_BYTES, MAX_INPUT_SIDE};
use vnfarm_proto::topology::input_key;
use vnfarm_proto::{
    EventKind, FailureKind, GenerateSpec, ImageRef, JobId, JobSpec, MAX_MESSAGE_BYTES, Submission,
    UpscaleSpec, ValidationError, decode_json, pipeline_size,
};

use vnfarm_storage::StorageError;

use crate::images::{self, InputLimits, VerifiedImage};
use crate::scheduler::{Lane, Scheduler};

/// Why a submission was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    /// The broker or storage is unavailable; the client may retry (with its idempotency key).
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// What became of an accepted submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// The job the submission names: its own, or the one its key or id already named.
    pub job_id: JobId,
    /// False for a repeat of a known key or id.
    pub created: bool,
}

impl Scheduler {
    /// Records the fleet's default checkpoint in a generate that names none, so the job stays
    /// reproducible when the default changes.
    fn default_checkpoint(&self, g: &mut GenerateSpec) {
        if g.checkpoint.is_none() {
            g.checkpoint.clone_from(&self.config().default_checkpoint);
        }
    }

    /// Validates, stores inline inputs and records the job (a pipeline with all its jobs) in one
    /// `queued` event, owned by `owner` (a person's name; `None`: `admin`). Returns once the
    /// event is confirmed by the broker, before it is read back: see [`Scheduler::accepted`] for
    /// the job it names.
    pub async fn accept(
        &self,
        submission: Submission,
        owner: Option<String>,
    ) -> Result<Submitted, AcceptError> {
        self.accept_on(Lane::Requests, submission, owner).await
    }

    /// [`Scheduler::accept`], its event published on `lane` (the intake consumer's on the
    /// session's own).
    async fn accept_on(
        &self,
        lane: Lane,
        submission: Submission,
        owner: Option<String>,
    ) -> Result<Submitted, AcceptError> {
        let mut submission = submission.validate(&mut || rand::random::<u64>() >> 11)?;
        let key = submission.idempotency_key.clone();
        if let Some(known) = self.known(key.as_deref(), submission.job_id) {
            return Ok(Submitted::Known(known));
        }
        // The id first, so that every line logged about the job carries it (its `job` span).
        let id = *submission.job_id.get_or_insert_with(JobId::new);
        self.accept_new(lane, id, submission, key, owner)
            .instrument(tracing::info_span!("job", job_id = %id))
            .await
    }

    /// [`Scheduler::accept`] of a job it did not know, once named `id`.
    async fn accept_new(
        &self,
        lane: Lane,
        id: JobId,
        mut submission: Submission,
        key: Option<String>,
        owner: Option<String>,
    ) -> Result<Submitted, AcceptError> {
        let files = self.resolve_names(&submission.job).await?;
        match &mut submission.job {
            JobSpec::Edit(edit) => {
                if let Some(input) = &mut edit.input {
                    self.store_inline(input, "job.input.inline").await?
                }
                for (n, input) in edit.inputs.iter_mut().enumerate() {
                    self.store_inline(input, &format!("job.inputs[{n}].inline"))
                        .await?
                }
            }
            JobSpec::Upscale(UpscaleSpec { input, .. }) => {
                self.store_inline(input, "job.input.inline").await?
            }
            JobSpec::Pipeline(p) => {
                for (i, edit) in p.edits.iter_mut().enumerate() {
                    for (j, input) in edit.references.iter_mut().enumerate() {
                        let field = format!("job.edits[{i}].references[{j}].inline");
                        self.store_inline(input, &field).await?
                    }
                }
                self.default_checkpoint(&mut p.base);
            }
            JobSpec::Generate(g) => self.default_checkpoint(g),
        }
        for (field, key) in stored_inputs(&submission.job) {
            self.check_stored(&field, key).await?;
        }
        let kind = submission.job.kind_name();
        let children: Vec<JobId> = (0..pipeline_size(&submission))
            .map(|_| JobId::new())
            .collect();
        let jobs = 1 + children.len();
        self.publish_event_on(
            lane,
            id,
            EventKind::Queued {
                submission: Box::new(submission),
                parent: None,
                children,
                owner,
                files,
            },
        )
        .await
        .map_err(|e| AcceptError::Unavailable(e.to_string()))?;
        self.metrics()
            .jobs_submitted_total
            .with_label_values(&[kind])
            .inc();
        tracing::info!(job_id = %id, kind, jobs, "job accepted");
        Ok(Submitted::Published { job_id: id, key })
    }

    /// The job a key or id already names, if the registry knows it.
    fn known(&self, key: Option<&str>, id: Option<JobId>) -> Option<JobId> {
        let reg = self.registry();
        key.and_then(|k| reg.resolve_key(k))
            .or_else(|| id.filter(|id| reg.contains(*id)))
    }

    /// Waits until a submission's `queued` event has been read back from the stream, and says which
    /// job it names: its own, or, when another submission of the same key came first, that one.
    pub async fn accepted(&self, submitted: Submitted, timeout: Duration) -> Option<Accepted> {
        let (id, key) = match submitted {
            Submitted::Known(id) => {
                return Some(Accepted {
                    job_id: id,
                    created: false,
                });
            }
            Submitted::Published { job_id, key } => (job_id, key),
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.applied().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let reg = self.registry();
                let by_key = key.as_deref().and_then(|k| reg.resolve_key(k));
                match by_key {
                    Some(first) => {
                        return Some(Accepted {
                            job_id: first,
                            created: first == id,
                        });
                    }
                    None if key.is_none() && reg.contains(id) => {
                        return Some(Accepted {
                            job_id: id,
                            created: true,
                        });
                    }
                    None => {}
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// A stored input must be there: one that is not is refused now, naming its field, rather than
    /// failing on a worker. A store that cannot answer refuses nothing (the worker's download
    /// retries).
    async fn check_stored(&self, field: &str, key: &str) -> Result<(), AcceptError> {
        let invalid = |message: String| {
            AcceptError::Invalid(ValidationError {
                field: field.to_owned(),
                message,
            })
        };
        match self.storage().exists(key).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(invalid(format!(
                "no stored image `{key}` (upload it first: POST /v1/uploads)"
            ))),
            Err(StorageError::InvalidKey { reason, .. }) => {
                Err(invalid(format!("`{key}` is not a storage key: {reason}")))
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "cannot check a stored input now; accepting the job");
                Ok(())
            }
        }
    }

    /// Replaces an inline image by a stored one under `inputs/` (content-addressed), after checking
    /// that it is a whole image of an accepted format and size; an error names `field`.
    async fn store_inline(&self, input: &mut ImageRef, field: &str) -> Result<(), AcceptError> {
        let Some(decoded) = input.inline_bytes() else {
            return Ok(());
        };
        let invalid = |message: String| {
            AcceptError::Invalid(ValidationError {
                field: field.to_owned(),
                message,
            })
        };
        let bytes = decoded.map_err(|e| invalid(format!("not valid base64: {e}")))?;
        let limits = InputLimits {
            max_bytes: MAX_INLINE_IMAGE_BYTES,
            ..self.input_limits()
        };
        match self.store_input(Bytes::from(bytes), limits).await {
            Ok(stored) => {
                *input = ImageRef::Stored(stored.key);
                Ok(())
            }
            Err(InputError::Invalid(message)) => Err(invalid(message)),
            Err(InputError::Unavailable(message)) => Err(AcceptError::Unavailable(message)),
        }
    }

    /// The bounds of an input image (uploads; inline inputs also keep the 8 MiB message bound).
    pub fn input_limits(&self) -> InputLimits {
        InputLimits {
            max_bytes: self.config().upload_max_bytes,
            max_side: MAX_INPUT_SIDE,
            max_pixels: self.config().upload_max_pixels,
        }
    }

    /// Verifies an input image by decoding it (on a blocking thread) and stores it under `inputs/`
    /// by the sha256 of its bytes, so the same image uploaded twice is one object.
    pub async fn store_input(
        &self,
        bytes: Bytes,
        limits: InputLimits,
    ) -> Result<StoredInput, InputError> {
        let checked = bytes.clone();
        let image = tokio::task::spawn_blocking(move || images::verify(&checked, limits))
            .await
            .map_err(|e| InputError::Unavailable(format!("the image check failed: {e}")))?
            .map_err(InputError::Invalid)?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let key = input_key(&sha256, image.format.extension());
        let size = bytes.len();
        self.storage()
            .put(&key, bytes, image.format.content_type())
            .await
            .map_err(|e| {
                self.metrics().storage_error("put", &e);
                InputError::Unavailable(e.to_string())
            })?;
        Ok(StoredInput {
            key,
            sha256,
            size,
            image,
        })
    }

    /// Takes submissions from the intake queue, each accepted in a task of its own (at most the
    /// channel's prefetch at once); the tasks end with this future.
    pub(crate) async fn consume_intake(&self, connection: &Connection) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        channel.basic_qos(32, BasicQosOptions::default()).await?;
        let mut intake = channel
            .basic_consume(
                self.topology().intake_queue().into(),
                "intake".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut tasks = JoinSet::new();
        loop {
            tokio::select! {
                d = intake.next() => {
                    let Some(d) = d else { anyhow::bail!("the intake consumer was cancelled") };
                    let d = d?;
                    let this = self.clone();
                    let channel = channel.clone();
                    tasks.spawn(async move {
                        if let Err(e) = this.on_intake(d, channel).await {
                            // Unsettled: the broker delivers it again on the next session.
                            tracing::error!(error = %e, "an intake message could not be settled");
                        }
                    });
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
    }

    /// A submission from a producer on the intake queue, handled in a task of its own so that a
    /// slow store never holds up the scheduler's other work. Invalid ones are dead-lettered with a
    /// `failed` event. One that cannot be accepted now (storage or the broker is unavailable) waits
    /// here, held, for as long as the outage lasts: see [`Scheduler::hold`]. The ack comes after the
    /// `queued` event is confirmed, so a scheduler killed in between leaves the message to be
    /// delivered again, and the key or id makes the repeat harmless.
    async fn on_intake(&self, delivery: Delivery, channel: Channel) -> anyhow::Result<()> {
        let id_hint = delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|m| m.as_str().parse::<JobId>().ok());
        // The message id names the job until the submission is read (which may name another).
        let span = tracing::info_span!("intake", job_id = tracing::field::Empty);
        if let Some(id) = id_hint {
            span.record("job_id", tracing::field::display(id));
        }
        self.intake(delivery, channel, id_hint)
            .instrument(span)
            .await
    }

    async fn intake(
        &self,
        delivery: Delivery,
        channel: Channel,
        id_hint: Option<JobId>,
    ) -> anyhow::Result<()> {
        let parsed = if delivery.data.len() > MAX_MESSAGE_BYTES {
            Err((
                FailureKind::Malformed,
                format!(
                    "message of {} bytes exceeds {MAX_MESSAGE_BYTES}",
                    delivery.data.len()
                ),
            ))
        } else {
            decode_json::<Submission>(&delivery.data)
                .map_err(|e| (FailureKind::Malformed, e.to_string()))
        };
        let rejected = match parsed {
            Ok(mut sub) => {
                // The id is fixed before the first attempt: the message id, or a fresh one that
                // a renewed copy of the message carries, so every attempt is the same job.
                let id = *sub
                    .job_id
                    .get_or_insert_with(|| id_hint.unwrap_or_default());
                match self.hold(&delivery, &channel, sub, id).await? {
                    Held::Accepted => None,
                    Held::Invalid(e) => Some((Some(id), FailureKind::InvalidSpec, e.to_string())),
                    Held::Settled => return Ok(()),
                }
            }
            Err((kind, message)) => Some((id_hint, kind, message)),
        };
        if let Some((job_id, failure, message)) = rejected {
            self.metrics().malformed_messages_total.inc();
            // A failed event needs an id: the producer's, or a fresh one reported in the dead letter.
            let job_id = job_id.unwrap_or_default();
            tracing::warn!(job_id = %job_id, failure = failure.as_str(), %message, "submission rejected");
            let id_text = job_id.to_string();
            self.dead_letter(
                &delivery.data,
                failure,
                dead_letter_headers(&message, failure.as_str(), Some(&id_text)),
            )
            .await?;
            self.publish_event(
                job_id,
                EventKind::Failed {
                    failure,
                    message,
                    retryable: false,
                },
            )
            .await?;
        }
        delivery.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }

    /// Accepts a valid submission, waiting out an outage of storage or the broker however long it
    /// lasts. The delivery is held (unacknowledged) meanwhile and retried with backoff, never sent
    /// back to the queue: a quorum queue counts every return against its delivery limit and
    /// dead-letters the submission after a few. A delivery that the broker already counted (it
    /// came back after a lost session) or that has been held for [`HOLD_RENEW`] (under the
    /// broker's consumer timeout) is renewed instead: a copy with the same id is published to the
    /// intake queue, confirmed, and then this one is acknowledged, so its count starts again at 0.
    /// Only a message that stops the scheduler each time it is delivered (a poison message) ever
    /// reaches the limit, and the dead-letter watch gives it a `failed` event.
    async fn hold(
        &self,
        delivery: &Delivery,
        channel: &Channel,
        submission: Submission,
        id: JobId,
    ) -> anyhow::Result<Held> {
        let held_since = tokio::time::Instant::now();
        let mut backoff = Backoff::new(HOLD_MAX_DELAY);
        let mut attempts = 0u32;
        loop {
            // The intake queue's publishers hold broker credentials, not a person's token: their
            // jobs are `admin`'s (no owner recorded).
            let reason = match self
                .accept_on(Lane::Session, submission.clone(), None)
                .await
            {
                Ok(_) => {
                    if attempts > 0 {
                        tracing::info!(
                            attempts,
                            waited_ms = held_since.elapsed().as_millis() as u64,
                            "submission accepted after waiting"
                        );
                    }
                    return Ok(Held::Accepted);
                }
                Err(AcceptError::Invalid(e)) => return Ok(Held::Invalid(e)),
                Err(AcceptError::Unavailable(reason)) => reason,
            };
            attempts += 1;
            if !channel.status().connected() {
                // The broker gives the message back when it sees the session end.
                tracing::warn!(%reason, "cannot accept a submission and its channel is gone; it is delivered again");
                return Ok(Held::Settled);
            }
            if delivery_count(&delivery.properties) > 0 || held_since.elapsed() >= HOLD_RENEW {
                match self.renew(delivery, id).await {
                    Ok(()) => {
                        delivery.acker.ack(BasicAckOptions::default()).await?;
                        tracing::info!(%reason, "cannot accept a submission now; renewed it in the intake queue");
                        return Ok(Held::Settled);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot renew a held submission; holding it")
                    }
                }
            }
            let delay = backoff.next_delay();
            if attempts == 1 || attempts.is_power_of_two() {
                tracing::warn!(%reason, attempts, retry_in_ms = delay.as_millis() as u64, "cannot accept a submission now; holding it");
            }
            self.metrics().intake_held_retries_total.inc();
            tokio::time::sleep(delay).await;
        }
    }

    /// Publishes a copy of an intake message, named `id`, back to the intake queue (confirmed).
    async fn renew(&self, delivery: &Delivery, id: JobId) -> Result<(), PublishError> {
        let props = delivery
            .properties
            .clone()
            .with_message_id(id.to_string().into())
            .with_delivery_mode(2)
            .with_headers(uncounted(delivery.properties.headers().as_ref()));
        self.publisher()?
            .publish("", &self.topology().intake_queue(), &delivery.data, props)
            .await
    }
}

/// The headers of a delivery without the broker's delivery count. A quorum queue sets
/// `x-delivery-count` only on a delivery after the first, so a renewed copy that kept it would read
/// as counted when first delivered and be renewed again at once, on every failed attempt.
fn uncounted(headers: Option<&FieldTable>) -> FieldTable {
    let mut kept = headers.map(|h| h.inner().clone()).unwrap_or_default();
    kept.retain(|name, _| name.as_str() != "x-delivery-count");
    FieldTable::from(kept)
}

/// What became of a held intake delivery.
enum Held {
    /// Accepted: the caller acknowledges it.
    Accepted,
    /// The spec broke a bound: the caller dead-letters it with a `failed` event.
    Invalid(ValidationError),
    /// Already settled here (renewed and acknowledged), or left for the broker to deliver again.
    Settled,
}

/// A held submission is retried after 100 ms, doubling up to this.
const HOLD_MAX_DELAY: Duration = Duration::from_secs(10);

/// A submission held this long is renewed in the intake queue: well under the broker's consumer
/// acknowledgement timeout (30 min by default), past which it closes the channel.
const HOLD_RENEW: Duration = Duration::from_secs(10 * 60);

/// An input image in storage.
#[derive(Clone, Debug)]
pub struct StoredInput {
    /// `inputs/<sha256>.<ext>`.
    pub key: String,
    pub sha256: String,
    /// Bytes.
    pub size: usize,
    pub image: VerifiedImage,
}

/// Why an input image was not stored.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// Not an image the farm accepts; the message says why.
    #[error("{0}")]
    Invalid(String),
    /// Storage is unavailable; the client may retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// A published submission, before its event is read back.
#[derive(Clone, Debug)]
pub enum Submitted {
    /// Its key or id already named this job.
    Known(JobId),
    Published {
        job_id: JobId,
        key: Option<String>,
    },
}

/// The stored images a job names, each with its field.
fn stored_inputs(job: &JobSpec) -> Vec<(String, &str)> {
    fn stored(r: &ImageRef) -> Option<&str> {
        match r {
            ImageRef::Stored(key) => Some(key.as_str()),
            ImageRef::JobOutput { .. } | ImageRef::Inline(_) => None,
        }
    }
    let mut found = Vec::new();
    match job {
        JobSpec::Edit(e) => {
            found.extend(
                e.input
                    .as_ref()
                    .and_then(stored)
                    .map(|k| ("job.input".to_owned(), k)),
            );
            for (i, r) in e.inputs.iter().enumerate() {
                found.extend(stored(r).map(|k| (format!("job.inputs[{i}]"), k)));
            }
        }
        JobSpec::Upscale(u) => found.extend(stored(&u.input).map(|k| ("job.input".to_owned(), k))),
        JobSpec::Pipeline(p) => {
            for (i, edit) in p.edits.iter().enumerate() {
                for (j, r) in edit.references.iter().enumerate() {
                    found.extend(stored(r).map(|k| (format!("job.edits[{i}].references[{j}]"), k)));
                }
            }
        }
        JobSpec::Generate(_) => {}
    }
    found
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

    /// A renewed copy keeps the producer's headers but not the broker's count of the old delivery.
    #[test]
    fn a_renewed_copy_is_not_counted_as_delivered() {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-delivery-count"),
            AMQPValue::LongLongInt(1),
        );
        headers.insert(
            ShortString::from("traceparent"),
            AMQPValue::LongString(LongString::from("00-ab-cd-01")),
        );
        let copy = super::uncounted(Some(&headers));
        let names: Vec<&str> = copy.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, ["traceparent"]);
        assert!(super::uncounted(None).inner().is_empty());
    }
}
