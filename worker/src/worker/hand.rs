//! The jobs in hand: the unsettled jobs of the messages being handled (up to `prefetch` of them at
//! once, so that one message's inputs are fetched and the last one's outputs stored while another
//! runs on the engine), each with its cancellation flag, which of them are on the engine now, and the cancelled job ids remembered (the last
//! [`CANCELLED_MEMORY`]) to skip a job that arrives after its cancel. One lock over all of it, so a
//! cancel cannot slip between a job's check against the remembered ids and its taking in hand.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use vnfarm_proto::JobId;

use crate::engine::{Cancel, CancelReason};

/// How many cancelled job ids a worker remembers (to skip them if they arrive later).
const CANCELLED_MEMORY: usize = 10_000;

#[derive(Default)]
pub struct Hand(Mutex<Jobs>);

#[derive(Default)]
struct Jobs {
    /// The unsettled jobs of the messages in hand, with their cancellation flags.
    in_hand: Vec<(JobId, Cancel)>,
    /// Those of them on the engine now (or waiting on its channel).
    running: Vec<JobId>,
    cancelled: Remembered,
}

/// The last [`CANCELLED_MEMORY`] cancelled job ids; the oldest is forgotten first.
#[derive(Default)]
struct Remembered {
    ids: HashSet<JobId>,
    order: VecDeque<JobId>,
}

impl Remembered {
    fn insert(&mut self, job_id: JobId) {
        if self.ids.insert(job_id) {
            self.order.push_back(job_id);
            if self.order.len() > CANCELLED_MEMORY
                && let Some(old) = self.order.pop_front()
            {
                self.ids.remove(&old);
            }
        }
    }

    fn contains(&self, job_id: &JobId) -> bool {
        self.ids.contains(job_id)
    }
}

impl Hand {
    fn lock(&self) -> std::sync::MutexGuard<'_, Jobs> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The jobs on the engine now.
    pub fn running(&self) -> Vec<JobId> {
        self.lock().running.clone()
    }

    /// The unsettled jobs of the messages in hand.
    pub fn jobs(&self) -> Vec<JobId> {
        self.lock().in_hand.iter().map(|(id, _)| *id).collect()
    }

    /// Takes the jobs of a message in hand, beside those of the other messages in hand, each with a
    /// fresh cancellation flag (already raised for a job cancelled before it came).
    pub(crate) fn take(&self, jobs: &[JobId]) -> Vec<Cancel> {
        let mut hand = self.lock();
        let cancels: Vec<Cancel> = jobs
            .iter()
            .map(|id| {
                let cancel = Cancel::default();
                if hand.cancelled.contains(id) {
                    cancel.request(CancelReason::User);
                }
                cancel
            })
            .collect();
        hand.in_hand
            .extend(jobs.iter().copied().zip(cancels.iter().cloned()));
        cancels
    }

    /// A message in hand is settled (or abandoned): its jobs leave the hand.
    pub(crate) fn release(&self, jobs: &[JobId]) {
        let mut hand = self.lock();
        hand.in_hand.retain(|(id, _)| !jobs.contains(id));
        hand.running.retain(|id| !jobs.contains(id));
    }

    /// A job of the message in hand is settled.
    pub(crate) fn settled(&self, job_id: JobId) {
        let mut hand = self.lock();
        hand.in_hand.retain(|(id, _)| *id != job_id);
        hand.running.retain(|id| *id != job_id);
    }

    /// These jobs of a message in hand are on the engine now.
    pub(crate) fn add_running(&self, running: &[JobId]) {
        self.lock().running.extend_from_slice(running);
    }

    /// The engine has answered this job.
    pub(crate) fn off_engine(&self, job_id: JobId) {
        self.lock().running.retain(|id| *id != job_id);
    }

