//! The `[amqp]` configuration section, shared by both binaries so their declarations agree.

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost`. The password is never logged.
    #[serde(default = "default_url")]
    pub url: String,
    /// Prefix of every exchange and queue name (`vnfarm`); lets several installations share a broker.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Deliveries of one message before the broker dead-letters it (RabbitMQ 3.x quorum queues have
    /// no limit unless one is set).
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
    /// Size cap of the event stream (the job history).
    #[serde(default = "default_stream_max_bytes")]
    pub events_max_bytes: u64,
    /// Age cap of the event stream, in RabbitMQ's syntax (`7D`, `24h`).
    #[serde(default = "default_stream_max_age")]
    pub events_max_age: String,
    /// Longest wait between reconnection attempts, in milliseconds.
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
}

fn default_url() -> String {
    "amqp://guest:guest@127.0.0.1:5672/%2f".into()
}
fn default_prefix() -> String {
    "vnfarm".into()
}
fn default_delivery_limit() -> u32 {
    3
}
fn default_stream_max_bytes() -> u64 {
    1 << 30
}
fn default_stream_max_age() -> String {
    "7D".into()
}
fn default_max_backoff_ms() -> u64 {
    5_000
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: default_url(),
            prefix: default_prefix(),
            delivery_limit: default_delivery_limit(),
            events_max_bytes: default_stream_max_bytes(),
            events_max_age: default_stream_max_age(),
            max_backoff_ms: default_max_backoff_ms(),
        }
    }
}

impl AmqpConfig {
    /// Checks without I/O; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err("amqp.url: must start with amqp:// or amqps://".into());
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.prefix.is_empty() || self.prefix.len() > 64 || !self.prefix.chars().all(ok) {
            return Err("amqp.prefix: must be 1-64 characters of [A-Za-z0-9._-]".into());
        }
        if !(1..=100).contains(&self.delivery_limit) {
            return Err("amqp.delivery_limit: must be 1..=100".into());
        }
        if self.max_backoff_ms == 0 {
            return Err("amqp.max_backoff_ms: must be positive".into());
        }
        Ok(())
    }

    pub fn topology(&self) -> vnfarm_proto::topology::Topology {
        vnfarm_proto::topology::Topology::new(self.prefix.clone())
    }

    /// The URL with its password replaced, for logs.
    pub fn redacted_url(&self) -> String {
        match (self.url.find("://"), self.url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                let creds = &self.url[scheme + 3..at];
                let user = creds.split(':').next().unwrap_or("");
                format!("{}{user}:***{}", &self.url[..scheme + 3], &self.url[at..])
            }
            _ => self.url.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        let c = AmqpConfig {
            url: "amqp://guest:secret@host:5672/%2f".into(),
            ..Default::default()
        };
        assert_eq!(c.redacted_url(), "amqp://guest:***@host:5672/%2f");
        assert!(!c.redacted_url().contains("secret"));
    }

    #[test]
    fn bad_values_name_the_field() {
        let c = AmqpConfig {
            url: "http://x".into(),
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().starts_with("amqp.url"));
        let c = AmqpConfig {
            delivery_limit: 0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().starts_with("amqp.delivery_limit"));
    }
}
