//! Estimates of when waiting and running jobs start and finish (DESIGN §5, "Estimates").
//!
//! - [`Rates`]: how long a job of each class takes on each worker, learned from the event stream
//!   alone (a job's `started` and `completed` event times), so that every scheduler, active,
//!   standby or restarted, learns the same rates from the same events (a snapshot carries them,
//!   since the events they were learned from age out of the stream). A class is a model and the
//!   output's resolution class (the classes of `vnfarm_worker_denoise_step_seconds`); a job's work
//!   is its denoising steps times its images, and a run's time is fitted as a fixed part plus a
//!   part per unit of work (exponentially weighted least squares, so the rate follows a worker
//!   whose speed changes). What a run spent on its input (the stages `download`, `encode` and
//!   `fetch_encodings` its `completed` event reports) is learned apart, by class ([`InputCost`]):
//!   the first job of a message pays it and the later ones do not, so one fit of both was early for
//!   the first (an interactive edit: predicted ÷ actual run 0.86 for edits that encoded their input)
//!   and late for the rest (1.10).
//! - [`Arrivals`] (`eta/arrivals.rs`): how fast interactive work arrives, by class, learned from
//!   the stream's `queued` events; part of the rates.
//! - [`simulate`]: the queue simulation, a pure function of its input: each worker's engine runs
//!   the jobs on it one after another (a worker's slots are prefetch; its engine is one thread),
//!   busy until the predicted finish of the last; then the waiting jobs, in dispatch order, each
//!   to the worker serving its route that frees first, no earlier than its inputs' predicted
//!   finish; a batch job after the interactive work expected to arrive before it starts
//!   ([`Stretch`]).
//! - The registry's side: [`Registry::dispatch_order`] (the one place the waiting order is read
//!   from), the simulation's input copied from the records under the registry's lock, the
//!   simulation run without it, and the estimates kept until [`REFRESH`] has passed, so a request
//!   costs a lookup whatever the backlog.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vnfarm_proto::http::{Estimate, JobState};
use vnfarm_proto::{
    JobId, JobSpec, ModelFamily, StageTimings, WorkerId, WorkerState, resolution_class,
};

use super::record::JobRecord;
use super::{INTERACTIVE_BURST, Registry, Route};

mod arrivals;

pub use arrivals::Arrivals;
use arrivals::Expected;

/// Estimates are made again at most this often (and only when asked for).
pub const REFRESH: Duration = Duration::from_millis(500);
/// How much of a class's fit each new run leaves: 0.8 weighs the last few runs most.
const DECAY: f64 = 0.8;
/// Batch messages whose last job end is remembered (for the next job of the same message).
const MESSAGE_ENDS: usize = 4096;
/// How far into a route's released jobs a worker looks for one whose inputs no other worker holds.
const HOLD_SCAN: usize = 64;
/// The resolution class of an upscale, whose input's size the scheduler does not know.
const ANY_INPUT: &str = "input";

/// What is measured together: a model and an output resolution class.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub(super) struct Class {
    pub(super) model: ModelFamily,
    pub(super) resolution: String,
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.model, self.resolution)
    }
}

/// How much work a job is: its class, and its denoising steps times its images (1 for an
/// upscale).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Work {
    pub(super) class: Class,
    pub(super) units: f64,
}

impl Work {
    /// The work of a job's spec; `None` for a pipeline (its jobs are estimated).
    pub(super) fn of(spec: &JobSpec) -> Option<Work> {
        let (model, resolution, units) = match spec {
            JobSpec::Generate(g) => (
                ModelFamily::Sdxl,
                resolution_class(g.width, g.height),
                f64::from(g.steps.max(1)) * f64::from(g.count.max(1)),
            ),
            JobSpec::Edit(e) => (
                ModelFamily::QwenEdit,
                match (e.width, e.height) {
                    (Some(w), Some(h)) => resolution_class(w, h),
                    // About one megapixel at the last input's aspect (diffusers' default).
                    _ => resolution_class(1024, 1024),
                },
                f64::from(e.steps.max(1)),
            ),
            JobSpec::Upscale(_) => (ModelFamily::Esrgan, ANY_INPUT, 1.0),
            JobSpec::Pipeline(_) => return None,
        };
        Some(Work {
            class: Class {
                model,
                resolution: resolution.to_owned(),
            },
            units,
        })
    }
}

/// The megapixels a resolution class stands for (`None` for an upscale's unknown input).
fn megapixels(class: &str) -> Option<f64> {
    class.strip_suffix("mp")?.parse().ok()
}

/// Exponentially weighted sums of (units, seconds) of one class's runs on one worker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Fit {
    runs: u32,
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Fit {
    fn add(&mut self, units: f64, seconds: f64) {
        self.runs = self.runs.saturating_add(1);
        self.w = self.w * DECAY + 1.0;
        self.x = self.x * DECAY + units;
        self.y = self.y * DECAY + seconds;
        self.xx = self.xx * DECAY + units * units;
        self.xy = self.xy * DECAY + units * seconds;
    }

    /// Seconds for `units` of work: the weighted least-squares line through the runs when their
    /// amounts of work differ enough to tell a fixed part from a part per unit, and both come out
    /// non-negative; otherwise the weighted mean seconds per unit.
    fn seconds(&self, units: f64) -> Option<f64> {
        if self.runs == 0 || self.w <= 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        let cov = self.xy / self.w - mx * my;
        if self.runs >= 3 && var > (0.05 * mx).powi(2) {
            let slope = cov / var;
            let fixed = my - slope * mx;
            if slope >= 0.0 && fixed >= 0.0 {
                return Some(fixed + slope * units);
            }
        }
        (mx > 0.0).then(|| my / mx * units)
    }
}

/// An exponentially weighted mean (weights [`DECAY`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Ewma {
    w: f64,
    sum: f64,
}

impl Ewma {
    fn add(&mut self, x: f64) {
        self.w = self.w * DECAY + 1.0;
        self.sum = self.sum * DECAY + x;
    }

    fn mean(&self) -> Option<f64> {
        (self.w > 0.0).then(|| self.sum / self.w)
    }
}

/// The stages of a run spent on its input, not on the model's own work.
const INPUT_STAGES: [&str; 3] = ["download", "encode", "fetch_encodings"];

/// What a class's runs spent on their input, learned apart from their own work.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(super) struct InputCost {
    /// By the first run of each message (the one that fetches the input, and encodes it unless
    /// its encodings are held): what a running job that starts a message is expected to pay.
    first: Ewma,
    /// By runs that encoded their input or fetched its encodings: what a job pays on a worker
    /// that does not hold them.
    paid: Ewma,
}

/// What a job pays for its input, as the estimate counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Input {
    /// A later job of a message, or an edit whose input's encodings its worker holds.
    Held,
    /// The first job of a message, its encodings held or not (on average).
    First,
    /// An edit on a worker without its input's encodings.
    Paid,
}

/// The run times the farm measured, by class and worker (durable: part of a snapshot).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "RatesWire", into = "RatesWire")]
pub struct Rates {
    fits: BTreeMap<(Class, WorkerId), Fit>,
    /// When the last job to end of each batch message ended, by the message's first job: the
    /// jobs of a message all start (`started`) when the message does and then run one after
    /// another, so a job's own run begins when the one before it ended.
    message_ends: HashMap<JobId, DateTime<Utc>>,
    /// `message_ends`' keys, oldest first (it keeps the newest [`MESSAGE_ENDS`]).
    message_order: VecDeque<JobId>,
    /// How fast interactive work arrives.
    arrivals: Arrivals,
    /// What runs spent on their inputs, by class (`fits` hold the rest of each run).
    inputs: BTreeMap<Class, InputCost>,
}

/// [`Rates`] as JSON holds it (a map's keys must be strings there).
#[derive(Serialize, Deserialize)]
struct RatesWire {
    fits: Vec<(Class, WorkerId, Fit)>,
    message_ends: Vec<(JobId, DateTime<Utc>)>,
    /// Absent from the snapshots of schedulers built before arrivals were learned.
    #[serde(default)]
    arrivals: Arrivals,
    /// Absent from the snapshots of schedulers built before inputs were learned apart.
    #[serde(default)]
    inputs: Vec<(Class, InputCost)>,
}

