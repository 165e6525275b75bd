//! Confirmed publishing: a publish returns `Ok` only after the broker has taken responsibility for the
//! message (publisher confirms), and unroutable messages are errors, not silent drops. A confirm
//! that does not come within the publisher's timeout is an error too, and marks the channel
//! [stuck](Publisher::stuck): its session should end and open fresh channels.

use std::time::Duration;

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The connection or channel failed; the message may or may not have arrived.
    #[error("broker unavailable: {0}")]
    Broker(#[from] lapin::Error),
    #[error("broker refused the message (nack) for {exchange:?}/{routing_key}")]
    Nacked {
        exchange: String,
        routing_key: String,
    },
    #[error("no queue is bound for {exchange:?}/{routing_key}")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    /// No confirm within the timeout: the message may or may not have arrived, and the channel
    /// may never confirm again (a channel that published across a cluster election can stay
    /// silent for minutes while fresh ones work at once).
    #[error("no confirm within {after:?} for {exchange:?}/{routing_key}")]
    ConfirmTimeout {
        exchange: String,
        routing_key: String,
        after: Duration,
    },
    /// An earlier publish on this channel got no confirm in time, so this one is not sent: a
    /// channel that published across a stream leader's election can confirm a later message the
    /// stream never keeps (the three-box test lost a job's `completed` event so; RabbitMQ
    /// rabbitmq-server#9457 reports losses of confirmed stream messages in a fail-over). The
    /// session that owns the channel ends and its runner opens a fresh one.
    #[error("not published to {exchange:?}/{routing_key}: this channel missed a confirm earlier")]
    Untrusted {
        exchange: String,
        routing_key: String,
    },
}

/// A channel in confirm mode. Clone freely: clones share the channel.
#[derive(Clone, Debug)]
pub struct Publisher {
    channel: Channel,
    confirm_timeout: Duration,
    stuck: CancellationToken,
}

/// The confirm timeout of a publisher opened without one (the `amqp.confirm_timeout_ms` default).
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Persistent JSON message properties.
pub fn json_properties() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
}

impl Publisher {
    pub async fn open(connection: &Connection) -> Result<Self, lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            stuck: CancellationToken::new(),
        })
    }

    /// The same publisher, failing publishes whose confirm takes longer than `timeout`
    /// (`AmqpConfig::confirm_timeout`).
    pub fn with_confirm_timeout(self, timeout: Duration) -> Self {
        Self {
            confirm_timeout: timeout,
            ..self
        }
    }

    /// Resolves once a publish on this channel timed out waiting for its confirm: the channel is
    /// not to be trusted any more, and the session that owns it should end (its runner then opens
    /// a new connection).
    pub async fn stuck(&self) {
        self.stuck.cancelled().await
    }

    /// Whether a publish on this channel already timed out (see [`Publisher::stuck`]): every later
    /// publish is refused ([`PublishError::Untrusted`]).
    pub fn is_stuck(&self) -> bool {
        self.stuck.is_cancelled()
    }

    /// Whether the channel is still open: after its connection was lost it publishes nothing
    /// more, and its session's unacknowledged deliveries come back to the broker.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes and waits for the broker's confirm; an unroutable message is an error (`mandatory`).
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.publish_with(exchange, routing_key, payload, properties, true)
            .await
    }

    /// Publishes a broadcast that may have no listener (a cancel request when no worker is
    /// connected): confirmed, but a message no queue takes is dropped, not an error. Not
    /// `mandatory` on purpose: a returned message on a channel shared by concurrent publishes can
    /// be matched to another publish's confirm, which would then fail for nothing.
    pub async fn broadcast_json<T: Serialize>(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &T,
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let payload = serde_json::to_vec(body).expect("vnfarm wire types serialize to JSON");
        self.publish_with(exchange, routing_key, &payload, properties, false)
            .await
    }

    async fn publish_with(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<(), PublishError> {
        if self.stuck.is_cancelled() {
            return Err(PublishError::Untrusted {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            });
        }
        let publish = async {
            self.channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory,
                        ..Default::default()
                    },
                    payload,
                    properties,
                )
                .await?
                .await
        };
        match self
            .within_confirm_timeout(exchange, routing_key, publish)
            .await??
        {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_returned)) => Err(PublishError::Unroutable {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            }),
            Confirmation::Nack(_) => Err(PublishError::Nacked {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            }),
        }
    }

    /// Awaits `confirm` for at most the confirm timeout; past it, marks the channel stuck.
    async fn within_confirm_timeout<T>(
        &self,
        exchange: &str,
        routing_key: &str,
        confirm: impl Future<Output = T>,
    ) -> Result<T, PublishError> {
        tokio::time::timeout(self.confirm_timeout, confirm)
            .await
            .map_err(|_| {
                self.stuck.cancel();
                PublishError::ConfirmTimeout {
                    exchange: exchange.into(),
                    routing_key: routing_key.into(),
                    after: self.confirm_timeout,
                }
            })
    }

    pub async fn publish_json<T: Serialize>(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &T,
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        // Serializing our own wire types cannot fail: they hold no maps with non-string keys.
        let payload = serde_json::to_vec(body).expect("vnfarm wire types serialize to JSON");
        self.publish(exchange, routing_key, &payload, properties)
            .await
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lapin::{Connection, ConnectionProperties};

    use super::*;

    #[tokio::test]
    async fn a_confirm_that_does_not_come_in_time_fails_the_publish_and_marks_the_channel_stuck() {
        let url = std::env::var("VNFARM_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("is RabbitMQ running on VNFARM_TEST_AMQP_URL?");
        let publisher = Publisher::open(&connection)
            .await
            .expect("a confirm channel")
            .with_confirm_timeout(Duration::from_millis(50));
        let stuck = publisher.clone();
        assert!(
            tokio::time::timeout(Duration::ZERO, stuck.stuck())
                .await
                .is_err(),
            "not stuck before any publish"
        );
        // A live broker confirms (a clone with room for a loaded machine), and the channel is fine...
        publisher
            .clone()
            .with_confirm_timeout(DEFAULT_CONFIRM_TIMEOUT)
            .broadcast_json("amq.fanout", "", &"nobody listens", json_properties())
            .await
            .expect("a live channel confirms");
        assert!(
            tokio::time::timeout(Duration::ZERO, stuck.stuck())
                .await
                .is_err(),
            "a confirmed publish leaves the channel trusted"
        );
        // ...and a confirm that never comes (a channel silent after a cluster election) times out.
        // A broker cannot be made to withhold one on demand, and a tiny timeout races the broker's
        // answer (a loaded CI machine saw the confirm win), so the silence is a future that never ends.
        let e = publisher
            .within_confirm_timeout("amq.fanout", "", std::future::pending::<()>())
            .await
            .unwrap_err();
        assert!(matches!(e, PublishError::ConfirmTimeout { .. }), "{e}");
        tokio::time::timeout(Duration::from_secs(1), stuck.stuck())
            .await
            .expect("every clone sees the channel stuck");
        // Nothing more goes out on it, from any clone: a later confirm there is not to be believed.
        let e = stuck
            .broadcast_json("amq.fanout", "", &"after the miss", json_properties())
            .await
            .unwrap_err();
        assert!(matches!(e, PublishError::Untrusted { .. }), "{e}");
        connection
            .close(200, "test over".into())
            .await
            .expect("closing");
    }
}
