//! Active and standby schedulers. Any number of schedulers may run on one installation; one is
//! active. All of them read the event stream and heartbeats (so a standby's registry is current),
//! and all serve the HTTP API: reads, submissions and cancellations, which only publish events.
//! Only the active one consumes the intake, redispatch and dead-letter watch queues, dispatches,
//! runs the watchdog and writes snapshots: the work the session hands [`Leadership::lead`] as an
//! [`ActiveWork`]. This file holds only leadership itself: the token, the start of a term, and
//! [`Leadership`], the active flag and the term's number.
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
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{AmqpConfig, Publisher};
use vnfarm_proto::topology::Topology;

use crate::replica::{Replica, publish_marker};

/// The active scheduler's work (consuming, dispatching, writing snapshots), which the session hands
/// to [`Leadership::lead`] to run while this scheduler holds the token. Boxed: the session's future
/// holds it, and inline it made that future large enough to overflow a 2 MiB thread stack (the
/// in-process test farm's).
pub(crate) type ActiveWork<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send + 'a>>;

/// Whether this scheduler leads, and its term. Changed only here: when a term of [`Leadership::lead`]
/// begins, and by [`Leadership::step_down`] when it ends or the session does; the
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

    /// Waits for the leader token as a standby, then runs `active` (the active scheduler's work)
    /// until the session ends (an error) or `stop`. `publisher` is the session's event publisher,
    /// `replica` the stream this scheduler has read; `install` makes the term's own publisher the
    /// one the active work publishes on.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn lead(
        &self,
        connection: &Connection,
        amqp: &AmqpConfig,
        publisher: &Publisher,
        replica: &Replica,
        stop: &CancellationToken,
        active: ActiveWork<'_>,
        install: &(dyn Fn(Publisher) + Send + Sync),
    ) -> anyhow::Result<()> {
        let topology = amqp.topology();
        let channel = connection.create_channel().await?;
        let ready_tokens = vnfarm_bus::topology::declare_scheduler(&channel, amqp).await?;
        if ready_tokens == 0 {
            publisher
                .publish("", &topology.leader_queue(), b"{}", json_properties())
                .await?;
        }
        channel.basic_qos(4, BasicQosOptions::default()).await?;
        let mut tokens = channel
            .basic_consume(
                topology.leader_queue().into(),
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
        // The term publishes on a channel opened now. A channel that published into a stream
        // before the stream's leader moved can go unconfirmed for minutes while fresh ones work
        // (shared/reference/fleet.md, trap 2): the three-box test saw a standby take the token 11 s
        // after the active box was cut and its marker, on the session's channel, wait out the
        // whole confirm timeout before a new session took over (20.6 s).
        let term_publisher = Publisher::open(connection)
            .await?
            .with_confirm_timeout(amqp.confirm_timeout());
        install(term_publisher.clone());
        let result = self
            .term(
                &topology,
                &term_publisher,
                replica,
                stop,
                &mut tokens,
                active,
            )
            .await;
        self.step_down();
        if let Err(e) = channel.close(200, "leadership over".into()).await {
            tracing::debug!(error = %e, "closing the leader channel");
        }
        result
    }

    /// One term: read the stream up to a marker of this term's, begin the term, then do the active
    /// work until it ends or `stop`.
    async fn term(
        &self,
        topology: &Topology,
        publisher: &Publisher,
        replica: &Replica,
        stop: &CancellationToken,
        tokens: &mut lapin::Consumer,
        active: ActiveWork<'_>,
    ) -> anyhow::Result<()> {
        let marker = publish_marker(publisher, topology).await?;
        let offset = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            offset = replica.wait_marker(&marker) => offset,
        };
        replica.registry().begin_term();
        // The marker's offset numbers the term: every later term's marker comes after it.
        self.begin(offset.map_or(0, |o| o + 1));
        tracing::info!("this scheduler is the active one");
        tokio::select! {
            _ = stop.cancelled() => Ok(()),
            r = discard_extra_tokens(tokens) => r,
            r = active => r,
            // The term's decisions go on this publisher: one that got no confirm in time is
            // untrusted, and the session reads the stream again (a new term) before it decides more.
            () = publisher.stuck() => anyhow::bail!("a publish of this term got no confirm in time"),
        }
    }

    /// Begins the term numbered `term`, active from now on.
    fn begin(&self, term: u64) {
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

/// Tokens beyond the one held come from schedulers that started while this one led: discard them.
async fn discard_extra_tokens(tokens: &mut lapin::Consumer) -> anyhow::Result<()> {
    while let Some(t) = tokens.next().await {
        t?.acker.ack(BasicAckOptions::default()).await?;
    }
    anyhow::bail!("the leader queue's consumer was cancelled")
}
