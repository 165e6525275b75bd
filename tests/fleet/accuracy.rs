//! How honest the scheduler's estimates are (issue 24): the fleet benchmark's workload, mixed in
//! size and steps, on the default dispatch, with the job list read a few times a second. Each job's
//! first estimate while it waits (its prediction at submission) and its first while it runs (at
//! start) are compared with when it actually finished, by the event log. The error of a prediction
//! made at `made_at` is `|predicted finish − actual finish| / (actual finish − made_at)`: relative
//! to the time the job still had to spend in the farm when the prediction was made.
//!
//! The farm first runs a generate, an edit and a pipeline of each size (a warm-up), as a farm that
//! has run before has measured its rates; without any measured run a job has no estimate, and says
//! so. With a history, it then runs the workload itself that many times, unmeasured, as a farm
//! whose users worked the same way before has seen how fast their interactive work arrives (the
//! measured run's batch jobs are all submitted in its first seconds, before any of its own
//! interactive work arrives, so nothing else can tell their first estimates about it).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use vnfarm_proto::http::{Estimate, JobState, JobView};
use vnfarm_proto::{JobId, Priority};

use super::workload::{self, Shape, Workload};
use super::{PolicyReport, RunConfig, VARIANTS, jobs_of, run_workload, start_farm};

/// How often the job list is read (twice per `ESTIMATE_REFRESH`, so a job is seen soon after its
/// first estimate).
const POLL: Duration = Duration::from_millis(250);

/// A job's end and start on its worker.
type Ended = (DateTime<Utc>, DateTime<Utc>, JobId);

/// What the list showed of one job.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// The first estimate while it waited, made after it was submitted.
    waiting: Option<Estimate>,
    /// The first estimate while it ran, made after it started.
    running: Option<Estimate>,
    /// Why it had none, the first time it had none.
    none: Option<String>,
}

/// The errors of one set of predictions.
#[derive(Clone, Debug, Default)]
pub struct Errors {
    /// Relative errors (see the module's documentation), sorted.
    relative: Vec<f64>,
    /// (predicted − actual) finish over the time left, sorted: negative is optimistic.
    signed: Vec<f64>,
}

impl Errors {
    fn add(&mut self, predicted: &Estimate, ended: DateTime<Utc>) {
        let left = (ended - predicted.made_at).num_milliseconds() as f64;
        if left <= 0.0 {
            return;
        }
        let off = (predicted.finish_at - ended).num_milliseconds() as f64;
        self.relative.push(off.abs() / left);
        self.signed.push(off / left);
    }

    fn sort(&mut self) {
        self.relative.sort_by(f64::total_cmp);
        self.signed.sort_by(f64::total_cmp);
    }

    pub fn len(&self) -> usize {
        self.relative.len()
    }

    pub fn is_empty(&self) -> bool {
        self.relative.is_empty()
    }

    pub fn median(&self) -> f64 {
        super::report::percentile(&self.relative, 0.5)
    }

    pub fn p90(&self) -> f64 {
        super::report::percentile(&self.relative, 0.9)
    }

    pub fn median_signed(&self) -> f64 {
        super::report::percentile(&self.signed, 0.5)
    }
}

#[derive(Clone, Debug, Default)]
pub struct AccuracyReport {
    /// Jobs of the workload (a pipeline's jobs, not the pipeline).
    pub jobs: usize,
    /// Predictions at submission and at start, over all jobs and by priority.
    pub at_submission: Errors,
    pub at_start: Errors,
    pub by_priority: BTreeMap<(&'static str, &'static str), Errors>,
    /// Jobs never estimated while they waited, with the first reason they gave.
    pub unestimated: Vec<(JobId, String)>,
    /// Of the batch jobs' first estimates while waiting, the seconds each counted on for
    /// interactive work expected to arrive just before it (the estimate's basis says so; what
    /// delayed the batch jobs before it on its worker is not included), sorted: 0 for none.
    pub arrivals_waited: Vec<f64>,
    /// Predicted over actual run time (from its start, or its worker's previous job's end when
    /// later, to its end) of the jobs estimated while running, sorted: the rates' own error.
    pub run_ratio: Vec<f64>,
    /// The same by kind and what the job paid for its input (an edit that encoded it, fetched
    /// its encodings or found them held), sorted.
    pub run_ratio_by: BTreeMap<&'static str, Vec<f64>>,
}

/// What a job paid for its input, as its events tell: the group of [`AccuracyReport::run_ratio_by`].
fn input_group(job: &super::JobTimes) -> &'static str {
    match (job.kind, job.encoded, job.fetched.is_some()) {
        ("edit", true, _) => "edit that encoded its input",
        ("edit", false, true) => "edit that fetched its input's encodings",
        ("edit", false, false) => "edit whose input's encodings were held",
        ("generate", ..) => "generate",
        _ => "upscale",
    }
}

