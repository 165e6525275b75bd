//! Connecting to the broker, retrying with exponential backoff until it answers or shutdown.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::AmqpConfig;

/// Connects, retrying with [`Backoff`] (100 ms doubling to `max_backoff_ms`). `None` means shutdown
/// came first. `on_failure` is called after each failed attempt (for a reconnect counter).
pub async fn connect_with_backoff(
    config: &AmqpConfig,
    name: &str,
    shutdown: &CancellationToken,
    mut on_failure: impl FnMut(&lapin::Error),
) -> Option<Connection> {
    let mut backoff = Backoff::new(Duration::from_millis(config.max_backoff_ms));
    loop {
        let props = ConnectionProperties::default().with_connection_name(name.to_owned().into());
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = Connection::connect(&config.url, props) => r,
        };
        let delay = match attempt {
            Ok(conn) => return Some(conn),
            Err(e) => {
                on_failure(&e);
                let delay = backoff.next_delay();
                tracing::warn!(url = %config.redacted_url(), error = %e, retry_in_ms = delay.as_millis() as u64, "broker connection failed");
                delay
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Exponential backoff: 100 ms, doubling on each call to [`Backoff::next_delay`], capped at a
/// maximum; [`Backoff::reset`] starts again from 100 ms.
#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);

    pub fn new(max: Duration) -> Self {
        Self {
            next: Self::FIRST.min(max),
            max,
        }
    }

    /// The delay to wait now; the one after it is twice as long, up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub fn reset(&mut self) {
        self.next = Self::FIRST.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(500));
        let delays: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn a_cap_below_the_first_delay_is_the_delay() {
        let mut b = Backoff::new(Duration::from_millis(30));
        assert_eq!(b.next_delay(), Duration::from_millis(30));
        assert_eq!(b.next_delay(), Duration::from_millis(30));
    }
}
