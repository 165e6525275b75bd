//! The verdict on a chaos run. Once the farm is quiet, four views of the run are compared:
//!
//! - the client's ledger: every idempotency key it used and every job id it was answered;
//! - the event stream: every job the system ever created (pipeline children and jobs no client
//!   heard of included), and how each one ended;
//! - the HTTP API: what the schedulers say about each of those jobs;
//! - S3: the objects under `results/<id>/` of every completed job.
//!
//! The stream is read by the contract's rules: in stream order the first `queued` event with a key
//! is that key's job, and a later `queued` with the same key is a duplicate submission (a *shadow*)
//! that must never run. A job's outcome is its first final event.
//!
//! What must be zero:
//! - **duplicated**: a key answered with more than one job id, or with another job than the
//!   stream's first for it; a key with more than one completed job; a job completed by more than
//!   one distinct run (runs are told apart by their measured stage timings: a `completed` event
//!   republished from the manifest of the same run is not a second run); a job whose manifest in S3
//!   is from another run than its outcome.
//! - **lost**: a key the client never got an answer for, or whose job the system does not know or
//!   never finished.
//! - **stranded**: a job in the stream (pipeline children included) with no final event.
//! - **missing outputs**: a completed job whose `results/<id>/` is not exactly its outputs and its
//!   manifest.
//! - **API disagrees**: a job whose state in the API is not its outcome in the stream.
//! - **stream copies differ**: a broker node whose copy of the event stream is not the first one's
//!   (a cluster's nodes each hold a replica; a single broker has one copy).
//! - **dispatched by two schedulers at once**: a `dispatched` event of a scheduler term that comes,
//!   in stream order, after the first one of a later term (each term is numbered by its marker's
//!   stream offset, so only a leader that went on dispatching after another took over writes one).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::Value;
use vnfarm_proto::{EventKind, FailureKind, JobId, JobSpec, Manifest, StageTimings, WorkerId};
use vnfarm_storage::Storage;

use crate::workload::Ledger;
use vnfarm_tests::stream::{self, EventLog};

/// The farm as the audit reads it.
pub struct Target<'a> {
    /// The base URL of every scheduler; the first that answers a request is asked.
    pub schedulers: Vec<String>,
    /// Carries whatever the API wants (a token).
    pub http: &'a reqwest::Client,
    pub storage: &'a Storage,
    /// The AMQP URL of every broker node: the stream is read from each, the first copy is
    /// audited and every other must equal it.
    pub brokers: Vec<String>,
    pub prefix: &'a str,
}

/// The farm counts as stuck when the set of unfinished jobs has not changed for this long.
const STUCK_AFTER: Duration = Duration::from_secs(30);
/// Requests in flight at once while auditing the API and S3.
const PARALLEL: usize = 8;
/// Findings printed per kind; the counts cover them all.
const SHOWN: usize = 10;

/// Problems of one kind, by subject (a key or a job id); the count is the number of subjects. Each
/// problem has a category (a short, fixed phrase, tallied for the summary) and its details.
#[derive(Default)]
pub struct Findings {
    by_subject: BTreeMap<String, Vec<String>>,
    by_category: BTreeMap<&'static str, usize>,
}

impl Findings {
    fn add(&mut self, subject: impl Into<String>, category: &'static str, details: String) {
        *self.by_category.entry(category).or_default() += 1;
        self.by_subject
            .entry(subject.into())
            .or_default()
            .push(format!("{category}: {details}"));
    }

    pub fn len(&self) -> usize {
        self.by_subject.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_subject.is_empty()
    }
}

/// How the wait for a quiet farm ended.
pub struct Quiescence {
    pub waited: Duration,
    /// Jobs the API still listed as unfinished when the wait ended (0: quiet).
    pub unfinished: usize,
}

