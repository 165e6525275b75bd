//! What each RabbitMQ role of deploy/rabbitmq/definitions.json may do and what it may not, tried
//! on a real broker: the e2e test `permissions` (one node) and the cluster test (three) run the
//! same matrix.

use std::time::Duration;

use anyhow::bail;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use vnfarm_proto::topology::{self, CANCEL_ROUTING_KEY, Topology};
use vnfarm_proto::{JobId, WorkerId};

/// One thing a role tries, on a channel of its own.
#[derive(Clone, Debug)]
pub enum Try {
    Publish {
        exchange: String,
        key: String,
    },
    Consume(String),
    /// A non-passive declare with no arguments: refused without configure; with it, the
    /// broker answers PRECONDITION_FAILED for a queue that exists with other arguments.
    Declare(String),
    DeclareWorkerQueue(WorkerId),
    /// `queue.delete`: only where it must be refused (it would delete the queue otherwise; the
    /// right to delete is the right to configure, which `Declare` shows without harm).
    Delete(String),
    Bind {
        queue: String,
        exchange: String,
        key: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    Allowed,
    Refused,
}
pub use Outcome::{Allowed, Refused};

impl Try {
    pub fn publish(exchange: &str, key: &str) -> Self {
        Try::Publish {
            exchange: exchange.to_owned(),
            key: key.to_owned(),
        }
    }

    pub fn bind(queue: &str, exchange: &str, key: &str) -> Self {
        Try::Bind {
            queue: queue.to_owned(),
            exchange: exchange.to_owned(),
            key: key.to_owned(),
        }
    }

    /// Allowed when the broker let the operation past its permission check (PRECONDITION_FAILED
    /// comes after it), refused on ACCESS_REFUSED; any other error fails the test.
    pub async fn run(&self, conn: &Connection, prefix: &str) -> anyhow::Result<Outcome> {
        let channel = conn.create_channel().await?;
        let result: Result<(), lapin::Error> = async {
            match self {
                Try::Publish { exchange, key } => {
                    channel
                        .confirm_select(ConfirmSelectOptions::default())
                        .await?;
                    let confirm = channel
                        .basic_publish(
                            exchange.as_str().into(),
                            key.as_str().into(),
                            BasicPublishOptions::default(),
                            b"{}",
                            BasicProperties::default(),
                        )
                        .await?;
                    match tokio::time::timeout(Duration::from_secs(10), confirm).await {
                        Ok(confirmation) => confirmation.map(|_| ()),
                        Err(_) => panic!("no confirm for {self:?} within 10 s"),
                    }
                }
                Try::Consume(queue) => channel
                    .basic_consume(
                        queue.as_str().into(),
                        "permission-probe".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map(|_| ()),
                Try::Declare(queue) => channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map(|_| ()),
                Try::DeclareWorkerQueue(worker) => {
                    let config = vnfarm_bus::AmqpConfig {
                        prefix: prefix.to_owned(),
                        ..Default::default()
                    };
                    vnfarm_bus::topology::declare_worker_queue(&channel, &config, worker)
                        .await
                        .map(|_| ())
                }
                Try::Delete(queue) => channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .map(|_| ()),
                Try::Bind {
                    queue,
                    exchange,
                    key,
                } => {
                    channel
                        .queue_bind(
                            queue.as_str().into(),
                            exchange.as_str().into(),
                            key.as_str().into(),
                            QueueBindOptions::default(),
                            FieldTable::default(),
                        )
                        .await
                }
            }
        }
        .await;
        match result {
            Ok(()) => Ok(Allowed),
            Err(e) => match e.kind() {
                lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => Ok(Refused),
                    AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => Ok(Allowed),
                    _ => bail!("{self:?}: {e}"),
                },
                _ => bail!("{self:?}: {e}"),
            },
        }
    }
}

/// Each role's connection and what it tries, with the outcome it must get.
type Cases<'a> = Vec<(&'a str, &'a Connection, Vec<(Try, Outcome)>)>;

/// One connection per role, each logged in as its definitions.json user (`worker` as box `box1`'s,
/// `worker2` as `box2`'s).
pub struct Roles<'a> {
    pub worker: &'a Connection,
    pub worker2: &'a Connection,
    pub submitter: &'a Connection,
    pub monitoring: &'a Connection,
    pub scheduler: &'a Connection,
}

