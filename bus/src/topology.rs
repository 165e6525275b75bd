//! Declares vnfarm's exchanges and queues (DESIGN §4). Declarations are idempotent, so both binaries
//! declare everything they use at every (re)connection; a mismatch of arguments is a broker error
//! (PRECONDITION_FAILED) that names the queue, which is why both read the same [`AmqpConfig`]. A
//! worker with `amqp.declare_topology = false` declares only its own queue and leaves
//! [`declare_core`] to the scheduler, so its broker user needs no configure right on shared names.
//!
//! | name | type | notes |
//! | --- | --- | --- |
//! | `<p>.events` | topic exchange | `job.<id>.<event>`, `worker.<id>.heartbeat`, `control.cancel`, `marker.<nonce>`, `people.<name>.<event>` |
//! | `<p>.events.log` | stream | bound to `job.#`, `marker.#` and `people.#`; the durable job history and people's tokens |
//! | `<p>.intake` | quorum queue | submissions; delivery limit; dead-letters to `<p>.dead` |
//! | `<p>.worker.<id>` | quorum queue | one worker's jobs; expired or over-limit messages go to `<p>.redispatch` |
//! | `<p>.submissions` | fanout exchange | bound to `<p>.intake`; what a submitter may write to |
//! | `<p>.redispatch` | quorum queue | consumed by the scheduler |
//! | `<p>.give-back` | fanout exchange | bound to `<p>.redispatch`; where a worker gives jobs back |
//! | `<p>.dead` | fanout exchange + quorum queue | permanent failures, reason in headers |
//! | `<p>.scheduler.leader` | quorum queue, single active consumer | the leader token ([`declare_scheduler`]) |
//! | `<p>.scheduler.snapshots` | stream | registry snapshots of the active scheduler |
//! | `<p>.scheduler.dead-watch` | quorum queue on `<p>.dead` | broker dead letters, given `failed` events by the active scheduler |

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};
use vnfarm_proto::WorkerId;
use vnfarm_proto::topology::{
    JOB_EVENTS_PATTERN, MARKER_ROUTING_PREFIX, PEOPLE_ROUTING_PREFIX, Topology,
};

use crate::AmqpConfig;

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.to_owned()))
}

