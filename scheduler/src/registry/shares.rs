//! Fair share (DESIGN §7a, "Fair share and queue control"): the queue's controls (the farm or one
//! person's work paused, by whom) and each person's GPU time today, as the event stream says, so
//! every scheduler, active, standby or restarted, holds the same and dispatches alike.
//!
//! The controls are people's events (`farm_paused`, `work_paused`, ...); the GPU time is charged
//! when a run ends, from that run's own events: the model stages its `completed` event reports
//! (a batch's jobs each carry their share of the batch's forwards), or, for a run that failed, was
//! cancelled or came back, the time from its `started` to that event. The day is the UTC day of
//! the event that ended the run; a later day's first charge starts the count again.
//!
//! The round among people is kept here too: the offset of each person's latest `dispatched`
//! event, so that of two people with as many jobs on workers the one served longer ago goes
//! first.
//!
//! What a person may start now ([`Registry::held`]) also takes the configured limits
//! ([`crate::config::DispatchConfig`]): at most `max_running` jobs of theirs on workers at once
//! (dispatched or running), and none once their GPU time today reaches `daily_gpu_minutes`.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use vnfarm_proto::{PersonEvent, PersonEventKind};

use super::Registry;
use crate::config::DispatchConfig;

/// Who paused, and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    pub by: String,
    pub at: DateTime<Utc>,
}

/// The queue's controls and the GPU time each person used today.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Shares {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    farm_paused: Option<Pause>,
    /// People whose work is paused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    paused: BTreeMap<String, Pause>,
    /// The UTC day `used` counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    day: Option<NaiveDate>,
    /// GPU seconds of each person's runs that ended on `day`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    used: BTreeMap<String, f64>,
    /// The stream offset of each person's latest `dispatched` event: of two people with as many
    /// jobs on workers, the one served longer ago goes first (a round, also on one worker).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    served: BTreeMap<String, u64>,
}

impl Shares {
    pub fn farm_paused(&self) -> Option<&Pause> {
        self.farm_paused.as_ref()
    }

    /// Whose work is paused, and by whom.
    pub fn paused(&self) -> &BTreeMap<String, Pause> {
        &self.paused
    }

    /// The GPU seconds `person`'s runs used on `today` (UTC).
    pub fn used_on(&self, person: &str, today: NaiveDate) -> f64 {
        if self.day == Some(today) {
            self.used.get(person).copied().unwrap_or(0.0)
        } else {
            0.0
        }
    }

    /// Everyone with GPU time counted on `today`.
    pub fn users_on(&self, today: NaiveDate) -> impl Iterator<Item = (&str, f64)> {
        self.used
            .iter()
            .filter(move |_| self.day == Some(today))
            .map(|(name, s)| (name.as_str(), *s))
    }

    /// Applies a control event; returns whether it changed anything (pausing what is paused does
    /// not: the first pause's author stays).
    pub(super) fn apply(&mut self, ev: &PersonEvent) -> bool {
        let pause = || Pause {
            by: ev.person.clone(),
            at: ev.at,
        };
        match &ev.kind {
            PersonEventKind::FarmPaused if self.farm_paused.is_none() => {
                self.farm_paused = Some(pause());
                true
            }
            PersonEventKind::FarmResumed => self.farm_paused.take().is_some(),
            PersonEventKind::WorkPaused { whose } if !self.paused.contains_key(whose) => {
                self.paused.insert(whose.clone(), pause());
                true
            }
            PersonEventKind::WorkResumed { whose } => self.paused.remove(whose).is_some(),
            _ => false,
        }
    }

    /// When `person` was last served: the offset of their latest `dispatched` event (0: never).
    pub fn served(&self, person: &str) -> u64 {
        self.served.get(person).copied().unwrap_or(0)
    }

    /// A job of `person`'s was dispatched, by the event at `seq`.
    pub(super) fn serve(&mut self, person: &str, seq: u64) {
        let last = self.served.entry(person.to_owned()).or_default();
        *last = (*last).max(seq);
    }

