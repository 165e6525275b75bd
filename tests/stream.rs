//! Reads a farm's whole event stream (`<prefix>.events.log`) back, from its first offset to a marker
//! published just before: the durable record of every job the system ever created, including the
//! ones no client heard of.

use std::time::Duration;

use crate::Farm;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use vnfarm_bus::Publisher;
use vnfarm_bus::headers::stream_offset;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::topology::{MARKER_ROUTING_PREFIX, PEOPLE_ROUTING_PREFIX, Topology};
use vnfarm_proto::{Event, PersonEvent, SequencedEvent, decode_json};

/// A stream that delivers nothing for this long is broken (the marker is always there to reach).
const STALL: Duration = Duration::from_secs(30);

/// The events of a stream in stream order, and what could not be read as an event.
pub struct EventLog {
    pub events: Vec<SequencedEvent>,
    /// People's token events, in stream order.
    pub people: Vec<PersonEvent>,
    /// Messages that are neither an event nor a marker (a writer's bug).
    pub undecodable: usize,
}

pub async fn read_all(farm: &Farm) -> anyhow::Result<EventLog> {
    read_all_from(&crate::amqp_url(), &farm.prefix).await
}

/// [`read_all`] of the installation `prefix` through the broker node at `url` (of a cluster, whose
/// nodes each hold a replica of the stream).
pub async fn read_all_from(url: &str, prefix: &str) -> anyhow::Result<EventLog> {
    let topology = Topology::new(prefix.to_owned());
    let connection =
        lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    // Our own marker: everything before it was written before the reading began.
    let marker = format!(
        "{MARKER_ROUTING_PREFIX}.log-reader-{}",
        uuid::Uuid::new_v4()
    );
    Publisher::open(&connection)
        .await?
        .publish(
            &topology.events_exchange(),
            &marker,
            b"{}",
            json_properties(),
        )
        .await?;

    let channel = connection.create_channel().await?;
    // A stream consumer needs a prefetch limit and acks.
    channel.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString(LongString::from("first")),
    );
    let mut consumer = channel
        .basic_consume(
            topology.events_stream().as_str().into(),
            "event-log-reader".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await?;

    let mut log = EventLog {
        events: Vec::new(),
        people: Vec::new(),
        undecodable: 0,
    };
    loop {
        let delivery = tokio::time::timeout(STALL, consumer.next())
            .await
            .map_err(|_| anyhow::anyhow!("the event stream stalled before the reader's marker"))?
            .ok_or_else(|| anyhow::anyhow!("the event stream consumer ended"))??;
        delivery.acker.ack(BasicAckOptions::default()).await?;
        let key = delivery.routing_key.as_str();
        if key == marker {
            break;
        }
        if key.starts_with(MARKER_ROUTING_PREFIX) {
            continue; // a scheduler's replay marker
        }
        if key.starts_with(PEOPLE_ROUTING_PREFIX) {
            match decode_json::<PersonEvent>(&delivery.data) {
                Ok(event) => log.people.push(event),
                Err(_) => log.undecodable += 1,
            }
            continue;
        }
        match (
            stream_offset(&delivery.properties),
            decode_json::<Event>(&delivery.data),
        ) {
            (Some(seq), Ok(event)) => log.events.push(SequencedEvent { seq, event }),
            _ => log.undecodable += 1,
        }
    }
    connection.close(200, "event log read".into()).await?;
    Ok(log)
}
