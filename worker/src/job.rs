//! One delivery, from message to acknowledgement: decode, run the message's jobs ([`crate::execute`]),
//! settle each, then ack (DESIGN §4: ack only after the side effects are done).
//!
//! A message carries one job, or a batch of jobs ([`WorkMessage::batch`]: edits of one input, or
//! compatible generates) that run on the engine together: one message, one delivery, one ack, and
//! each job still gets its own events, outputs and manifest. Each job's end is settled by its
//! [`Disposition`], decided once in [`crate::end`].
//!
//! A single-job message is settled as a whole: dead-lettered, acked, or requeued to the worker's
//! queue. In a batch, each job is settled on its own and the message is acked once all are, so a
//! failure or cancel of one never loses the others: a job failing permanently is dead-lettered as a
//! single-job copy; one to try again (a transient failure, shutdown) goes back to the scheduler as
//! a single-job message on the redispatch queue. When the broker is lost, the whole message is
//! redelivered and the jobs it had finished are skipped by their manifests.

use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use tracing::Instrument;
use vnfarm_bus::headers::{dead_letter_headers, delivery_count};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher};
use vnfarm_proto::topology::{HEADER_FAILURE, HEADER_JOB_ID, HEADER_REASON, HEADER_YIELDED};
use vnfarm_proto::{
    BatchedJob, Event, EventKind, FailureKind, JobId, MAX_MESSAGE_BYTES, Manifest, WorkMessage,
    decode_json, work::decodable_protocols,
};

use crate::end::{Disposition, Done, Ended, JobEnd, JobError};
use crate::engine::EngineError;
use crate::outbox::Outbox;
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

/// Why a job goes back to the scheduler unfinished.
enum GiveBackReason {
    /// A transient failure, to be retried.
    Failed(FailureKind, String),
    Shutdown,
    /// The scheduler asked for it back before it started.
    Yielded,
}

/// What a delivery decoded into.
enum Parsed {
    Work(WorkMessage),
    /// Not a work message this worker can read; the ids of the jobs that can be recovered.
    Malformed(Vec<JobId>, String),
    /// Written in a protocol version this worker does not read (a newer one, or one it was told
    /// not to): not a fault of the jobs, which another worker may run.
    Unreadable(u32),
}

/// The protocol versions of work messages this worker decodes, as its heartbeat advertises them:
/// this build's ([`decodable_protocols`]), or version 1 alone when the test harness makes it stand
/// in for a worker of the previous release ([`V1_ONLY_VAR`]), which also settles a message it
/// cannot read as that release did: dead-lettered as malformed.
pub(crate) fn protocols() -> Vec<u32> {
    if v1_only() {
        vec![1]
    } else {
        decodable_protocols()
    }
}

/// Test hook (the harness's reserved prefix): `1` makes the worker speak protocol version 1 only.
pub const V1_ONLY_VAR: &str = "VNFARM_TEST_PROTOCOL_V1_ONLY";

fn v1_only() -> bool {
    std::env::var_os(V1_ONLY_VAR).is_some_and(|v| v == "1")
}

/// The envelope's version alone, read before the rest (a newer version's spec may not decode).
#[derive(serde::Deserialize)]
struct Version {
    schema_version: u32,
}

/// Decodes a delivery into a work message.
fn parse(delivery: &Delivery) -> Parsed {
    match parse_work(delivery) {
        Ok(msg) => Parsed::Work(msg),
        Err(ParseError::Malformed(ids, reason)) => Parsed::Malformed(ids, reason),
        Err(ParseError::Unreadable(version)) => Parsed::Unreadable(version),
    }
}

enum ParseError {
    Malformed(Vec<JobId>, String),
    Unreadable(u32),
}