impl From<RatesWire> for Rates {
    fn from(wire: RatesWire) -> Self {
        let mut rates = Rates {
            fits: wire.fits.into_iter().map(|(c, w, f)| ((c, w), f)).collect(),
            arrivals: wire.arrivals,
            inputs: wire.inputs.into_iter().collect(),
            ..Rates::default()
        };
        for (lead, at) in wire.message_ends {
            rates.message_ended(lead, at);
        }
        rates
    }
}

impl From<Rates> for RatesWire {
    fn from(rates: Rates) -> Self {
        RatesWire {
            fits: rates
                .fits
                .into_iter()
                .map(|((c, w), f)| (c, w, f))
                .collect(),
            message_ends: rates
                .message_order
                .iter()
                .filter_map(|lead| Some((*lead, *rates.message_ends.get(lead)?)))
                .collect(),
            arrivals: rates.arrivals,
            inputs: rates.inputs.into_iter().collect(),
        }
    }
}

impl Rates {
    /// Learns from a job just queued at `at` (a pipeline's jobs one by one): an interactive job
    /// is an arrival of its class's work.
    pub(super) fn queued(&mut self, job: &JobRecord, at: DateTime<Utc>) {
        let work = job.submission().and_then(|s| Work::of(&s.job));
        let interactive = job.priority() == vnfarm_proto::Priority::Interactive;
        self.arrivals.queued(work.as_ref(), interactive, at);
    }

    /// Learns from a job that has just completed at `at` (its record already says so): its run
    /// took from its `started` (or the end of the job before it in its message) to `at`, of which
    /// its input took what `timings` report for [`INPUT_STAGES`]. A job completed without a run of
    /// its own here (answered from an earlier run's manifest) teaches nothing.
    pub(super) fn learn(&mut self, job: &JobRecord, at: DateTime<Utc>, timings: &StageTimings) {
        let (Some(work), Some(worker), Some(started)) = (
            job.submission().and_then(|s| Work::of(&s.job)),
            job.worker(),
            job.started_at(),
        ) else {
            return;
        };
        let lead = job.batch;
        let before = lead.and_then(|l| self.message_ends.get(&l).copied());
        let began = before.map_or(started, |ended| started.max(ended));
        if let Some(l) = lead {
            self.message_ended(l, at);
        }
        let seconds = (at - began).num_microseconds().unwrap_or(0) as f64 / 1e6;
        if seconds < 0.0 {
            return;
        }
        let stage = |name: &str| timings.0.get(name).copied().unwrap_or(0.0).max(0.0);
        let input = INPUT_STAGES
            .iter()
            .map(|s| stage(s))
            .sum::<f64>()
            .min(seconds);
        let cost = self.inputs.entry(work.class.clone()).or_default();
        // The first run of its message: no job of it ended before.
        if before.is_none() {
            cost.first.add(input);
        }
        if stage("encode") > 0.0 || stage("fetch_encodings") > 0.0 {
            cost.paid.add(input);
        }
        self.fits
            .entry((work.class, worker.clone()))
            .or_default()
            .add(work.units, seconds - input);
    }

    /// Seconds a job of `class` is expected to spend on its input (none where nothing was
    /// learned yet: its runs' fits then hold it).
    pub(super) fn input_seconds(&self, class: &Class, input: Input) -> f64 {
        let Some(cost) = self.inputs.get(class) else {
            return 0.0;
        };
        match input {
            Input::Held => 0.0,
            Input::First => cost.first.mean().unwrap_or(0.0),
            Input::Paid => cost
                .paid
                .mean()
                .or_else(|| cost.first.mean())
                .unwrap_or(0.0),
        }
    }

    /// [`Rates::seconds`] with what the job pays for its input.
    pub(super) fn run_seconds(
        &self,
        work: &Work,
        worker: &WorkerId,
        input: Input,
    ) -> Result<(f64, String), String> {
        let (seconds, basis) = self.seconds(work, worker)?;
        let extra = self.input_seconds(&work.class, input);
        if extra > 0.0 {
            Ok((
                seconds + extra,
                format!("{basis}, + {extra:.2} s for its input"),
            ))
        } else {
            Ok((seconds, basis))
        }
    }

    fn message_ended(&mut self, lead: JobId, at: DateTime<Utc>) {
        if self.message_ends.insert(lead, at).is_none() {
            self.message_order.push_back(lead);
            while self.message_order.len() > MESSAGE_ENDS {
                if let Some(old) = self.message_order.pop_front() {
                    self.message_ends.remove(&old);
                }
            }
        }
    }

    /// When the last job to end of a batch message ended.
    pub(super) fn message_end(&self, lead: JobId) -> Option<DateTime<Utc>> {
        self.message_ends.get(&lead).copied()
    }

    /// Seconds `work` takes on `worker`, with what that rests on: the worker's own runs of the
    /// class; else the mean of the other workers' estimates for the class; else runs of the same
    /// model at another resolution (the nearest measured), scaled by the area. `Err` says why
    /// there is no basis.
    pub(super) fn seconds(&self, work: &Work, worker: &WorkerId) -> Result<(f64, String), String> {
        let class = &work.class;
        if let Some(fit) = self.fits.get(&(class.clone(), worker.clone()))
            && let Some(s) = fit.seconds(work.units)
        {
            return Ok((
                s,
                format!("{class} on {worker}: {} runs measured", fit.runs),
            ));
        }
        let others: Vec<(f64, u32)> = self
            .fits
            .iter()
            .filter(|((c, _), _)| c == class)
            .filter_map(|(_, fit)| Some((fit.seconds(work.units)?, fit.runs)))
            .collect();
        if !others.is_empty() {
            let mean = others.iter().map(|(s, _)| s).sum::<f64>() / others.len() as f64;
            let runs: u32 = others.iter().map(|(_, r)| r).sum();
            return Ok((
                mean,
                format!(
                    "{class}: {runs} runs measured on {} other worker(s)",
                    others.len()
                ),
            ));
        }
        if let Some(mp) = megapixels(&class.resolution) {
            let nearest = self
                .fits
                .iter()
                .filter(|((c, _), _)| c.model == class.model)
                .filter_map(|((c, w), fit)| {
                    let theirs = megapixels(&c.resolution)?;
                    let s = fit.seconds(work.units)?;
                    // This worker's own first, then the nearest area.
                    let rank = (w != worker, (mp.ln() - theirs.ln()).abs());
                    Some((rank, s * mp / theirs, c, fit.runs))
                })
                .min_by(|a, b| a.0.0.cmp(&b.0.0).then(a.0.1.total_cmp(&b.0.1)));
            if let Some((_, s, c, runs)) = nearest {
                return Ok((
                    s,
                    format!("{class}: scaled by area from {runs} runs of {c}"),
                ));
            }
        }
        Err(format!(
            "no {class} job has finished on this farm yet (estimates start after the first)"
        ))
    }
}

/// A job on a worker, in the order its engine runs them.
#[derive(Clone, Debug)]
pub(super) struct OnWorker {
    pub(super) id: JobId,
    pub(super) work: Option<Work>,
    /// When its run began, for a running job: its `started`, or the end of the job before it in
    /// its message when later.
    pub(super) started_at: Option<DateTime<Utc>>,
    /// What it pays for its input: the first job of its message to run pays it.
    pub(super) input: Input,
}

/// A worker as the simulation sees it.
#[derive(Clone, Debug)]
pub(super) struct SimWorker {
    pub(super) id: WorkerId,
    /// Heard from within the heartbeat timeout: otherwise nothing on it is estimated.
    pub(super) heard: bool,
    /// It takes new work (ready); otherwise (warming, draining) it only finishes what it has.
    pub(super) takes_work: bool,
    pub(super) models: Vec<ModelFamily>,
    pub(super) checkpoints: Vec<String>,
    pub(super) jobs: Vec<OnWorker>,
}

impl SimWorker {
    fn serves(&self, route: &Route) -> bool {
        self.models.contains(&route.model)
            && route
                .checkpoint
                .as_ref()
                .is_none_or(|c| self.checkpoints.contains(c))
    }
}

