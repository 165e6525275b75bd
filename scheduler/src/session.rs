//! One broker session of the scheduler: declare the topology, replay the event stream up to a marker
//! of our own (so the registry is current before any decision), then serve intake, returned jobs,
//! heartbeats and live events until shutdown or until the connection is lost.

use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;
use vnfarm_bus::headers::{dead_letter_headers, death_reason, stream_offset};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{Publisher, topology};
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::topology::{HEARTBEAT_ROUTING_PATTERN, MARKER_ROUTING_PREFIX};
use vnfarm_proto::{
    Event, EventKind, FailureKind, Heartbeat, JobId, MAX_MESSAGE_BYTES, Submission, decode_json,
};

use crate::scheduler::{AcceptError, Scheduler};

pub enum SessionEnd {
    Shutdown,
    Lost(String),
}

async fn ack(d: &Delivery) -> anyhow::Result<()> {
    d.acker.ack(BasicAckOptions::default()).await?;
    Ok(())
}

impl Scheduler {
    pub(crate) async fn session(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        let end = self.session_inner(connection, shutdown).await;
        self.set_publisher(None);
        self.metrics.amqp_connected.set(0);
        match end {
            Ok(end) => end,
            Err(e) => SessionEnd::Lost(format!("{e:#}")),
        }
    }

