//! Dispatch, done by the active scheduler only: the follow-ups the registry owes (finished
//! pipelines, jobs whose input failed), the dispatch policy and the publishing of jobs to worker
//! queues, jobs that come back from worker queues (redispatch), and the watchdog for dispatches
//! that never started.
//!
//! Runs in its own task ([`Scheduler::dispatcher`]), woken by new events, heartbeats and a timer,
//! so a slow publish never holds up the reading of the stream. The decisions are taken under the
//! registry lock (O(dispatches), not O(backlog)), then published without it.

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use vnfarm_bus::PublishError;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::topology::{YIELD_ROUTING_KEY, manifest_key};
use vnfarm_proto::{
    BatchedJob, EventKind, FailureKind, JobId, JobSpec, Manifest, Task, WorkMessage, YieldRequest,
};
use vnfarm_storage::StorageError;

use crate::registry::Dispatch;

/// The reason of a returned message that carries no death record: its worker gave it back.
pub(crate) const GIVEN_BACK: &str = "given_back";
/// The reason of a job its worker gave back unstarted because this scheduler asked (a yield).
pub(crate) const YIELDED: &str = "yielded";
use crate::scheduler::Scheduler;

impl Scheduler {
    /// The active scheduler's loop: settle whenever something may have changed, when a hold or a
    /// coalescing window the last plan left open ends, and at least every half second (the
    /// watchdog). Returns on the first publish error: the session is then lost and starts again.
    pub(crate) async fn dispatcher(&self, stop: CancellationToken) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut wake_at: Option<Instant> = None;
        loop {
            let wake = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let timer = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = self.dispatch_wanted().notified() => false,
                _ = wake => false,
                _ = tick.tick() => true,
            };
            wake_at = self.settle().await?;
            if timer {
                self.requeue_stale().await?;
                self.recover_unheld().await?;
                self.fail_unserved().await?;
            }
        }
    }

    /// Publishes what the registry owes (finished pipelines, failed dependents), then dispatches.
    /// Returns when planning again may dispatch more with nothing else happening.
    pub(crate) async fn settle(&self) -> Result<Option<Instant>, PublishError> {
        let follow_ups = self.registry().take_follow_ups();
        for (id, kind) in follow_ups {
            if let Err(e) = self.publish_event(id, kind).await {
                tracing::error!(job_id = %id, error = %e, "a follow-up event could not be published; it is owed again");
                self.registry().follow_up_failed(id);
                return Err(e);
            }
        }
        self.dispatch().await
    }

    /// Plans with the configured policy and sends each planned message.
    async fn dispatch(&self) -> Result<Option<Instant>, PublishError> {
        let plan = self.registry().plan_dispatch(
            &self.config().dispatch,
            Instant::now(),
            self.heartbeat_timeout(),
        );
        for (n, d) in plan.dispatches.iter().enumerate() {
            let jobs: Vec<BatchedJob> =
                d.jobs.iter().filter_map(|id| self.work_item(*id)).collect();
            if jobs.len() != d.jobs.len() {
                // A job without a runnable spec is never planned; should one be, it is not sent.
                tracing::error!(worker = %d.worker, "a planned job has no work item; not dispatching its message");
                self.undo(&plan.dispatches[n..]);
                return Ok(None);
            }
            let mut message = WorkMessage::of(jobs).expect("a planned dispatch has a job");
            // In the newest version its worker reads: a worker of the previous release keeps
            // working through a rolling upgrade.
            let protocols = self
                .registry()
                .worker(&d.worker)
                .map(|w| w.protocols().to_vec());
            let Some(version) = message.version_for(protocols.as_deref().unwrap_or(&[1])) else {
                tracing::error!(worker = %d.worker, protocols = ?protocols, needed = message.version_needed(), "a planned message is in no version its worker reads; not dispatching it");
                self.undo(&plan.dispatches[n..]);
                return Ok(None);
            };
            message.schema_version = version;
            // One span per message: its first job (the message's id) and, for a batch, them all.
            let span = tracing::info_span!(
                "dispatch",
                job_id = %d.jobs[0],
                job_ids = tracing::field::Empty,
                worker = %d.worker
            );
            if d.jobs.len() > 1 {
                span.record("job_ids", tracing::field::debug(&d.jobs));
            }
            let sent = self.send(d, &message).instrument(span.clone()).await;
            // No await below while the span is entered.
            let _in_span = span.enter();
            match sent {
                Ok(()) => {
                    self.metrics()
                        .dispatches_total
                        .with_label_values(&[d.decision.as_str()])
                        .inc();
                    self.metrics()
                        .dispatch_batch_jobs
                        .observe(d.jobs.len() as f64);
                    tracing::info!(
                        job_id = %d.jobs[0],
                        jobs = d.jobs.len(),
                        worker = %d.worker,
                        decision = d.decision.as_str(),
                        "dispatched"
                    );
                }
                Err(e) => {
                    tracing::error!(job_id = %d.jobs[0], worker = %d.worker, error = %e, "dispatch failed; its jobs go back to the backlog");
                    self.undo(&plan.dispatches[n..]);
                    return Err(e);
                }
            }
        }
        for y in &plan.yields {
            let request = YieldRequest::new(y.worker.clone(), y.jobs.clone());
            let props = json_properties().with_delivery_mode(1);
            // Advisory: a worker that misses it finishes its message as planned. A failed publish
            // means the session is lost, like a failed dispatch.
            self.publisher()?
                .broadcast_json(
                    &self.topology().events_exchange(),
                    YIELD_ROUTING_KEY,
                    &request,
                    props,
                )
                .await?;
            self.metrics().yields_total.inc();
            tracing::info!(worker = %y.worker, jobs = y.jobs.len(), "asked a worker for the unstarted jobs of its message back, for interactive work");
        }
        Ok(plan.wake_at)
    }

    /// Gives planned dispatches that were not sent back to the backlog.
    fn undo(&self, dispatches: &[Dispatch]) {
        let mut reg = self.registry();
        for d in dispatches {
            for id in &d.jobs {
                reg.dispatch_failed(*id, &d.worker);
            }
        }
    }

    fn work_item(&self, job_id: JobId) -> Option<BatchedJob> {
        let reg = self.registry();
        let sub = reg.job(job_id)?.submission()?;
        let task = match &sub.job {
            JobSpec::Generate(g) => Task::Generate(g.clone()),
            JobSpec::Edit(e) => Task::Edit(e.clone()),
            JobSpec::Upscale(u) => Task::Upscale(u.clone()),
            // Pipelines have no model and are never planned.
            JobSpec::Pipeline(_) => return None,
        };
        Some(BatchedJob {
            job_id,
            priority: sub.priority,
            deadline: sub.deadline,
            task,
        })
    }

    /// The `dispatched` events go first, so the stream never shows `started` before `dispatched`.
    /// If the message then cannot be sent, `requeued` events put its jobs back in the backlog; if
    /// that fails too, or the scheduler dies in between, the watchdog ([`Scheduler::requeue_stale`])
    /// requeues them.
    async fn send(&self, d: &Dispatch, message: &WorkMessage) -> Result<(), PublishError> {
        let queue = self.topology().worker_queue(&d.worker);
        let props = json_properties()
            .with_message_id(message.job_id.to_string().into())
            .with_expiration(self.config().dispatch_ttl_ms.to_string().into());
        let batch = (d.jobs.len() > 1).then_some(message.job_id);
        futures::future::try_join_all(d.jobs.iter().map(|id| {
            self.publish_event(
                *id,
                EventKind::Dispatched {
                    queue: queue.clone(),
                    worker: Some(d.worker.clone()),
                    batch,
                    term: self.current_term(),
                },
            )
        }))
        .await?;
        if let Err(e) = self
            .publisher()?
            .publish_json("", &queue, message, props)
            .await
        {
            for id in &d.jobs {
                let requeued = self
                    .publish_event(
                        *id,
                        EventKind::Requeued {
                            reason: format!("dispatch failed: {e}"),
                            dispatch: None,
                        },
                    )
                    .await;
                if let Err(r) = requeued {
                    tracing::error!(job_id = %id, error = %r, "could not requeue a job whose dispatch failed; the watchdog will");
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// The watchdog: requeues jobs dispatched long ago that never started, whose message was lost
    /// between the `dispatched` event and the publish (a scheduler crash). A live worker starts a
    /// dispatched job at once and a dead worker's queue returns it after `dispatch_ttl_ms`, so twice
    /// that plus a heartbeat timeout is conservative; a worker that does get the message after all
    /// finds the job's manifest if the other run finished first, and does not run it again.
    pub(crate) async fn requeue_stale(&self) -> Result<(), PublishError> {
        let threshold = Duration::from_millis(
            2 * self.config().dispatch_ttl_ms + self.config().heartbeat_timeout_ms,
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
                    dispatch: None,
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Fails the generates whose checkpoint has had no live worker for `checkpoint_wait_s` while
    /// other workers of their model are up (see `Registry::unserved_checkpoints`). A repeat before
    /// the event comes back is harmless: a finished job's later events change nothing.
    pub(crate) async fn fail_unserved(&self) -> Result<(), PublishError> {
        let wait = self.config().checkpoint_wait_s;
        if wait == 0 {
            return Ok(());
        }
        let before =
            chrono::Utc::now() - chrono::Duration::seconds(wait.min(i64::MAX as u64) as i64);
        let unserved = self
            .registry()
            .unserved_checkpoints(before, self.heartbeat_timeout());
        for (id, route) in unserved {
            let message = format!(
                "no live worker served {route} for {wait} s (checkpoint_wait_s), while other \
                 workers of its model were up"
            );
            tracing::warn!(job_id = %id, %message, "job failed");
            self.publish_event(
                id,
                EventKind::Failed {
                    failure: FailureKind::NoWorker,
                    message,
                    retryable: false,
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Ends the runs whose final event never reached the stream (see `Registry::unheld_runs`):
    /// `completed` again from the run's manifest, as the run published it; without a manifest the
    /// run did not complete, and the dispatch it ran in is requeued (a requeue of that dispatch
    /// only, so a job that has been dispatched again since keeps running where it is). Storage
    /// that cannot be read leaves the job for the next tick.
    pub(crate) async fn recover_unheld(&self) -> Result<(), PublishError> {
        let grace = 2 * self.heartbeat_timeout();
        let runs = self.registry().unheld_runs(grace);
        for (id, dispatches) in runs {
            let kind = match self.storage().get(&manifest_key(id)).await {
                Ok(bytes) => match serde_json::from_slice::<Manifest>(&bytes) {
                    Ok(manifest) if manifest.job_id == id => {
                        tracing::warn!(job_id = %id, "its worker holds it no longer and its manifest is stored: completed, as the run's own event was lost");
                        manifest.completed()
                    }
                    _ => {
                        tracing::warn!(job_id = %id, "its worker holds it no longer and its stored manifest is unreadable; requeueing it");
                        unheld_requeue(dispatches)
                    }
                },
                Err(StorageError::NotFound { .. }) => {
                    tracing::warn!(job_id = %id, "its worker holds it no longer and it left no manifest; requeueing it");
                    unheld_requeue(dispatches)
                }
                Err(e) => {
                    self.metrics().storage_error("get", &e);
                    tracing::warn!(job_id = %id, error = %e, "cannot read the manifest of a job its worker holds no longer; trying again later");
                    self.registry().recovery_failed(id);
                    continue;
                }
            };
            if let Err(e) = self.publish_event(id, kind).await {
                self.registry().recovery_failed(id);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Jobs that came back from worker queues.
    pub(crate) async fn consume_redispatch(&self, connection: &Connection) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        channel.basic_qos(32, BasicQosOptions::default()).await?;
        let mut returned = channel
            .basic_consume(
                self.topology().redispatch_queue().into(),
                "redispatch".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        while let Some(d) = returned.next().await {
            let d = d?;
            let yielded = vnfarm_bus::headers::string_header(
                &d.properties,
                vnfarm_proto::topology::HEADER_YIELDED,
            )
            .is_some();
            let reason = vnfarm_bus::headers::death_reason(&d.properties).unwrap_or_else(|| {
                if yielded {
                    YIELDED.into()
                } else {
                    GIVEN_BACK.into()
                }
            });
            self.returned(&d.data, &d.properties, &reason).await?;
            d.acker.ack(BasicAckOptions::default()).await?;
        }
        anyhow::bail!("the redispatch consumer was cancelled")
    }

    /// A job came back from a worker queue (the message expired there or hit the delivery limit):
    /// back to the backlog, or, past `max_dispatches` or the delivery limit, failed and
    /// dead-lettered.
    pub(crate) async fn returned(
        &self,
        body: &[u8],
        props: &BasicProperties,
        reason: &str,
    ) -> Result<(), PublishError> {
        let Ok(msg) = vnfarm_proto::decode_json::<WorkMessage>(body) else {
            self.metrics().malformed_messages_total.inc();
            tracing::warn!(
                reason,
                "an undecodable message came back from a worker queue; dead-lettered"
            );
            let headers = vnfarm_bus::headers::dead_letter_headers(
                "undecodable message returned from a worker queue",
                "malformed",
                None,
            );
            return self
                .dead_letter(body, FailureKind::Malformed, headers)
                .await;
        };
        // A batch comes back whole; its jobs were dispatched together and go back one by one.
        for job in msg.jobs() {
            let single = WorkMessage::of(vec![job]).expect("one job");
            let span = tracing::info_span!("job", job_id = %single.job_id);
            self.returned_job(&single, props, reason)
                .instrument(span)
                .await?;
        }
        Ok(())
    }

    /// One job of a returned message. A message without a death reason was given back by its
    /// worker (a job of a batch it could not finish: shutdown, a transient failure) and counts like
    /// an expiry.
    async fn returned_job(
        &self,
        msg: &WorkMessage,
        props: &BasicProperties,
        reason: &str,
    ) -> Result<(), PublishError> {
        let id = msg.job_id;
        let expired = reason == "expired" || reason == GIVEN_BACK;
        // Asked back by this scheduler: no failure, and no step towards `max_dispatches`.
        let yielded = reason == YIELDED;
        self.metrics()
            .requeues_total
            .with_label_values(&[match reason {
                "expired" => "expired",
                GIVEN_BACK => "given_back",
                YIELDED => "yielded",
                _ => "delivery_limit",
            }])
            .inc();
        let (known, terminal, dispatches) = {
            let reg = self.registry();
            match reg.job(id) {
                Some(j) => (true, j.state().is_terminal(), j.dispatches()),
                None => (false, false, 0),
            }
        };
        if !known || terminal {
            tracing::info!(job_id = %id, known, "ignoring a returned message for a finished or unknown job");
            return Ok(());
        }
        let count = vnfarm_bus::headers::delivery_count(props);
        if !yielded && (!expired || dispatches >= self.config().max_dispatches) {
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
            let body = serde_json::to_vec(msg).expect("work messages serialize to JSON");
            self.dead_letter(&body, FailureKind::DeliveryLimit, headers)
                .await?;
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
        let reason = if yielded {
            tracing::info!(job_id = %id, "job given back unstarted, as asked; dispatching it again");
            vnfarm_proto::event::YIELDED_REASON.to_owned()
        } else {
            tracing::warn!(job_id = %id, reason, "job came back from its worker; dispatching it again");
            format!("returned from a worker queue ({reason})")
        };
        self.publish_event(
            id,
            EventKind::Requeued {
                reason,
                dispatch: None,
            },
        )
        .await
    }
}

/// The requeue of a run whose worker holds it no longer: of the dispatch it ran in only.
fn unheld_requeue(dispatches: u32) -> EventKind {
    EventKind::Requeued {
        reason: "its worker holds it no longer, and it ended without a final event".into(),
        dispatch: Some(dispatches),
    }
}
