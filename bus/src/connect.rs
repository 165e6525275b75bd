//! Connecting to the broker: the nodes of the cluster raced with a stagger, retrying with
//! exponential backoff until one answers or shutdown.

use std::pin::pin;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::{Connection, ConnectionProperties};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::redacted;

/// Longest wait for one node to take a connection. A node behind a cut link does not refuse: it
/// stays silent until TCP gives up (minutes), while the next node may be alive.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an attempt has alone before the next node is tried beside it (RFC 8305's "connection
/// attempt delay", the Happy Eyeballs idea applied to a cluster's nodes): a node that answers
/// within it is kept, so a box's processes stay on its own node while it lives, and a silent one
/// costs this instead of [`CONNECT_TIMEOUT`]. A refused attempt starts the next one at once.
const STAGGER: Duration = Duration::from_secs(1);

/// The broker nodes to try, in turn: from a random one, so that a fleet started together spreads
/// over the cluster. A session lost while its connection stayed up (a channel that stopped
/// confirming, a queue leader that moved) reconnects to the same node first. A session whose
/// connection failed (no heartbeat: the node or the link is gone; a reset: the node died) moves on
/// to the next node first: behind a cut link, the same node would cost [`STAGGER`] before the next
/// one is tried (the three-box test saw a standby whose node was on the cut-off active scheduler's
/// box spend the whole connect timeout on it, then, 5 s, take over after 28.6 s).
#[derive(Clone, Debug)]
pub struct Nodes {
    urls: Vec<String>,
    current: usize,
}

impl Nodes {
    /// `urls` from a random one of them (see [`crate::AmqpConfig::nodes`]).
    pub fn new(urls: &[String]) -> Self {
        Self::starting_at(urls, rand::random_range(0..urls.len().max(1)))
    }

    pub fn starting_at(urls: &[String], first: usize) -> Self {
        assert!(
            !urls.is_empty(),
            "a validated AmqpConfig has at least one node"
        );
        Self {
            urls: urls.to_vec(),
            current: first % urls.len(),
        }
    }

    /// The node to try first: the one that served last, until an attempt on it fails.
    pub fn current(&self) -> &str {
        &self.urls[self.current]
    }

    /// An attempt on [`Nodes::current`] failed: the next node is tried first.
    pub fn failed(&mut self) {
        self.current = (self.current + 1) % self.urls.len();
    }

    /// A session on [`Nodes::current`] ended; `connection_failed`: its connection had failed (the
    /// node is unreachable or dead), so the next node is tried first.
    pub fn session_lost(&mut self, connection_failed: bool) {
        if connection_failed {
            self.failed();
        }
    }

    /// Every node's index, from the current one.
    fn in_turn(&self) -> impl Iterator<Item = usize> + use<> {
        let (n, first) = (self.urls.len(), self.current);
        (0..n).map(move |k| (first + k) % n)
    }

    pub fn len(&self) -> usize {
        self.urls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }
}