/// Arguments of a quorum queue that dead-letters (at least once) to `dlx` with `dl_routing_key`.
fn quorum_args(config: &AmqpConfig, dlx: &str, dl_routing_key: Option<&str>) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongInt(config.delivery_limit as i32),
    );
    args.insert("x-dead-letter-exchange".into(), text(dlx));
    if let Some(key) = dl_routing_key {
        args.insert("x-dead-letter-routing-key".into(), text(key));
    }
    // At-least-once dead-lettering needs reject-publish overflow; without it the broker may drop.
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    args
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// Declares everything shared by the whole installation.
pub async fn declare_core(channel: &Channel, config: &AmqpConfig) -> Result<(), lapin::Error> {
    let t = config.topology();
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .exchange_declare(
            t.events_exchange().into(),
            ExchangeKind::Topic,
            durable_exchange,
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_declare(
            t.dead_exchange().into(),
            ExchangeKind::Fanout,
            durable_exchange,
            FieldTable::default(),
        )
        .await?;

    for x in [t.submissions_exchange(), t.give_back_exchange()] {
        channel
            .exchange_declare(
                x.into(),
                ExchangeKind::Fanout,
                durable_exchange,
                FieldTable::default(),
            )
            .await?;
    }

    let mut dead_args = FieldTable::default();
    dead_args.insert("x-queue-type".into(), text("quorum"));
    channel
        .queue_declare(t.dead_queue().into(), durable(), dead_args)
        .await?;
    channel
        .queue_bind(
            t.dead_queue().into(),
            t.dead_exchange().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

    channel
        .queue_declare(
            t.intake_queue().into(),
            durable(),
            quorum_args(config, &t.dead_exchange(), None),
        )
        .await?;
    channel
        .queue_declare(
            t.redispatch_queue().into(),
            durable(),
            quorum_args(config, &t.dead_exchange(), None),
        )
        .await?;

    for (queue, exchange) in [
        (t.intake_queue(), t.submissions_exchange()),
        (t.redispatch_queue(), t.give_back_exchange()),
    ] {
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }

    let mut stream_args = FieldTable::default();
    stream_args.insert("x-queue-type".into(), text("stream"));
    stream_args.insert(
        "x-max-length-bytes".into(),
        AMQPValue::LongLongInt(config.events_max_bytes as i64),
    );
    stream_args.insert("x-max-age".into(), text(&config.events_max_age));
    // Small segments keep retention fine-grained and a test installation's disk use small.
    stream_args.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongInt(16 << 20),
    );
    channel
        .queue_declare(t.events_stream().into(), durable(), stream_args)
        .await?;
    for pattern in [
        JOB_EVENTS_PATTERN.to_owned(),
        format!("{MARKER_ROUTING_PREFIX}.#"),
        format!("{PEOPLE_ROUTING_PREFIX}.#"),
    ] {
        channel
            .queue_bind(
                t.events_stream().into(),
                t.events_exchange().into(),
                pattern.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// Declares the schedulers' own queues: the leader queue (quorum, single active consumer, a
/// delivery limit out of reach: its token is redelivered at every takeover) and the snapshot stream (small
/// retention: only the latest snapshot matters). Returns the number of ready tokens in the leader
/// queue (a held token is not counted).
pub async fn declare_scheduler(
    channel: &Channel,
    config: &AmqpConfig,
) -> Result<u32, lapin::Error> {
    let t = config.topology();
    let mut leader_args = FieldTable::default();
    leader_args.insert("x-queue-type".into(), text("quorum"));
    leader_args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    // The token is redelivered at every takeover. RabbitMQ 4 gives quorum queues a default delivery
    // limit of 20, past which the token would be dropped: set one no fleet reaches.
    leader_args.insert("x-delivery-limit".into(), AMQPValue::LongInt(1_000_000_000));
    let leader = channel
        .queue_declare(t.leader_queue().into(), durable(), leader_args)
        .await?;
    let mut snapshot_args = FieldTable::default();
    snapshot_args.insert("x-queue-type".into(), text("stream"));
    snapshot_args.insert("x-max-length-bytes".into(), AMQPValue::LongLongInt(1 << 30));
    snapshot_args.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongInt(64 << 20),
    );
    channel
        .queue_declare(t.snapshot_stream().into(), durable(), snapshot_args)
        .await?;
    // No dead-letter exchange of its own: it reads that exchange, and a limit reached here would
    // send the message round again. The operators' copy stays in the dead queue.
    let mut watch_args = FieldTable::default();
    watch_args.insert("x-queue-type".into(), text("quorum"));
    channel
        .queue_declare(t.dead_watch_queue().into(), durable(), watch_args)
        .await?;
    channel
        .queue_bind(
            t.dead_watch_queue().into(),
            t.dead_exchange().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(leader.message_count())
}

/// Declares one worker's own queue. Messages that expire there (the worker died or stalled) or exceed
/// the delivery limit go to the redispatch queue, where the scheduler decides what happens next.
pub async fn declare_worker_queue(
    channel: &Channel,
    config: &AmqpConfig,
    worker: &WorkerId,
) -> Result<String, lapin::Error> {
    let t: Topology = config.topology();
    let name = t.worker_queue(worker);
    let redispatch = t.redispatch_queue();
    channel
        .queue_declare(
            name.as_str().into(),
            durable(),
            quorum_args(config, "", Some(&redispatch)),
        )
        .await?;
    Ok(name)
}

/// Deletes every queue and exchange of an installation whose workers are `workers` (for tests).
pub async fn delete_all(
    channel: &Channel,
    config: &AmqpConfig,
    workers: &[WorkerId],
) -> Result<(), lapin::Error> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let t = config.topology();
    let mut queues = vec![
        t.intake_queue(),
        t.redispatch_queue(),
        t.dead_queue(),
        t.events_stream(),
        t.leader_queue(),
        t.snapshot_stream(),
        t.dead_watch_queue(),
    ];
    queues.extend(workers.iter().map(|w| t.worker_queue(w)));
    for q in queues {
        channel
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await?;
    }
    for x in [
        t.events_exchange(),
        t.dead_exchange(),
        t.submissions_exchange(),
        t.give_back_exchange(),
    ] {
        channel
            .exchange_delete(x.into(), ExchangeDeleteOptions::default())
            .await?;
    }
    Ok(())
}

/// A private subscription to `routing_key` on `exchange`: an exclusive, auto-deleted, server-named
/// queue on its own channel, consumed without acknowledgements. For messages that matter only while
/// this connection lives (heartbeats for the scheduler, cancel fan-out for a worker); the queue goes
/// away with the connection.
pub async fn subscribe_private(
    connection: &lapin::Connection,
    exchange: &str,
    routing_key: &str,
    consumer_tag: &str,
) -> Result<lapin::Consumer, lapin::Error> {
    subscribe_private_keys(connection, exchange, &[routing_key], consumer_tag).await
}

/// [`subscribe_private`] to several routing keys on one queue (a delivery's `routing_key` says
/// which).
pub async fn subscribe_private_keys(
    connection: &lapin::Connection,
    exchange: &str,
    routing_keys: &[&str],
    consumer_tag: &str,
) -> Result<lapin::Consumer, lapin::Error> {
    let channel = connection.create_channel().await?;
    let private = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    };
    let queue = channel
        .queue_declare("".into(), private, FieldTable::default())
        .await?;
    for routing_key in routing_keys {
        channel
            .queue_bind(
                queue.name().clone(),
                exchange.into(),
                (*routing_key).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    let no_ack = lapin::options::BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    channel
        .basic_consume(
            queue.name().clone(),
            consumer_tag.into(),
            no_ack,
            FieldTable::default(),
        )
        .await
}