fn parse_work(delivery: &Delivery) -> Result<WorkMessage, ParseError> {
    let id_from_props = delivery
        .properties
        .message_id()
        .as_ref()
        .and_then(|m| m.as_str().parse::<JobId>().ok());
    let malformed =
        |reason: String| ParseError::Malformed(id_from_props.into_iter().collect(), reason);
    if delivery.data.len() > MAX_MESSAGE_BYTES {
        return Err(malformed(format!(
            "message of {} bytes exceeds {MAX_MESSAGE_BYTES}",
            delivery.data.len()
        )));
    }
    if let Ok(Version { schema_version }) = serde_json::from_slice(&delivery.data)
        && !protocols().contains(&schema_version)
    {
        return Err(if v1_only() {
            malformed(format!("schema_version: {schema_version} is not supported"))
        } else {
            ParseError::Unreadable(schema_version)
        });
    }
    decode_json(&delivery.data).map_err(|e| malformed(e.to_string()))
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
            Parsed::Work(msg) => msg,
            Parsed::Malformed(job_ids, reason) => {
                self.metrics().malformed_messages_total.inc();
                tracing::warn!(job_ids = ?job_ids, %reason, "dead-lettering a malformed work message");
                self.dead_letter(publisher, &body, &job_ids, FailureKind::Malformed, &reason)
                    .await?;
                return pending.ack().await;
            }
            Parsed::Unreadable(version) => {
                self.give_back_unreadable(publisher, &pending.0, version)
                    .await?;
                return pending.ack().await;
            }
        };
        let jobs: Vec<BatchedJob> = msg.jobs().collect();
        let outbox = Outbox::Bus(publisher.clone());
        self.metrics().batch_jobs.observe(jobs.len() as f64);
        let (ends, mut ended) = tokio::sync::mpsc::unbounded_channel();
        let settled = if jobs.len() == 1 {
            let job = &jobs[0];
            let span = tracing::info_span!("job", job_id = %job.job_id, kind = job.task.kind_name(), attempt);
            async {
                let ((), end) =
                    tokio::join!(self.execute(&outbox, &jobs, attempt, ends), ended.recv());
                let end = end.map(|(_, end)| end).unwrap_or_else(|| {
                    Err(JobError::Engine(EngineError::Failed(
                        "no end for the job".into(),
                    )))
                });
                self.settle_single(publisher, pending, &body, job, end, started)
                    .await
            }
            .instrument(span)
            .await
        } else {
            let span =
                tracing::info_span!("batch", first = %msg.job_id, jobs = jobs.len(), attempt);
            async {
                let ((), settled) = tokio::join!(
                    self.execute(&outbox, &jobs, attempt, ends),
                    self.settle_batch(publisher, &jobs, ended, started)
                );
                settled?;
                pending.ack().await
            }
            .instrument(span)
            .await
        };
        self.hand()
            .release(&jobs.iter().map(|j| j.job_id).collect::<Vec<_>>());
        settled
    }

    /// Settles a single-job message as a whole: acked, dead-lettered, or requeued on this worker's
    /// queue.
    async fn settle_single(
        &self,
        publisher: &Publisher,
        pending: Pending,
        body: &[u8],
        job: &BatchedJob,
        end: JobEnd,
        started: Instant,
    ) -> Result<(), Lost> {
        let job_id = job.job_id;
        let kind = job.task.kind_name();
        let error = match end {
            Ok(ended) => {
                self.report(publisher, job, ended, started).await?;
                return pending.ack().await;
            }
            Err(error) => error,
        };
        if let JobError::Engine(EngineError::DeviceLost(reason)) = &error {
            // Stop taking jobs before this one is given back, so it goes to another worker.
            self.device_loss().latch(reason);
        }
        self.count_failure(job, &error.disposition(), started);
        match error.disposition() {
            Disposition::DeadLetter(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job failed permanently");
                self.dead_letter(publisher, body, &[job_id], failure, &error.to_string())
                    .await?;
                pending.ack().await
            }
            Disposition::Retry(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job failed, will be retried");
                self.publish_failed(publisher, job_id, failure, &error, true)
                    .await?;
                // Back off before giving it back, so a broken dependency is not hammered.
                tokio::time::sleep(RETRY_BACKOFF).await;
                pending.requeue().await
            }
            Disposition::Cancelled => {
                self.report_cancelled(publisher, job_id, "cancelled while running")
                    .await?;
                pending.ack().await
            }
            Disposition::GiveBack => {
                tracing::info!(job_id = %job_id, kind, "shutdown interrupted the job; giving it back");
                pending.requeue().await
            }
            Disposition::Yield => {
                tracing::info!(job_id = %job_id, kind, "giving the job back unstarted, as the scheduler asked");
                self.give_back(publisher, job, GiveBackReason::Yielded)
                    .await?;
                pending.ack().await
            }
            Disposition::Abandon => {
                tracing::warn!(job_id = %job_id, error = %error, "broker lost mid-job; it will be redelivered");
                Err(Lost(error.to_string()))
            }
        }
    }

    /// Settles each job of a batch message on its own as its end arrives (the caller acks the
    /// message after the last). A job to try again goes back to the scheduler alone, after the
    /// others; one that failed for good is dead-lettered alone.
    async fn settle_batch(
        &self,
        publisher: &Publisher,
        jobs: &[BatchedJob],
        mut ends: tokio::sync::mpsc::UnboundedReceiver<(usize, JobEnd)>,
        started: Instant,
    ) -> Result<(), Lost> {
        let mut retries = Vec::new();
        let mut seen = vec![false; jobs.len()];
        while let Some((i, end)) = ends.recv().await {
            seen[i] = true;
            if matches!(&end, Err(e) if matches!(e.disposition(), Disposition::Retry(_))) {
                retries.push((i, end));
                continue;
            }
            self.settle_member(publisher, &jobs[i], end, started)
                .await?;
            self.hand().settled(jobs[i].job_id);
        }
        for (i, job) in jobs.iter().enumerate().filter(|(i, _)| !seen[*i]) {
            // `execute` ends every job; should one be missed, it fails with a reason, not silently.
            tracing::error!(job_id = %job.job_id, "no end for a job of the batch");
            let missing = Err(JobError::Engine(EngineError::Failed(
                "no end for the job".into(),
            )));
            self.settle_member(publisher, job, missing, started).await?;
            self.hand().settled(jobs[i].job_id);
        }
        if !retries.is_empty() {
            // Back off once before giving jobs back, so a broken dependency is not hammered (the
            // others are reported first: they do not wait for it).
            tokio::time::sleep(RETRY_BACKOFF).await;
        }
        for (i, end) in retries {
            self.settle_member(publisher, &jobs[i], end, started)
                .await?;
            self.hand().settled(jobs[i].job_id);
        }
        Ok(())
    }

    async fn settle_member(
        &self,
        publisher: &Publisher,
        job: &BatchedJob,
        end: JobEnd,
        started: Instant,
    ) -> Result<(), Lost> {
        let job_id = job.job_id;
        let error = match end {
            Ok(ended) => return self.report(publisher, job, ended, started).await,
            Err(error) => error,
        };
        if let JobError::Engine(EngineError::DeviceLost(reason)) = &error {
            self.device_loss().latch(reason);
        }
        let disposition = error.disposition();
        self.count_failure(job, &disposition, started);
        match disposition {
            Disposition::DeadLetter(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job of a batch failed permanently");
                let alone = single_job_body(job);
                self.dead_letter(publisher, &alone, &[job_id], failure, &error.to_string())
                    .await
            }
            Disposition::Retry(failure) => {
                tracing::warn!(job_id = %job_id, failure = failure.as_str(), error = %error, "job of a batch failed; giving it back to be retried");
                self.publish_failed(publisher, job_id, failure, &error, true)
                    .await?;
                self.give_back(
                    publisher,
                    job,
                    GiveBackReason::Failed(failure, error.to_string()),
                )
                .await
            }
            Disposition::Cancelled => {
                self.report_cancelled(publisher, job_id, "cancelled while running")
                    .await
            }
            Disposition::GiveBack => {
                tracing::info!(job_id = %job_id, "shutdown interrupted a job of a batch; giving it back");
                self.give_back(publisher, job, GiveBackReason::Shutdown)
                    .await
            }
            Disposition::Yield => {
                tracing::info!(job_id = %job_id, "giving a job of the batch back unstarted, as the scheduler asked");
                self.give_back(publisher, job, GiveBackReason::Yielded)
                    .await
            }
            Disposition::Abandon => {
                tracing::warn!(job_id = %job_id, error = %error, "broker lost mid-batch; the message will be redelivered");
                Err(Lost(error.to_string()))
            }
        }
    }

    /// Publishes the event of a job that ended without failing: `cancelled` before it started,
    /// `completed` from an earlier delivery's manifest, or `completed` here.
    async fn report(
        &self,
        publisher: &Publisher,
        job: &BatchedJob,
        ended: Ended,
        started: Instant,
    ) -> Result<(), Lost> {
        let job_id = job.job_id;
        let kind = job.task.kind_name();
        match ended {
            Ended::CancelledBefore => {
                self.metrics()
                    .jobs_total
                    .with_label_values(&[kind, "cancelled"])
                    .inc();
                self.report_cancelled(publisher, job_id, "cancelled before it started")
                    .await
            }
            Ended::FinishedBefore(manifest) => {
                self.report_finished(publisher, kind, *manifest).await
            }
            Ended::Completed(Done {
                outputs,
                manifest,
                timings,
            }) => {
                self.metrics()
                    .job_seconds
                    .with_label_values(&[kind])
                    .observe(started.elapsed().as_secs_f64());
                let event = EventKind::Completed {
                    outputs,
                    manifest,
                    worker: Some(self.id().clone()),
                    timings,
                };
                self.publish_event(publisher, job_id, event)
                    .await
                    .map_err(broker)?;
                self.metrics()
                    .jobs_total
                    .with_label_values(&[kind, "completed"])
                    .inc();
                tracing::info!(job_id = %job_id, seconds = started.elapsed().as_secs_f64(), "job completed");
                Ok(())
            }
        }
    }

    /// Reports a job an earlier delivery finished (see [`Worker::finished_before`]): `completed`
    /// rebuilt from its manifest. The engine does not run and no `started` is sent.
    async fn report_finished(
        &self,
        publisher: &Publisher,
        kind: &'static str,
        manifest: Manifest,
    ) -> Result<(), Lost> {
        let job_id = manifest.job_id;
        let made_by = manifest.worker.clone();
        self.publish_event(publisher, job_id, manifest.completed())
            .await
            .map_err(broker)?;
        self.metrics()
            .jobs_total
            .with_label_values(&[kind, "already_completed"])
            .inc();
        tracing::info!(job_id = %job_id, made_by = %made_by, "job already completed; not running it again");
        Ok(())
    }

    async fn report_cancelled(
        &self,
        publisher: &Publisher,
        job_id: JobId,
        reason: &str,
    ) -> Result<(), Lost> {
        tracing::info!(job_id = %job_id, reason, "job cancelled");
        self.publish_event(
            publisher,
            job_id,
            EventKind::Cancelled {
                reason: reason.into(),
                by: None,
            },
        )
        .await
        .map_err(broker)
    }

    /// Counts a failed job by what happens to it (a cancel counts as `cancelled`).
    fn count_failure(&self, job: &BatchedJob, disposition: &Disposition, started: Instant) {
        let kind = job.task.kind_name();
        let outcome = match disposition {
            Disposition::DeadLetter(_) => "failed",
            Disposition::Retry(_) | Disposition::GiveBack => "requeued",
            Disposition::Cancelled => "cancelled",
            // Nothing is settled: the message comes back. A yield is no outcome: the job runs later.
            Disposition::Abandon | Disposition::Yield => return,
        };
        self.metrics()
            .jobs_total
            .with_label_values(&[kind, outcome])
            .inc();
        if outcome != "cancelled" {
            self.metrics()
                .job_seconds
                .with_label_values(&[kind])
                .observe(started.elapsed().as_secs_f64());
        }
    }

    async fn publish_failed(
        &self,
        publisher: &Publisher,
        job_id: JobId,
        failure: FailureKind,
        error: &JobError,
        retryable: bool,
    ) -> Result<(), Lost> {
        let event = EventKind::Failed {
            failure,
            message: error.to_string(),
            retryable,
        };
        self.publish_event(publisher, job_id, event)
            .await
            .map_err(broker)
    }

    /// Copies `body` to the dead-letter exchange with the reason, and publishes `failed` (final)
    /// for each of `job_ids` (the first is named in the headers). The caller acks.
    async fn dead_letter(
        &self,
        publisher: &Publisher,
        body: &[u8],
        job_ids: &[JobId],
        failure: FailureKind,
        reason: &str,
    ) -> Result<(), Lost> {
        let id = job_ids.first().map(|j| j.to_string());
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(dead_letter_headers(reason, failure.as_str(), id.as_deref()));
        if let Err(e) = publisher
            .publish(&self.topology().dead_exchange(), "", body, props)
            .await
        {
            tracing::warn!(job_ids = ?job_ids, error = %e, "could not dead-letter the message; it stays unsettled");
            return Err(broker(e));
        }
        self.metrics()
            .dead_letters_total
            .with_label_values(&[failure.as_str()])
            .inc();
        for &job_id in job_ids {
            let event = EventKind::Failed {
                failure,
                message: reason.to_owned(),
                retryable: false,
            };
            self.publish_event(publisher, job_id, event)
                .await
                .map_err(broker)?;
        }
        Ok(())
    }

    /// Gives a message written in a protocol version this worker does not read back to the
    /// scheduler as it came (the scheduler reads every version it writes), to run elsewhere. It
    /// only happens when a worker was replaced by an older build while its queue held messages.
    async fn give_back_unreadable(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        version: u32,
    ) -> Result<(), Lost> {
        let reason = format!(
            "given back by worker {}: written in protocol version {version}; it reads {:?}",
            self.id(),
            protocols()
        );
        tracing::warn!(%reason, "giving back a work message it cannot read");
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_REASON.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        let mut props = json_properties().with_headers(headers);
        if let Some(id) = delivery.properties.message_id() {
            props = props.with_message_id(id.clone());
        }
        publisher
            .publish(
                &self.topology().give_back_exchange(),
                "",
                &delivery.data,
                props,
            )
            .await
            .map_err(broker)
    }

    /// Gives one job of a batch back to the scheduler: a single-job message on the redispatch
    /// queue (through the give-back exchange), where the scheduler takes it back into its backlog. The headers say why (and the
    /// failure, for a transient one).
    async fn give_back(
        &self,
        publisher: &Publisher,
        job: &BatchedJob,
        why: GiveBackReason,
    ) -> Result<(), Lost> {
        let id = job.job_id.to_string();
        let mut headers = FieldTable::default();
        let mut put = |name: &str, value: String| {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        };
        let reason = match &why {
            GiveBackReason::Failed(_, error) => error.as_str(),
            GiveBackReason::Shutdown => "the worker shut down",
            GiveBackReason::Yielded => "yielded unstarted, as the scheduler asked",
        };
        put(
            HEADER_REASON,
            format!("given back by worker {}: {reason}", self.id()),
        );
        put(HEADER_JOB_ID, id.clone());
        match why {
            GiveBackReason::Failed(failure, _) => {
                put(HEADER_FAILURE, failure.as_str().to_owned());
            }
            GiveBackReason::Yielded => put(HEADER_YIELDED, "true".to_owned()),
            GiveBackReason::Shutdown => {}
        }
        let props = json_properties()
            .with_message_id(id.into())
            .with_headers(headers);
        let body = single_job_body(job);
        if let Err(e) = publisher
            .publish(&self.topology().give_back_exchange(), "", &body, props)
            .await
        {
            tracing::warn!(job_id = %job.job_id, error = %e, "could not give the job back; the message stays unsettled");
            return Err(broker(e));
        }
        Ok(())
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
                &self.topology().events_exchange(),
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
}

