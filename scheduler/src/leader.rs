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

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use futures::StreamExt;
use lapin::BasicProperties;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use prometheus::IntGauge;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::headers::{death_queue, death_reason, delivery_count, string_header};
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::topology::HEADER_FAILURE;
use vnfarm_proto::{EventKind, FailureKind, Submission};

use crate::scheduler::Scheduler;

/// The active scheduler's work (consuming, dispatching, writing snapshots), which the session hands
/// to [`Scheduler::lead`] to run while this scheduler holds the token. Boxed: the session's future
/// holds it, and inline it made that future large enough to overflow a 2 MiB thread stack (the
/// in-process test farm's).
pub(crate) type ActiveWork<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send + 'a>>;

/// Whether this scheduler leads, and its term. Changed only here: [`Leadership::lead`] when a term
/// begins, [`Leadership::step_down`] when it ends or the session does; the
/// `vnfarm_scheduler_active` gauge follows the flag.
pub(crate) struct Leadership {
    /// This scheduler holds the leader token.
    active: AtomicBool,
    /// The current term's number while this scheduler leads: the stream offset of the marker its
    /// term began with, plus one, so a later term always has a larger one (0: none yet).
    term: AtomicU64,
    /// `vnfarm_scheduler_active`.
    gauge: IntGauge,
}

impl Leadership {
    pub(crate) fn new(gauge: IntGauge) -> Self {
        Self {
            active: AtomicBool::new(false),
            term: AtomicU64::new(0),
            gauge,
        }
    }

    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }

    /// The current term's number, recorded on every `dispatched` event of the term.
    pub(crate) fn current_term(&self) -> Option<u64> {
        Some(self.term.load(Ordering::SeqCst)).filter(|t| *t > 0)
    }

    /// Begins the term numbered `term`, active from now on.
    fn lead(&self, term: u64) {
        self.term.store(term, Ordering::SeqCst);
        self.set_active(true);
    }

    /// No longer active (the term's number stays until the next term replaces it).
    pub(crate) fn step_down(&self) {
        self.set_active(false);
    }

    fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::SeqCst);
        self.gauge.set(i64::from(active));
    }
}

impl Scheduler {
    /// Waits for the leader token as a standby, then runs `active` (the active scheduler's work)
    /// until the session ends (an error) or `stop`.
    pub(crate) async fn lead(
        &self,
        connection: &Connection,
        stop: &CancellationToken,
        active: ActiveWork<'_>,
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
        let result = self.term(stop, &mut tokens, active).await;
        self.leadership().step_down();
        if let Err(e) = channel.close(200, "leadership over".into()).await {
            tracing::debug!(error = %e, "closing the leader channel");
        }
        result
    }

    /// One term: read the stream up to a marker of this term's, begin the term, then do the active
    /// work until it ends or `stop`.
    async fn term(
        &self,
        stop: &CancellationToken,
        tokens: &mut lapin::Consumer,
        active: ActiveWork<'_>,
    ) -> anyhow::Result<()> {
        let marker = self.publish_marker().await?;
        let offset = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            offset = self.wait_marker(&marker) => offset,
        };
        self.registry().begin_term();
        // The marker's offset numbers the term: every later term's marker comes after it.
        self.leadership().lead(offset.map_or(0, |o| o + 1));
        tracing::info!("this scheduler is the active one");
        tokio::select! {
            _ = stop.cancelled() => Ok(()),
            r = discard_extra_tokens(tokens) => r,
            r = active => r,
        }
    }
}

impl Scheduler {
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

/// Tokens beyond the one held come from schedulers that started while this one led: discard them.
async fn discard_extra_tokens(tokens: &mut lapin::Consumer) -> anyhow::Result<()> {
    while let Some(t) = tokens.next().await {
        t?.acker.ack(BasicAckOptions::default()).await?;
    }
    anyhow::bail!("the leader queue's consumer was cancelled")
}
