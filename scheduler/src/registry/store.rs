//! The indexes the decisions use, kept right by bracketing every change of a job.

use std::sync::Arc;
use std::time::Instant;

use vnfarm_proto::JobId;

use super::Registry;
use super::record::{JobState, Local};

impl Registry {
    /// Removes a job from the indexes its current state puts it in. Every change of a job is
    /// bracketed by `index_out` and [`Registry::index_in`].
    pub(super) fn index_out(&mut self, id: JobId) {
        let job = &self.jobs[&id];
        let (state, model, priority, rank) = (job.state, job.model(), job.priority(), job.rank());
        let awaiting = job.awaiting_start();
        let waiting = job
            .waiting()
            .then(|| (job.route(), job.group_key(), job.local.hold_until));
        if let Some(n) = self.counts.get_mut(&state) {
            *n = n.saturating_sub(1);
        }
        if let (JobState::Queued, Some(m)) = (state, model)
            && let Some(n) = self.backlog.get_mut(&(m, priority))
        {
            *n = n.saturating_sub(1);
        }
        if let Some((route, key, hold)) = waiting {
            match (hold, route) {
                (Some(until), _) => {
                    self.holds.remove(&(until, id));
                }
                (None, Some(route)) => {
                    if let Some(set) = self.ready.get_mut(&route) {
                        set.remove(&rank);
                        if set.is_empty() {
                            self.ready.remove(&route);
                        }
                    }
                }
                (None, None) => {}
            }
            if let Some(key) = key
                && let Some(set) = self.groups.get_mut(&key)
            {
                set.remove(&rank);
                if set.is_empty() {
                    self.groups.remove(&key);
                }
            }
        }
        if awaiting {
            self.awaiting_start.remove(&id);
        }
    }

    pub(super) fn index_in(&mut self, id: JobId) {
        let job = &self.jobs[&id];
        let (state, model, priority, rank) = (job.state, job.model(), job.priority(), job.rank());
        let awaiting = job.awaiting_start();
        let waiting = job
            .waiting()
            .then(|| (job.route(), job.group_key(), job.local.hold_until));
        *self.counts.entry(state).or_default() += 1;
        if let (JobState::Queued, Some(m)) = (state, model) {
            *self.backlog.entry((m, priority)).or_default() += 1;
        }
        if let Some((route, key, hold)) = waiting {
            match (hold, route) {
                (Some(until), _) => {
                    self.holds.insert((until, id));
                }
                (None, Some(route)) => {
                    self.ready.entry(route).or_default().insert(rank);
                }
                (None, None) => {}
            }
            if let Some(key) = key {
                self.groups.entry(key).or_default().insert(rank);
            }
            self.waiting_since.entry(id).or_insert_with(Instant::now);
        } else {
            self.waiting_since.remove(&id);
        }
        if awaiting {
            self.awaiting_start.insert(id);
        }
    }

    /// Changes a job's local decision flags, keeping the indexes right.
    pub(super) fn set_local(&mut self, id: JobId, f: impl FnOnce(&mut Local)) {
        self.index_out(id);
        f(&mut Arc::make_mut(self.jobs.get_mut(&id).expect("a known job")).local);
        self.index_in(id);
    }
}