    /// Counts `seconds` of GPU time for `person`, for a run that ended at `at`.
    pub(super) fn charge(&mut self, person: &str, at: DateTime<Utc>, seconds: f64) {
        let day = at.date_naive();
        match self.day {
            Some(d) if d > day => return, // a late event of an earlier day
            Some(d) if d == day => {}
            _ => {
                self.day = Some(day);
                self.used.clear();
            }
        }
        *self.used.entry(person.to_owned()).or_default() += seconds.max(0.0);
    }
}

/// Why a person's waiting work is not dispatched now.
#[derive(Clone, Debug, PartialEq)]
pub enum Held {
    /// The whole farm is paused.
    FarmPaused(Pause),
    /// This person's work is paused.
    Paused(Pause),
    /// As many of their jobs as they may run at once are on workers.
    AtCap { running: usize, cap: u32 },
    /// Their GPU time today reached their daily quota; it counts again from 00:00 UTC.
    Quota { used_s: f64, quota_s: f64 },
}

impl Registry {
    /// The queue's controls and the GPU time people used.
    pub fn shares(&self) -> &Shares {
        &self.shares
    }

    /// Why `person`'s waiting work may not start now, if it may not (`today` for the quota).
    pub fn held(&self, person: &str, config: &DispatchConfig, today: NaiveDate) -> Option<Held> {
        if let Some(p) = &self.shares.farm_paused {
            return Some(Held::FarmPaused(p.clone()));
        }
        if let Some(p) = self.shares.paused.get(person) {
            return Some(Held::Paused(p.clone()));
        }
        let limits = config.limits_of(person);
        let running = self.jobs.running(person);
        if let Some(cap) = limits.max_running
            && running >= cap as usize
        {
            return Some(Held::AtCap { running, cap });
        }
        if let Some(minutes) = limits.daily_gpu_minutes {
            let (used_s, quota_s) = (self.shares.used_on(person, today), minutes as f64 * 60.0);
            if used_s >= quota_s {
                return Some(Held::Quota { used_s, quota_s });
            }
        }
        None
    }

    /// How many of `person`'s jobs are on workers (dispatched, being dispatched, or running).
    pub fn running_of(&self, person: &str) -> usize {
        self.jobs.running(person)
    }

    /// How many of `person`'s jobs wait for a worker (ready or held for their input's holder).
    pub fn waiting_of(&self, person: &str) -> usize {
        self.jobs.waiting_of(person)
    }

    /// Everyone the queue concerns: with jobs waiting or on workers, paused, with GPU time
    /// `today`, or with a live token; by name, once each.
    pub fn sharers(&self, today: NaiveDate) -> std::collections::BTreeSet<String> {
        self.jobs
            .owners()
            .chain(self.shares.paused.keys().map(String::as_str))
            .chain(self.shares.users_on(today).map(|(name, _)| name))
            .chain(
                self.people
                    .iter()
                    .filter(|(_, p)| p.is_live())
                    .map(|(name, _)| name),
            )
            .map(str::to_owned)
            .collect()
    }