/// A job waiting for a worker (or for its inputs).
#[derive(Clone, Debug)]
pub(super) struct Waiting {
    pub(super) id: JobId,
    pub(super) route: Route,
    pub(super) work: Option<Work>,
    /// Unfinished jobs whose outputs it takes: it starts after they finish.
    pub(super) after: Vec<JobId>,
    /// For an edit, the affinity key of its inputs: batch edits wait for the worker that holds
    /// their inputs' encodings (or made their input), as dispatch holds them (§5).
    pub(super) affinity: Option<String>,
    pub(super) interactive: bool,
    /// The worker that holds its inputs' encodings now, if one does.
    pub(super) holder: Option<WorkerId>,
    /// The workers whose latest beat lists its inputs' encodings (`holder` may only have made
    /// the input): placed there it pays nothing for its input.
    pub(super) encoded_on: Vec<WorkerId>,
}

/// What the simulation is given.
#[derive(Clone, Debug)]
pub(super) struct SimInput {
    pub(super) now: DateTime<Utc>,
    pub(super) workers: Vec<SimWorker>,
    /// In dispatch order: the first is dispatched first when a worker serving it frees.
    pub(super) waiting: Vec<Waiting>,
    /// The interactive work expected to arrive from `now`, by class.
    pub(super) arrivals: Vec<Expected>,
}

/// What the interactive work expected to arrive does to one worker's batch jobs: it overtakes
/// them (§5), taking `load` of the worker's time (its share of the arrivals of the models it
/// serves, split evenly among the workers that serve them, priced by the rates), but no more
/// than `INTERACTIVE_BURST` of its mean interactive job before each batch job, as dispatch lets
/// at most that many interactive jobs go in a row while batch work waits. A fluid model: the
/// arrivals are spread evenly in time, not drawn.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Stretch {
    load: f64,
    most: Micros,
}

impl Stretch {
    /// The worker's stretch from the expected arrivals of the classes it serves.
    fn of(worker: &SimWorker, input: &SimInput, rates: &Rates) -> Stretch {
        if !(worker.heard && worker.takes_work) {
            return Stretch::default();
        }
        let (mut load, mut jobs) = (0.0, 0.0);
        for expected in &input.arrivals {
            let model = &expected.work.class.model;
            if !worker.models.contains(model) {
                continue;
            }
            let serving = input
                .workers
                .iter()
                .filter(|w| w.heard && w.takes_work && w.models.contains(model))
                .count();
            // A class without a basis yet is left out: its jobs say so when they come.
            let Ok((seconds, _)) = rates.run_seconds(&expected.work, &worker.id, Input::First)
            else {
                continue;
            };
            let per_second = expected.per_second / serving as f64;
            load += per_second * seconds;
            jobs += per_second;
        }
        if jobs <= 0.0 {
            return Stretch::default();
        }
        Stretch {
            load,
            most: micros(f64::from(INTERACTIVE_BURST) * load / jobs),
        }
    }

    /// When a batch job that the worker could start at `t` starts: after the work that arrived
    /// since `cleared` (when it last had none owed) and what arrives while that is served,
    /// `t′ − t = load × (t′ − cleared)`, at most `most` after `t`.
    fn batch_start(self, t: Micros, cleared: Micros) -> Micros {
        if self.load <= 0.0 {
            return t;
        }
        let fluid = if self.load < 1.0 {
            (t as f64 - self.load * cleared as f64) / (1.0 - self.load)
        } else {
            f64::INFINITY
        };
        t + micros((fluid - t as f64).min(self.most as f64) / 1e6)
    }
}

/// A job's estimate, or why it has none.
pub type Outcome = Result<Estimate, String>;

/// Microseconds since the simulation's `now`.
type Micros = i64;

fn micros(seconds: f64) -> Micros {
    (seconds * 1e6).round().clamp(0.0, 1e15) as Micros
}

