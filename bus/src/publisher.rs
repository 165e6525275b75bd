//! Confirmed publishing: a publish returns `Ok` only after the broker has taken responsibility for the
//! message (publisher confirms), and unroutable messages are errors, not silent drops.

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;

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
}

/// A channel in confirm mode. Clone freely: clones share the channel.
#[derive(Clone, Debug)]
pub struct Publisher {
    channel: Channel,
}

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
        Ok(Self { channel })
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
        let confirm = self
            .channel
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
            .await?;
        match confirm {
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