/// Connects to the first of `nodes` that answers: [`Nodes::current`] first, the next one beside it
/// after [`STAGGER`] or as soon as an attempt fails, and so on (every attempt within
/// [`CONNECT_TIMEOUT`]); after a round in which none answered, waits with [`Backoff`] (100 ms
/// doubling to `max_backoff`). The node that answered becomes the current one. `None` means
/// shutdown came first. `on_failure` is called after each failed attempt (for a reconnect
/// counter).
pub async fn connect_with_backoff(
    nodes: &mut Nodes,
    max_backoff: Duration,
    name: &str,
    shutdown: &CancellationToken,
    mut on_failure: impl FnMut(),
) -> Option<Connection> {
    let mut backoff = Backoff::new(max_backoff);
    loop {
        let conn = tokio::select! {
            _ = shutdown.cancelled() => return None,
            conn = race(nodes, name, &mut on_failure) => conn,
        };
        if let Some((index, conn)) = conn {
            nodes.current = index;
            return Some(conn);
        }
        let delay = backoff.next_delay();
        tracing::warn!(
            nodes = nodes.len(),
            retry_in_ms = delay.as_millis() as u64,
            "no broker node answered"
        );
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// One round of [`connect_with_backoff`]: the index and connection of the first node to answer, or
/// `None` when every attempt failed. Attempts still under way when one wins are left to finish in
/// a task of their own, which closes any connection they open.
async fn race(
    nodes: &Nodes,
    name: &str,
    on_failure: &mut impl FnMut(),
) -> Option<(usize, Connection)> {
    let attempt = |index: usize| {
        let url = nodes.urls[index].clone();
        let props = ConnectionProperties::default().with_connection_name(name.to_owned().into());
        async move {
            let result =
                match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(&url, props)).await
                {
                    Ok(Ok(conn)) => Ok(conn),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {CONNECT_TIMEOUT:?}")),
                };
            (index, url, result)
        }
    };
    let mut waiting = nodes.in_turn();
    let mut running = FuturesUnordered::new();
    running.extend(waiting.next().map(attempt));
    let mut stagger = pin!(tokio::time::sleep(STAGGER));
    loop {
        let start_next = tokio::select! {
            finished = running.next() => match finished {
                Some((index, url, Ok(conn))) => {
                    tracing::info!(url = %redacted(&url), connection = name, "connected to the broker");
                    close_latecomers(running);
                    return Some((index, conn));
                }
                Some((_, url, Err(error))) => {
                    on_failure();
                    tracing::warn!(url = %redacted(&url), %error, "broker connection failed");
                    true
                }
                None => return None,
            },
            _ = &mut stagger => true,
        };
        if start_next {
            match waiting.next() {
                Some(index) => {
                    running.push(attempt(index));
                    stagger.as_mut().reset(Instant::now() + STAGGER);
                }
                // Nothing left to start: wait for the attempts under way (the timer stays
                // spent, so only they can wake this loop).
                None if running.is_empty() => return None,
                None => stagger.as_mut().reset(Instant::now() + CONNECT_TIMEOUT * 2),
            }
        }
    }
}

/// Lets the attempts that lost a [`race`] finish on their own and closes what they connect, so that
/// no connection is left open on a node nobody uses.
fn close_latecomers<F>(mut running: FuturesUnordered<F>)
where
    F: std::future::Future<Output = (usize, String, Result<Connection, String>)> + Send + 'static,
{
    if running.is_empty() {
        return;
    }
    tokio::spawn(async move {
        while let Some((_, _, result)) = running.next().await {
            if let Ok(conn) = result {
                let _ = conn.close(200, "another node answered first".into()).await;
            }
        }
    });
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

    fn urls(n: usize) -> Vec<String> {
        (1..=n)
            .map(|i| format!("amqp://u:p@10.0.0.{i}:5672/%2f"))
            .collect()
    }

    #[test]
    fn the_node_that_served_is_kept_and_a_failed_one_left_for_the_next() {
        let all = urls(3);
        let mut nodes = Nodes::starting_at(&all, 1);
        assert_eq!(nodes.current(), all[1]);
        assert_eq!(nodes.current(), all[1], "kept while it serves");
        let mut tried = Vec::new();
        for _ in 0..4 {
            nodes.failed();
            tried.push(nodes.current().to_owned());
        }
        assert_eq!(tried, [2, 0, 1, 2].map(|i| all[i].clone()));
    }

    #[test]
    fn a_session_lost_with_its_connection_moves_on_and_one_lost_on_a_live_connection_stays() {
        let all = urls(3);
        let mut nodes = Nodes::starting_at(&all, 0);
        nodes.session_lost(false);
        assert_eq!(
            nodes.current(),
            all[0],
            "the node is still there: it is tried first"
        );
        nodes.session_lost(true);
        assert_eq!(
            nodes.current(),
            all[1],
            "the connection failed: the next node first"
        );
    }

    #[test]
    fn a_fleet_starts_spread_over_the_nodes() {
        let firsts: std::collections::BTreeSet<String> = (0..200)
            .map(|_| Nodes::new(&urls(3)).current().to_owned())
            .collect();
        assert_eq!(
            firsts.len(),
            3,
            "every node is somebody's first: {firsts:?}"
        );
    }

    #[tokio::test]
    async fn a_dead_node_is_skipped_for_a_live_one() {
        let live = std::env::var("VNFARM_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        // Nothing listens on port 1: the attempt is refused, and the next node is tried at once.
        let mut nodes = Nodes::starting_at(&["amqp://guest:guest@127.0.0.1:1/%2f".into(), live], 0);
        let mut failures = 0;
        let shutdown = CancellationToken::new();
        let conn = connect_with_backoff(
            &mut nodes,
            Duration::from_secs(5),
            "vnfarm-bus connect test",
            &shutdown,
            || failures += 1,
        )
        .await
        .expect("the live node (is RabbitMQ running on VNFARM_TEST_AMQP_URL?)");
        assert!(conn.status().connected());
        assert_eq!(failures, 1);
        conn.close(200, "test over".into()).await.expect("closing");
    }

    #[tokio::test]
    async fn a_silent_node_is_raced_by_the_next_one() {
        let live = std::env::var("VNFARM_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        // A listener that never accepts: the TCP handshake completes in its backlog, and the AMQP
        // one never starts (a node behind a cut link is silent the same way).
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let silent = format!(
            "amqp://guest:guest@{}/%2f",
            silent.local_addr().expect("bound")
        );
        let mut nodes = Nodes::starting_at(&[silent, live.clone()], 0);
        let mut failures = 0;
        let shutdown = CancellationToken::new();
        let conn = connect_with_backoff(
            &mut nodes,
            Duration::from_secs(5),
            "vnfarm-bus connect race test",
            &shutdown,
            || failures += 1,
        )
        .await
        .expect("the live node (is RabbitMQ running on VNFARM_TEST_AMQP_URL?)");
        assert!(conn.status().connected());
        assert_eq!(
            failures, 0,
            "the live node answered while the silent one was still being waited for"
        );
        assert_eq!(nodes.current(), live, "the node that answered is kept");
        conn.close(200, "test over".into()).await.expect("closing");
    }

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