/// Runs the workload (made with `mixed`) on the default dispatch, after `history` unmeasured runs
/// of it, and measures the estimates of the last run. The report is of the whole stream, history
/// included.
pub async fn run_estimates(
    config: &RunConfig,
    workload: &Workload,
    history: usize,
) -> anyhow::Result<(PolicyReport, AccuracyReport)> {
    let variant = VARIANTS[0];
    let mut farm = start_farm(variant, config).await?;
    warm_up(&farm).await?;
    for _ in 0..history {
        run_workload(variant, config, workload, &mut farm).await?;
    }
    let before: Vec<JobId> = farm
        .jobs("all=true&limit=1000")
        .await?
        .iter()
        .map(|j| j.id)
        .collect();

    let seen: Arc<Mutex<HashMap<JobId, Seen>>> = Arc::default();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let poller = {
        let (http, url, seen) = (
            farm.http.clone(),
            farm.url("/v1/jobs?all=true&limit=1000"),
            seen.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(POLL);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => return,
                }
                let Ok(answer) = http.get(&url).send().await else {
                    continue;
                };
                let Ok(mut list) = answer.json::<Value>().await else {
                    continue;
                };
                let Ok(jobs) = serde_json::from_value::<Vec<JobView>>(list["jobs"].take()) else {
                    continue;
                };
                let mut seen = seen.lock().expect("the poller alone holds it, briefly");
                for job in jobs.iter().filter(|j| !j.is_pipeline()) {
                    note(seen.entry(job.id).or_default(), job);
                }
            }
        })
    };
    let report = run_workload(variant, config, workload, &mut farm).await;
    let _ = stop.send(true);
    poller.await?;
    let report = report?;

    let log = crate::stream::read_all(&farm).await?;
    let times = jobs_of(&log.events);
    let seen = seen.lock().expect("the poller has ended").clone();
    let mut acc = AccuracyReport::default();
    // Each job's own run: from its start, or the end of the job before it on its worker.
    let mut by_worker: BTreeMap<&str, Vec<Ended>> = BTreeMap::new();
    for (id, job) in &times {
        if let (Some(w), Some(s), Some(e), true) =
            (job.worker.as_deref(), job.started, job.ended, job.completed)
        {
            by_worker.entry(w).or_default().push((e, s, *id));
        }
    }
    let mut own_run: HashMap<JobId, f64> = HashMap::new();
    for runs in by_worker.values_mut() {
        runs.sort();
        let mut prev: Option<DateTime<Utc>> = None;
        for (e, s, id) in runs.iter() {
            let began = prev.map_or(*s, |p| p.max(*s));
            own_run.insert(*id, (*e - began).num_milliseconds() as f64 / 1e3);
            prev = Some(*e);
        }
    }
    for (id, job) in &times {
        if before.contains(id) {
            continue;
        }
        let (Some(ended), true) = (job.ended, job.completed) else {
            continue;
        };
        acc.jobs += 1;
        let seen = seen.get(id).cloned().unwrap_or_default();
        let priority = match job.priority {
            Some(Priority::Interactive) => "interactive",
            _ => "batch",
        };
        match &seen.waiting {
            Some(e) => {
                if priority == "batch" {
                    acc.arrivals_waited.push(waited_for_arrivals(&e.basis));
                }
                acc.at_submission.add(e, ended);
                acc.by_priority
                    .entry((priority, "submission"))
                    .or_default()
                    .add(e, ended);
            }
            None => acc.unestimated.push((
                *id,
                seen.none
                    .unwrap_or_else(|| "never seen waiting by the list".into()),
            )),
        }
        if let Some(e) = &seen.running {
            if let Some(actual) = own_run.get(id).filter(|a| **a > 0.0) {
                let predicted = (e.finish_at - e.start_at).num_milliseconds() as f64 / 1e3;
                acc.run_ratio.push(predicted / actual);
                acc.run_ratio_by
                    .entry(input_group(job))
                    .or_default()
                    .push(predicted / actual);
            }
            acc.at_start.add(e, ended);
            acc.by_priority
                .entry((priority, "start"))
                .or_default()
                .add(e, ended);
        }
    }
    acc.run_ratio.sort_by(f64::total_cmp);
    for ratios in acc.run_ratio_by.values_mut() {
        ratios.sort_by(f64::total_cmp);
    }
    acc.arrivals_waited.sort_by(f64::total_cmp);
    acc.at_submission.sort();
    acc.at_start.sort();
    for errors in acc.by_priority.values_mut() {
        errors.sort();
    }
    Ok((report, acc))
}

