//! The device-loss latch: set by the first failure that shows the GPU is gone (an engine error
//! classified `DeviceLost`), never cleared. Once set, the worker drains like on a SIGTERM and exits
//! with the first reason, so that a supervisor restarts it with a fresh device context.

use std::future::Future;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

#[derive(Default)]
pub struct DeviceLoss {
    /// Cancelled when the latch is set.
    latched: CancellationToken,
    /// The first reason given; later ones are logged, not kept.
    reason: Mutex<Option<String>>,
}

impl DeviceLoss {
    /// The device failed: stop taking jobs and exit with an error once the job in hand is given
    /// back.
    pub fn latch(&self, reason: &str) {
        tracing::error!(%reason, "device failure: this worker stops taking jobs and exits");
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| reason.to_owned());
        self.latched.cancel();
    }

    /// Resolves once the latch is set (at once if it already is).
    pub fn latched(&self) -> impl Future<Output = ()> + Send + 'static {
        self.latched.clone().cancelled_owned()
    }

    /// Why the worker must exit with an error, if it must.
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_reason_is_kept_and_the_latch_stays_set() {
        let loss = DeviceLoss::default();
        assert_eq!(loss.reason(), None);
        let latched = loss.latched();
        loss.latch("CUDA error: an illegal memory access");
        loss.latch("CUDA error: device-side assert");
        latched.await;
        loss.latched().await;
        assert_eq!(
            loss.reason().as_deref(),
            Some("CUDA error: an illegal memory access")
        );
    }
}
