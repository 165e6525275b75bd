//! Active and standby schedulers. Any number of schedulers may run on one installation; one is
//! active. All of them read the event stream and heartbeats (so a standby's registry is current),
//! and all serve the HTTP API: reads, submissions and cancellations, which only publish events.
//! Only the active one consumes the intake, redispatch and dead-letter watch queues, dispatches, runs the watchdog and
//! writes snapshots.
//!
//! Leadership is a token: a message in the quorum queue `<prefix>.scheduler.leader`, declared with
//! single-active-consumer. The scheduler whose consumer is the queue's active one receives the token
//! and holds it unacknowledged for as long as it leads. When its connection dies (SIGKILL, a network
//! cut, a broker restart) the broker returns the token to the queue and delivers it to the next
//! consumer: the standby takes over within the broker's detection of the dead connection. Every
//! scheduler publishes a token at start when the queue has none ready; extra tokens all reach the
//! active consumer (single-active-consumer), which acknowledges (discards) them, so there is never
//! more than one leader.
//!
//! A new leader first reads the stream up to a marker of its own, so that every event the old
//! leader published (its dispatches in particular) is applied before it decides anything, then
//! starts a new term ([`crate::registry::Registry::begin_term`]).

use futures::StreamExt;
use lapin::BasicProperties;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::Publisher;
use vnfarm_bus::headers::{death_queue, death_reason, delivery_count, string_header};
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::topology::HEADER_FAILURE;
use vnfarm_proto::{EventKind, FailureKind, Submission};

use crate::scheduler::Scheduler;

impl Scheduler {
    /// Waits for the leader token as a standby, then does the active scheduler's work until the
    /// session ends (an error) or `stop`.
    pub(crate) async fn lead(
        &self,
        connection: &Connection,
        stop: &CancellationToken,
        snapshots: &Publisher,
    ) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        let ready_tokens =
            vnfarm_bus::topology::declare_scheduler(&channel, &self.config().amqp).await?;
        if ready_tokens == 0 {
            self.publisher()?
                .publish(
                    "",
                    &self.topology().leader_queue(),
                    b"{}",
                    json_properties(),
                )
                .await?;
        }
        channel.basic_qos(4, BasicQosOptions::default()).await?;
        let mut tokens = channel
            .basic_consume(
                self.topology().leader_queue().into(),
                "leader".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!("standing by for the leader token");
        // The token is held, never acknowledged: closing the channel gives it back.
        let _token = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            t = tokens.next() => match t {
                Some(t) => t?,
                None => anyhow::bail!("the leader queue's consumer was cancelled"),
            },
        };
        let result = self.term(connection, stop, snapshots, &mut tokens).await;
        self.set_active(false);
        if let Err(e) = channel.close(200, "leadership over".into()).await {
            tracing::debug!(error = %e, "closing the leader channel");
        }
        result
    }

    async fn term(
        &self,
        connection: &Connection,
        stop: &CancellationToken,
        snapshots: &Publisher,
        tokens: &mut lapin::Consumer,
    ) -> anyhow::Result<()> {
        let marker = self.publish_marker().await?;
        let offset = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            offset = self.wait_marker(&marker) => offset,
        };
        // The marker's offset numbers the term: every later term's marker comes after it.
        self.set_term(offset.map_or(0, |o| o + 1));
        self.registry().begin_term();
        self.set_active(true);
        tracing::info!("this scheduler is the active one");
        tokio::select! {
            _ = stop.cancelled() => Ok(()),
            r = discard_extra_tokens(tokens) => r,
            r = self.consume_intake(connection) => r,
            r = self.consume_redispatch(connection) => r,
            r = self.watch_dead_letters(connection) => r,
            r = self.dispatcher(stop.clone()) => r,
            r = self.snapshots().run(self.replica(), snapshots) => r,
        }
    }

    /// Takes submissions from the intake queue, each accepted in a task of its own (at most the
    /// channel's prefetch at once); the tasks end with this future.
    async fn consume_intake(&self, connection: &Connection) -> anyhow::Result<()> {
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

    /// Jobs that came back from worker queues.
    async fn consume_redispatch(&self, connection: &Connection) -> anyhow::Result<()> {
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
            let reason = death_reason(&d.properties).unwrap_or_else(|| {
                if yielded {
                    crate::dispatch::YIELDED.into()
                } else {
                    crate::dispatch::GIVEN_BACK.into()
                }
            });
            self.returned(&d.data, &d.properties, &reason).await?;
            d.acker.ack(BasicAckOptions::default()).await?;
        }
        anyhow::bail!("the redispatch consumer was cancelled")
    }
}

impl Scheduler {
    /// Messages the broker dead-lettered: each gets the `failed` event its client reads (see
    /// [`Scheduler::dead_lettered`]).
    async fn watch_dead_letters(&self, connection: &Connection) -> anyhow::Result<()> {
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

/// Tokens beyond the one held come from schedulers that started while this one led: discard them.
async fn discard_extra_tokens(tokens: &mut lapin::Consumer) -> anyhow::Result<()> {
    while let Some(t) = tokens.next().await {
        t?.acker.ack(BasicAckOptions::default()).await?;
    }
    anyhow::bail!("the leader queue's consumer was cancelled")
}
