//! Registry snapshots, so that a restarted or standby scheduler serves within seconds however long
//! the event history is.
//!
//! The active scheduler writes its registry's durable part (jobs, retention order, the event-stream
//! offset it reflects) to the stream `<prefix>.scheduler.snapshots` after `snapshot_every_events`
//! events, and at least every five minutes while events arrive. A starting scheduler loads the latest
//! snapshot and replays the event stream from the snapshot's offset on. The snapshot is only an
//! accelerator: the event stream stays the truth, and without a usable snapshot the scheduler
//! replays the whole stream as before.
//!
//! A snapshot reflects a prefix of the stream and the registry applies the same events the same
//! way (retention is measured on event times), so a scheduler started from a snapshot and one that
//! has been running all along hold the same jobs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use vnfarm_bus::Publisher;
use vnfarm_bus::headers::stream_offset;
use vnfarm_bus::publisher::json_properties;

use crate::metrics::Metrics;
use crate::registry::{Registry, Retention, Snapshot};
use crate::replica::Replica;

/// Larger snapshots are not written (RabbitMQ refuses messages over 128 MiB by default); the
/// scheduler then replays the stream from the last snapshot written, which stays correct.
const MAX_SNAPSHOT_BYTES: usize = 64 << 20;
/// A snapshot is also written this long after the last one when any event arrived since, so a
/// quiet farm's restart replays little. Between, `snapshot_every_events` decides.
const SNAPSHOT_AT_LEAST_EVERY: Duration = Duration::from_secs(300);
/// How often the snapshot writer checks whether one is due.
const SNAPSHOT_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The active scheduler's snapshot writer. Every scheduler counts the events it applies (a standby
/// too, so a new leader knows how many it owes), and the one that leads runs [`SnapshotWriter::run`]
/// on the snapshot publisher its session hands it.
pub(crate) struct SnapshotWriter {
    /// A snapshot is due after this many events.
    every_events: u64,
    /// The snapshot stream's name.
    stream: String,
    metrics: Metrics,
    /// Events applied since the last snapshot was written.
    since: AtomicU64,
    /// When the last snapshot was written (none yet: `None`).
    last: Mutex<Option<Instant>>,
}

impl SnapshotWriter {
    pub(crate) fn new(every_events: u64, stream: String, metrics: Metrics) -> Self {
        Self {
            every_events,
            stream,
            metrics,
            since: AtomicU64::new(0),
            last: Mutex::new(None),
        }
    }

    /// One more event applied since the last snapshot.
    pub(crate) fn event_applied(&self) {
        self.since.fetch_add(1, Ordering::Relaxed);
    }

    /// Writes snapshots of `replica`'s registry on `publisher` while the scheduler leads, a task of
    /// its own beside the dispatcher: the registry lock is held only to take a
    /// [`crate::registry::SnapshotView`] (pointer copies); serializing runs on a blocking thread
    /// and publishing on this task, so neither delays dispatch, events or heartbeats. A failure is
    /// logged and counted, and the next check tries again; it never ends the session.
    pub(crate) async fn run(&self, replica: &Replica, publisher: &Publisher) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(SNAPSHOT_CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.maybe_snapshot(replica, publisher).await;
        }
    }

    async fn maybe_snapshot(&self, replica: &Replica, publisher: &Publisher) {
        let since = self.since.load(Ordering::Relaxed);
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let due = since >= self.every_events
            || (since > 0 && last.is_none_or(|t| t.elapsed() >= SNAPSHOT_AT_LEAST_EVERY));
        if !due {
            return;
        }
        let started = Instant::now();
        let view = replica.registry().snapshot();
        let locked = started.elapsed();
        let (offset, jobs) = (view.next_offset(), view.jobs());
        self.since.fetch_sub(since, Ordering::Relaxed);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let serialized = tokio::task::spawn_blocking(move || {
            let mut bytes = Vec::new();
            view.write(&mut bytes).map(|()| bytes)
        })
        .await;
        let bytes = match serialized {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "could not serialize a registry snapshot");
                self.not_written(since, "failed");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "the snapshot serializer panicked");
                self.not_written(since, "failed");
                return;
            }
        };
        if bytes.len() > MAX_SNAPSHOT_BYTES {
            tracing::warn!(
                bytes = bytes.len(),
                jobs,
                "registry snapshot too large to write; a restart replays from the previous one"
            );
            self.metrics
                .snapshots_total
                .with_label_values(&["too_large"])
                .inc();
            return;
        }
        let size = bytes.len();
        let published = publisher
            .publish("", &self.stream, &bytes, json_properties())
            .await;
        drop(bytes);
        match published {
            Ok(()) => {
                self.metrics
                    .snapshots_total
                    .with_label_values(&["written"])
                    .inc();
                self.metrics.snapshot_bytes.set(size as i64);
                tracing::info!(
                    offset,
                    jobs,
                    bytes = size,
                    lock_seconds = locked.as_secs_f64(),
                    seconds = started.elapsed().as_secs_f64(),
                    "registry snapshot written"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "registry snapshot not written; retrying later");
                self.not_written(since, "failed");
            }
        }
    }

    /// Owes the snapshot again at the next check.
    fn not_written(&self, since: u64, outcome: &str) {
        self.since.fetch_add(since, Ordering::Relaxed);
        self.metrics
            .snapshots_total
            .with_label_values(&[outcome])
            .inc();
    }
}

/// Reads the latest snapshot, if there is a usable one. Snapshots are the only messages of
/// their stream, so the latest is the last message of the stream's last chunk: read from
/// "last" until the stream goes quiet. The broker reports no message count for a stream
/// (`queue.declare` answers 0), so an empty one (a fresh installation) can only be told by
/// the first wait running out: a start without snapshots costs that wait once.
pub(crate) async fn load(
    connection: &Connection,
    stream: &str,
    retention: Retention,
) -> anyhow::Result<Option<Registry>> {
    let channel = connection.create_channel().await?;
    channel.basic_qos(16, BasicQosOptions::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString(LongString::from("last")),
    );
    let mut consumer = channel
        .basic_consume(
            stream.into(),
            "snapshot-loader".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await?;
    let mut latest: Option<(u64, Vec<u8>)> = None;
    let mut quiet = Duration::from_millis(1500);
    while let Ok(Some(delivery)) = tokio::time::timeout(quiet, consumer.next()).await {
        let delivery = delivery?;
        let offset = stream_offset(&delivery.properties).unwrap_or(0);
        delivery.acker.ack(BasicAckOptions::default()).await?;
        if latest.as_ref().is_none_or(|(o, _)| offset >= *o) {
            latest = Some((offset, delivery.data));
        }
        quiet = Duration::from_millis(300);
    }
    if let Err(e) = channel.close(200, "snapshot read".into()).await {
        tracing::debug!(error = %e, "closing the snapshot channel");
    }
    let Some((offset, bytes)) = latest else {
        return Ok(None);
    };
    let started = Instant::now();
    match serde_json::from_slice::<Snapshot>(&bytes) {
        Ok(snapshot) => {
            let (next, jobs) = (snapshot.next_offset(), snapshot.jobs());
            let registry = Registry::restore(snapshot, retention);
            tracing::info!(
                snapshot_offset = offset,
                events_from = next,
                jobs,
                bytes = bytes.len(),
                seconds = started.elapsed().as_secs_f64(),
                "registry snapshot loaded"
            );
            Ok(Some(registry))
        }
        Err(e) => {
            tracing::warn!(snapshot_offset = offset, error = %e, "the latest registry snapshot does not decode; replaying the whole event stream");
            Ok(None)
        }
    }
}
