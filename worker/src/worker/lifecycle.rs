//! The worker's lifecycle, which its heartbeats report: `warming` until the engine is loaded and
//! warm, `ready` from then on, `draining` from shutdown on. Draining is for good: an engine that
//! finishes loading after shutdown began leaves the worker draining. Being warm is kept apart from
//! the state, because a session waits for it before it takes jobs.

use std::sync::Mutex;

use tokio_util::sync::CancellationToken;
use vnfarm_proto::WorkerState;

pub struct Lifecycle {
    state: Mutex<WorkerState>,
    /// Cancelled once the engine is loaded and warm.
    warm: CancellationToken,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            state: Mutex::new(WorkerState::Warming),
            warm: CancellationToken::new(),
        }
    }
}

impl Lifecycle {
    fn lock(&self) -> std::sync::MutexGuard<'_, WorkerState> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn state(&self) -> WorkerState {
        *self.lock()
    }

    /// Starts draining: no new jobs, and the heartbeat says so.
    pub fn drain(&self) {
        *self.lock() = WorkerState::Draining;
    }

    /// The engine is loaded and warm: ready for jobs, unless already draining.
    pub fn engine_ready(&self) {
        {
            let mut state = self.lock();
            if *state == WorkerState::Warming {
                *state = WorkerState::Ready;
            }
        }
        self.warm.cancel();
    }

    /// Whether the engine is loaded and warm (also when draining).
    pub fn is_warm(&self) -> bool {
        self.warm.is_cancelled()
    }

    /// Resolves once the engine is loaded and warm (at once if it is).
    pub async fn warm(&self) {
        self.warm.cancelled().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn warming_then_ready_then_draining() {
        let life = Lifecycle::default();
        assert_eq!(life.state(), WorkerState::Warming);
        assert!(!life.is_warm());
        life.engine_ready();
        life.warm().await;
        assert_eq!(life.state(), WorkerState::Ready);
        life.drain();
        assert_eq!(life.state(), WorkerState::Draining);
        assert!(life.is_warm());
    }

    #[test]
    fn an_engine_warm_after_shutdown_began_leaves_the_worker_draining() {
        let life = Lifecycle::default();
        life.drain();
        life.engine_ready();
        assert_eq!(life.state(), WorkerState::Draining);
        assert!(life.is_warm());
    }
}