/// The queue simulation: an estimate (or why none) for every job on a worker and every waiting
/// job of `input`.
pub(super) fn simulate(input: &SimInput, rates: &Rates) -> HashMap<JobId, Outcome> {
    let now = input.now;
    let at = |t: Micros| now + chrono::Duration::microseconds(t);
    let estimate = |start: Micros, finish: Micros, basis: String| Estimate {
        start_at: at(start),
        finish_at: at(finish),
        basis,
        made_at: now,
    };
    let mut out: HashMap<JobId, Outcome> = HashMap::new();
    // Predicted finishes, for the jobs that wait on them.
    let mut finishes: HashMap<JobId, Micros> = HashMap::new();
    // The worker each job on a worker is on (the images it makes are held there).
    let mut ran_on: HashMap<JobId, usize> = HashMap::new();

    // 1. What the workers have: one after another, from each running job's start.
    let mut free: BinaryHeap<Reverse<(Micros, usize)>> = BinaryHeap::new();
    let mut placed = 0usize;
    for (w, worker) in input.workers.iter().enumerate() {
        // The predicted finish of the job before, on this worker's engine.
        let mut prev: Option<Micros> = None;
        let mut known = true;
        for job in &worker.jobs {
            if !worker.heard {
                out.insert(
                    job.id,
                    Err(format!("its worker {} has not been heard from", worker.id)),
                );
                continue;
            }
            if !known {
                out.insert(
                    job.id,
                    Err(format!(
                        "it waits on worker {} behind a job without an estimate",
                        worker.id
                    )),
                );
                continue;
            }
            let cost = match &job.work {
                Some(work) => rates.run_seconds(work, &worker.id, job.input),
                None => Err("a job of unknown kind".into()),
            };
            let (seconds, basis) = match cost {
                Ok(cost) => cost,
                Err(why) => {
                    out.insert(job.id, Err(why));
                    known = false;
                    continue;
                }
            };
            // A running job began in the past (a negative offset), a job sent and not started
            // begins when the one before it ends; one that overruns its estimate is taken to
            // finish now.
            let start = match job.started_at {
                Some(s) => (s - now).num_microseconds().unwrap_or(0),
                None => 0,
            };
            let start = prev.map_or(start, |p| start.max(p));
            let finish = (start + micros(seconds)).max(0);
            prev = Some(finish);
            finishes.insert(job.id, finish);
            ran_on.insert(job.id, w);
            placed += 1;
            out.insert(
                job.id,
                Ok(estimate(
                    start,
                    finish,
                    format!("{basis}; on worker {}", worker.id),
                )),
            );
        }
        if worker.heard && worker.takes_work && known {
            free.push(Reverse((prev.unwrap_or(0), w)));
        }
    }

    // 2. The waiting jobs, in dispatch order, as workers free up; each worker's batch jobs after
    // the interactive work expected to arrive first (owed since `cleared`).
    let stretch: Vec<Stretch> = input
        .workers
        .iter()
        .map(|worker| Stretch::of(worker, input, rates))
        .collect();
    let mut cleared: Vec<Micros> = vec![0; input.workers.len()];
    let n = input.waiting.len();
    let index: HashMap<JobId, usize> = input
        .waiting
        .iter()
        .enumerate()
        .map(|(i, j)| (j.id, i))
        .collect();
    let mut ready_at: Vec<Micros> = vec![0; n];
    let mut unmet: Vec<usize> = vec![0; n];
    let mut blocked: HashMap<usize, Vec<usize>> = HashMap::new();
    // Released jobs by route, by their place in the order.
    let mut released: BTreeMap<&Route, BTreeSet<usize>> = BTreeMap::new();
    let mut releases: BinaryHeap<Reverse<(Micros, usize)>> = BinaryHeap::new();
    // Which worker holds each affinity key (by its index).
    let by_id: HashMap<&WorkerId, usize> = input
        .workers
        .iter()
        .enumerate()
        .map(|(w, worker)| (&worker.id, w))
        .collect();
    let mut holders: HashMap<&str, usize> = HashMap::new();
    for job in &input.waiting {
        let Some(key) = &job.affinity else { continue };
        let holder = job
            .holder
            .as_ref()
            .and_then(|h| by_id.get(h).copied())
            .or_else(|| job.after.iter().find_map(|d| ran_on.get(d).copied()));
        if let Some(w) = holder {
            holders.entry(key.as_str()).or_insert(w);
        }
    }
    // Which workers hold each affinity key's encodings: by their beats, then as the simulation
    // places an edit of it.
    let mut encoded: HashSet<(&str, usize)> = HashSet::new();
    for job in &input.waiting {
        if let Some(key) = &job.affinity {
            for w in job.encoded_on.iter().filter_map(|w| by_id.get(w)) {
                encoded.insert((key.as_str(), *w));
            }
        }
    }
    let mut failed: Vec<(usize, String)> = Vec::new();
    for (i, job) in input.waiting.iter().enumerate() {
        if !input
            .workers
            .iter()
            .any(|w| w.heard && w.takes_work && w.serves(&job.route))
        {
            failed.push((i, format!("no live worker serves {}", job.route)));
            continue;
        }
        let mut why = None;
        for dep in &job.after {
            if let Some(&d) = index.get(dep) {
                unmet[i] += 1;
                blocked.entry(d).or_default().push(i);
            } else if let Some(f) = finishes.get(dep) {
                ready_at[i] = ready_at[i].max(*f);
            } else if out.get(dep).is_some_and(Result::is_err) {
                why = Some(format!("its input job {dep} has no estimate"));
            }
        }
        if let Some(why) = why {
            failed.push((i, why));
        } else if unmet[i] == 0 {
            releases.push(Reverse((ready_at[i], i)));
        }
    }
    // A job that cannot be estimated takes the jobs waiting on it along.
    let mut dead = vec![false; n];
    let fail =
        |start: Vec<(usize, String)>, out: &mut HashMap<JobId, Outcome>, dead: &mut Vec<bool>| {
            let mut stack = start;
            while let Some((i, why)) = stack.pop() {
                if std::mem::replace(&mut dead[i], true) {
                    continue;
                }
                let id = input.waiting[i].id;
                out.insert(id, Err(why));
                for &d in blocked.get(&i).into_iter().flatten() {
                    stack.push((d, format!("its input job {id} has no estimate")));
                }
            }
        };
    fail(failed, &mut out, &mut dead);

    while let Some(Reverse((t, w))) = free.pop() {
        while let Some(&Reverse((r, i))) = releases.peek() {
            if r > t {
                break;
            }
            releases.pop();
            if !dead[i] {
                released
                    .entry(&input.waiting[i].route)
                    .or_default()
                    .insert(i);
            }
        }
        let worker = &input.workers[w];
        // Its next job, as `affinity` picks it (§5): first the released edits of inputs it holds,
        // unless they are batch work and interactive work it could run waits; then the first
        // released job of a route it serves, passing over batch edits whose inputs another worker
        // holds (they wait for it), unless it has nothing else to do (dispatch is
        // work-conserving).
        let held = |i: &usize| {
            let job = &input.waiting[*i];
            job.affinity
                .as_ref()
                .and_then(|k| holders.get(k.as_str()))
                .is_some_and(|h| *h == w)
        };
        let mine = |i: &usize| {
            let job = &input.waiting[*i];
            job.interactive
                || job
                    .affinity
                    .as_ref()
                    .and_then(|k| holders.get(k.as_str()))
                    .is_none_or(|h| *h == w)
        };
        let serving = || {
            released
                .iter()
                .filter(|(route, _)| worker.serves(route))
                .map(|(_, set)| set)
        };
        let first = serving().filter_map(|set| set.first().copied()).min();
        let urgent = first.is_some_and(|i| input.waiting[i].interactive);
        let next = serving()
            .filter_map(|set| {
                set.iter()
                    .take(HOLD_SCAN)
                    .copied()
                    .find(|i| held(i) && (input.waiting[*i].interactive || !urgent))
            })
            .min()
            .or_else(|| {
                serving()
                    .filter_map(|set| set.iter().take(HOLD_SCAN).copied().find(mine))
                    .min()
            })
            .or(first);
        let Some(i) = next else {
            // Nothing it serves is ready yet: it is free again when the next job is, having
            // served what arrived meanwhile if there was time.
            if let Some(&Reverse((r, _))) = releases.peek() {
                let r = r.max(t);
                if r >= stretch[w].batch_start(t, cleared[w]) {
                    cleared[w] = r;
                }
                free.push(Reverse((r, w)));
            }
            continue;
        };
        let job = &input.waiting[i];
        if let Some(set) = released.get_mut(&job.route) {
            set.remove(&i);
            if set.is_empty() {
                released.remove(&job.route);
            }
        }
        // An edit pays for its input where the worker does not hold its encodings (it holds
        // them from then on); another job as the first of a message.
        let pays = match &job.affinity {
            Some(key) if !encoded.insert((key.as_str(), w)) => Input::Held,
            Some(_) => Input::Paid,
            None => Input::First,
        };
        let cost = match &job.work {
            Some(work) => rates.run_seconds(work, &worker.id, pays),
            None => Err("a job of unknown kind".into()),
        };
        match cost {
            Ok((seconds, basis)) => {
                let start = if job.interactive {
                    t
                } else {
                    cleared[w] = stretch[w].batch_start(t, cleared[w]);
                    cleared[w]
                };
                let overtaken = if start > t {
                    format!(
                        ", after {:.1} s of interactive work expected to arrive",
                        (start - t) as f64 / 1e6
                    )
                } else {
                    String::new()
                };
                let finish = start + micros(seconds);
                finishes.insert(job.id, finish);
                out.insert(
                    job.id,
                    Ok(estimate(
                        start,
                        finish,
                        format!(
                            "{basis}; {placed} job(s) ahead of it, then worker {}{overtaken}",
                            worker.id
                        ),
                    )),
                );
                placed += 1;
                free.push(Reverse((finish, w)));
                // It holds this input's encodings now, and the images it makes.
                if let Some(key) = &job.affinity {
                    holders.entry(key.as_str()).or_insert(w);
                }
                for &d in blocked.get(&i).into_iter().flatten() {
                    if let Some(key) = &input.waiting[d].affinity {
                        holders.entry(key.as_str()).or_insert(w);
                    }
                    ready_at[d] = ready_at[d].max(finish);
                    unmet[d] -= 1;
                    if unmet[d] == 0 && !dead[d] {
                        releases.push(Reverse((ready_at[d], d)));
                    }
                }
            }
            // The worker's time after a job without an estimate is unknown: it takes no more.
            Err(why) => fail(vec![(i, why)], &mut out, &mut dead),
        }
    }
    for job in &input.waiting {
        out.entry(job.id).or_insert_with(|| {
            Err("it waits behind jobs without an estimate on every worker that serves it".into())
        });
    }
    out
}

/// The estimates last made, and when.
#[derive(Default)]
pub(super) struct Estimates {
    made: Option<Instant>,
    /// Since when the next are being made.
    making: Option<Instant>,
    by_job: HashMap<JobId, Outcome>,
}

/// The queue and the rates, copied out of the registry, to make estimates from.
pub struct EstimateWork {
    input: SimInput,
    rates: Rates,
}

/// Estimates made, to be stored in the registry.
pub struct MadeEstimates(HashMap<JobId, Outcome>);

impl EstimateWork {
    /// Runs the simulation (O(jobs × routes + jobs × log jobs)): off the async runtime and
    /// without the registry's lock.
    pub fn make(self) -> MadeEstimates {
        MadeEstimates(simulate(&self.input, &self.rates))
    }
}

impl Registry {
    /// The waiting jobs of a route (ready, or held for their input's holder) in the order dispatch
    /// takes them, by the turns of `plan.rs`: an owner's `n`-th waiting job gets the turn (class,
    /// move to the front, their jobs on workers + `n`, when they were last served, age), which is
    /// the round by person as slots free one at a time. Paused work is left out (it has no
    /// estimate until resumed); per-person caps and quotas are not simulated.
    pub(super) fn dispatch_order(&self, route: &Route) -> Vec<JobId> {
        if self.shares.farm_paused().is_some() {
            return Vec::new();
        }
        let mut queues: BTreeMap<&str, Vec<super::record::QueueKey>> = BTreeMap::new();
        for (owner, queue) in self.jobs.ready().get(route).into_iter().flatten() {
            queues
                .entry(owner)
                .or_default()
                .extend(queue.iter().copied());
        }
        for job in self.jobs.holds().iter().map(|(_, id)| &self.jobs[id]) {
            if job.route().as_ref() == Some(route) {
                queues.entry(job.owner()).or_default().push(job.queue_key());
            }
        }
        let mut order: Vec<(u8, u64, usize, u64, JobId)> = Vec::new();
        for (owner, mut keys) in queues {
            if self.shares.paused().contains_key(owner) {
                continue;
            }
            keys.sort_unstable();
            let (running, served) = (self.jobs.running(owner), self.shares.served(owner));
            order.extend(
                keys.into_iter()
                    .enumerate()
                    .map(|(n, (class, front, id))| (class, front, running + n, served, id)),
            );
        }
        order.sort_unstable();
        order.into_iter().map(|t| t.4).collect()
    }