    /// Applies a queue control event (see [`Shares::apply`]).
    pub(super) fn apply_control(&mut self, ev: &PersonEvent) -> bool {
        self.shares.apply(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PersonLimits;
    use crate::registry::testing::*;
    use crate::registry::{Blocker, Dispatch, Retention, Snapshot};
    use chrono::TimeZone;
    use vnfarm_proto::{EventKind, Heartbeat, JobId, StageTimings};

    /// The jobs of `sent`, in order, with their workers.
    fn jobs_of(sent: Vec<Dispatch>) -> Vec<(JobId, String)> {
        sent.into_iter()
            .flat_map(|d| {
                let w = d.worker.to_string();
                d.jobs.into_iter().map(move |j| (j, w.clone()))
            })
            .collect()
    }

    /// The jobs a plan sends, in order, with their workers.
    fn plan(r: &mut Registry, config: &DispatchConfig) -> Vec<(JobId, String)> {
        jobs_of(r.plan_dispatch(config, later(0), T).dispatches)
    }

    /// Plans, and has every planned job dispatched and started on its worker.
    fn run(r: &mut Registry, s: &mut Stream, config: &DispatchConfig) -> Vec<(JobId, String)> {
        let sent = r.plan_dispatch(config, later(0), T).dispatches;
        for d in &sent {
            s.dispatched(r, d);
            for j in &d.jobs {
                s.started_on(r, *j, d.worker.as_str());
            }
        }
        jobs_of(sent)
    }

    /// `n` generates queued as `owner`'s.
    fn queue_n(r: &mut Registry, s: &mut Stream, n: usize, owner: &str) -> Vec<JobId> {
        (0..n)
            .map(|_| s.queue_as(r, generate(), Some(owner)))
            .collect()
    }

    fn person_event(who: &str, kind: PersonEventKind) -> PersonEvent {
        PersonEvent::now(who, kind)
    }

    #[test]
    fn another_persons_work_goes_before_a_long_backlog_round_by_person() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        r.heartbeat(worker("b", 1));
        let ann: Vec<JobId> = queue_n(&mut r, &mut s, 20, "ann");
        let bo: Vec<JobId> = queue_n(&mut r, &mut s, 3, "bo");
        let config = affinity();
        // Both free: ann's oldest, then bo's (ann now has one on a worker, bo none).
        let first = run(&mut r, &mut s, &config);
        let ids: Vec<JobId> = first.iter().map(|(j, _)| *j).collect();
        assert_eq!(ids, vec![ann[0], bo[0]]);
        // Whichever worker frees, the person with fewer jobs on workers goes next.
        let on_a = |sent: &[(JobId, String)]| sent.iter().find(|(_, w)| w == "a").unwrap().0;
        s.completed_on(&mut r, on_a(&first), "a");
        let next = run(&mut r, &mut s, &config);
        assert_eq!(
            next.iter().map(|(j, _)| *j).collect::<Vec<_>>(),
            vec![ann[1]]
        );
        s.completed_on(&mut r, bo[0], "b");
        let next = run(&mut r, &mut s, &config);
        assert_eq!(
            next.iter().map(|(j, _)| *j).collect::<Vec<_>>(),
            vec![bo[1]]
        );
        assert_eq!((r.running_of("ann"), r.running_of("bo")), (1, 1));
        assert_eq!((r.waiting_of("ann"), r.waiting_of("bo")), (18, 1));
    }

    #[test]
    fn a_message_carries_its_leads_owners_work_first() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let config = affinity();
        r.heartbeat(worker("b", 1));
        let ann: Vec<JobId> = queue_n(&mut r, &mut s, 6, "ann");
        let sent = run(&mut r, &mut s, &config);
        assert_eq!(sent, vec![(ann[0], "b".to_owned())]);
        let bo: Vec<JobId> = queue_n(&mut r, &mut s, 3, "bo");
        r.heartbeat(batching_worker("a", 1, 4));
        let sent = plan(&mut r, &config);
        let jobs: Vec<JobId> = sent.iter().map(|(j, _)| *j).collect();
        assert_eq!(
            jobs,
            vec![bo[0], bo[1], bo[2], ann[1]],
            "bo's turn, bo's work first"
        );
    }