    /// The scheduler asks for these jobs back, should they not have started on the engine (to make
    /// room for interactive work): the engine host gives back those whose run has not begun. Jobs
    /// not in hand here are not this worker's: ignored. Returns how many are in hand.
    pub fn yield_jobs(&self, jobs: &[JobId]) -> usize {
        let hand = self.lock();
        let mut asked = 0;
        for (id, cancel) in &hand.in_hand {
            if jobs.contains(id) {
                cancel.request_yield();
                asked += 1;
            }
        }
        asked
    }

    /// Records a cancellation; stops the job if it is in hand here.
    pub fn cancel(&self, job_id: JobId) {
        let mut hand = self.lock();
        hand.cancelled.insert(job_id);
        for (id, cancel) in &hand.in_hand {
            if *id == job_id {
                cancel.request(CancelReason::User);
            }
        }
    }

    pub fn is_cancelled(&self, job_id: JobId) -> bool {
        self.lock().cancelled.contains(&job_id)
    }

    /// Interrupts the jobs in hand so that they go back to the queue (shutdown past the grace
    /// period).
    pub fn interrupt_for_shutdown(&self) {
        for (_, cancel) in &self.lock().in_hand {
            cancel.request(CancelReason::Shutdown);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<JobId> {
        (0..n).map(|_| JobId::new()).collect()
    }

    #[test]
    fn a_job_cancelled_before_it_came_is_taken_with_its_flag_raised() {
        let hand = Hand::default();
        let jobs = ids(2);
        hand.cancel(jobs[1]);
        let cancels = hand.take(&jobs);
        assert_eq!(cancels[0].requested(), None);
        assert_eq!(cancels[1].requested(), Some(CancelReason::User));
        assert_eq!(hand.jobs(), jobs);
    }

    #[test]
    fn a_settled_job_leaves_the_hand_and_the_engine() {
        let hand = Hand::default();
        let jobs = ids(3);
        hand.take(&jobs);
        hand.add_running(&jobs[..2]);
        hand.settled(jobs[0]);
        assert_eq!(hand.jobs(), jobs[1..]);
        assert_eq!(hand.running(), [jobs[1]]);
        hand.off_engine(jobs[1]);
        assert!(hand.running().is_empty());
        hand.release(&jobs);
        assert!(hand.jobs().is_empty());
    }

    #[test]
    fn two_messages_in_hand_are_released_each_on_its_own() {
        let hand = Hand::default();
        let first = ids(2);
        let second = ids(1);
        let first_cancels = hand.take(&first);
        let second_cancels = hand.take(&second);
        hand.add_running(&first);
        assert_eq!(hand.jobs(), [first.clone(), second.clone()].concat());
        hand.cancel(second[0]);
        assert_eq!(second_cancels[0].requested(), Some(CancelReason::User));
        assert_eq!(first_cancels[0].requested(), None);
        hand.release(&first);
        assert_eq!(hand.jobs(), second);
        assert!(hand.running().is_empty());
    }

    #[test]
    fn only_jobs_in_hand_are_yielded_cancelled_or_interrupted() {
        let hand = Hand::default();
        let jobs = ids(3);
        let cancels = hand.take(&jobs[..2]);
        assert_eq!(hand.yield_jobs(&[jobs[1], jobs[2]]), 1);
        assert!(!cancels[0].yield_requested());
        assert!(cancels[1].yield_requested());
        hand.cancel(jobs[2]);
        assert_eq!(cancels[0].requested(), None);
        hand.interrupt_for_shutdown();
        assert_eq!(cancels[0].requested(), Some(CancelReason::Shutdown));
    }

    #[test]
    fn the_oldest_cancellation_is_forgotten_first() {
        let hand = Hand::default();
        let jobs = ids(CANCELLED_MEMORY + 1);
        for id in &jobs {
            hand.cancel(*id);
        }
        // Once more: already remembered, so it does not push the oldest out again.
        hand.cancel(jobs[CANCELLED_MEMORY]);
        assert!(!hand.is_cancelled(jobs[0]));
        assert!(hand.is_cancelled(jobs[1]));
        assert!(hand.is_cancelled(jobs[CANCELLED_MEMORY]));
    }
}
