//! A job's cancellation flag, shared between the async side and the engine thread, and the rule for
//! work that several jobs share.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::error::{CancelReason, EngineError};

/// A cancellation flag shared between the async side and the engine thread, with a separate flag
/// for a yield: the scheduler asked for the job back if it has not started yet. Engines never see
/// a yield (a job on the engine runs to its end); the engine host checks it between the runs of a
/// message.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicU8>);

/// The bit of [`Cancel`] that records a yield request; the low bits hold the cancel reason.
const YIELD_BIT: u8 = 0x10;

impl Cancel {
    pub fn request(&self, reason: CancelReason) {
        let code = match reason {
            CancelReason::User => 1,
            CancelReason::Shutdown => 2,
        };
        // Keep the first reason: a user cancel is not turned into a requeue.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                (now & !YIELD_BIT == 0).then_some(now | code)
            });
    }

    pub fn requested(&self) -> Option<CancelReason> {
        match self.0.load(Ordering::SeqCst) & !YIELD_BIT {
            0 => None,
            1 => Some(CancelReason::User),
            _ => Some(CancelReason::Shutdown),
        }
    }

    /// The scheduler asks for the job back, should it not have started.
    pub fn request_yield(&self) {
        self.0.fetch_or(YIELD_BIT, Ordering::SeqCst);
    }

    /// A yield was asked for and no cancel (which wins: it settles the job for good).
    pub fn yield_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) == YIELD_BIT
    }

    /// `Err(Cancelled)` when cancellation was requested; engines call it between steps.
    pub fn check(&self) -> Result<(), EngineError> {
        match self.requested() {
            Some(reason) => Err(EngineError::Cancelled(reason)),
            None => Ok(()),
        }
    }
}

/// Whether work that jobs share should stop: only when every one of them was cancelled (a job
/// cancelled alone rides along and its result is discarded). Shutdown reaches every job at once.
pub fn all_cancelled<'a>(cancels: impl IntoIterator<Item = &'a Cancel>) -> Option<CancelReason> {
    let mut reason = None;
    for cancel in cancels {
        match (cancel.requested(), reason) {
            (None, _) => return None,
            (Some(CancelReason::Shutdown), _) => reason = Some(CancelReason::Shutdown),
            (Some(CancelReason::User), None) => reason = Some(CancelReason::User),
            (Some(CancelReason::User), Some(_)) => {}
        }
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_yield_is_no_cancel_and_a_cancel_overrides_it() {
        let c = Cancel::default();
        c.request_yield();
        assert!(c.yield_requested());
        assert_eq!(c.requested(), None, "engines never see a yield");
        assert!(c.check().is_ok());
        c.request(CancelReason::User);
        assert_eq!(c.requested(), Some(CancelReason::User));
        assert!(
            !c.yield_requested(),
            "a cancelled job is settled as cancelled, not given back"
        );
        let c = Cancel::default();
        c.request(CancelReason::Shutdown);
        c.request_yield();
        assert_eq!(c.requested(), Some(CancelReason::Shutdown));
        assert!(!c.yield_requested());
    }

    #[test]
    fn shared_work_stops_only_when_every_job_is_cancelled() {
        let (a, b) = (Cancel::default(), Cancel::default());
        assert_eq!(all_cancelled([&a, &b]), None);
        a.request(CancelReason::User);
        assert_eq!(all_cancelled([&a, &b]), None);
        b.request(CancelReason::User);
        assert_eq!(all_cancelled([&a, &b]), Some(CancelReason::User));
        let c = Cancel::default();
        c.request(CancelReason::Shutdown);
        assert_eq!(all_cancelled([&a, &c]), Some(CancelReason::Shutdown));
    }
}
