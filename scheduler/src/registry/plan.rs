//! The dispatch policy (DESIGN §5): which waiting jobs go to which worker, in which messages.
//!
//! Decisions are taken on the registry's indexes, never by scanning the backlog: the ready index
//! per route (interactive first, then oldest), the groups of waiting jobs that may share a message
//! (edits of the same inputs, by [`vnfarm_proto::Task::affinity_key`]; compatible generates), the
//! holds (edits waiting for the busy worker that holds their input's encodings) by expiry, and per
//! worker its load, its free slots and the affinity keys it holds. A plan costs O(dispatches ×
//! workers × keys per worker).
//!
//! With the `affinity` policy, after SGLang's cache-aware router (Apache-2.0; the rule, not its
//! code):
//! 1. A worker with a free slot first takes the waiting edits of inputs it holds, as one batch
//!    (up to `max_batch` and the worker's own limit), once the coalescing window of the group's
//!    first job has passed or the batch is full, unless they are batch work and interactive work
//!    it could run waits. A holder loaded far beyond the least-loaded
//!    worker of the model (`imbalance_abs` and `imbalance_rel`) takes nothing by affinity.
//! 2. Then the next job by priority (interactive first, at most `INTERACTIVE_BURST` in a row while
//!    batch work waits). A batch edit whose input a busy worker holds waits for it (a *hold*)
//!    while the free workers have other work to take, up to `affinity_wait_ms`, unless
//!    `spill_after` edits of that input wait (a hot input: a second worker takes some) or every
//!    holder is overloaded. Interactive edits are never held: priority means a free worker runs
//!    them now rather than batch work. Otherwise it goes to the least-loaded worker, with the
//!    waiting jobs of its group; that worker now holds the input.
//! 3. Dispatch is work-conserving: a worker that would otherwise idle takes a held edit (a second
//!    encode of its input costs a fraction of an edit; idling costs the whole edit).
//!
//! `least_loaded` and `round_robin` send one job per message, as the baselines the fleet
//! benchmark compares against.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{NaiveDate, Utc};
use vnfarm_proto::{JobId, ModelFamily, WorkerId};

use super::shares::Held;
use super::store::Queues;
use super::{INTERACTIVE_BURST, JobRecord, Registry, Route, WorkerRecord};
use crate::config::{DispatchConfig, Policy};

/// A waiting job's turn: its class (0 interactive), its move to the front (see
/// [`JobRecord::queue_key`]), its owner's jobs on workers, when its owner was last served (the
/// offset of their latest `dispatched` event), its id (age).
type Turn = (u8, u64, usize, u64, JobId);

/// What one plan needs for fair share: the limits, and the day a quota counts.
struct Turns<'a> {
    config: &'a DispatchConfig,
    today: NaiveDate,
}

/// The jobs of a group that may share a message led by a job of `lead_rank`, in order: a message
/// led by interactive work carries only interactive work (batch work behind it would keep the
/// worker from the next interactive arrival, and such a message is never asked to yield).
fn companions(
    group: &std::collections::BTreeSet<(u8, JobId)>,
    lead_rank: u8,
) -> impl Iterator<Item = JobId> + '_ {
    group
        .iter()
        .take_while(move |(rank, _)| lead_rank > 0 || *rank == 0)
        .map(|(_, id)| *id)
}

/// Jobs for one message to one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    pub worker: WorkerId,
    /// At least one; the first names the message.
    pub jobs: Vec<JobId>,
    pub decision: Decision,
}

/// Why a worker was chosen (the `decision` label of the dispatch metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The worker holds the input's encodings.
    AffinityHit,
    /// No worker holds the input: the least-loaded one takes it (and now holds it).
    AffinityMiss,
    /// Many edits of a hot input wait: a second worker takes some.
    AffinitySpill,
    /// The holder did not free a slot within `affinity_wait_ms`.
    AffinityWaitExpired,
    /// Every holder is loaded far beyond the least-loaded worker.
    AffinityImbalance,
    /// Held for a busy holder, taken by a worker that had nothing else to do.
    AffinityIdle,
    /// An interactive edit whose holders are all busy: a free worker runs it now.
    AffinityInteractive,
    LeastLoaded,
    RoundRobin,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::AffinityHit => "affinity_hit",
            Decision::AffinityMiss => "affinity_miss",
            Decision::AffinitySpill => "affinity_spill",
            Decision::AffinityWaitExpired => "affinity_wait_expired",
            Decision::AffinityImbalance => "affinity_imbalance",
            Decision::AffinityIdle => "affinity_idle",
            Decision::AffinityInteractive => "affinity_interactive",
            Decision::LeastLoaded => "least_loaded",
            Decision::RoundRobin => "round_robin",
        }
    }
}

/// A worker asked for the unstarted jobs of one of its messages back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Yield {
    pub worker: WorkerId,
    /// The message's jobs still on the worker; it keeps the one its engine runs.
    pub jobs: Vec<JobId>,
}

/// What a plan decided, and when planning again may decide more (a hold expires, a coalescing
/// window closes) even if nothing else happens.
#[derive(Debug, Default)]
pub struct Plan {
    pub dispatches: Vec<Dispatch>,
    pub yields: Vec<Yield>,
    pub wake_at: Option<Instant>,
}

