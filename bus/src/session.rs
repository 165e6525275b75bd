//! The reconnect loop both binaries run: connect with backoff, run one *session* on the connection
//! until it ends, close the connection, and connect again unless the session ended in shutdown.
//!
//! A session owns what lives only as long as one connection (channels, consumers, helper tasks) and
//! says why it ended with a [`SessionEnd`]; what must survive a reconnection lives in the caller and
//! is reached through the closure's captures. Every session re-declares the topology it uses, so a
//! broker that lost its non-durable state is set up again.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::AmqpConfig;
use crate::connect::{Backoff, Nodes, connect_with_backoff};

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was requested: do not reconnect.
    Shutdown,
    /// The connection, a channel or a consumer failed (the reason, for the log): reconnect.
    Lost(String),
}

/// A session shorter than this that ends in [`SessionEnd::Lost`] counts as failing at once (a
/// declaration the broker refuses, a broker still starting): the next connection waits with
/// backoff instead of reconnecting in a tight loop.
const STEADY: Duration = Duration::from_secs(1);

/// Runs sessions until one ends in [`SessionEnd::Shutdown`] or `shutdown` is cancelled while
/// connecting. Connections go to the nodes of [`AmqpConfig::nodes`] in turn (see
/// [`crate::connect::Nodes`]).
///
/// `session` gets each new connection; the runner closes it once the session's future has finished
/// (a failed close is expected after a lost session and logged at debug). `on_reconnect` is called
/// after each failed connection attempt and each lost session (for an `amqp_reconnects_total`
/// counter). `name` is the connection name the broker shows.
///
/// The connection comes in an [`Arc`] so that the session's future need not borrow from the
/// closure; a session that needs its owner's `&self` captures the reference:
///
/// ```text
/// let this = &self;
/// vnfarm_bus::run_sessions(&config, "vnfarm-scheduler", &shutdown, || metric.inc(), move |c| async move {
///     this.session(&c, shutdown).await
/// }).await;
/// ```
pub async fn run_sessions<F, Fut>(
    config: &AmqpConfig,
    name: &str,
    shutdown: &CancellationToken,
    on_reconnect: impl Fn(),
    mut session: F,
) where
    F: FnMut(Arc<Connection>) -> Fut,
    Fut: Future<Output = SessionEnd>,
{
    let max_backoff = Duration::from_millis(config.max_backoff_ms);
    let mut quick_losses = Backoff::new(max_backoff);
    // Kept across sessions: a session lost with a reachable node reconnects to it first; one whose
    // connection failed (no heartbeat, reset) moves on to the next node.
    let mut nodes = Nodes::new(config.nodes());
    loop {
        let Some(connection) =
            connect_with_backoff(&mut nodes, max_backoff, name, shutdown, &on_reconnect).await
        else {
            return;
        };
        let connection = Arc::new(connection);
        let began = Instant::now();
        let end = session(connection.clone()).await;
        // Read before the close below: the session's own end does not say whether the node is
        // still there, the connection's state does.
        let connection_failed = connection.status().errored();
        if let Err(e) = connection.close(200, "session over".into()).await {
            // After a lost session the connection is usually gone already: nothing left to close.
            tracing::debug!(connection = name, error = %e, "closing the broker connection failed");
        }
        let reason = match end {
            SessionEnd::Shutdown => return,
            SessionEnd::Lost(reason) => reason,
        };
        on_reconnect();
        tracing::warn!(connection = name, %reason, connection_failed, "broker session lost; reconnecting");
        nodes.session_lost(connection_failed);
        if began.elapsed() >= STEADY {
            quick_losses.reset();
            continue;
        }
        let delay = quick_losses.next_delay();
        tracing::debug!(
            connection = name,
            delay_ms = delay.as_millis() as u64,
            "the session failed as it started; waiting before reconnecting"
        );
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// The broker of the test suite (see `tests/lib.rs`).
    fn broker() -> AmqpConfig {
        AmqpConfig {
            url: std::env::var("VNFARM_TEST_AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn lost_sessions_reconnect_until_one_ends_in_shutdown() {
        let config = broker();
        let shutdown = CancellationToken::new();
        let reconnects = AtomicU32::new(0);
        // Popped from the back: two lost sessions, then a shutdown.
        let mut ends = vec![
            SessionEnd::Shutdown,
            SessionEnd::Lost("second".into()),
            SessionEnd::Lost("first".into()),
        ];
        let mut connections = Vec::new();
        let run = run_sessions(
            &config,
            "vnfarm-bus session test",
            &shutdown,
            || {
                reconnects.fetch_add(1, Ordering::SeqCst);
            },
            |connection: Arc<Connection>| {
                assert!(connection.status().connected());
                connections.push(connection);
                let end = ends.pop().expect("no session after the one that shut down");
                async move { end }
            },
        );
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("sessions ran (is RabbitMQ running on VNFARM_TEST_AMQP_URL?)");
        assert_eq!(connections.len(), 3, "one connection per session");
        assert!(
            connections.iter().all(|c| !c.status().connected()),
            "every connection was closed after its session"
        );
        assert_eq!(reconnects.load(Ordering::SeqCst), 2, "one per lost session");
    }

    #[tokio::test]
    async fn shutdown_while_connecting_starts_no_session() {
        let config = AmqpConfig {
            // Nothing listens on port 1: every attempt fails.
            url: "amqp://guest:guest@127.0.0.1:1/%2f".into(),
            ..Default::default()
        };
        let shutdown = CancellationToken::new();
        let attempts = AtomicU32::new(0);
        let run = run_sessions(
            &config,
            "vnfarm-bus session test",
            &shutdown,
            || {
                if attempts.fetch_add(1, Ordering::SeqCst) == 1 {
                    shutdown.cancel();
                }
            },
            |_| -> std::future::Ready<SessionEnd> { unreachable!("no connection, no session") },
        );
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("shutdown ends the connection attempts");
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
    }
}
