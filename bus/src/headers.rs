//! Message headers: reading RabbitMQ's (`x-death`, `x-delivery-count`, `x-stream-offset`) and
//! writing vnfarm's own (`x-vnfarm-reason`, ...).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()?
        .inner()
        .get(&ShortString::from(name))
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::Timestamp(v) => Some(*v),
        _ => None,
    }
}

fn as_string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// How many times a quorum queue delivered this message before (absent on the first delivery).
pub fn delivery_count(props: &BasicProperties) -> u64 {
    header(props, "x-delivery-count")
        .and_then(as_u64)
        .unwrap_or(0)
}

/// The offset of a message read from a stream.
pub fn stream_offset(props: &BasicProperties) -> Option<u64> {
    header(props, "x-stream-offset").and_then(as_u64)
}

/// Why the broker last dead-lettered this message (`expired`, `delivery_limit`, `rejected`, ...).
pub fn death_reason(props: &BasicProperties) -> Option<String> {
    latest_death(props, "reason")
        .or_else(|| header(props, "x-first-death-reason").and_then(as_string))
}

/// The queue the broker last dead-lettered this message from.
pub fn death_queue(props: &BasicProperties) -> Option<String> {
    latest_death(props, "queue")
        .or_else(|| header(props, "x-first-death-queue").and_then(as_string))
}

/// A field of the latest `x-death` entry (the broker puts the latest first).
fn latest_death(props: &BasicProperties, field: &str) -> Option<String> {
    if let Some(AMQPValue::FieldArray(deaths)) = header(props, "x-death")
        && let Some(AMQPValue::FieldTable(latest)) = deaths.as_slice().first()
    {
        return latest
            .inner()
            .get(&ShortString::from(field))
            .and_then(as_string);
    }
    None
}

pub fn string_header(props: &BasicProperties, name: &str) -> Option<String> {
    header(props, name).and_then(as_string)
}

/// Headers for a message vnfarm dead-letters itself.
pub fn dead_letter_headers(reason: &str, failure: &str, job_id: Option<&str>) -> FieldTable {
    let mut table = FieldTable::default();
    let mut put = |k: &str, v: &str| {
        table.insert(
            k.into(),
            AMQPValue::LongString(LongString::from(v.to_owned())),
        );
    };
    put(vnfarm_proto::topology::HEADER_REASON, reason);
    put(vnfarm_proto::topology::HEADER_FAILURE, failure);
    if let Some(id) = job_id {
        put(vnfarm_proto::topology::HEADER_JOB_ID, id);
    }
    table
}