impl Plan {
    fn wake(&mut self, at: Instant) {
        self.wake_at = Some(self.wake_at.map_or(at, |w| w.min(at)));
    }
}

enum Placement {
    Send(Dispatch),
    Hold(Instant),
}

impl Registry {
    /// Plans every dispatch possible now. Jobs planned are pending until their `dispatched`
    /// events come back (or [`Registry::dispatch_failed`]).
    pub fn plan_dispatch(
        &mut self,
        config: &DispatchConfig,
        now: Instant,
        heartbeat_timeout: Duration,
    ) -> Plan {
        self.release_holds(now);
        let mut plan = Plan::default();
        if self.shares.farm_paused().is_some() {
            // Nothing starts; a resume's event wakes the dispatcher.
            return plan;
        }
        let today = Utc::now().date_naive();
        let turns = Turns { config, today };
        loop {
            if config.policy == Policy::Affinity
                && let Some(d) = self.affinity_batch(&turns, now, heartbeat_timeout, &mut plan)
            {
                self.commit(&d, now);
                plan.dispatches.push(d);
                continue;
            }
            let Some((id, route, batch_waits)) = self.next_head(&turns, heartbeat_timeout) else {
                if self.release_hold_to_idle(&turns, heartbeat_timeout) {
                    continue;
                }
                break;
            };
            match self.place(id, &route, &turns, now, heartbeat_timeout) {
                Placement::Hold(until) => {
                    self.set_local(id, |l| l.hold_until = Some(until));
                    plan.wake(until);
                }
                Placement::Send(d) => {
                    let interactive = self.jobs[&id].rank().0 == 0;
                    self.interactive_streak = if interactive && batch_waits {
                        self.interactive_streak + 1
                    } else {
                        0
                    };
                    self.commit(&d, now);
                    plan.dispatches.push(d);
                }
            }
        }
        if config.policy == Policy::Affinity && config.max_batch > 1 {
            plan.yields = self.plan_yields(&turns, heartbeat_timeout);
        }
        if let Some(&(until, _)) = self.jobs.holds().first() {
            plan.wake(until);
        }
        if self.quota_waits(&turns) {
            // A quota counts again from midnight (UTC).
            let midnight = (today + chrono::Days::new(1)).and_time(chrono::NaiveTime::MIN);
            let left = (midnight.and_utc() - Utc::now())
                .to_std()
                .unwrap_or_default();
            plan.wake(now + left + Duration::from_secs(1));
        }
        plan
    }

    /// Whether someone's waiting work waits for their quota to count again.
    fn quota_waits(&self, turns: &Turns) -> bool {
        self.jobs.ready().values().any(|queues| {
            queues.keys().any(|owner| {
                matches!(
                    self.held(owner, turns.config, turns.today),
                    Some(Held::Quota { .. })
                )
            })
        })
    }