    /// What the next estimates are made from, when the last were made [`REFRESH`] ago or more and
    /// none are being made: the caller makes them ([`EstimateWork::make`], without the registry's
    /// lock) and stores them ([`Registry::store_estimates`]). The lock is held only to copy the
    /// queue's shape and the rates.
    pub fn estimates_due(&mut self, heartbeat_timeout: Duration) -> Option<EstimateWork> {
        let fresh = self
            .estimates
            .made
            .is_some_and(|made| made.elapsed() < REFRESH);
        // One at a time; a maker that never stored (its task died) is given up on.
        let making = self
            .estimates
            .making
            .is_some_and(|since| since.elapsed() < 10 * REFRESH);
        if fresh || making {
            return None;
        }
        self.estimates.making = Some(Instant::now());
        Some(EstimateWork {
            input: self.sim_input(Utc::now(), heartbeat_timeout),
            rates: self.rates.clone(),
        })
    }

    /// Keeps the estimates just made, with each unfinished pipeline's from its jobs'.
    pub fn store_estimates(&mut self, made: MadeEstimates) {
        let mut by_job = made.0;
        self.add_pipelines(&mut by_job);
        self.estimates = Estimates {
            made: Some(Instant::now()),
            making: None,
            by_job,
        };
    }

    /// Makes the estimates again, here, if they are due ([`Registry::estimates_due`]).
    pub fn refresh_estimates(&mut self, heartbeat_timeout: Duration) {
        if let Some(work) = self.estimates_due(heartbeat_timeout) {
            let made = work.make();
            self.store_estimates(made);
        }
    }

    /// A job's estimate as last made (see [`Registry::refresh_estimates`]), or why it has none;
    /// `None` for a finished job.
    pub fn estimate(&self, job: &JobRecord) -> Option<Outcome> {
        if job.state.is_terminal() {
            return None;
        }
        Some(match self.estimates.by_job.get(&job.id) {
            Some(outcome) => outcome.clone(),
            None => Err(match job.state {
                JobState::Retrying => "a transient failure: estimated again once requeued".into(),
                JobState::Queued if job.local.cancel_requested => "being cancelled".into(),
                JobState::Queued
                    if self.shares.farm_paused().is_some()
                        || self.shares.paused().contains_key(job.owner()) =>
                {
                    "paused: estimated again once resumed".into()
                }
                JobState::Queued | JobState::Dispatched | JobState::Running => {
                    "not estimated yet (estimates are remade a few times a second)".into()
                }
                JobState::Completed
                | JobState::Failed
                | JobState::Cancelled
                | JobState::Unknown => "in a state this build does not estimate".into(),
            }),
        })
    }

    /// What the simulation needs, from the records: every worker with the jobs on it, and the
    /// waiting jobs in dispatch order (those being dispatched first, then each route's order
    /// merged by the rank of its head; jobs waiting for their inputs join by rank).
    pub(super) fn sim_input(&self, now: DateTime<Utc>, timeout: Duration) -> SimInput {
        let work = |job: &JobRecord| job.submission().and_then(|s| Work::of(&s.job));
        let mut workers = Vec::new();
        for w in self.workers.values() {
            let Some((_, hb)) = w.last_heartbeat() else {
                continue;
            };
            let mut on: Vec<&JobRecord> = w
                .assigned()
                .filter_map(|id| self.jobs.get(&id))
                .filter(|j| matches!(j.state, JobState::Running | JobState::Dispatched))
                .collect();
            on.sort_by_key(|j| (j.state != JobState::Running, j.started_at(), j.id));
            // The messages whose first job to run is before, in this order.
            let mut begun: HashSet<JobId> = HashSet::new();
            let jobs = on
                .into_iter()
                .map(|j| OnWorker {
                    id: j.id,
                    work: work(j),
                    started_at: (j.state == JobState::Running).then(|| {
                        let started = j.started_at().unwrap_or(j.updated_at);
                        j.batch
                            .and_then(|lead| self.rates.message_end(lead))
                            .map_or(started, |ended| started.max(ended))
                    }),
                    input: match (j.batch, j.local.encodings_held) {
                        (Some(lead), _)
                            if self.rates.message_end(lead).is_some() || !begun.insert(lead) =>
                        {
                            Input::Held
                        }
                        (_, Some(true)) => Input::Held,
                        (_, Some(false)) => Input::Paid,
                        (_, None) => Input::First,
                    },
                })
                .collect();
            workers.push(SimWorker {
                id: w.id().clone(),
                heard: w.alive(timeout),
                takes_work: hb.state == WorkerState::Ready,
                models: hb.models.clone(),
                checkpoints: hb.checkpoints.clone(),
                jobs,
            });
        }

        let mut pending = Vec::new();
        let mut on_inputs = Vec::new();
        for id in self.jobs.active() {
            let job = &self.jobs[id];
            if job.state != JobState::Queued || job.is_pipeline() || job.local.cancel_requested {
                continue;
            }
            if job.local.dispatch_pending {
                pending.push(job.rank());
            } else if job.local.unmet > 0 {
                on_inputs.push(job.rank());
            }
        }
        pending.sort_unstable();
        on_inputs.sort_unstable();
        let routes: BTreeSet<Route> = self
            .jobs
            .ready()
            .keys()
            .cloned()
            .chain(
                self.jobs
                    .holds()
                    .iter()
                    .filter_map(|(_, id)| self.jobs[id].route()),
            )
            .collect();
        let mut queues: Vec<VecDeque<JobId>> = routes
            .iter()
            .map(|r| self.dispatch_order(r).into())
            .collect();
        queues.push(on_inputs.into_iter().map(|(_, id)| id).collect());
        let mut order: Vec<JobId> = pending.into_iter().map(|(_, id)| id).collect();
        // As dispatch goes: at most `INTERACTIVE_BURST` interactive jobs in a row while a batch
        // job could go.
        let mut streak = self.interactive_streak;
        loop {
            let heads = queues.iter_mut().filter(|q| !q.is_empty());
            let next = if streak >= super::INTERACTIVE_BURST {
                heads
                    .filter(|q| self.jobs[&q[0]].rank().0 > 0)
                    .min_by_key(|q| self.jobs[&q[0]].rank())
            } else {
                heads.min_by_key(|q| self.jobs[&q[0]].rank())
            };
            let next = match next {
                Some(q) => q,
                None => match queues
                    .iter_mut()
                    .filter(|q| !q.is_empty())
                    .min_by_key(|q| self.jobs[&q[0]].rank())
                {
                    Some(q) => q,
                    None => break,
                },
            };
            let Some(id) = next.pop_front() else { break };
            let interactive = self.jobs[&id].rank().0 == 0;
            streak = if interactive { streak + 1 } else { 0 };
            order.push(id);
        }
        let waiting = order
            .into_iter()
            .filter_map(|id| {
                let job = &self.jobs[&id];
                let affinity = match &job.submission()?.job {
                    JobSpec::Edit(e) => e.affinity_key(),
                    JobSpec::Generate(_) | JobSpec::Upscale(_) | JobSpec::Pipeline(_) => None,
                };
                let holder = affinity.as_ref().and_then(|key| {
                    self.workers
                        .values()
                        .find(|w| w.holds(key))
                        .map(|w| w.id().clone())
                });
                let encoded_on = affinity.as_ref().map_or_else(Vec::new, |key| {
                    self.workers
                        .values()
                        .filter(|w| w.has_encodings(key))
                        .map(|w| w.id().clone())
                        .collect()
                });
                Some(Waiting {
                    id,
                    route: job.route()?,
                    work: work(job),
                    after: job
                        .dependencies()
                        .into_iter()
                        .filter(|d| self.jobs.is_active(d))
                        .collect(),
                    affinity,
                    interactive: job.rank().0 == 0,
                    holder,
                    encoded_on,
                })
            })
            .collect();
        SimInput {
            now,
            workers,
            waiting,
            arrivals: self.rates.arrivals.expected(now),
        }
    }

