//! The dead-letter watch, run by the active scheduler only. Every dead letter also reaches the
//! watch queue, bound to the dead-letter exchange beside the dead-letter queue. vnfarm's own
//! already have their event; each one the broker dead-lettered on its own (a submission or a
//! returned job past its queue's delivery limit, a submission whose TTL ran out) is answered here,
//! so its client learns what became of the job. The message itself stays in the dead-letter queue
//! for an operator.

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use vnfarm_bus::headers::{death_queue, death_reason, delivery_count, string_header};
use vnfarm_proto::topology::HEADER_FAILURE;
use vnfarm_proto::{EventKind, FailureKind, Submission};

use crate::scheduler::Scheduler;

impl Scheduler {
    /// Messages the broker dead-lettered: each gets the `failed` event its client reads (see
    /// [`Scheduler::dead_lettered`]).
    pub(crate) async fn watch_dead_letters(&self, connection: &Connection) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        channel.basic_qos(8, BasicQosOptions::default()).await?;
        let mut dead = channel
            .basic_consume(
                self.topology().dead_watch_queue().into(),
                "dead-watch".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        while let Some(d) = dead.next().await {
            let d = d?;
            self.dead_lettered(&d.data, &d.properties).await?;
            d.acker.ack(BasicAckOptions::default()).await?;
        }
        anyhow::bail!("the dead-letter watch consumer was cancelled")
    }

    /// One dead letter. vnfarm's own (they carry a failure header) already have their event. The
    /// broker's come from a queue whose delivery limit a message reached because the scheduler
    /// stopped on it each time (a valid submission waiting out an outage never does: see
    /// `Scheduler::hold`): a submission that was never accepted fails with `delivery_limit`; a job
    /// that came back from a worker queue is settled as the redispatch consumer would have.
    async fn dead_lettered(&self, body: &[u8], props: &BasicProperties) -> anyhow::Result<()> {
        if string_header(props, HEADER_FAILURE).is_some() {
            return Ok(());
        }
        let queue = death_queue(props).unwrap_or_default();
        let reason = death_reason(props).unwrap_or_else(|| "unknown".into());
        if queue == self.topology().redispatch_queue() {
            self.returned(body, props, &reason).await?;
        } else if queue == self.topology().intake_queue() {
            let id = vnfarm_proto::decode_json::<Submission>(body)
                .ok()
                .and_then(|s| s.job_id)
                .or_else(|| {
                    props
                        .message_id()
                        .as_ref()
                        .and_then(|m| m.as_str().parse().ok())
                });
            let Some(id) = id else {
                tracing::warn!(%reason, "the broker dead-lettered a submission without a job id; it stays in the dead-letter queue");
                return Ok(());
            };
            if self.registry().contains(id) {
                tracing::info!(job_id = %id, %reason, "a dead-lettered submission was accepted before; nothing to do");
                return Ok(());
            }
            // `expired`: the producer's message TTL ran out before a scheduler took it.
            let (failure, message) = if reason == "expired" {
                (
                    FailureKind::DeadlineExceeded,
                    "the submission expired in the intake queue before a scheduler took it (its message TTL); it is kept in the dead-letter queue".to_owned(),
                )
            } else {
                (
                    FailureKind::DeliveryLimit,
                    format!(
                        "the broker dead-lettered the submission ({reason}) after {} deliveries without it being accepted; it is kept in the dead-letter queue",
                        delivery_count(props) + 1
                    ),
                )
            };
            tracing::warn!(job_id = %id, %message, "submission failed");
            self.publish_event(
                id,
                EventKind::Failed {
                    failure,
                    message,
                    retryable: false,
                },
            )
            .await?;
        } else {
            tracing::warn!(queue, %reason, "a message the broker dead-lettered from another queue; it stays in the dead-letter queue");
            return Ok(());
        }
        self.metrics().dead_letters_watched_total.inc();
        Ok(())
    }
}