/// Tries everything in the matrix; returns the attempts whose outcome was not the expected one
/// (empty: every role can do its work and no more).
pub async fn wrong_outcomes(
    roles: &Roles<'_>,
    prefix: &str,
    box1: &WorkerId,
    box2: &WorkerId,
) -> anyhow::Result<Vec<String>> {
    let t = Topology::new(prefix.to_owned());
    let Roles {
        worker,
        worker2,
        submitter,
        monitoring,
        scheduler,
    } = *roles;
    let events = t.events_exchange();
    let job_event = format!("job.{}.progress", JobId::new());
    let marker = format!("{}.{}", topology::MARKER_ROUTING_PREFIX, JobId::new());
    let box1_beat = topology::heartbeat_routing_key(box1);
    let box2_beat = topology::heartbeat_routing_key(box2);
    // Publishing to the default exchange with a key no queue has proves the right to write there
    // without putting a message anywhere.
    let nowhere = format!("{}.no-such-queue", prefix);
    let submissions = t.submissions_exchange();
    let mine = format!("{}.mine", prefix);
    let cases: Cases = vec![
        (
            "worker 1",
            worker,
            vec![
                // Its own queue, its events and heartbeats ...
                (Try::DeclareWorkerQueue(box1.clone()), Allowed),
                (Try::Consume(t.worker_queue(box1)), Allowed),
                (Try::publish(&events, &box1_beat), Allowed),
                (Try::publish(&events, &job_event), Allowed),
                // ... not another worker's queue or heartbeat, not the scheduler's queues or
                // messages.
                (Try::Consume(t.worker_queue(box2)), Refused),
                (Try::publish(&events, &box2_beat), Refused),
                (Try::publish(&events, CANCEL_ROUTING_KEY), Refused),
                (Try::publish(&events, &marker), Refused),
                (Try::Consume(t.leader_queue()), Refused),
                (Try::Consume(t.snapshot_stream()), Refused),
                (Try::Consume(t.dead_watch_queue()), Refused),
                (Try::Declare(t.leader_queue()), Refused),
                (Try::Delete(t.leader_queue()), Refused),
                (Try::bind(&t.events_stream(), &events, "#"), Refused),
                // Nothing shared: it neither consumes, declares nor deletes the shared queues
                // (the scheduler declares them), and gives jobs back through the give-back
                // exchange, not the default exchange, which reaches every queue.
                (Try::Consume(t.intake_queue()), Refused),
                (Try::Consume(t.redispatch_queue()), Refused),
                (Try::publish("", &nowhere), Refused),
                (Try::publish(&submissions, ""), Refused),
                (Try::Declare(t.intake_queue()), Refused),
                (Try::Delete(t.redispatch_queue()), Refused),
                (Try::bind(&t.intake_queue(), &submissions, ""), Refused),
            ],
        ),
        (
            "worker 2",
            worker2,
            vec![
                (Try::DeclareWorkerQueue(box2.clone()), Allowed),
                (Try::Consume(t.worker_queue(box2)), Allowed),
                (Try::Consume(t.worker_queue(box1)), Refused),
                (Try::publish(&events, &box1_beat), Refused),
            ],
        ),
        (
            // The submissions exchange and nothing else.
            "submitter",
            submitter,
            vec![
                (Try::publish(&submissions, ""), Allowed),
                (Try::publish("", &t.intake_queue()), Refused),
                (Try::publish("", &nowhere), Refused),
                (Try::publish(&events, &job_event), Refused),
                (Try::Consume(t.intake_queue()), Refused),
                (Try::Declare(mine.clone()), Refused),
                (Try::Delete(t.intake_queue()), Refused),
            ],
        ),
        (
            // Logs in; may neither publish, consume nor declare.
            "monitoring",
            monitoring,
            vec![
                (Try::publish(&events, &job_event), Refused),
                (Try::publish("", &nowhere), Refused),
                (Try::Consume(t.dead_queue()), Refused),
                (Try::Consume(t.events_stream()), Refused),
                (Try::Declare(mine.clone()), Refused),
                (Try::Delete(t.intake_queue()), Refused),
            ],
        ),
        (
            // Pushes into worker queues but neither declares nor reads them.
            "scheduler",
            scheduler,
            vec![
                (Try::publish("", &nowhere), Allowed),
                (Try::Declare(t.intake_queue()), Allowed),
                (Try::DeclareWorkerQueue(box1.clone()), Refused),
                (Try::Consume(t.worker_queue(box1)), Refused),
            ],
        ),
    ];
    let mut wrong = Vec::new();
    for (role, conn, attempts) in &cases {
        for (attempt, expected) in attempts {
            let outcome = attempt.run(conn, prefix).await?;
            if outcome != *expected {
                wrong.push(format!(
                    "{role}: {attempt:?}: {outcome:?}, expected {expected:?}"
                ));
            }
        }
    }
    Ok(wrong)
}