/// How long a job to retry waits before it goes back, so that a broken dependency is not hammered.
const RETRY_BACKOFF: Duration = Duration::from_millis(500);

/// The work message of one job of a batch, alone.
fn single_job_body(job: &BatchedJob) -> Vec<u8> {
    let message = WorkMessage::of(vec![job.clone()]).expect("one job makes a message");
    serde_json::to_vec(&message).expect("work messages serialize to JSON")
}

/// The broker connection is gone (or refused an event): the session must end and reconnect.
#[derive(Debug, thiserror::Error)]
#[error("broker session lost: {0}")]
pub struct Lost(pub String);

fn broker(e: PublishError) -> Lost {
    Lost(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::end::tests::manifest;
    use vnfarm_proto::topology::{manifest_key, output_key};

    #[test]
    fn completed_is_rebuilt_from_the_manifest_and_credits_the_worker_that_made_it() {
        let id = JobId::new();
        let stored = manifest(id);
        let EventKind::Completed {
            outputs,
            manifest: key,
            worker,
            timings,
        } = stored.clone().completed()
        else {
            panic!("a completed event")
        };
        assert_eq!(outputs, [output_key(id, 0), output_key(id, 1)]);
        assert_eq!(key, manifest_key(id));
        assert_eq!(worker, Some(stored.worker.clone()));
        assert_eq!(timings, stored.timings);
    }

    #[test]
    fn a_job_of_a_batch_goes_back_alone() {
        let job = |n: u128| BatchedJob {
            job_id: JobId(uuid::Uuid::from_u128(n)),
            priority: vnfarm_proto::Priority::Interactive,
            deadline: None,
            task: decode_json(br#"{"kind": "generate", "prompt": "a lighthouse", "seed": 4}"#)
                .expect("a valid task"),
        };
        let batch = WorkMessage::of(vec![job(1), job(2), job(3)]).unwrap();
        let second = batch.jobs().nth(1).unwrap();
        let alone: WorkMessage = decode_json(&single_job_body(&second)).unwrap();
        assert_eq!(alone.job_id, second.job_id);
        assert_eq!(alone.priority, second.priority);
        assert_eq!(alone.task, second.task);
        assert!(alone.batch.is_empty());
    }
}
