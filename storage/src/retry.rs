//! The one retry policy of storage operations, in both binaries and for both stores: an operation
//! that finds the store unavailable ([`StorageError::Unavailable`]) is tried again after 200 ms,
//! then after twice as long each time up to 5 s, `attempts` times in all; any other answer
//! (`NotFound`, `InvalidKey`) is final at once.
//!
//! The S3 SDK's own retries are turned off (`S3Store::open`), so this is the only layer. Under the
//! worker's own loop they multiplied its attempts (3 SDK attempts inside each of the worker's 5),
//! added the SDK's jittered backoff and retry quota, which no log showed, and left the local
//! directory without retries at all; here every failed attempt is logged with its operation and
//! key, and both stores retry alike. It does not use `vnfarm_bus`'s `Backoff`, whose first delay is
//! 100 ms: storage does not depend on the RabbitMQ crate for the doubling of one duration, and
//! these delays are the ones the worker used before.

use std::future::Future;
use std::time::Duration;

use crate::StorageError;

/// How many times a storage operation is tried while the store is unavailable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retries {
    attempts: u32,
}

impl Retries {
    /// What `Storage::open` uses: three attempts, as the SDK's default retry mode made before.
    pub const DEFAULT: Retries = Retries { attempts: 3 };
    const FIRST_DELAY: Duration = Duration::from_millis(200);
    const MAX_DELAY: Duration = Duration::from_secs(5);

    /// `attempts` tries in all (at least one).
    pub fn attempts(attempts: u32) -> Self {
        Self {
            attempts: attempts.max(1),
        }
    }

    /// Runs `attempt` until it answers or the attempts are spent; the last failure is returned.
    pub(crate) async fn run<T, F, Fut>(
        self,
        op: &'static str,
        key: &str,
        mut attempt: F,
    ) -> Result<T, StorageError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StorageError>>,
    {
        let mut delay = Self::FIRST_DELAY;
        let mut tries = 1;
        loop {
            match attempt().await {
                Err(e @ StorageError::Unavailable { .. }) if tries < self.attempts => {
                    tracing::warn!(key, op, error = %e, "storage operation failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Self::MAX_DELAY);
                    tries += 1;
                }
                answer => return answer,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn unavailable() -> StorageError {
        StorageError::Unavailable {
            op: "get",
            key: "k".into(),
            message: "connection refused".into(),
        }
    }

    #[tokio::test]
    async fn an_unavailable_store_is_tried_again_with_doubling_delays() {
        let tries = AtomicU32::new(0);
        let started = std::time::Instant::now();
        let result: Result<(), _> = Retries::attempts(3)
            .run("get", "k", || async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err(unavailable())
            })
            .await;
        assert!(matches!(result, Err(StorageError::Unavailable { .. })));
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        // 200 and 400 ms between the three attempts.
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(600), "{waited:?}");
    }

    #[tokio::test]
    async fn an_answer_is_final_at_once_and_a_recovered_store_answers() {
        let tries = AtomicU32::new(0);
        let result: Result<(), _> = Retries::DEFAULT
            .run("get", "k", || async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err(StorageError::NotFound { key: "k".into() })
            })
            .await;
        assert!(matches!(result, Err(StorageError::NotFound { .. })));
        assert_eq!(tries.load(Ordering::SeqCst), 1, "not found is an answer");

        let tries = AtomicU32::new(0);
        let result = Retries::DEFAULT
            .run("get", "k", || async {
                match tries.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(unavailable()),
                    _ => Ok(7),
                }
            })
            .await;
        assert_eq!(result.unwrap(), 7);
        assert_eq!(
            Retries::attempts(0),
            Retries::attempts(1),
            "at least one try"
        );
    }
}