    /// A pipeline's estimate from its unfinished jobs': it starts with the first of them and
    /// finishes with the last.
    fn add_pipelines(&self, by_job: &mut HashMap<JobId, Outcome>) {
        for id in self.jobs.active() {
            let job = &self.jobs[id];
            if !job.is_pipeline() {
                continue;
            }
            let mut outcome: Option<Outcome> = None;
            for child in &job.children {
                if !self.jobs.is_active(child) {
                    continue;
                }
                let theirs = by_job
                    .get(child)
                    .cloned()
                    .unwrap_or_else(|| Err(format!("its job {child} is not estimated yet")));
                outcome = Some(match (outcome, theirs) {
                    (None, theirs) => theirs,
                    (Some(Err(why)), _) => Err(why),
                    (Some(Ok(_)), Err(why)) => Err(format!("its job {child}: {why}")),
                    (Some(Ok(a)), Ok(b)) => Ok(Estimate {
                        start_at: a.start_at.min(b.start_at),
                        finish_at: a.finish_at.max(b.finish_at),
                        ..a
                    }),
                });
            }
            if let Some(outcome) = outcome {
                let unfinished = job
                    .children
                    .iter()
                    .filter(|c| self.jobs.is_active(c))
                    .count();
                by_job.insert(
                    *id,
                    outcome.map(|e| Estimate {
                        basis: format!(
                            "its {unfinished} unfinished job(s): the first starts, the last ends"
                        ),
                        ..e
                    }),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::{EventKind, Priority, Submission};

    use super::super::testing::*;
    use super::*;

    fn sdxl(units: f64) -> Work {
        Work {
            class: Class {
                model: ModelFamily::Sdxl,
                resolution: "1mp".into(),
            },
            units,
        }
    }

    fn route() -> Route {
        Route {
            model: ModelFamily::Sdxl,
            checkpoint: None,
            catalogue: None,
        }
    }

    /// Rates of `seconds` per job of `sdxl(1.0)` on each of `workers`.
    fn rates(workers: &[&str], seconds: f64) -> Rates {
        let mut r = Rates::default();
        for w in workers {
            r.fits
                .entry((sdxl(1.0).class, wid(w)))
                .or_default()
                .add(1.0, seconds);
        }
        r
    }

    fn sim_worker(id: &str, jobs: Vec<OnWorker>) -> SimWorker {
        SimWorker {
            id: wid(id),
            heard: true,
            takes_work: true,
            models: vec![ModelFamily::Sdxl],
            checkpoints: vec![],
            jobs,
        }
    }

    fn waiting(after: Vec<JobId>) -> Waiting {
        Waiting {
            id: JobId::new(),
            route: route(),
            work: Some(sdxl(1.0)),
            after,
            affinity: None,
            interactive: false,
            holder: None,
            encoded_on: vec![],
        }
    }

    /// Seconds from `now` of an estimate's start and finish.
    fn offsets(out: &HashMap<JobId, Outcome>, id: JobId, now: DateTime<Utc>) -> (f64, f64) {
        let e = out[&id]
            .as_ref()
            .unwrap_or_else(|why| panic!("{id}: {why}"));
        let s = |t: DateTime<Utc>| (t - now).num_milliseconds() as f64 / 1e3;
        (s(e.start_at), s(e.finish_at))
    }

    #[test]
    fn a_fit_tells_the_fixed_part_from_the_part_per_step() {
        let mut fit = Fit::default();
        for units in [10.0, 20.0, 40.0, 20.0] {
            fit.add(units, 2.0 + 0.5 * units);
        }
        let s = fit.seconds(30.0).unwrap();
        assert!((s - 17.0).abs() < 1e-9, "{s}");
        // One amount of work alone: seconds per unit.
        let mut fit = Fit::default();
        fit.add(20.0, 10.0);
        assert_eq!(fit.seconds(40.0), Some(20.0));
        assert_eq!(Fit::default().seconds(1.0), None);
    }

    #[test]
    fn the_waiting_jobs_go_in_order_to_the_worker_that_frees_first() {
        let now = Utc::now();
        let half_ago = now - chrono::Duration::milliseconds(500);
        let (a, b) = (JobId::new(), JobId::new());
        let on = |id, started_at| OnWorker {
            id,
            work: Some(sdxl(1.0)),
            started_at,
            input: Input::First,
        };
        let queue: Vec<Waiting> = (0..4).map(|_| waiting(vec![])).collect();
        let input = SimInput {
            now,
            workers: vec![
                sim_worker("a", vec![on(a, Some(half_ago))]),
                // Sent, not started: it starts now.
                sim_worker("b", vec![on(b, None)]),
            ],
            waiting: queue.clone(),
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert_eq!(offsets(&out, a, now), (-0.5, 0.5));
        assert_eq!(offsets(&out, b, now), (0.0, 1.0));
        let got: Vec<(f64, f64)> = queue.iter().map(|j| offsets(&out, j.id, now)).collect();
        assert_eq!(got, [(0.5, 1.5), (1.0, 2.0), (1.5, 2.5), (2.0, 3.0)]);
        let basis = &out[&queue[2].id].as_ref().unwrap().basis;
        assert!(basis.contains("sdxl 1mp on a: 1 runs measured"), "{basis}");
    }

    /// A job waiting for its input starts when the input's job is predicted to finish; meanwhile
    /// the worker takes the jobs behind it that are ready.
    #[test]
    fn a_job_waits_for_its_input_and_the_jobs_behind_it_go_first() {
        let now = Utc::now();
        let base = waiting(vec![]);
        let edit = waiting(vec![base.id]);
        let other = waiting(vec![]);
        let input = SimInput {
            now,
            workers: vec![sim_worker("a", vec![]), sim_worker("b", vec![])],
            waiting: vec![base.clone(), edit.clone(), other.clone()],
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a", "b"], 2.0));
        assert_eq!(offsets(&out, base.id, now), (0.0, 2.0));
        assert_eq!(offsets(&out, other.id, now), (0.0, 2.0));
        assert_eq!(offsets(&out, edit.id, now), (2.0, 4.0));
    }

    /// No run of a class measured: that job has no estimate, and neither have the jobs behind it
    /// on its worker or the jobs that take its output; the other worker's are still estimated.
    #[test]
    fn without_a_measured_rate_a_job_says_why_and_takes_nothing_else_with_it() {
        let now = Utc::now();
        let unknown = Work {
            class: Class {
                model: ModelFamily::Sdxl,
                resolution: ANY_INPUT.into(),
            },
            units: 1.0,
        };
        let (x, behind) = (JobId::new(), JobId::new());
        let on = |id, work| OnWorker {
            id,
            work: Some(work),
            started_at: None,
            input: Input::First,
        };
        let of_x = waiting(vec![x]);
        let fine = waiting(vec![]);
        let input = SimInput {
            now,
            workers: vec![
                sim_worker("a", vec![on(x, unknown), on(behind, sdxl(1.0))]),
                sim_worker("b", vec![]),
            ],
            waiting: vec![of_x.clone(), fine.clone()],
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert!(
            out[&x]
                .as_ref()
                .unwrap_err()
                .contains("no sdxl input job has finished"),
            "{:?}",
            out[&x]
        );
        assert!(out[&behind].as_ref().unwrap_err().contains("behind a job"));
        assert!(out[&of_x.id].as_ref().unwrap_err().contains("input job"));
        assert_eq!(offsets(&out, fine.id, now), (0.0, 1.0));
    }

    /// A batch edit waits for the worker that holds its input while the other worker has other
    /// work; an interactive one does not wait.
    #[test]
    fn a_batch_edit_waits_for_its_inputs_holder() {
        let now = Utc::now();
        let busy = JobId::new();
        let on = OnWorker {
            id: busy,
            work: Some(sdxl(1.0)),
            started_at: None,
            input: Input::First,
        };
        let edit = |interactive| Waiting {
            affinity: Some("qwen-edit:stored:x".into()),
            interactive,
            holder: Some(wid("a")),
            encoded_on: vec![],
            ..waiting(vec![])
        };
        let (held, other, urgent) = (edit(false), waiting(vec![]), edit(true));
        let input = SimInput {
            now,
            workers: vec![sim_worker("a", vec![on]), sim_worker("b", vec![])],
            waiting: vec![held.clone(), other.clone()],
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert_eq!(
            offsets(&out, other.id, now),
            (0.0, 1.0),
            "b takes the other job"
        );
        assert_eq!(
            offsets(&out, held.id, now),
            (1.0, 2.0),
            "the edit waits for a"
        );
        let input = SimInput {
            waiting: vec![urgent.clone(), other.clone()],
            ..input
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert_eq!(
            offsets(&out, urgent.id, now),
            (0.0, 1.0),
            "interactive: at once"
        );
    }

    /// Interactive work expected at half a job per second (1 s each, so half the one worker's
    /// time) overtakes the waiting batch jobs, not the interactive one. By hand: the running job
    /// ends at 1 s and the interactive job runs until 2 s; by then 1 s of new interactive work
    /// has arrived, and 1 s more while that is served, so the first batch job starts at 4 s
    /// (`t′ = 2 + 0.5 × t′`); the 0.5 s that arrives while it runs and what arrives while that is
    /// served put the second at 6 s. Without the arrivals they run back to back from 2 s.
    #[test]
    fn expected_interactive_arrivals_put_batch_jobs_later() {
        let now = Utc::now();
        let running = OnWorker {
            id: JobId::new(),
            work: Some(sdxl(1.0)),
            started_at: Some(now),
            input: Input::First,
        };
        let urgent = Waiting {
            interactive: true,
            ..waiting(vec![])
        };
        let (first, second) = (waiting(vec![]), waiting(vec![]));
        let without = SimInput {
            now,
            workers: vec![sim_worker("a", vec![running])],
            waiting: vec![urgent.clone(), first.clone(), second.clone()],
            arrivals: vec![],
        };
        let expecting = |per_second| SimInput {
            arrivals: vec![Expected {
                per_second,
                work: sdxl(1.0),
            }],
            ..without.clone()
        };
        let rates = rates(&["a"], 1.0);
        let plain = simulate(&without, &rates);
        let stretched = simulate(&expecting(0.5), &rates);
        let at = |out: &HashMap<JobId, Outcome>, id| offsets(out, id, now);
        assert_eq!(at(&plain, urgent.id), (1.0, 2.0));
        assert_eq!(at(&plain, first.id), (2.0, 3.0));
        assert_eq!(at(&plain, second.id), (3.0, 4.0));
        assert_eq!(at(&stretched, urgent.id), (1.0, 2.0), "not overtaken");
        assert_eq!(at(&stretched, first.id), (4.0, 5.0));
        assert_eq!(at(&stretched, second.id), (6.0, 7.0));
        let basis = &stretched[&second.id].as_ref().unwrap().basis;
        assert!(
            basis.contains("after 1.0 s of interactive work expected to arrive"),
            "{basis}"
        );
        // At 0.9 of the worker's time, dispatch's burst limit bounds the wait: at most
        // `INTERACTIVE_BURST` interactive jobs of 1 s go before each batch job.
        let burst = simulate(&expecting(0.9), &rates);
        assert_eq!(at(&burst, first.id), (6.0, 7.0));
        assert_eq!(at(&burst, second.id), (11.0, 12.0));
    }

    /// Through the registry: interactive jobs queued every 2 s over the last minute (each 1 s of
    /// work, as the farm measured) make the rate half a job per second, so the batch job waiting
    /// behind a running one starts about twice as late from now as without them.
    #[test]
    fn the_arrival_rate_is_learned_from_the_queued_events() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let learn = s.queue(&mut r, generate());
        run(&mut s, &mut r, learn, "a", None);
        s.at += chrono::Duration::seconds(1);
        s.completed_on(&mut r, learn, "a");
        for _ in 0..30 {
            s.at += chrono::Duration::seconds(2);
            let id = s.queue(
                &mut r,
                Submission {
                    priority: Priority::Interactive,
                    ..generate()
                },
            );
            s.complete(&mut r, id);
        }
        let running = s.queue(&mut r, generate());
        run(&mut s, &mut r, running, "a", None);
        let batch = s.queue(&mut r, generate());
        let now = s.at;
        let input = r.sim_input(now, T);
        assert_eq!(input.arrivals.len(), 1);
        let rate = input.arrivals[0].per_second;
        assert!((rate - 0.5).abs() < 0.02, "{rate}");
        let learned = simulate(&input, &r.rates);
        let without = simulate(
            &SimInput {
                arrivals: vec![],
                ..input
            },
            &r.rates,
        );
        let (plain, stretched) = (offsets(&without, batch, now), offsets(&learned, batch, now));
        assert!((plain.0 - 1.0).abs() < 0.01, "{plain:?}");
        assert!((stretched.0 - 2.0).abs() < 0.1, "{stretched:?}");
    }

    /// As `affinity` does, a worker that frees takes the batch edits of inputs it holds before
    /// the jobs ahead of them in the order, unless interactive work waits.
    #[test]
    fn a_worker_takes_the_edits_of_inputs_it_holds_first() {
        let now = Utc::now();
        let on = |seconds: f64| OnWorker {
            id: JobId::new(),
            work: Some(sdxl(seconds)),
            started_at: Some(now),
            input: Input::First,
        };
        let edit = Waiting {
            affinity: Some("qwen-edit:stored:x".into()),
            holder: Some(wid("a")),
            encoded_on: vec![],
            ..waiting(vec![])
        };
        let (ahead, urgent) = (
            waiting(vec![]),
            Waiting {
                interactive: true,
                ..waiting(vec![])
            },
        );
        let input = SimInput {
            now,
            // a frees at 1 s, b at 2 s.
            workers: vec![
                sim_worker("a", vec![on(1.0)]),
                sim_worker("b", vec![on(2.0)]),
            ],
            waiting: vec![ahead.clone(), edit.clone()],
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert_eq!(offsets(&out, edit.id, now), (1.0, 2.0), "a takes its edit");
        assert_eq!(offsets(&out, ahead.id, now), (2.0, 3.0), "b the job ahead");
        let input = SimInput {
            waiting: vec![urgent.clone(), ahead.clone(), edit.clone()],
            ..input
        };
        let out = simulate(&input, &rates(&["a", "b"], 1.0));
        assert_eq!(
            offsets(&out, urgent.id, now),
            (1.0, 2.0),
            "interactive first"
        );
        assert_eq!(offsets(&out, edit.id, now), (2.0, 3.0), "then a's edit");
        assert_eq!(offsets(&out, ahead.id, now), (2.0, 3.0), "b the job ahead");
    }

    #[test]
    fn a_job_no_live_worker_serves_has_no_estimate() {
        let now = Utc::now();
        let mut job = waiting(vec![]);
        job.route.checkpoint = Some("other".into());
        let input = SimInput {
            now,
            workers: vec![sim_worker("a", vec![])],
            waiting: vec![job.clone()],
            arrivals: vec![],
        };
        let out = simulate(&input, &rates(&["a"], 1.0));
        assert_eq!(
            out[&job.id].as_ref().unwrap_err(),
            "no live worker serves sdxl checkpoint other"
        );
    }

    fn sized(width: u32, steps: u32) -> Submission {
        let mut s = generate();
        if let JobSpec::Generate(g) = &mut s.job {
            (g.width, g.height, g.steps) = (width, width, steps);
        }
        s
    }

    /// The registry a restarted scheduler restores from `r`'s snapshot.
    fn restored(r: &Registry) -> Registry {
        let mut bytes = Vec::new();
        r.snapshot().write(&mut bytes).unwrap();
        Registry::restore(
            serde_json::from_slice(&bytes).unwrap(),
            super::super::Retention::default(),
        )
    }

    /// Dispatches the job to `worker` (in the message `batch` names) and starts it there.
    fn run(s: &mut Stream, r: &mut Registry, id: JobId, worker: &str, batch: Option<JobId>) {
        r.apply(s.ev(
            id,
            EventKind::Dispatched {
                queue: "q".into(),
                worker: Some(wid(worker)),
                batch,
                term: Some(1),
            },
        ));
        r.apply(s.ev(
            id,
            EventKind::Started {
                worker: wid(worker),
                attempt: 1,
            },
        ));
    }

    /// The rate comes from `started` → `completed` per model, resolution class and worker; the
    /// jobs of a batch message, which all start with the message, each from the end of the one
    /// before; another worker uses the mean of the others', another size the area's scale.
    #[test]
    fn rates_are_learned_from_the_streams_event_times() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let (first, second) = (
            s.queue(&mut r, sized(1024, 20)),
            s.queue(&mut r, sized(1024, 20)),
        );
        run(&mut s, &mut r, first, "a", Some(first));
        run(&mut s, &mut r, second, "a", Some(first));
        let t0 = s.at;
        s.at = t0 + chrono::Duration::seconds(3);
        s.completed_on(&mut r, first, "a");
        s.at = t0 + chrono::Duration::seconds(7);
        s.completed_on(&mut r, second, "a");
        let work = Work::of(&sized(1024, 20).job).unwrap();
        let (secs, basis) = r.rates.seconds(&work, &wid("a")).unwrap();
        // 3 s and 4 s (from the first's end), both 20 steps: their mean, give or take the
        // stream's millisecond per event.
        assert!((secs - 3.5).abs() < 0.1, "{secs}");
        assert!(basis.contains("2 runs"), "{basis}");
        let (elsewhere, basis) = r.rates.seconds(&work, &wid("b")).unwrap();
        assert_eq!(elsewhere, secs);
        assert!(basis.contains("other worker"), "{basis}");
        let half = Work::of(&sized(724, 10).job).unwrap();
        assert_eq!(half.class.resolution, "0.5mp");
        let (scaled, basis) = r.rates.seconds(&half, &wid("a")).unwrap();
        assert!((scaled - secs / 4.0).abs() < 1e-9, "{scaled} {basis}");
        let upscale = Work {
            class: Class {
                model: ModelFamily::Esrgan,
                resolution: ANY_INPUT.into(),
            },
            units: 1.0,
        };
        assert!(r.rates.seconds(&upscale, &wid("a")).is_err());

        // A restarted scheduler learns the same from its snapshot.
        assert_eq!(restored(&r).rates, r.rates);
    }

    /// What a run spent on its input (`download`, `encode`, `fetch_encodings`) is learned apart
    /// from its own work: the first job of a message pays it, the later ones do not, and an edit
    /// placed on a worker without its input's encodings pays what the runs that encoded paid.
    #[test]
    fn a_messages_first_job_pays_for_its_input_and_the_rest_do_not() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let done = |s: &mut Stream, r: &mut Registry, id, stages: &[(&str, f64)]| {
            let mut timings = StageTimings::default();
            for (stage, seconds) in stages {
                timings.add(stage, *seconds);
            }
            r.apply(s.ev(
                id,
                EventKind::Completed {
                    outputs: vec![format!("results/{id}/0.png")],
                    manifest: format!("results/{id}/manifest.json"),
                    worker: Some(wid("a")),
                    timings,
                },
            ));
        };
        // Three messages of three edits: the first of each runs 3 s, of which 1 s fetches and
        // encodes its input; the others 2 s.
        let base = JobId::new();
        for _ in 0..3 {
            let jobs: Vec<JobId> = (0..3).map(|_| s.queue(&mut r, edit_of(base))).collect();
            for &j in &jobs {
                run(&mut s, &mut r, j, "a", Some(jobs[0]));
            }
            let t0 = s.at;
            s.at = t0 + chrono::Duration::seconds(3);
            done(
                &mut s,
                &mut r,
                jobs[0],
                &[("download", 0.25), ("encode", 0.75), ("denoise", 1.9)],
            );
            s.at = t0 + chrono::Duration::seconds(5);
            done(&mut s, &mut r, jobs[1], &[("denoise", 1.9)]);
            s.at = t0 + chrono::Duration::seconds(7);
            done(&mut s, &mut r, jobs[2], &[("denoise", 1.9)]);
            s.at += chrono::Duration::seconds(1);
        }
        let work = Work::of(&edit_of(base).job).unwrap();
        let near = |a: f64, b: f64| (a - b).abs() < 0.05;
        let (own, _) = r.rates.seconds(&work, &wid("a")).unwrap();
        assert!(near(own, 2.0), "the run without its input: {own}");
        for (input, expected) in [(Input::Held, 2.0), (Input::First, 3.0), (Input::Paid, 3.0)] {
            let (secs, basis) = r.rates.run_seconds(&work, &wid("a"), input).unwrap();
            assert!(near(secs, expected), "{input:?}: {secs} ({basis})");
            assert_eq!(
                basis.contains("for its input"),
                input != Input::Held,
                "{basis}"
            );
        }
        // Through the registry: of a new message's three running edits only the first pays.
        let jobs: Vec<JobId> = (0..3).map(|_| s.queue(&mut r, edit_of(base))).collect();
        r.heartbeat(worker("a", 1));
        for &j in &jobs {
            run(&mut s, &mut r, j, "a", Some(jobs[0]));
        }
        r.refresh_estimates(T);
        let took = |r: &Registry, id| {
            let e = r.estimate(r.job(id).unwrap()).unwrap().unwrap();
            (e.finish_at - e.start_at).num_milliseconds()
        };
        let runs: Vec<i64> = jobs.iter().map(|&j| took(&r, j)).collect();
        assert!((2950..=3050).contains(&runs[0]), "{runs:?}");
        // On a worker whose beat lists the input's encodings, a message's first edit pays
        // nothing, and so does a waiting edit of that input placed there; an edit of another
        // input pays what the encoding runs paid.
        let key = match &edit_of(base).job {
            JobSpec::Edit(e) => e.affinity_key().unwrap(),
            _ => unreachable!(),
        };
        let mut beat = worker("b", 1);
        beat.encode_cache = vec![key];
        r.heartbeat(beat);
        let on_b = s.queue(&mut r, edit_of(base));
        run(&mut s, &mut r, on_b, "b", None);
        let (waits_held, waits_new) = (
            s.queue(&mut r, edit_of(base)),
            s.queue(&mut r, edit_of(JobId::new())),
        );
        r.estimates.made = None; // made again now, not after `REFRESH`
        r.refresh_estimates(T);
        let (on_b, waits_held, waits_new) =
            (took(&r, on_b), took(&r, waits_held), took(&r, waits_new));
        assert!((1950..=2050).contains(&on_b), "{on_b}");
        assert!((1950..=2050).contains(&waits_held), "{waits_held}");
        assert!((2950..=3050).contains(&waits_new), "{waits_new}");
        assert!(
            runs[1..].iter().all(|t| (1950..=2050).contains(t)),
            "{runs:?}"
        );
        // A restarted scheduler keeps what it learned.
        assert_eq!(restored(&r).rates, r.rates);
    }

    /// Through the registry: a running job and the waiting ones behind it get estimates, the
    /// interactive one first; the dispatch order puts interactive work first, then the oldest.
    #[test]
    fn the_registry_estimates_running_and_waiting_jobs_in_dispatch_order() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        r.heartbeat(worker("a", 1));
        let learn = s.queue(&mut r, generate());
        run(&mut s, &mut r, learn, "a", None);
        s.at += chrono::Duration::seconds(2);
        s.completed_on(&mut r, learn, "a");
        let running = s.queue(&mut r, generate());
        run(&mut s, &mut r, running, "a", None);
        let batch = s.queue(&mut r, generate());
        let interactive = s.queue(
            &mut r,
            Submission {
                priority: Priority::Interactive,
                ..generate()
            },
        );
        assert_eq!(r.dispatch_order(&route()), [interactive, batch]);
        r.refresh_estimates(T);
        let est = |id| {
            r.estimate(r.job(id).unwrap())
                .unwrap()
                .unwrap_or_else(|why| panic!("{why}"))
        };
        let (run_e, int_e, batch_e) = (est(running), est(interactive), est(batch));
        assert_eq!(int_e.start_at, run_e.finish_at);
        // The interactive job is an arrival too: one 2 s job in the minute a young farm counts
        // at least is ρ ≈ 3.5 % of the worker's time, so the batch job, free to start `t` after
        // the estimates were made, waits t × ρ / (1 − ρ) more for the work expected meanwhile.
        let rho = 2.0 / (600.0 * (1.0 - (-0.1f64).exp()));
        let free = (int_e.finish_at - batch_e.made_at)
            .num_microseconds()
            .unwrap() as f64
            / 1e6;
        let gap = (batch_e.start_at - int_e.finish_at)
            .num_microseconds()
            .unwrap() as f64
            / 1e6;
        assert!(
            (gap - free * rho / (1.0 - rho)).abs() < 0.005,
            "{gap} s after {free} s"
        );
        assert!(
            batch_e.basis.contains("interactive work expected"),
            "{}",
            batch_e.basis
        );
        let took = (batch_e.finish_at - batch_e.start_at).num_milliseconds();
        assert!((1990..=2010).contains(&took), "{took} ms");
        s.complete(&mut r, batch);
        assert!(r.estimate(r.job(batch).unwrap()).is_none(), "finished");
    }
}
