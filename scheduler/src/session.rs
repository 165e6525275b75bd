//! One broker session of a scheduler: declare the topology, load the latest snapshot (first session
//! only), replay the event stream up to a marker of our own (so the registry is current before any
//! decision), then, concurrently: read the stream, read heartbeats, read the shared queues' depths
//! (for the metrics), and stand by for or exercise leadership ([`crate::leader`]). Each of these
//! awaits on its own, so none holds up the others: a slow publish of the dispatcher does not delay
//! the reading of events or heartbeats. The session ends at shutdown or when any part of it loses
//! the broker, or when a publish on one of its channels got no confirm in time (the channel may
//! never confirm again: `vnfarm_bus::Publisher::stuck`).

use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, Consumer};
use tokio_util::sync::CancellationToken;
use vnfarm_bus::headers::stream_offset;
use vnfarm_bus::{Publisher, SessionEnd, topology};
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::topology::{
    HEARTBEAT_ROUTING_PATTERN, MARKER_ROUTING_PREFIX, PEOPLE_ROUTING_PREFIX,
};
use vnfarm_proto::{Event, Heartbeat, PersonEvent, decode_json};

use crate::leader::ActiveWork;
use crate::replica::publish_marker;
use crate::scheduler::Scheduler;
use crate::snapshot;

/// How often the depths of the shared queues are read.
const QUEUE_DEPTH_INTERVAL: Duration = Duration::from_secs(2);

/// Stream deliveries are acknowledged in batches (the stream's credit); well under the prefetch.
const STREAM_ACK_BATCH: u64 = 200;

impl Scheduler {
    pub(crate) async fn session(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        let end = self.session_inner(connection, shutdown).await;
        self.leadership().step_down();
        self.set_publisher(None);
        self.set_requests_publisher(None);
        self.metrics().amqp_connected.set(0);
        match end {
            Ok(end) => end,
            Err(e) => SessionEnd::Lost(format!("{e:#}")),
        }
    }

