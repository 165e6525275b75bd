//! Dispatch, done by the active scheduler only: the follow-ups the registry owes (finished
//! pipelines, jobs whose input failed), the dispatch policy and the publishing of jobs to worker
//! queues, jobs that come back from worker queues (redispatch), and the watchdog for dispatches
//! that never started.
//!
//! Runs in its own task ([`Scheduler::dispatcher`]), woken by new events, heartbeats and a timer,
//! so a slow publish never holds up the reading of the stream. The decisions are taken under the
//! registry lock (O(dispatches), not O(backlog)), then published without it.

use std::time::Duration;

use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::PublishError;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::{
    EventKind, FailureKind, JobId, JobSpec, SCHEMA_VERSION, Task, WorkMessage, WorkerId,
};

use crate::scheduler::Scheduler;

impl Scheduler {
    /// The active scheduler's loop: settle whenever something may have changed, and at least every
    /// half second (the watchdog). Returns on the first publish error: the session is then lost
    /// and starts again.
    pub(crate) async fn dispatcher(&self, stop: CancellationToken) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let timer = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = self.dispatch_wanted.notified() => false,
                _ = tick.tick() => true,
            };
            self.settle().await?;
            if timer {
                self.requeue_stale().await?;
            }
        }
    }

    /// Publishes what the registry owes (finished pipelines, failed dependents), then dispatches.
    pub(crate) async fn settle(&self) -> Result<(), PublishError> {
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

    /// Sends every dispatchable job to the least-loaded worker that can take it.
    async fn dispatch(&self) -> Result<(), PublishError> {
        let plan = self.registry().plan_dispatch(self.heartbeat_timeout());
        for (job_id, worker) in plan {
            let Some(message) = self.work_message(job_id) else {
                self.registry().dispatch_failed(job_id, &worker);
                continue;
            };
            match self.send(job_id, &worker, &message).await {
                Ok(()) => {
                    self.metrics
                        .dispatches_total
                        .with_label_values(&["least_loaded"])
                        .inc();
                    tracing::info!(job_id = %job_id, worker = %worker, "job dispatched");
                }
                Err(e) => {
                    tracing::error!(job_id = %job_id, worker = %worker, error = %e, "dispatch failed; the job goes back to the backlog");
                    self.registry().dispatch_failed(job_id, &worker);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn work_message(&self, job_id: JobId) -> Option<WorkMessage> {
        let reg = self.registry();
        let sub = reg.job(job_id)?.submission()?;
        let task = match &sub.job {
            JobSpec::Generate(g) => Task::Generate(g.clone()),
            JobSpec::Edit(e) => Task::Edit(e.clone()),
            JobSpec::Upscale(u) => Task::Upscale(u.clone()),
            // Pipelines have no model and are never planned.
            JobSpec::Pipeline(_) => return None,
        };
        Some(WorkMessage {
            schema_version: SCHEMA_VERSION,
            job_id,
            priority: sub.priority,
            deadline: sub.deadline,
            task,
        })
    }

    /// The `dispatched` event goes first, so the stream never shows `started` before `dispatched`.
    /// If the message then cannot be sent, a `requeued` event puts the job back in the backlog; if
    /// that fails too, or the scheduler dies in between, the watchdog ([`Scheduler::requeue_stale`])
    /// requeues it.
    async fn send(
        &self,
        job_id: JobId,
        worker: &WorkerId,
        message: &WorkMessage,
    ) -> Result<(), PublishError> {
        let queue = self.topology.worker_queue(worker);
        let props = json_properties()
            .with_message_id(job_id.to_string().into())
            .with_expiration(self.config.dispatch_ttl_ms.to_string().into());
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
            .publish_json("", &queue, message, props)
            .await
        {
            let requeued = self
                .publish_event(
                    job_id,
                    EventKind::Requeued {
                        reason: format!("dispatch failed: {e}"),
                    },
                )
                .await;
            if let Err(r) = requeued {
                tracing::error!(job_id = %job_id, error = %r, "could not requeue a job whose dispatch failed; the watchdog will");
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
            self.metrics.malformed_messages_total.inc();
            tracing::warn!(
                reason,
                "an undecodable message came back from a worker queue; dead-lettered"
            );
            let headers = vnfarm_bus::headers::dead_letter_headers(
                "undecodable message returned from a worker queue",
                "malformed",
                None,
            );
            return self.dead_letter(body, headers).await;
        };
        let id = msg.job_id;
        let expired = reason == "expired";
        self.metrics
            .requeues_total
            .with_label_values(&[if expired { "expired" } else { "delivery_limit" }])
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
        if !expired || dispatches >= self.config.max_dispatches {
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
}