/// The counts of a chaos run, and the findings behind every count that must be zero.
#[derive(Default)]
pub struct Report {
    /// Distinct idempotency keys the client used.
    pub submitted: usize,
    pub completed: usize,
    pub failed: usize,
    /// Every failed job of the stream (pipeline children included), by failure kind.
    pub failures: BTreeMap<&'static str, usize>,
    pub cancelled: usize,
    pub duplicated: Findings,
    pub lost: Findings,
    pub stranded: Findings,
    pub missing_outputs: Findings,
    pub api_disagrees: Findings,
    pub stream_copies_differ: Findings,
    pub overlapping_terms: Findings,
    /// Dispatched events that name their scheduler's term, and the terms seen.
    pub termed_dispatches: usize,
    pub terms: usize,
    /// Jobs in the stream (pipelines and their children included, shadows not).
    pub jobs: usize,
    pub events: usize,
    pub undecodable_events: usize,
    /// Duplicate submissions the stream holds (a later `queued` with a known key), and how many
    /// jobs of theirs (pipeline children included) were dispatched all the same.
    pub shadows: usize,
    pub shadow_jobs_dispatched: usize,
    /// Completed jobs whose `completed` event names another worker than their manifest (the run is
    /// the right one; the credit is not), and one of them.
    pub credited_to_another_worker: usize,
    pub credited_example: Option<String>,
    pub waited: Option<Quiescence>,
    /// How long reading each view took.
    pub phases: Vec<(&'static str, Duration)>,
}

impl Report {
    /// True when nothing was duplicated, lost, stranded or missing, and every view agrees.
    pub fn is_clean(&self) -> bool {
        self.duplicated.is_empty()
            && self.lost.is_empty()
            && self.stranded.is_empty()
            && self.missing_outputs.is_empty()
            && self.api_disagrees.is_empty()
            && self.stream_copies_differ.is_empty()
            && self.overlapping_terms.is_empty()
            && self.undecodable_events == 0
    }
}

/// Waits until no scheduler lists an unfinished job, or until the set of unfinished jobs has
/// stopped changing for [`STUCK_AFTER`], or until `bound`.
pub async fn quiesce(farm: &Target<'_>, bound: Duration) -> Quiescence {
    let start = Instant::now();
    let mut last: Option<(BTreeSet<String>, Instant)> = None;
    loop {
        let unfinished = unfinished_jobs(farm).await;
        if let Some(ids) = &unfinished {
            let quiet = ids.is_empty();
            let stuck = last
                .as_ref()
                .is_some_and(|(prev, since)| prev == ids && since.elapsed() > STUCK_AFTER);
            if quiet || stuck || start.elapsed() > bound {
                return Quiescence {
                    waited: start.elapsed(),
                    unfinished: ids.len(),
                };
            }
            if last.as_ref().is_none_or(|(prev, _)| prev != ids) {
                last = Some((ids.clone(), Instant::now()));
            }
        } else if start.elapsed() > bound {
            return Quiescence {
                waited: start.elapsed(),
                unfinished: usize::MAX,
            };
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `id:state` of every job some scheduler lists as not final; `None` when none answers.
async fn unfinished_jobs(farm: &Target<'_>) -> Option<BTreeSet<String>> {
    let mut ids = BTreeSet::new();
    for state in ["queued", "dispatched", "running", "retrying"] {
        let list = api_get(farm, &format!("/v1/jobs?all=true&state={state}&limit=1000")).await?;
        for job in list["jobs"].as_array()? {
            ids.insert(format!("{}:{state}", job["id"].as_str()?));
        }
    }
    Some(ids)
}

/// `GET path` from the first scheduler that answers it with a success; `None` when none does.
async fn api_get(farm: &Target<'_>, path: &str) -> Option<Value> {
    for base in &farm.schedulers {
        let Ok(response) = farm
            .http
            .get(format!("{base}{path}"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
        else {
            continue;
        };
        if response.status().is_success() {
            return response.json().await.ok();
        }
    }
    None
}

/// How a job ended: its first final event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Completed,
    Failed(FailureKind),
    Cancelled,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed(_) => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// One `completed` event of a job.
#[derive(Clone, Debug)]
struct Completion {
    outputs: Vec<String>,
    manifest: String,
    worker: Option<WorkerId>,
    timings: StageTimings,
}

impl Completion {
    /// Whether both report the same run, not two runs of the job. Stage timings are measured, so two
    /// runs never share them; a `completed` event republished from a run's manifest (a redelivered
    /// job that had finished) carries that run's timings, whichever worker republished it.
    fn same_run(&self, other: &Completion) -> bool {
        self.timings == other.timings
    }
}

/// One job as the event stream tells it.
#[derive(Default)]
struct Trace {
    /// Its own `queued` event was seen.
    queued: bool,
    /// Listed as a child in its pipeline's `queued` event.
    listed: bool,
    key: Option<String>,
    parent: Option<JobId>,
    pipeline: bool,
    /// A duplicate submission (or a child of one): it must never run.
    shadow: bool,
    dispatched: bool,
    /// The name of its latest event (what an unfinished job last did).
    last_event: Option<&'static str>,
    outcome: Option<Outcome>,
    completions: Vec<Completion>,
}

impl Trace {
    /// Whether the stream created this job (rather than only naming it in other events).
    fn created(&self) -> bool {
        self.queued || self.listed
    }

    /// How many distinct runs completed this job.
    fn completed_runs(&self) -> usize {
        let mut runs: Vec<&Completion> = Vec::new();
        for c in &self.completions {
            if !runs.iter().any(|r| r.same_run(c)) {
                runs.push(c);
            }
        }
        runs.len()
    }
}

/// Every job of the stream, and every key's jobs in stream order (the first is the key's job).
struct Traces {
    jobs: BTreeMap<JobId, Trace>,
    by_key: BTreeMap<String, Vec<JobId>>,
}

fn trace(log: &EventLog) -> Traces {
    let mut jobs: BTreeMap<JobId, Trace> = BTreeMap::new();
    let mut by_key: BTreeMap<String, Vec<JobId>> = BTreeMap::new();
    for ev in &log.events {
        let id = ev.event.job_id;
        let job = jobs.entry(id).or_default();
        job.last_event = Some(ev.event.kind.name());
        match &ev.event.kind {
            EventKind::Queued {
                submission,
                parent,
                children,
                ..
            } => {
                if job.queued {
                    continue; // the same id queued again is the same job
                }
                job.queued = true;
                job.parent = job.parent.or(*parent);
                job.pipeline = matches!(submission.job, JobSpec::Pipeline(_));
                if let Some(key) = &submission.idempotency_key {
                    let holders = by_key.entry(key.clone()).or_default();
                    job.shadow = !holders.is_empty();
                    job.key = Some(key.clone());
                    holders.push(id);
                }
                let shadow = job.shadow;
                for child in children {
                    let child = jobs.entry(*child).or_default();
                    child.listed = true;
                    child.parent = Some(id);
                    child.shadow |= shadow;
                }
            }
            EventKind::Dispatched { .. } | EventKind::Started { .. } => job.dispatched = true,
            EventKind::Completed {
                outputs,
                manifest,
                worker,
                timings,
            } => {
                job.completions.push(Completion {
                    outputs: outputs.clone(),
                    manifest: manifest.clone(),
                    worker: worker.clone(),
                    timings: timings.clone(),
                });
                job.outcome.get_or_insert(Outcome::Completed);
            }
            EventKind::Failed {
                retryable: false,
                failure,
                ..
            } => {
                job.outcome.get_or_insert(Outcome::Failed(*failure));
            }
            EventKind::Cancelled { .. } => {
                job.outcome.get_or_insert(Outcome::Cancelled);
            }
            EventKind::Failed {
                retryable: true, ..
            }
            | EventKind::Requeued { .. }
            | EventKind::Progress { .. } => {}
        }
    }
    Traces { jobs, by_key }
}

/// Waits for a quiet farm, reads every view and compares them.
pub async fn audit(farm: &Target<'_>, ledger: &Ledger, bound: Duration) -> anyhow::Result<Report> {
    let waited = quiesce(farm, bound).await;
    let started = Instant::now();
    let (first, others) = farm
        .brokers
        .split_first()
        .expect("a farm has at least one broker node");
    let log = stream::read_all_from(first, farm.prefix).await?;
    let traces = trace(&log);
    let mut report = Report {
        submitted: ledger.submissions.len(),
        events: log.events.len(),
        undecodable_events: log.undecodable,
        waited: Some(waited),
        ..Report::default()
    };
    report.phases.push(("stream", started.elapsed()));
    for (n, url) in others.iter().enumerate() {
        let copy = stream::read_all_from(url, farm.prefix).await?;
        if let Some(difference) = first_difference(&log, &copy) {
            report.stream_copies_differ.add(
                format!("broker node {}", n + 2),
                "another event history than node 1's",
                difference,
            );
        }
    }
    report.phases.push(("stream copies", started.elapsed()));
    check_terms(&log, &mut report);
    check_stream(&traces, &mut report);
    check_ledger(ledger, &traces, &mut report);
    let started = Instant::now();
    check_api(farm, &traces, &mut report).await;
    report.phases.push(("API", started.elapsed()));
    let started = Instant::now();
    check_storage(farm, &traces, &mut report).await;
    report.phases.push(("S3", started.elapsed()));
    Ok(report)
}

/// In stream order, no scheduler term dispatches after a later term has begun to.
fn check_terms(log: &EventLog, report: &mut Report) {
    let mut latest: Option<u64> = None;
    let mut terms = BTreeSet::new();
    for ev in &log.events {
        let EventKind::Dispatched {
            term: Some(term), ..
        } = ev.event.kind
        else {
            continue;
        };
        report.termed_dispatches += 1;
        terms.insert(term);
        match latest {
            Some(l) if term < l => report.overlapping_terms.add(
                ev.event.job_id.to_string(),
                "dispatched in an earlier term after a later one began",
                format!("term {term} at offset {} after term {l}", ev.seq),
            ),
            _ => latest = Some(term),
        }
    }
    report.terms = terms.len();
}

/// Where `copy` (one node's stream) first differs from `log`, if it does. The readers' own markers
/// are not in either: each stops at its own.
fn first_difference(log: &EventLog, copy: &EventLog) -> Option<String> {
    if let Some((n, (a, b))) = log
        .events
        .iter()
        .zip(&copy.events)
        .enumerate()
        .find(|(_, (a, b))| a != b)
    {
        return Some(format!(
            "event {n} differs: offset {} there, {} here",
            b.seq, a.seq
        ));
    }
    (log.events.len() != copy.events.len() || log.undecodable != copy.undecodable).then(|| {
        format!(
            "{} events ({} undecodable) there, {} ({}) here",
            copy.events.len(),
            copy.undecodable,
            log.events.len(),
            log.undecodable
        )
    })
}

/// Stranded jobs, duplicate runs and shadows, from the stream alone.
fn check_stream(traces: &Traces, report: &mut Report) {
    for (id, job) in &traces.jobs {
        if job.shadow {
            report.shadows += usize::from(job.key.is_some());
            report.shadow_jobs_dispatched += usize::from(job.dispatched);
            continue;
        }
        if !job.created() {
            continue; // events of a job the stream never created (none expected; see `jobs`)
        }
        report.jobs += 1;
        if let Some(Outcome::Failed(failure)) = job.outcome {
            *report.failures.entry(failure.as_str()).or_default() += 1;
        }
        if job.outcome.is_none() {
            let orphan = job
                .parent
                .is_some_and(|p| traces.jobs.get(&p).is_none_or(|p| !p.created()));
            let category = if orphan {
                "a pipeline child whose pipeline was never recorded"
            } else {
                "no final event"
            };
            let last = job.last_event.unwrap_or("none");
            report
                .stranded
                .add(format!("job {id}"), category, format!("last event {last}"));
        }
        let runs = job.completed_runs();
        if runs > 1 {
            let workers: Vec<String> = job
                .completions
                .iter()
                .map(|c| {
                    c.worker
                        .as_ref()
                        .map_or("none", WorkerId::as_str)
                        .to_owned()
                })
                .collect();
            report.duplicated.add(
                format!("job {id}"),
                "completed by several runs",
                format!("{runs} runs; completed events from {}", workers.join(", ")),
            );
        }
    }
    for (key, ids) in &traces.by_key {
        let completed: Vec<String> = ids
            .iter()
            .filter(|id| traces.jobs[*id].outcome == Some(Outcome::Completed))
            .map(ToString::to_string)
            .collect();
        if completed.len() > 1 {
            report.duplicated.add(
                format!("key {key}"),
                "several jobs of one key completed",
                completed.join(", "),
            );
        }
    }
}

/// Every key of the client: answered once, with the key's job, which ended; and the outcome counts.
fn check_ledger(ledger: &Ledger, traces: &Traces, report: &mut Report) {
    for (key, sent) in &ledger.submissions {
        let subject = format!("key {key}");
        if sent.ids.len() > 1 {
            let ids: Vec<&str> = sent.ids.iter().map(String::as_str).collect();
            report.duplicated.add(
                &subject,
                "one key answered with several job ids",
                ids.join(", "),
            );
        }
        let Some(answered) = sent.ids.first() else {
            let why = sent.unanswered.as_deref().unwrap_or("still unanswered");
            report.lost.add(
                &subject,
                "never answered",
                format!("{why} ({:?})", sent.kind),
            );
            continue;
        };
        let Ok(id) = answered.parse::<JobId>() else {
            report.lost.add(
                &subject,
                "answered with something else than a job id",
                answered.clone(),
            );
            continue;
        };
        if let Some(first) = traces.by_key.get(key).and_then(|ids| ids.first())
            && *first != id
        {
            report.duplicated.add(
                &subject,
                "answered with a duplicate, not the key's first job",
                format!("answered {id}, the stream's first job for the key is {first}"),
            );
        }
        match traces.jobs.get(&id).filter(|t| t.created()) {
            None => report.lost.add(
                &subject,
                "answered with a job the stream never created",
                id.to_string(),
            ),
            Some(job) => match job.outcome {
                None => report
                    .lost
                    .add(&subject, "its job never finished", id.to_string()),
                Some(Outcome::Completed) => report.completed += 1,
                Some(Outcome::Failed(_)) => report.failed += 1,
                Some(Outcome::Cancelled) => report.cancelled += 1,
            },
        }
    }
}

/// Every job of the stream, as the API shows it, must be in the state of its outcome.
async fn check_api(farm: &Target<'_>, traces: &Traces, report: &mut Report) {
    let jobs: Vec<(JobId, Option<Outcome>)> = traces
        .jobs
        .iter()
        .filter(|(_, t)| t.created() && !t.shadow)
        .map(|(id, t)| (*id, t.outcome))
        .collect();
    let views: Vec<(JobId, Option<Outcome>, Option<Value>)> =
        futures::stream::iter(jobs.into_iter().map(|(id, outcome)| async move {
            (id, outcome, api_get(farm, &format!("/v1/jobs/{id}")).await)
        }))
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    for (id, outcome, view) in views {
        let shown = view.as_ref().and_then(|v| v["state"].as_str());
        let (category, details) = match (outcome, shown) {
            (o, None) => (
                "unknown to the API",
                format!("the stream says {}", o.map_or("unfinished", Outcome::name)),
            ),
            // Unfinished in both: counted as stranded.
            (None, Some(_)) => continue,
            (Some(o), Some(state)) if o.name() == state => continue,
            (Some(o), Some(state)) => (
                "another state in the API",
                format!("the API shows {state}, the stream {}", o.name()),
            ),
        };
        report
            .api_disagrees
            .add(format!("job {id}"), category, details);
    }
}

/// Every completed job (but a pipeline, whose outputs are its children's) has exactly its outputs
/// and its manifest under `results/<id>/`, and the manifest is from the run of its outcome.
async fn check_storage(farm: &Target<'_>, traces: &Traces, report: &mut Report) {
    let completed: Vec<(JobId, &Completion)> = traces
        .jobs
        .iter()
        .filter(|(_, t)| t.created() && !t.shadow && !t.pipeline)
        .filter(|(_, t)| t.outcome == Some(Outcome::Completed))
        .filter_map(|(id, t)| Some((*id, t.completions.first()?)))
        .collect();
    let checked: Vec<(JobId, Result<Stored, Problem>)> = futures::stream::iter(
        completed
            .into_iter()
            .map(|(id, completion)| async move { (id, stored_run(farm, id, completion).await) }),
    )
    .buffer_unordered(PARALLEL)
    .collect()
    .await;
    for (id, result) in checked {
        match result {
            Ok(Stored::AsCompleted) => {}
            Ok(Stored::MadeByAnother(maker)) => {
                report.credited_to_another_worker += 1;
                if report.credited_example.is_none() {
                    report.credited_example = Some(format!("job {id}: {maker}"));
                }
            }
            Err(Problem::Missing(what)) => {
                report
                    .missing_outputs
                    .add(format!("job {id}"), "objects not as completed", what)
            }
            Err(Problem::OtherRun(what)) => report.duplicated.add(
                format!("job {id}"),
                "manifest from another run than the outcome",
                what,
            ),
        }
    }
}

/// A completed job's objects, as they should be.
enum Stored {
    AsCompleted,
    /// The run of the outcome, but the `completed` event names another worker than the one that
    /// made it (the manifest's): it was republished by the worker of a redelivery.
    MadeByAnother(String),
}

/// What is wrong with a completed job's objects.
enum Problem {
    Missing(String),
    /// The manifest was written by another run than the one the job's outcome reports.
    OtherRun(String),
}

async fn stored_run(
    farm: &Target<'_>,
    id: JobId,
    completion: &Completion,
) -> Result<Stored, Problem> {
    let missing = |e: vnfarm_storage::StorageError| Problem::Missing(e.to_string());
    let mut stored = farm
        .storage
        .list(&format!("results/{id}/"))
        .await
        .map_err(missing)?;
    stored.sort();
    let mut expected = completion.outputs.clone();
    expected.push(completion.manifest.clone());
    expected.sort();
    if stored != expected {
        return Err(Problem::Missing(format!(
            "results/{id}/ holds {stored:?}, expected {expected:?}"
        )));
    }
    let bytes = farm
        .storage
        .get(&completion.manifest)
        .await
        .map_err(missing)?;
    let manifest: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| Problem::Missing(format!("{}: {e}", completion.manifest)))?;
    if manifest.job_id != id {
        return Err(Problem::Missing(format!(
            "{} names job {}",
            completion.manifest, manifest.job_id
        )));
    }
    let run = Completion {
        worker: Some(manifest.worker.clone()),
        timings: manifest.timings.clone(),
        ..completion.clone()
    };
    let reporter = completion.worker.as_ref().map_or("none", WorkerId::as_str);
    if !run.same_run(completion) {
        return Err(Problem::OtherRun(format!(
            "the manifest is from attempt {} on {} finished at {}, the completed event from a run on \
             {reporter} with other stage timings",
            manifest.attempt, manifest.worker, manifest.finished_at,
        )));
    }
    if run.worker != completion.worker {
        return Ok(Stored::MadeByAnother(format!(
            "made by {} (manifest), reported completed by {reporter}",
            manifest.worker
        )));
    }
    Ok(Stored::AsCompleted)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, name: &str, n: usize, must_be_zero: bool| {
            let mark = if must_be_zero && n > 0 {
                "  <-- must be 0"
            } else {
                ""
            };
            writeln!(f, "| {name:<30} | {n:>7} |{mark}")
        };
        writeln!(f, "| {:<30} | {:>7} |", "chaos run", "count")?;
        writeln!(f, "| {:-<30} | {:->7} |", "", "")?;
        row(f, "submitted (keys)", self.submitted, false)?;
        row(f, "completed", self.completed, false)?;
        row(f, "failed", self.failed, false)?;
        row(f, "cancelled", self.cancelled, false)?;
        row(f, "duplicated output sets", self.duplicated.len(), true)?;
        row(f, "lost", self.lost.len(), true)?;
        row(f, "stranded", self.stranded.len(), true)?;
        row(
            f,
            "completed, outputs missing",
            self.missing_outputs.len(),
            true,
        )?;
        row(
            f,
            "API disagrees with stream",
            self.api_disagrees.len(),
            true,
        )?;
        row(
            f,
            "stream copies that differ",
            self.stream_copies_differ.len(),
            true,
        )?;
        row(
            f,
            "dispatched by two schedulers",
            self.overlapping_terms.len(),
            true,
        )?;
        row(f, "undecodable events", self.undecodable_events, true)?;
        row(f, "jobs in the stream", self.jobs, false)?;
        row(f, "scheduler terms dispatching", self.terms, false)?;
        row(f, "events in the stream", self.events, false)?;
        row(f, "duplicate submissions", self.shadows, false)?;
        row(
            f,
            "  their jobs dispatched",
            self.shadow_jobs_dispatched,
            false,
        )?;
        row(
            f,
            "completed, credited elsewhere",
            self.credited_to_another_worker,
            false,
        )?;
        if let Some(q) = &self.waited {
            let unfinished = match q.unfinished {
                0 => "quiet".to_owned(),
                usize::MAX => "no scheduler answered".to_owned(),
                n => format!("{n} jobs still unfinished"),
            };
            writeln!(
                f,
                "waited {:.1} s for the farm to finish: {unfinished}",
                q.waited.as_secs_f64()
            )?;
        }
        let phases: Vec<String> = self
            .phases
            .iter()
            .map(|(view, took)| format!("{view} {:.1} s", took.as_secs_f64()))
            .collect();
        writeln!(f, "audit read: {}", phases.join(", "))?;
        if !self.failures.is_empty() {
            let tally: Vec<String> = self
                .failures
                .iter()
                .map(|(kind, n)| format!("{kind} {n}"))
                .collect();
            writeln!(f, "failed jobs by failure: {}", tally.join(", "))?;
        }
        if let Some(example) = &self.credited_example {
            writeln!(f, "credited elsewhere, e.g. {example}")?;
        }
        for (name, findings) in [
            ("duplicated", &self.duplicated),
            ("lost", &self.lost),
            ("stranded", &self.stranded),
            ("outputs missing", &self.missing_outputs),
            ("API disagrees", &self.api_disagrees),
            ("stream copies differ", &self.stream_copies_differ),
            ("dispatched by two schedulers", &self.overlapping_terms),
        ] {
            if findings.is_empty() {
                continue;
            }
            let tally: Vec<String> = findings
                .by_category
                .iter()
                .map(|(category, n)| format!("{category} {n}"))
                .collect();
            writeln!(f, "{name} ({}): {}", findings.len(), tally.join(", "))?;
            for (subject, problems) in findings.by_subject.iter().take(SHOWN) {
                writeln!(f, "  {subject}: {}", problems.join("; "))?;
            }
            if findings.len() > SHOWN {
                writeln!(f, "  ...")?;
            }
        }
        Ok(())
    }
}