/// The seconds an estimate's basis says it waits for interactive work expected to arrive ("…,
/// after 1.5 s of interactive work expected to arrive"), 0 when it says nothing of it.
fn waited_for_arrivals(basis: &str) -> f64 {
    basis
        .split_once(" s of interactive work expected")
        .and_then(|(before, _)| before.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Notes a job's estimate (or why it had none) the first time each is seen.
fn note(seen: &mut Seen, job: &JobView) {
    match (job.state, &job.estimate) {
        (JobState::Queued | JobState::Dispatched, Some(e))
            if seen.waiting.is_none() && e.made_at >= job.created_at =>
        {
            seen.waiting = Some(e.clone());
        }
        (JobState::Running, Some(e)) if seen.running.is_none() => {
            seen.running = Some(e.clone());
        }
        (_, None) if seen.none.is_none() => seen.none.clone_from(&job.no_estimate),
        _ => {}
    }
}

/// For each size of a mixed workload, one after another: a generate, an edit of an upload and a
/// pipeline of a base and four edits (which run as a batch message on the base's worker).
async fn warm_up(farm: &crate::Farm) -> anyhow::Result<()> {
    farm.storage
        .put(
            &workload::upload_key(0),
            bytes::Bytes::from(crate::png_bytes(256, 256, 0)),
            "image/png",
        )
        .await?;
    for (n, shape) in Shape::mixed().enumerate() {
        let input = json!({"stored": workload::upload_key(0)});
        let edits: Vec<Value> = (0..4)
            .map(|e| json!({"instruction": format!("warm-up {e}"), "steps": shape.edit_steps}))
            .collect();
        let pipeline = json!({"kind": "pipeline", "base": {"prompt": format!("warm-up {n}"),
            "width": shape.side, "height": shape.side, "steps": shape.steps}, "edits": edits});
        for job in [
            workload::generate(n, 1, shape),
            workload::edit(input, &format!("warm-up {n}"), shape),
            pipeline,
        ] {
            let body = json!({"schema_version": 1, "job": job});
            let done = farm.run(&body, Duration::from_secs(120)).await?;
            anyhow::ensure!(
                done.state == JobState::Completed,
                "warm-up job {} {:?}",
                done.id,
                done.state
            );
        }
    }
    Ok(())
}

/// The report as a Markdown table.
pub fn render_accuracy(config: &RunConfig, acc: &AccuracyReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "estimates, profile {} (scale {}), {} workers, {} jobs, mixed sizes {}",
        config.profile.name, config.scale, config.workers, acc.jobs, config.mixed
    );
    let _ = writeln!(
        out,
        "\n| prediction | jobs | median abs error | p90 abs error | median signed (− early) |"
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- |");
    let row = |out: &mut String, name: &str, e: &Errors| {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.1} % | {:.1} % | {:+.1} % |",
            e.len(),
            100.0 * e.median(),
            100.0 * e.p90(),
            100.0 * e.median_signed()
        );
    };
    row(&mut out, "at submission", &acc.at_submission);
    row(&mut out, "at start", &acc.at_start);
    for ((priority, when), e) in &acc.by_priority {
        row(&mut out, &format!("{priority}, at {when}"), e);
    }
    let _ = writeln!(
        out,
        "\npredicted ÷ actual run time, jobs estimated while running: p10 {:.2}, median {:.2}, p90 {:.2}",
        super::report::percentile(&acc.run_ratio, 0.1),
        super::report::percentile(&acc.run_ratio, 0.5),
        super::report::percentile(&acc.run_ratio, 0.9)
    );
    for (group, ratios) in &acc.run_ratio_by {
        let _ = writeln!(
            out,
            "- {group} ({}): p10 {:.2}, median {:.2}, p90 {:.2}",
            ratios.len(),
            super::report::percentile(ratios, 0.1),
            super::report::percentile(ratios, 0.5),
            super::report::percentile(ratios, 0.9)
        );
    }
    let waited = &acc.arrivals_waited;
    let _ = writeln!(
        out,
        "\nbatch jobs' first estimates while waiting that count on interactive work expected to arrive: {} of {}; seconds of it just before the job (the waits before earlier batch jobs on its worker not included), median {:.1}, p90 {:.1}",
        waited.iter().filter(|s| **s > 0.0).count(),
        waited.len(),
        super::report::percentile(waited, 0.5),
        super::report::percentile(waited, 0.9)
    );
    let _ = writeln!(
        out,
        "\njobs never estimated while waiting: {}",
        acc.unestimated.len()
    );
    for (id, why) in acc.unestimated.iter().take(5) {
        let _ = writeln!(out, "- {id}: {why}");
    }
    out
}