    /// The heads of a route's queues whose owners may start work now: each such owner's first
    /// interactive job and first batch job, by their turn.
    fn heads<'a>(
        &'a self,
        queues: &'a Queues,
        turns: &'a Turns,
    ) -> impl Iterator<Item = Turn> + 'a {
        queues
            .iter()
            .filter(|(owner, _)| self.held(owner, turns.config, turns.today).is_none())
            .flat_map(|(owner, queue)| {
                let running = self.jobs.running(owner);
                let served = self.shares.served(owner);
                [
                    queue.first().filter(|k| k.0 == 0),
                    queue.range((1, 0, JobId(uuid::Uuid::nil()))..).next(),
                ]
                .into_iter()
                .flatten()
                .map(move |&(class, front, id)| (class, front, running, served, id))
            })
    }

    /// A job's turn, as [`Registry::heads`] keys it.
    fn turn_of(&self, id: JobId) -> Turn {
        let job = &self.jobs[&id];
        let (class, front, id) = job.queue_key();
        let owner = job.owner();
        (
            class,
            front,
            self.jobs.running(owner),
            self.shares.served(owner),
            id,
        )
    }

    /// `lead`, then the others of `ids` that are its owner's, then the rest, each in order: a
    /// message carries its lead's owner's compatible work before anyone else's.
    fn owner_first(
        &self,
        lead: JobId,
        ids: impl Iterator<Item = JobId>,
    ) -> impl Iterator<Item = JobId> {
        let owner = self.jobs[&lead].owner();
        let (mut same, others): (Vec<JobId>, Vec<JobId>) = ids
            .filter(|id| *id != lead)
            .partition(|id| self.jobs[id].owner() == owner);
        same.insert(0, lead);
        same.into_iter().chain(others)
    }

    /// The jobs among `ids` that may go now, in order and at most `max`: those whose owners'
    /// work may start, and none beyond its owner's cap counting the ones taken before it.
    fn admit(&self, ids: impl Iterator<Item = JobId>, max: usize, turns: &Turns) -> Vec<JobId> {
        let mut taken: HashMap<&str, usize> = HashMap::new();
        let mut admitted = Vec::new();
        for id in ids {
            if admitted.len() == max {
                break;
            }
            let owner = self.jobs[&id].owner();
            let before = taken.get(owner).copied().unwrap_or(0);
            let may = if before == 0 {
                self.held(owner, turns.config, turns.today).is_none()
            } else {
                turns
                    .config
                    .limits_of(owner)
                    .max_running
                    .is_none_or(|cap| self.jobs.running(owner) + before < cap as usize)
            };
            if may {
                *taken.entry(owner).or_default() += 1;
                admitted.push(id);
            }
        }
        admitted
    }

    /// Interactive work that no free worker can take: a busy worker of its route, in a message of
    /// batch work with unstarted jobs left, is asked to give those back, so that it frees up after
    /// the job its engine runs rather than after the whole message (the jobs given back wait for
    /// it as their input's holder, and keep their encoding). A worker holding the input of a waiting
    /// interactive edit goes first, then the message with the fewest jobs left (as few as possible
    /// move); at most one yield is outstanding per waiting interactive job.
    fn plan_yields(&mut self, turns: &Turns, timeout: Duration) -> Vec<Yield> {
        let mut yields = Vec::new();
        for (route, queues) in self.jobs.ready() {
            // The waiting interactive jobs of the people whose work may start now.
            let interactive: Vec<JobId> = queues
                .iter()
                .filter(|(owner, _)| self.held(owner, turns.config, turns.today).is_none())
                .flat_map(|(_, queue)| queue.iter().take_while(|k| k.0 == 0).map(|k| k.2))
                .collect();
            let waiting = interactive.len();
            if waiting == 0 || self.workers.values().any(|w| w.can_take(route, timeout)) {
                continue;
            }
            let serving: Vec<&WorkerRecord> = self
                .workers
                .values()
                .filter(|w| w.serves(route, timeout))
                .collect();
            let outstanding: usize = serving.iter().map(|w| w.yields.len()).sum();
            // The inputs the waiting interactive edits need: a worker that holds one frees up
            // for it with its encoding at hand.
            let wanted_keys: Vec<String> = interactive
                .iter()
                .filter_map(|id| self.jobs[id].group_key())
                .collect();
            let holds_wanted = |w: &WorkerRecord| wanted_keys.iter().any(|k| w.holds(k));
            let mut candidates: Vec<(usize, &WorkerRecord, Vec<JobId>)> = serving
                .iter()
                .flat_map(|w| {
                    w.messages
                        .keys()
                        .filter(|lead| !w.yields.contains(lead))
                        .map(move |&lead| (lead, w))
                })
                .filter_map(|(lead, w)| {
                    let jobs: Vec<JobId> = w.jobs_of(lead).collect();
                    let batch_work = jobs
                        .iter()
                        .all(|j| self.jobs.get(j).is_some_and(|job| job.rank().0 > 0));
                    (jobs.len() >= 2 && batch_work).then_some((jobs.len(), *w, jobs))
                })
                .collect();
            candidates.sort_by(|a, b| {
                (holds_wanted(b.1), a.0)
                    .cmp(&(holds_wanted(a.1), b.0))
                    .then_with(|| a.1.id.cmp(&b.1.id))
            });
            yields.extend(
                candidates
                    .into_iter()
                    .take(waiting.saturating_sub(outstanding))
                    .map(|(_, w, jobs)| Yield {
                        worker: w.id.clone(),
                        jobs,
                    }),
            );
        }
        for y in &yields {
            let lead = self.workers[&y.worker].assigned[&y.jobs[0]];
            self.worker_mut(&y.worker).yields.insert(lead);
        }
        yields
    }

    /// Held jobs whose wait is over go back to the ready index, not to be held again.
    fn release_holds(&mut self, now: Instant) {
        while let Some(&(until, id)) = self.jobs.holds().first() {
            if until > now {
                break;
            }
            self.set_local(id, |l| {
                l.hold_until = None;
                l.hold_expired = true;
            });
        }
    }

    /// Work conservation: when no ready job is left for a free worker, the oldest held job that a
    /// free worker serves goes back to the ready index, marked to go to a non-holder. Whether any
    /// worker is free is checked first, so a saturated farm pays nothing for its holds.
    fn release_hold_to_idle(&mut self, turns: &Turns, timeout: Duration) -> bool {
        if !self.workers.values().any(WorkerRecord::has_slot) {
            return false;
        }
        // A job whose holder is free waits only for its coalescing window: not released.
        let found = self.jobs.holds().iter().map(|&(_, id)| id).find(|id| {
            let job = &self.jobs[id];
            let Some(route) = job.route() else {
                return false;
            };
            if self.held(job.owner(), turns.config, turns.today).is_some() {
                return false;
            }
            let key = job.group_key();
            let free: Vec<&WorkerRecord> = self
                .workers
                .values()
                .filter(|w| w.can_take(&route, timeout))
                .collect();
            !free.is_empty()
                && !free
                    .iter()
                    .any(|w| key.as_deref().is_some_and(|k| w.holds(k)))
        });
        let Some(id) = found else {
            return false;
        };
        self.set_local(id, |l| {
            l.hold_until = None;
            l.hold_expired = true;
            l.idle_release = true;
        });
        true
    }

    /// The next job by its turn among routes that a worker with a free slot serves, and whether
    /// batch work was among the candidates (for starvation freedom). A turn is, in order: the
    /// job's class (interactive first), a move to the front (the latest first), its owner's jobs
    /// on workers now (the fewest first) and when they were last served (longest ago first): a
    /// round by person; then its age.
    fn next_head(&self, turns: &Turns, timeout: Duration) -> Option<(JobId, Route, bool)> {
        let mut candidates: Vec<(Turn, &Route)> = Vec::new();
        for (route, queues) in self.jobs.ready() {
            if !self.workers.values().any(|w| w.can_take(route, timeout)) {
                continue;
            }
            candidates.extend(self.heads(queues, turns).map(|t| (t, route)));
        }
        let batch_waits = candidates.iter().any(|(t, _)| t.0 == 1);
        let batch_turn = batch_waits && self.interactive_streak >= INTERACTIVE_BURST;
        candidates
            .into_iter()
            .filter(|(t, _)| !batch_turn || t.0 == 1)
            .min_by_key(|(t, _)| *t)
            .map(|(t, route)| (t.4, route.clone(), batch_waits))
    }

    /// The best turn among the waiting work this worker could run (see [`Registry::next_head`]).
    fn best_turn_for(&self, w: &WorkerRecord, turns: &Turns, timeout: Duration) -> Option<Turn> {
        self.jobs
            .ready()
            .iter()
            .filter(|(route, _)| w.serves(route, timeout))
            .flat_map(|(_, queues)| self.heads(queues, turns))
            .min()
    }

    /// Step 1 of the affinity policy: a free worker takes waiting edits of an input it holds, when
    /// it is their turn: no waiting work it could run has a better one (interactive work, a job
    /// moved to the front, or a person with fewer jobs on workers goes first; affinity only
    /// breaks ties of turn, and never takes a person's work past their cap).
    fn affinity_batch(
        &self,
        turns: &Turns,
        now: Instant,
        timeout: Duration,
        plan: &mut Plan,
    ) -> Option<Dispatch> {
        let config = turns.config;
        let window = Duration::from_millis(config.coalesce_window_ms);
        let mut free: Vec<&WorkerRecord> = self
            .workers
            .values()
            .filter(|w| w.has_slot() && !w.keys.is_empty())
            .collect();
        free.sort_by_key(|w| (w.load(), w.id.clone()));
        for w in free {
            let best = self.best_turn_for(w, turns, timeout);
            for key in w.keys.keys() {
                let Some(group) = self.jobs.group(key) else {
                    continue;
                };
                let max = config.max_batch.min(w.max_batch()) as usize;
                // The first of the group whose owner's work may start leads it.
                let Some(&(lead_rank, lead)) = group.iter().find(|(_, id)| {
                    self.held(self.jobs[id].owner(), config, turns.today)
                        .is_none()
                }) else {
                    continue;
                };
                let jobs = self.admit(
                    self.owner_first(lead, companions(group, lead_rank)),
                    max,
                    turns,
                );
                let Some(&first) = jobs.first() else {
                    continue;
                };
                let Some(route) = self.jobs[&first].route() else {
                    continue;
                };
                if !w.serves(&route, timeout) || self.overloaded(w, &route, config, timeout) {
                    continue;
                }
                let turn = self.turn_of(first);
                if best.is_some_and(|b| (b.0, b.1, b.2, b.3) < (turn.0, turn.1, turn.2, turn.3)) {
                    continue;
                }
                let since = self.jobs.waiting_since(&first).unwrap_or(now);
                if jobs.len() < max && since + window > now {
                    plan.wake(since + window);
                    continue;
                }
                return Some(Dispatch {
                    worker: w.id.clone(),
                    jobs,
                    decision: Decision::AffinityHit,
                });
            }
        }
        None
    }

    /// Where the next job by priority goes, or how long it waits for its input's holder.
    fn place(
        &self,
        id: JobId,
        route: &Route,
        turns: &Turns,
        now: Instant,
        timeout: Duration,
    ) -> Placement {
        let config = turns.config;
        let eligible: Vec<&WorkerRecord> = self
            .workers
            .values()
            .filter(|w| w.can_take(route, timeout))
            .collect();
        // The fewest of the job's catalogue files to fetch first, then the least load.
        let job = &self.jobs[&id];
        let least_loaded = |among: &[&WorkerRecord]| {
            among
                .iter()
                .min_by_key(|w| (self.files_to_fetch(w, job), w.load(), w.id.clone()))
                .map(|w| w.id.clone())
        };
        let single = |worker: WorkerId, decision| {
            Placement::Send(Dispatch {
                worker,
                jobs: vec![id],
                decision,
            })
        };
        let Some(fallback) = least_loaded(&eligible) else {
            unreachable!("next_head only offers routes a free worker serves")
        };
        match config.policy {
            Policy::RoundRobin => {
                let next = eligible
                    .iter()
                    .find(|w| self.rr_cursor.as_ref().is_none_or(|c| w.id > *c))
                    .or(eligible.first())
                    .map_or(fallback, |w| w.id.clone());
                single(next, Decision::RoundRobin)
            }
            Policy::LeastLoaded => single(fallback, Decision::LeastLoaded),
            Policy::Affinity => {
                let Some(key) = job.group_key() else {
                    return single(fallback, Decision::LeastLoaded);
                };
                let group_len = self.jobs.group(&key).map_or(1, |g| g.len());
                let (worker, decision) = if route.model == ModelFamily::QwenEdit {
                    let holders: Vec<&WorkerRecord> = self
                        .workers
                        .values()
                        .filter(|w| w.holds(&key) && w.serves(route, timeout))
                        .collect();
                    let balanced = holders
                        .iter()
                        .any(|w| !self.overloaded(w, route, config, timeout));
                    let hot = group_len >= config.spill_after as usize;
                    let interactive = job.rank().0 == 0;
                    let free_holder = holders
                        .iter()
                        .filter(|w| interactive && w.can_take(route, timeout))
                        .min_by_key(|w| (w.load(), w.id.clone()));
                    if holders.is_empty() {
                        (fallback, Decision::AffinityMiss)
                    } else if let Some(w) = free_holder {
                        // Its group's coalescing window is still open; interactive work does not
                        // wait for it.
                        (w.id.clone(), Decision::AffinityHit)
                    } else if balanced && !hot && !interactive && !job.local.hold_expired {
                        let since = self.jobs.waiting_since(&id).unwrap_or(now);
                        let until = since + Duration::from_millis(config.affinity_wait_ms);
                        return Placement::Hold(until.max(now + Duration::from_millis(1)));
                    } else {
                        let others: Vec<&WorkerRecord> = eligible
                            .iter()
                            .copied()
                            .filter(|w| !w.holds(&key))
                            .collect();
                        let decision = if !balanced {
                            Decision::AffinityImbalance
                        } else if hot {
                            Decision::AffinitySpill
                        } else if interactive {
                            Decision::AffinityInteractive
                        } else if job.local.idle_release {
                            Decision::AffinityIdle
                        } else {
                            Decision::AffinityWaitExpired
                        };
                        (least_loaded(&others).unwrap_or(fallback), decision)
                    }
                } else {
                    (fallback, Decision::LeastLoaded)
                };
                let max = config
                    .max_batch
                    .min(self.workers[&worker].max_batch())
                    .max(1) as usize;
                let mut jobs = vec![id];
                if let Some(group) = self.jobs.group(&key) {
                    let lead_rank = self.jobs[&id].rank().0;
                    jobs = self.admit(
                        self.owner_first(id, companions(group, lead_rank)),
                        max,
                        turns,
                    );
                }
                Placement::Send(Dispatch {
                    worker,
                    jobs,
                    decision,
                })
            }
        }
    }

    /// How many of the job's catalogue files the worker would fetch: those its model cache does
    /// not list and no job already sent to it needs (that one fetches them: one download serves
    /// both).
    fn files_to_fetch(&self, w: &WorkerRecord, job: &JobRecord) -> usize {
        job.needs_files()
            .filter(|sha256| {
                !w.caches(sha256.as_str())
                    && !w.assigned().any(|other| {
                        self.jobs
                            .get(&other)
                            .is_some_and(|o| o.needs_files().any(|h| h == *sha256))
                    })
            })
            .count()
    }

    /// Loaded far beyond the least-loaded live worker of the route.
    fn overloaded(
        &self,
        w: &WorkerRecord,
        route: &Route,
        config: &DispatchConfig,
        timeout: Duration,
    ) -> bool {
        let min = self
            .workers
            .values()
            .filter(|o| o.serves(route, timeout))
            .map(WorkerRecord::load)
            .min()
            .unwrap_or(0);
        let load = w.load();
        load.saturating_sub(min) > config.imbalance_abs as usize
            && load as f64 > config.imbalance_rel * min as f64
    }

    /// Marks a planned message's jobs pending and counts them on the worker at once.
    fn commit(&mut self, d: &Dispatch, now: Instant) {
        let lead = d.jobs[0];
        for &id in &d.jobs {
            self.set_local(id, |l| {
                l.dispatch_pending = true;
                l.hold_until = None;
            });
            let key = self.jobs[&id].group_key();
            let w = self.worker_mut(&d.worker);
            w.assign(id, lead);
            if let Some(key) = key.filter(|k| k.starts_with(ModelFamily::QwenEdit.as_str())) {
                w.keys.insert(key, now);
            }
        }
        if d.decision == Decision::RoundRobin {
            self.rr_cursor = Some(d.worker.clone());
        }
    }

    /// Undoes a planned dispatch that could not be published.
    pub fn dispatch_failed(&mut self, job: JobId, worker: &WorkerId) {
        self.worker_mut(worker).unassign(job);
        let cancelled = self.jobs.update(job, |j| {
            j.local.dispatch_pending = false;
            j.local.cancel_requested
        });
        // Cancelled while its dispatch was pending: nobody else will report it.
        if cancelled == Some(true) {
            self.owed.insert(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::{EventKind, GenerateSpec, Heartbeat, JobSpec, Priority, Submission};

    use super::*;
    use crate::registry::Blocker;
    use crate::registry::testing::*;
    use vnfarm_proto::http::JobState;

    #[test]
    fn edits_of_a_base_go_as_one_batch_to_the_worker_that_made_it() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        for w in ["a", "b", "c"] {
            r.heartbeat(batching_worker(w, 1, 8));
        }
        let base = s.queue(&mut r, generate());
        let edits: Vec<JobId> = (0..5).map(|_| s.queue(&mut r, edit_of(base))).collect();
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1, "only the base can run");
        s.dispatched(&mut r, &plan.dispatches[0]);
        s.completed_on(&mut r, base, "b");
        // Inside the coalescing window nothing goes yet, and the plan says when to look again.
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert!(plan.dispatches.is_empty(), "{plan:?}");
        assert!(plan.wake_at.is_some());
        let plan = r.plan_dispatch(&affinity(), later(60), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        let d = &plan.dispatches[0];
        assert_eq!(d.worker.as_str(), "b");
        assert_eq!(d.decision, Decision::AffinityHit);
        assert_eq!(d.jobs, edits, "one message, oldest first");
        // Their dispatched events keep the worker's one slot taken by the one message.
        s.dispatched(&mut r, d);
        assert_eq!(r.workers[&wid("b")].messages.len(), 1);
        assert_eq!(r.workers[&wid("b")].load(), 5);
    }

    /// Worker `a` made `base` (so it holds the base's encodings) and is now busy with another
    /// job; worker `b` has just joined, free. Both take `max_batch` jobs per message.
    fn busy_holder(max_batch: u32) -> (Registry, Stream, JobId) {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(batching_worker("a", 1, max_batch));
        let base = s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        s.dispatched(&mut r, &plan.dispatches[0]);
        s.completed_on(&mut r, base, "a");
        let other = s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches[0].jobs, vec![other]);
        s.dispatched(&mut r, &plan.dispatches[0]);
        r.heartbeat(batching_worker("b", 1, max_batch));
        (r, s, base)
    }

    #[test]
    fn an_edit_waits_for_its_busy_holder_while_others_have_work_then_goes_elsewhere() {
        let (mut r, mut s, base) = busy_holder(8);
        let edit = s.queue(&mut r, edit_of(base));
        let other = s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        assert_eq!(
            plan.dispatches[0].jobs,
            vec![other],
            "b takes other work; a holds the edit's input"
        );
        s.dispatched(&mut r, &plan.dispatches[0]);
        assert!(plan.wake_at.is_some_and(|w| w > later(500)));
        assert_eq!(
            r.blocker(r.job(edit).unwrap(), T, &affinity()),
            Some(Blocker::Holders(vec![wid("a")]))
        );
        // Past `affinity_wait_ms` a newly free worker takes it before younger work.
        let younger = s.queue(&mut r, generate());
        r.heartbeat(batching_worker("c", 1, 8));
        let plan = r.plan_dispatch(&affinity(), later(1_100), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        let d = &plan.dispatches[0];
        assert_eq!((d.worker.as_str(), d.jobs.as_slice()), ("c", &[edit][..]));
        assert_eq!(d.decision, Decision::AffinityWaitExpired);
        assert_eq!(r.job(younger).unwrap().state, JobState::Queued);
    }

    #[test]
    fn a_held_edit_goes_to_a_worker_that_would_otherwise_idle() {
        let (mut r, mut s, base) = busy_holder(8);
        s.queue(&mut r, edit_of(base));
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        let d = &plan.dispatches[0];
        assert_eq!(
            (d.worker.as_str(), d.decision),
            ("b", Decision::AffinityIdle)
        );
    }

    #[test]
    fn an_interactive_edit_is_not_held_and_travels_without_batch_work() {
        let (mut r, mut s, base) = busy_holder(8);
        let batch = s.queue(&mut r, edit_of(base));
        let interactive = s.queue(
            &mut r,
            Submission {
                priority: Priority::Interactive,
                ..edit_of(base)
            },
        );
        s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        let d = &plan.dispatches[0];
        assert_eq!(
            (d.worker.as_str(), d.decision, d.jobs.as_slice()),
            ("b", Decision::AffinityInteractive, &[interactive][..]),
            "{plan:?}"
        );
        assert_eq!(r.job(batch).unwrap().state, JobState::Queued);
    }

    #[test]
    fn interactive_work_with_no_free_worker_asks_a_batch_message_back_once() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(batching_worker("a", 1, 8));
        let base = s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        s.dispatched(&mut r, &plan.dispatches[0]);
        s.completed_on(&mut r, base, "a");
        // a takes five edits of its image in one message; b one generate.
        let edits: Vec<JobId> = (0..5).map(|_| s.queue(&mut r, edit_of(base))).collect();
        let plan = r.plan_dispatch(&affinity(), later(100), T);
        assert_eq!(plan.dispatches[0].jobs, edits, "{plan:?}");
        s.dispatched(&mut r, &plan.dispatches[0]);
        r.heartbeat(batching_worker("b", 1, 8));
        s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(100), T);
        s.dispatched(&mut r, &plan.dispatches[0]);
        assert!(
            plan.yields.is_empty(),
            "no interactive work waits: {plan:?}"
        );

        let interactive = s.queue(
            &mut r,
            Submission {
                priority: Priority::Interactive,
                ..generate()
            },
        );
        let plan = r.plan_dispatch(&affinity(), later(100), T);
        assert!(plan.dispatches.is_empty(), "{plan:?}");
        assert_eq!(
            plan.yields,
            vec![Yield {
                worker: wid("a"),
                jobs: edits
                    .iter()
                    .copied()
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect(),
            }],
            "a's message has jobs to give back; b's single job has none"
        );
        let again = r.plan_dispatch(&affinity(), later(100), T);
        assert!(
            again.yields.is_empty(),
            "one yield per waiting job: {again:?}"
        );
        // With the least-loaded policy (one job per message) there is nothing to ask back.
        let plain = DispatchConfig {
            max_batch: 1,
            ..affinity()
        };
        assert!(r.plan_dispatch(&plain, later(100), T).yields.is_empty());

        // a finishes the edit on its engine and gives the rest back: the interactive job goes to
        // a first, the edits wait for it (their holder), and the yield did not count as a dispatch.
        s.completed_on(&mut r, edits[0], "a");
        for &e in &edits[1..] {
            r.apply(s.ev(
                e,
                EventKind::Requeued {
                    reason: vnfarm_proto::event::YIELDED_REASON.into(),
                    dispatch: None,
                },
            ));
            assert_eq!(r.job(e).unwrap().dispatches(), 0);
        }
        let plan = r.plan_dispatch(&affinity(), later(200), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        assert_eq!(
            (
                plan.dispatches[0].worker.as_str(),
                plan.dispatches[0].jobs.as_slice()
            ),
            ("a", &[interactive][..])
        );
        s.dispatched(&mut r, &plan.dispatches[0]);
        s.completed_on(&mut r, interactive, "a");
        let plan = r.plan_dispatch(&affinity(), later(300), T);
        assert_eq!(
            (
                plan.dispatches[0].worker.as_str(),
                plan.dispatches[0].decision,
                plan.dispatches[0].jobs.len()
            ),
            ("a", Decision::AffinityHit, 4),
            "{plan:?}"
        );
    }

    #[test]
    fn a_hot_input_spills_to_a_second_worker_and_batches_stay_within_limits() {
        let (mut r, mut s, base) = busy_holder(4);
        // Six edits of a's input (spill_after) while a is busy: b takes some at once.
        for _ in 0..6 {
            s.queue(&mut r, edit_of(base));
        }
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        let d = &plan.dispatches[0];
        assert_eq!(
            (d.worker.as_str(), d.decision),
            ("b", Decision::AffinitySpill)
        );
        assert_eq!(d.jobs.len(), 4, "the worker's own max_batch");
    }

    #[test]
    fn a_job_naming_a_checkpoint_goes_only_to_a_worker_holding_it() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("plain", 4));
        let named = |c: &str| {
            let JobSpec::Generate(g) = generate().job else {
                unreachable!()
            };
            Submission {
                job: JobSpec::Generate(GenerateSpec {
                    checkpoint: Some(c.into()),
                    ..g
                }),
                ..generate()
            }
        };
        let job = s.queue(&mut r, named("novaAnimeXL"));
        for policy in [Policy::Affinity, Policy::LeastLoaded, Policy::RoundRobin] {
            let config = DispatchConfig {
                policy,
                ..affinity()
            };
            assert!(r.plan_dispatch(&config, later(0), T).dispatches.is_empty());
        }
        assert_eq!(
            r.blocker(r.job(job).unwrap(), T, &affinity()),
            Some(Blocker::NoWorker(Route {
                model: ModelFamily::Sdxl,
                checkpoint: Some("novaAnimeXL".into()),
                catalogue: None,
            }))
        );
        r.heartbeat(Heartbeat {
            checkpoints: vec!["novaAnimeXL".into()],
            ..worker("nova", 1)
        });
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1);
        assert_eq!(plan.dispatches[0].worker.as_str(), "nova");
        // A job naming no checkpoint may go to either.
        s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches[0].worker.as_str(), "plain");
    }

    #[test]
    fn round_robin_takes_workers_in_turn_and_least_loaded_by_load() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        for w in ["a", "b", "c"] {
            r.heartbeat(worker(w, 4));
        }
        for _ in 0..6 {
            s.queue(&mut r, generate());
        }
        let config = DispatchConfig {
            policy: Policy::RoundRobin,
            ..affinity()
        };
        let order: Vec<String> = r
            .plan_dispatch(&config, later(0), T)
            .dispatches
            .iter()
            .map(|d| d.worker.to_string())
            .collect();
        assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
    }

    #[test]
    fn compatible_generates_share_a_message_with_a_batching_worker() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(batching_worker("a", 1, 3));
        let same: Vec<JobId> = (0..4).map(|_| s.queue(&mut r, generate())).collect();
        let JobSpec::Generate(g) = generate().job else {
            unreachable!()
        };
        let bigger = s.queue(
            &mut r,
            Submission {
                job: JobSpec::Generate(GenerateSpec { width: 512, ..g }),
                ..generate()
            },
        );
        let plan = r.plan_dispatch(&affinity(), later(0), T);
        assert_eq!(plan.dispatches.len(), 1);
        assert_eq!(plan.dispatches[0].jobs, same[..3].to_vec());
        assert!(!plan.dispatches[0].jobs.contains(&bigger));
        // The same workload under least_loaded: one job per message.
        assert_eq!(r.workers[&wid("a")].messages.len(), 1);
    }

    #[test]
    fn least_loaded_dispatch_counts_at_dispatch() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        r.heartbeat(worker("b", 2));
        let ids: Vec<JobId> = (0..4).map(|_| s.queue(&mut r, generate())).collect();
        let plan = r.plan_ll();
        // Three slots in all: a gets one, b two; the fourth job waits.
        assert_eq!(plan.len(), 3);
        assert_eq!(plan.iter().filter(|(_, w)| w.as_str() == "a").count(), 1);
        assert!(
            r.plan_ll().is_empty(),
            "pending dispatches are not repeated"
        );
        let (done, w) = plan[0].clone();
        r.apply(s.ev(
            done,
            EventKind::Dispatched {
                queue: "q".into(),
                worker: Some(w),
                batch: None,
                term: Some(1),
            },
        ));
        s.complete(&mut r, done);
        let next = r.plan_ll();
        assert_eq!(next.len(), 1, "a completion frees a slot");
        assert_eq!(next[0].0, ids[3]);
    }

    #[test]
    fn interactive_jobs_go_first_across_models() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let batch = s.queue(&mut r, generate());
        let base = s.queue(&mut r, generate());
        s.complete(&mut r, base);
        let interactive = s.queue(
            &mut r,
            Submission {
                priority: Priority::Interactive,
                ..edit_of(base)
            },
        );
        r.heartbeat(worker("a", 1));
        assert_eq!(r.plan_ll(), vec![(interactive, "a".parse().unwrap())]);
        r.heartbeat(worker("b", 1));
        assert_eq!(r.plan_ll(), vec![(batch, "b".parse().unwrap())]);
    }

    #[test]
    fn batch_jobs_are_not_starved_by_interactive_ones() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let batch: Vec<JobId> = (0..2).map(|_| s.queue(&mut r, generate())).collect();
        let interactive = Submission {
            priority: Priority::Interactive,
            ..generate()
        };
        for _ in 0..20 {
            s.queue(&mut r, interactive.clone());
        }
        r.heartbeat(worker("a", 12));
        let plan: Vec<JobId> = r.plan_ll().into_iter().map(|(j, _)| j).collect();
        let burst = INTERACTIVE_BURST as usize;
        // Four interactive jobs, then the oldest batch job, four more, the next batch job, ...
        assert_eq!(plan[burst], batch[0], "{plan:?}");
        assert_eq!(plan[2 * burst + 1], batch[1], "{plan:?}");
        assert_eq!(plan.len(), 12);
        // With no batch job waiting, interactive jobs go back to back.
        assert!(plan[2 * burst + 2..].iter().all(|j| !batch.contains(j)));
    }

    #[test]
    fn a_job_goes_to_a_worker_that_holds_its_catalogue_files_or_already_fetches_them() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let (h1, h2) = ("1".repeat(64), "2".repeat(64));
        r.heartbeat(worker("a", 2));
        r.heartbeat(Heartbeat {
            model_cache: Some(vec![h1.clone()]),
            ..worker("b", 2)
        });
        let needing = |s: &mut Stream, r: &mut Registry, hash: &str, prompt: &str| {
            let mut sub = generate();
            if let JobSpec::Generate(g) = &mut sub.job {
                g.prompt = prompt.into();
                g.loras = vec![vnfarm_proto::LoraRef {
                    name: format!("lora-{prompt}"),
                    weight: 1.0,
                }];
            }
            let files = [(
                format!("lora-{prompt}"),
                vnfarm_proto::catalogue::ContentHash::try_from(hash.to_owned()).unwrap(),
            )]
            .into();
            s.queue_with_files(r, sub, files)
        };
        let policy = DispatchConfig {
            max_batch: 1,
            ..affinity()
        };
        // A plain job first: the least-loaded worker, `a`.
        s.queue(&mut r, generate());
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert_eq!(plan.dispatches[0].worker.as_str(), "a");
        // b holds h1: it takes the job that needs it, though a is as loaded.
        needing(&mut s, &mut r, &h1, "one");
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert_eq!(plan.dispatches[0].worker.as_str(), "b", "{plan:?}");
        // Nobody holds h2: the least-loaded worker takes it (c, new and idle)...
        r.heartbeat(worker("c", 2));
        needing(&mut s, &mut r, &h2, "two");
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert_eq!(plan.dispatches[0].worker.as_str(), "c", "{plan:?}");
        // ...and the next job needing h2 follows it there (one download), though others are free.
        needing(&mut s, &mut r, &h2, "three");
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert_eq!(plan.dispatches[0].worker.as_str(), "c", "{plan:?}");
    }
}