    async fn session_inner(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let began = std::time::Instant::now();
        let confirm_timeout = self.config().amqp.confirm_timeout();
        let publisher = Publisher::open(connection)
            .await?
            .with_confirm_timeout(confirm_timeout);
        let channel = connection.create_channel().await?;
        topology::declare_core(&channel, &self.config().amqp).await?;
        topology::declare_scheduler(&channel, &self.config().amqp).await?;
        self.set_publisher(Some(publisher.clone()));
        let requests = Publisher::open(connection)
            .await?
            .with_confirm_timeout(confirm_timeout);
        self.set_requests_publisher(Some(requests.clone()));
        // Snapshots travel on a channel of their own, so a large one never delays an event.
        let snapshots = Publisher::open(connection)
            .await?
            .with_confirm_timeout(confirm_timeout);
        self.metrics().amqp_connected.set(1);

        if !self.is_ready()
            && self.registry().next_offset() == 0
            && let Some(registry) = snapshot::load(
                connection,
                &self.topology().snapshot_stream(),
                crate::registry::Retention::of(self.config()),
            )
            .await?
        {
            self.set_registry(registry);
        }

        let mut heartbeats = topology::subscribe_private(
            connection,
            &self.topology().events_exchange(),
            HEARTBEAT_ROUTING_PATTERN,
            "heartbeats",
        )
        .await?;

        // The event stream, from where this process left off (the first offset on a fresh start).
        let stream_channel = connection.create_channel().await?;
        stream_channel
            .basic_qos(1000, BasicQosOptions::default())
            .await?;
        let from = self.registry().next_offset();
        let offset = if from == 0 {
            AMQPValue::LongString(LongString::from("first"))
        } else {
            AMQPValue::LongLongInt(from as i64)
        };
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), offset);
        let mut stream = stream_channel
            .basic_consume(
                self.topology().events_stream().into(),
                "events".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await?;

        // Catch up: everything before our marker is history.
        let marker = publish_marker(&publisher, self.topology()).await?;
        let set_up = began.elapsed();
        let replay_started = std::time::Instant::now();
        let mut replayed = 0u64;
        let live = self.is_ready();
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                n = stream.next() => n,
            };
            let delivery = match next {
                Some(d) => d?,
                None => anyhow::bail!("the event stream consumer was cancelled"),
            };
            replayed += 1;
            let done = delivery.routing_key.as_str() == marker;
            self.on_stream_message(&delivery, live);
            ack_stream(&delivery, replayed, done).await?;
            if done {
                break;
            }
        }
        tracing::info!(
            events = replayed,
            from_offset = from,
            seconds = replay_started.elapsed().as_secs_f64(),
            // Channels, declarations, the snapshot, the consumers and the marker's confirm.
            set_up_seconds = set_up.as_secs_f64(),
            "event stream replayed"
        );
        self.set_ready();

        let stop = shutdown.child_token();
        let _stop_on_exit = stop.clone().drop_guard();
        tracing::info!("scheduler ready");
        let install_term_publisher = |p: Publisher| self.set_publisher(Some(p));
        tokio::select! {
            _ = shutdown.cancelled() => Ok(SessionEnd::Shutdown),
            r = self.read_stream(&mut stream) => r.map(|()| SessionEnd::Lost("event stream ended".into())),
            r = self.read_heartbeats(&mut heartbeats) => r.map(|()| SessionEnd::Lost("heartbeat consumer ended".into())),
            r = self.leadership().lead(
                connection,
                &self.config().amqp,
                &publisher,
                self.replica(),
                &stop,
                self.active_work(connection, &stop, &snapshots),
                &install_term_publisher,
            ) => r.map(|()| SessionEnd::Shutdown),
            r = self.watch_queues(connection) => r.map(|()| SessionEnd::Lost("queue watcher ended".into())),
            () = self.housekeeping() => unreachable!("housekeeping runs until dropped"),
            // A publish of the session's (a marker, a token) that got no confirm in time; the
            // term's own publisher is watched by the term.
            () = publisher.stuck() => Ok(SessionEnd::Lost("an event publish got no confirm in time".into())),
            () = snapshots.stuck() => Ok(SessionEnd::Lost("a snapshot publish got no confirm in time".into())),
            r = self.renew_requests_publisher(connection, requests) => r.map(|()| SessionEnd::Lost("the requests' publisher ended".into())),
        }
    }

    /// What only the active scheduler does, for [`Leadership::lead`](crate::leader::Leadership::lead) to run while it leads: consume
    /// the intake, redispatch and dead-letter watch queues, dispatch (and the watchdog), write
    /// snapshots on this session's snapshot publisher.
    fn active_work<'a>(
        &'a self,
        connection: &'a Connection,
        stop: &'a CancellationToken,
        snapshots: &'a Publisher,
    ) -> ActiveWork<'a> {
        Box::pin(async move {
            tokio::select! {
                r = self.consume_intake(connection) => r,
                r = self.consume_redispatch(connection) => r,
                r = self.watch_dead_letters(connection) => r,
                r = self.dispatcher(stop.clone()) => r,
                r = self.snapshots().run(self.replica(), snapshots) => r,
            }
        })
    }

    async fn read_stream(&self, stream: &mut Consumer) -> anyhow::Result<()> {
        let mut n = 0u64;
        while let Some(d) = stream.next().await {
            let d = d?;
            n += 1;
            self.on_stream_message(&d, true);
            ack_stream(&d, n, false).await?;
        }
        Ok(())
    }

    /// Gives the API's requests a fresh publisher each time theirs stops confirming (see
    /// [`crate::scheduler::Lane::Requests`]); returns only when a channel cannot be opened (the
    /// connection is gone: the session ends).
    async fn renew_requests_publisher(
        &self,
        connection: &Connection,
        mut requests: Publisher,
    ) -> anyhow::Result<()> {
        loop {
            requests.stuck().await;
            tracing::warn!(
                "a request's publish got no confirm in time; requests go on a fresh channel"
            );
            self.metrics().requests_channel_renewals_total.inc();
            requests = Publisher::open(connection)
                .await?
                .with_confirm_timeout(self.config().amqp.confirm_timeout());
            self.set_requests_publisher(Some(requests.clone()));
        }
    }

    async fn read_heartbeats(&self, heartbeats: &mut Consumer) -> anyhow::Result<()> {
        while let Some(d) = heartbeats.next().await {
            match decode_json::<Heartbeat>(&d?.data) {
                Ok(hb) => {
                    self.registry().heartbeat(hb);
                    self.dispatch_wanted().notify_one();
                }
                Err(e) => tracing::warn!(error = %e, "ignoring a malformed heartbeat"),
            }
        }
        Ok(())
    }

    /// Gauges for every scheduler; a standby also drops the follow-ups its registry owes (the
    /// active one publishes them, and a takeover works them all out again).
    async fn housekeeping(&self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if !self.is_active() {
                self.registry().drop_follow_ups();
            }
            self.update_gauges();
        }
    }

    /// The depth of the shared queues, for `vnfarm_queue_messages`: a passive declare of each
    /// every [`QUEUE_DEPTH_INTERVAL`]. The dead-letter queue's depth counts what the broker
    /// dead-lettered on its own (intake past the delivery limit), which no process hears of.
    /// Returns only when the broker fails (a queue that vanished closes the channel, and the next
    /// session declares it again).
    async fn watch_queues(&self, connection: &Connection) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        let queues = [
            ("intake", self.topology().intake_queue()),
            ("redispatch", self.topology().redispatch_queue()),
            ("dead", self.topology().dead_queue()),
        ];
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let mut tick = tokio::time::interval(QUEUE_DEPTH_INTERVAL);
        loop {
            tick.tick().await;
            for (label, name) in &queues {
                let queue = channel
                    .queue_declare(name.as_str().into(), passive, FieldTable::default())
                    .await?;
                self.metrics()
                    .queue_messages
                    .with_label_values(&[label])
                    .set(i64::from(queue.message_count()));
            }
        }
    }

    fn on_stream_message(&self, delivery: &Delivery, live: bool) {
        let seq = stream_offset(&delivery.properties);
        if delivery
            .routing_key
            .as_str()
            .starts_with(MARKER_ROUTING_PREFIX)
        {
            self.marker_seen(delivery.routing_key.as_str(), seq);
            return;
        }
        let Some(seq) = seq else {
            tracing::warn!("stream message without an offset; skipped");
            return;
        };
        if delivery
            .routing_key
            .as_str()
            .starts_with(PEOPLE_ROUTING_PREFIX)
        {
            match decode_json::<PersonEvent>(&delivery.data) {
                Ok(event) => self.apply_person(seq, &event),
                Err(e) => {
                    tracing::warn!(seq, error = %e, "undecodable person event in the stream; skipped");
                    self.registry().skip(seq);
                }
            }
            return;
        }
        match decode_json::<Event>(&delivery.data) {
            Ok(event) => self.apply(SequencedEvent { seq, event }, live),
            Err(e) => {
                tracing::warn!(seq, error = %e, "undecodable event in the stream; skipped");
                self.registry().skip(seq);
            }
        }
    }
}

/// Acknowledges stream deliveries in batches (`multiple`), and at once when `now`.
async fn ack_stream(delivery: &Delivery, n: u64, now: bool) -> anyhow::Result<()> {
    if now || n.is_multiple_of(STREAM_ACK_BATCH) {
        delivery
            .acker
            .ack(BasicAckOptions { multiple: true })
            .await?;
    }
    Ok(())
}
