//! Connecting to the broker, retrying with exponential backoff until it answers or shutdown.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::AmqpConfig;

/// Connects, retrying with backoff (100 ms doubling to `max_backoff_ms`). `None` means shutdown came
/// first. `on_failure` is called after each failed attempt (for a reconnect counter).
pub async fn connect_with_backoff(
    config: &AmqpConfig,
    name: &str,
    shutdown: &CancellationToken,
    mut on_failure: impl FnMut(&lapin::Error),
) -> Option<Connection> {
    let mut delay = Duration::from_millis(100);
    let max = Duration::from_millis(config.max_backoff_ms);
    loop {
        let props = ConnectionProperties::default().with_connection_name(name.to_owned().into());
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = Connection::connect(&config.url, props) => r,
        };
        match attempt {
            Ok(conn) => return Some(conn),
            Err(e) => {
                on_failure(&e);
                tracing::warn!(url = %config.redacted_url(), error = %e, retry_in_ms = delay.as_millis() as u64, "broker connection failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(max);
    }
}