    async fn consume(
        &self,
        channel: &Channel,
        queue: &str,
        tag: &str,
        args: FieldTable,
    ) -> anyhow::Result<lapin::Consumer> {
        Ok(channel
            .basic_consume(
                queue.into(),
                tag.into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await?)
    }

    async fn session_inner(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let publisher = Publisher::open(connection).await?;
        let channel = connection.create_channel().await?;
        topology::declare_core(&channel, &self.config.amqp).await?;
        self.set_publisher(Some(publisher.clone()));
        self.metrics.amqp_connected.set(1);

        // Heartbeats: a private queue bound to every worker's heartbeat.
        let mut heartbeats = topology::subscribe_private(
            connection,
            &self.topology.events_exchange(),
            HEARTBEAT_ROUTING_PATTERN,
            "heartbeats",
        )
        .await?;

        // The event stream, from where this process left off (the first offset on a fresh start).
        let stream_channel = connection.create_channel().await?;
        stream_channel
            .basic_qos(1000, BasicQosOptions::default())
            .await?;
        let mut args = FieldTable::default();
        let from = self.registry().next_offset;
        let offset = if from == 0 {
            AMQPValue::LongString(LongString::from("first"))
        } else {
            AMQPValue::LongLongInt(from as i64)
        };
        args.insert("x-stream-offset".into(), offset);
        let mut stream = self
            .consume(
                &stream_channel,
                &self.topology.events_stream(),
                "events",
                args,
            )
            .await?;

        // Catch up: everything before our marker is history.
        let nonce = JobId::new().to_string();
        let marker_key = format!("{MARKER_ROUTING_PREFIX}.{nonce}");
        publisher
            .publish(
                &self.topology.events_exchange(),
                &marker_key,
                b"{}",
                json_properties(),
            )
            .await?;
        let replay_started = std::time::Instant::now();
        let mut replayed = 0u64;
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                n = stream.next() => n,
            };
            let delivery = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Ok(SessionEnd::Lost(e.to_string())),
                None => return Ok(SessionEnd::Lost("event stream consumer cancelled".into())),
            };
            let done = delivery.routing_key.as_str() == marker_key;
            self.on_stream_message(&delivery, self.is_ready());
            ack(&delivery).await?;
            replayed += 1;
            if done {
                break;
            }
        }
        tracing::info!(
            events = replayed,
            seconds = replay_started.elapsed().as_secs_f64(),
            "event stream replayed"
        );
        self.set_ready();
        self.settle().await?;

        let intake_channel = connection.create_channel().await?;
        intake_channel
            .basic_qos(32, BasicQosOptions::default())
            .await?;
        let mut intake = self
            .consume(
                &intake_channel,
                &self.topology.intake_queue(),
                "intake",
                FieldTable::default(),
            )
            .await?;
        let mut returned = self
            .consume(
                &intake_channel,
                &self.topology.redispatch_queue(),
                "redispatch",
                FieldTable::default(),
            )
            .await?;

        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tracing::info!("scheduler ready");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                n = stream.next() => {
                    let Some(Ok(d)) = n else { return Ok(SessionEnd::Lost("event stream ended".into())) };
                    self.on_stream_message(&d, true);
                    ack(&d).await?;
                    self.settle().await?;
                }
                n = heartbeats.next() => {
                    let Some(Ok(d)) = n else { return Ok(SessionEnd::Lost("heartbeat consumer ended".into())) };
                    match decode_json::<Heartbeat>(&d.data) {
                        Ok(hb) => {
                            self.registry().heartbeat(hb);
                            self.dispatch().await?;
                        }
                        Err(e) => tracing::warn!(error = %e, "ignoring a malformed heartbeat"),
                    }
                }
                n = intake.next() => {
                    let Some(Ok(d)) = n else { return Ok(SessionEnd::Lost("intake consumer ended".into())) };
                    self.on_intake(d).await?;
                }
                n = returned.next() => {
                    let Some(Ok(d)) = n else { return Ok(SessionEnd::Lost("redispatch consumer ended".into())) };
                    let reason = death_reason(&d.properties).unwrap_or_else(|| "unknown".into());
                    self.returned(&d.data, &d.properties, &reason).await?;
                    ack(&d).await?;
                }
                _ = self.dispatch_wanted.notified() => self.settle().await?,
                _ = tick.tick() => {
                    self.update_gauges();
                    self.requeue_stale().await?;
                    self.settle().await?;
                }
            }
        }
    }

    fn on_stream_message(&self, delivery: &Delivery, live: bool) {
        if delivery
            .routing_key
            .as_str()
            .starts_with(MARKER_ROUTING_PREFIX)
        {
            if let Some(offset) = stream_offset(&delivery.properties) {
                let mut reg = self.registry();
                reg.next_offset = reg.next_offset.max(offset + 1);
            }
            return;
        }
        let Some(seq) = stream_offset(&delivery.properties) else {
            tracing::warn!("stream message without an offset; skipped");
            return;
        };
        match decode_json::<Event>(&delivery.data) {
            Ok(event) => self.apply(SequencedEvent { seq, event }, live),
            Err(e) => {
                tracing::warn!(seq, error = %e, "undecodable event in the stream; skipped");
                self.registry().next_offset = seq + 1;
            }
        }
    }

    /// A submission from a producer on the intake queue. Invalid ones are dead-lettered with a `failed`
    /// event; transient failures put the message back.
    async fn on_intake(&self, delivery: Delivery) -> anyhow::Result<()> {
        let id_hint = delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|m| m.as_str().parse::<JobId>().ok());
        let parsed = if delivery.data.len() > MAX_MESSAGE_BYTES {
            Err((
                FailureKind::Malformed,
                format!(
                    "message of {} bytes exceeds {MAX_MESSAGE_BYTES}",
                    delivery.data.len()
                ),
            ))
        } else {
            decode_json::<Submission>(&delivery.data)
                .map_err(|e| (FailureKind::Malformed, e.to_string()))
        };
        let outcome = match parsed {
            Ok(mut sub) => {
                if sub.job_id.is_none() {
                    sub.job_id = id_hint;
                }
                let fallback_id = sub.job_id;
                match self.accept(sub).await {
                    Ok(_) => Ok(()),
                    Err(AcceptError::Invalid(e)) => {
                        Err((fallback_id, FailureKind::InvalidSpec, e.to_string()))
                    }
                    Err(AcceptError::Unavailable(reason)) => {
                        tracing::warn!(%reason, "cannot accept a submission now; it goes back to the intake queue");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        delivery
                            .acker
                            .nack(BasicNackOptions {
                                requeue: true,
                                multiple: false,
                            })
                            .await?;
                        return Ok(());
                    }
                }
            }
            Err((kind, message)) => Err((id_hint, kind, message)),
        };
        if let Err((job_id, failure, message)) = outcome {
            self.metrics.malformed_messages_total.inc();
            // A failed event needs an id: the producer's, or a fresh one reported in the dead letter.
            let job_id = job_id.unwrap_or_default();
            tracing::warn!(job_id = %job_id, failure = failure.as_str(), %message, "submission rejected");
            let id_text = job_id.to_string();
            self.dead_letter(
                &delivery.data,
                dead_letter_headers(&message, failure.as_str(), Some(&id_text)),
            )
            .await?;
            self.publish_event(
                job_id,
                EventKind::Failed {
                    failure,
                    message,
                    retryable: false,
                },
            )
            .await?;
        }
        ack(&delivery).await
    }
}