    #[test]
    fn estimates_take_people_in_turns_and_leave_paused_work_out() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let ann: Vec<JobId> = queue_n(&mut r, &mut s, 3, "ann");
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        let route = crate::registry::Route {
            model: vnfarm_proto::ModelFamily::Sdxl,
            checkpoint: None,
            catalogue: None,
        };
        assert_eq!(r.dispatch_order(&route), vec![ann[0], bo, ann[1], ann[2]]);
        s.seq += 1;
        r.apply_person(
            s.seq,
            &person_event(
                "lee",
                PersonEventKind::WorkPaused {
                    whose: "ann".into(),
                },
            ),
        );
        assert_eq!(r.dispatch_order(&route), vec![bo]);
    }

    #[test]
    fn on_one_worker_people_take_turns() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let config = affinity();
        let ann: Vec<JobId> = queue_n(&mut r, &mut s, 4, "ann");
        let first = run(&mut r, &mut s, &config);
        assert_eq!(first[0].0, ann[0]);
        let bo: Vec<JobId> = queue_n(&mut r, &mut s, 2, "bo");
        let mut order = vec![ann[0]];
        s.completed_on(&mut r, ann[0], "a");
        for _ in 0..5 {
            let sent = run(&mut r, &mut s, &config);
            order.push(sent[0].0);
            s.completed_on(&mut r, sent[0].0, "a");
        }
        assert_eq!(order, vec![ann[0], bo[0], ann[1], bo[1], ann[2], ann[3]]);
    }

    #[test]
    fn interactive_work_still_goes_first_and_moved_jobs_before_anyones_turn() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let ann: Vec<JobId> = queue_n(&mut r, &mut s, 3, "ann");
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        let urgent = s.queue_as(
            &mut r,
            vnfarm_proto::Submission {
                priority: vnfarm_proto::Priority::Interactive,
                ..generate()
            },
            Some("cy"),
        );
        // A lead moves ann's newest job to the front: it goes before the older jobs and bo's
        // turn, but not before interactive work.
        s.seq += 1;
        assert!(r.apply_person(
            s.seq,
            &person_event("lee", PersonEventKind::MovedToFront { job_id: ann[2] })
        ));
        assert_eq!(r.job(ann[2]).unwrap().moved_by(), Some("lee"));
        let config = affinity();
        let mut order = Vec::new();
        for _ in 0..5 {
            let sent = run(&mut r, &mut s, &config);
            assert_eq!(sent.len(), 1);
            order.push(sent[0].0);
            s.completed_on(&mut r, sent[0].0, "a");
        }
        // After ann's moved job, bo (never served) before ann's older ones.
        assert_eq!(order, vec![urgent, ann[2], bo, ann[0], ann[1]]);
        // A running job is not moved.
        s.seq += 1;
        assert!(!r.apply_person(
            s.seq,
            &person_event("lee", PersonEventKind::MovedToFront { job_id: ann[1] })
        ));
    }

    #[test]
    fn a_cap_keeps_a_persons_jobs_on_workers_at_most_and_says_so() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        for w in ["a", "b", "c"] {
            r.heartbeat(batching_worker(w, 1, 8));
        }
        let base = s.queue_as(&mut r, generate(), Some("ann"));
        let config = DispatchConfig {
            person: [(
                "ann".to_owned(),
                PersonLimits {
                    max_running: Some(2),
                    daily_gpu_minutes: None,
                },
            )]
            .into(),
            ..affinity()
        };
        let sent = run(&mut r, &mut s, &config);
        s.completed_on(&mut r, sent[0].0, &sent[0].1);
        // Five edits of one input would travel as one batch; the cap lets two go.
        let edits: Vec<JobId> = (0..5)
            .map(|_| s.queue_as(&mut r, edit_of(base), Some("ann")))
            .collect();
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        let sent = r.plan_dispatch(&config, later(100), T).dispatches;
        let ann_sent: usize = sent
            .iter()
            .flat_map(|d| &d.jobs)
            .filter(|j| edits.contains(j))
            .count();
        assert_eq!(ann_sent, 2, "{sent:?}");
        assert!(sent.iter().any(|d| d.jobs == vec![bo]), "{sent:?}");
        let waiting = edits
            .iter()
            .find(|e| !sent.iter().any(|d| d.jobs.contains(e)))
            .unwrap();
        assert_eq!(
            r.blocker(r.job(*waiting).unwrap(), T, &config),
            Some(Blocker::Share(Held::AtCap { running: 2, cap: 2 }))
        );
    }

    #[test]
    fn past_the_daily_quota_a_persons_work_waits_and_others_run() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let config = DispatchConfig {
            daily_gpu_minutes_per_person: 1,
            ..affinity()
        };
        let first = s.queue_as(&mut r, generate(), Some("ann"));
        run(&mut r, &mut s, &config);
        // Its completed event reports 75 s of model stages and 40 s of upload (not GPU time).
        let mut timings = StageTimings::default();
        timings.add("denoise", 70.0);
        timings.add("decode", 5.0);
        timings.add("upload", 40.0);
        r.apply(s.ev(
            first,
            EventKind::Completed {
                outputs: vec!["results/x/0.png".into()],
                manifest: "results/x/manifest.json".into(),
                worker: Some("a".parse().unwrap()),
                timings,
            },
        ));
        let today = Utc::now().date_naive();
        assert_eq!(r.shares().used_on("ann", today), 75.0);
        let second = s.queue_as(&mut r, generate(), Some("ann"));
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        let sent = plan(&mut r, &config);
        assert_eq!(sent.iter().map(|(j, _)| *j).collect::<Vec<_>>(), vec![bo]);
        assert!(matches!(
            r.blocker(r.job(second).unwrap(), T, &config),
            Some(Blocker::Share(Held::Quota { used_s, quota_s })) if used_s == 75.0 && quota_s == 60.0
        ));
        // The plan asks to be woken when the day turns.
        let plan = r.plan_dispatch(&config, later(0), T);
        assert!(plan.wake_at.is_some());
    }

    #[test]
    fn pauses_stop_dispatch_until_resumed_and_survive_a_snapshot() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 4));
        let ann = s.queue_as(&mut r, generate(), Some("ann"));
        let config = affinity();
        let control = |r: &mut Registry, s: &mut Stream, kind| {
            s.seq += 1;
            r.apply_person(s.seq, &person_event("lee", kind))
        };
        assert!(control(&mut r, &mut s, PersonEventKind::FarmPaused));
        assert!(plan(&mut r, &config).is_empty(), "the farm is paused");
        assert!(matches!(
            r.blocker(r.job(ann).unwrap(), T, &config),
            Some(Blocker::Share(Held::FarmPaused(Pause { by, .. }))) if by == "lee"
        ));
        assert!(control(&mut r, &mut s, PersonEventKind::FarmResumed));
        let whose = || "ann".to_owned();
        assert!(control(
            &mut r,
            &mut s,
            PersonEventKind::WorkPaused { whose: whose() }
        ));
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        assert_eq!(
            plan(&mut r, &config)
                .iter()
                .map(|(j, _)| *j)
                .collect::<Vec<_>>(),
            vec![bo],
            "ann's work is paused, bo's is not"
        );
        // A restarted scheduler (from a snapshot) holds the same pause.
        let json = serde_json::to_vec(&r.snapshot()).unwrap();
        let snapshot: Snapshot = serde_json::from_slice(&json).unwrap();
        let mut restored = Registry::restore(snapshot, Retention::default());
        restored.heartbeat(worker("a", 4));
        // bo's dispatch was only planned (not in the stream): the restored one plans it again.
        assert_eq!(
            plan(&mut restored, &config)
                .iter()
                .map(|(j, _)| *j)
                .collect::<Vec<_>>(),
            vec![bo]
        );
        assert!(restored.shares().paused().contains_key("ann"));
        s.seq += 1;
        assert!(restored.apply_person(
            s.seq,
            &person_event("lee", PersonEventKind::WorkResumed { whose: whose() })
        ));
        assert_eq!(
            plan(&mut restored, &config)
                .iter()
                .map(|(j, _)| *j)
                .collect::<Vec<_>>(),
            vec![ann]
        );
    }

    #[test]
    fn affinity_does_not_take_a_turn_that_is_someone_elses() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(batching_worker("a", 1, 8));
        r.heartbeat(batching_worker("b", 1, 8));
        let config = affinity();
        // ann's base is made on a, so a holds its encodings.
        let base = s.queue_as(&mut r, generate(), Some("ann"));
        let sent = r.plan_dispatch(&config, later(0), T).dispatches;
        assert_eq!(sent[0].worker.as_str(), "a");
        s.dispatched(&mut r, &sent[0]);
        s.completed_on(&mut r, base, "a");
        // Another of ann's jobs runs on b (a serving nothing for a moment).
        r.heartbeat(Heartbeat {
            models: vec![],
            ..batching_worker("a", 1, 8)
        });
        let other = s.queue_as(&mut r, generate(), Some("ann"));
        let sent = r.plan_dispatch(&config, later(0), T).dispatches;
        assert_eq!(sent[0].worker.as_str(), "b");
        s.dispatched(&mut r, &sent[0]);
        s.started_on(&mut r, other, "b");
        r.heartbeat(batching_worker("a", 1, 8));
        // ann's edits of the base (a holds it) and bo's generate wait; a frees first.
        let edits: Vec<JobId> = (0..3)
            .map(|_| s.queue_as(&mut r, edit_of(base), Some("ann")))
            .collect();
        let bo = s.queue_as(&mut r, generate(), Some("bo"));
        let sent = r.plan_dispatch(&config, later(100), T).dispatches;
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].worker.as_str(), "a");
        assert_eq!(
            sent[0].jobs,
            vec![bo],
            "bo has nothing on a worker: bo's turn"
        );
        assert!(
            edits
                .iter()
                .all(|e| r.job(*e).unwrap().state() == vnfarm_proto::http::JobState::Queued)
        );
    }

    fn at(day: u32, hour: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, day, hour, 0, 0).unwrap()
    }

    #[test]
    fn gpu_time_counts_per_utc_day_and_late_events_do_not_reopen_a_day() {
        let mut s = Shares::default();
        s.charge("ann", at(3, 10), 30.0);
        s.charge("ann", at(3, 23), 12.5);
        s.charge("bo", at(3, 23), 4.0);
        let day3 = at(3, 0).date_naive();
        assert_eq!(s.used_on("ann", day3), 42.5);
        s.charge("bo", at(4, 0), 1.0);
        let day4 = at(4, 0).date_naive();
        assert_eq!(s.used_on("ann", day4), 0.0, "a new day starts at nothing");
        assert_eq!(s.used_on("ann", day3), 0.0, "yesterday is not kept");
        s.charge("ann", at(3, 23), 100.0);
        assert_eq!(s.used_on("ann", day4), 0.0, "a late event of yesterday");
        assert_eq!(s.used_on("bo", day4), 1.0);
    }

    #[test]
    fn the_first_pause_names_its_author_and_resume_clears_it() {
        let mut s = Shares::default();
        let ev = |who: &str, kind| PersonEvent::now(who, kind);
        assert!(s.apply(&ev("lee", PersonEventKind::FarmPaused)));
        assert!(!s.apply(&ev("ann", PersonEventKind::FarmPaused)));
        assert_eq!(s.farm_paused().unwrap().by, "lee");
        assert!(s.apply(&ev("ann", PersonEventKind::FarmResumed)));
        assert!(!s.apply(&ev("ann", PersonEventKind::FarmResumed)));
        let whose = || "bo".to_owned();
        assert!(s.apply(&ev("lee", PersonEventKind::WorkPaused { whose: whose() })));
        assert_eq!(s.paused()["bo"].by, "lee");
        assert!(s.apply(&ev("lee", PersonEventKind::WorkResumed { whose: whose() })));
        assert!(s.paused().is_empty());
    }
}
