//! Following a job to its end: a job's Server-Sent Events drive a progress bar and state lines; a
//! pipeline (whose own stream only says `queued` and then how it ended) is polled instead.
//!
//! State lines go to stderr, above the bar; on completion the output keys go to stdout, one a line,
//! so `vnfarm submit ... | xargs` sees only them. A stream that ends before a final event is reopened
//! with `Last-Event-ID`, so no event is shown twice or missed.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sse_stream::SseByteStream;
use vnfarm_proto::{EventKind, JobId, SequencedEvent};

use vnfarm_proto::http::{JobAnswer, JobState, JobView};

use crate::client::{Api, ApiError};

/// How often a pipeline is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Consecutive failed attempts to reach the scheduler before giving up.
const MAX_RETRIES: u32 = 10;

/// How a watched job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    Failed,
    Cancelled,
}

/// Watches a job until it ends: a pipeline by polling, anything else by its event stream.
/// An archived job (past the registry's retention) completed long ago: its outputs are printed.
pub async fn watch(api: &Api, id: JobId) -> anyhow::Result<Outcome> {
    match api.job(id).await? {
        JobAnswer::Live(job) if job.is_pipeline() => {
            print_estimate(&job);
            watch_pipeline(api, job).await
        }
        JobAnswer::Live(job) => {
            print_estimate(&job);
            watch_events(api, id).await
        }
        JobAnswer::Archived(job) => {
            eprintln!("{} {id} completed (archived)", job.kind);
            print_outputs(&job.outputs);
            Ok(Outcome::Completed)
        }
    }
}

/// Sleeps between attempts after a transient error; gives the error back once retrying is pointless.
#[derive(Debug, Default)]
struct Retry {
    failures: u32,
}

impl Retry {
    async fn after(&mut self, error: ApiError) -> Result<(), ApiError> {
        if !error.is_transient() || self.failures >= MAX_RETRIES {
            return Err(error);
        }
        self.failures += 1;
        let delay = Duration::from_millis(250 << self.failures.min(5)).min(Duration::from_secs(5));
        eprintln!("{error}; retrying in {:.1}s", delay.as_secs_f64());
        tokio::time::sleep(delay).await;
        Ok(())
    }

    fn reset(&mut self) {
        self.failures = 0;
    }
}

async fn watch_events(api: &Api, id: JobId) -> anyhow::Result<Outcome> {
    let view = EventView::new();
    let mut last_event_id: Option<String> = None;
    let mut retry = Retry::default();
    loop {
        let response = match api.events(id, last_event_id.as_deref()).await {
            Ok(response) => response,
            Err(e) => {
                retry.after(e).await?;
                continue;
            }
        };
        // `sse-stream` keeps an unfinished line (or UTF-8 character) until the next chunk completes it.
        let mut blocks = SseByteStream::new(response.bytes_stream());
        while let Some(block) = blocks.next().await {
            // A broken stream, or one that is not UTF-8, is reopened below like one that ended early.
            let Ok(block) = block else { break };
            if let Some(seq) = block.id {
                last_event_id = Some(seq);
            }
            // A block without data (the keep-alive comments) is no event, as in the specification.
            let Some(data) = block.data else { continue };
            retry.reset();
            match serde_json::from_str::<SequencedEvent>(&data) {
                Ok(event) => {
                    let started = matches!(event.event.kind, EventKind::Started { .. });
                    if let Some(outcome) = view.show(event) {
                        return Ok(outcome);
                    }
                    // Its finish, now that it runs (an estimate that cannot be read is no
                    // reason to stop watching).
                    if started && let Ok(JobAnswer::Live(job)) = api.job(id).await {
                        view.bar.suspend(|| print_estimate(&job));
                    }
                }
                Err(e) => view.line(&format!(
                    "(skipping a `{}` event this build cannot read: {e})",
                    block.event.as_deref().unwrap_or("message")
                )),
            }
        }
        retry.after(ApiError::StreamEnded(id)).await?;
    }
}

/// Renders one job's events: a bar for `progress`, a line for everything else.
struct EventView {
    bar: ProgressBar,
}

impl EventView {
    fn new() -> Self {
        Self {
            bar: ProgressBar::hidden(),
        }
    }

    fn line(&self, text: &str) {
        self.bar.suspend(|| eprintln!("{text}"));
    }

    /// Shows an event; returns the outcome when it is final.
    fn show(&self, event: SequencedEvent) -> Option<Outcome> {
        let at = event.event.at.format("%H:%M:%S");
        let line = |text: String| self.line(&format!("{at} {text}"));
        match event.event.kind {
            EventKind::Queued { submission, .. } => {
                line(format!("queued ({})", submission.job.kind_name()))
            }
            EventKind::Dispatched {
                queue,
                worker,
                batch,
                ..
            } => {
                let with = batch.map_or(String::new(), |b| format!(", in the batch of {b}"));
                match worker {
                    Some(worker) => line(format!("dispatched to {worker} ({queue}{with})")),
                    None => line(format!("dispatched to {queue}{with}")),
                }
            }
            EventKind::Requeued { reason, .. } => {
                self.bar.set_position(0);
                line(format!("requeued: {reason}"));
            }
            EventKind::Started { worker, attempt } => match attempt {
                0 | 1 => line(format!("started on {worker}")),
                n => line(format!("started on {worker} (attempt {n})")),
            },
            EventKind::Progress { step, total } => {
                if self.bar.is_hidden() {
                    self.bar.set_style(bar_style(
                        "{elapsed_precise} [{bar:40}] {pos}/{len} steps {msg}",
                    ));
                    self.bar.set_draw_target(ProgressDrawTarget::stderr());
                }
                self.bar.set_length(u64::from(total));
                self.bar.set_position(u64::from(step));
            }
            EventKind::Completed {
                outputs, timings, ..
            } => {
                self.bar.finish_and_clear();
                let seconds: f64 = timings.0.values().sum();
                if seconds > 0.0 {
                    line(format!("completed ({seconds:.1}s of work)"));
                } else {
                    line("completed".to_owned());
                }
                print_outputs(&outputs);
                return Some(Outcome::Completed);
            }
            EventKind::Failed {
                failure,
                message,
                retryable: true,
            } => {
                self.bar.set_position(0);
                line(format!(
                    "failed, will retry: {}: {message}",
                    failure.as_str()
                ));
            }
            EventKind::Failed {
                failure,
                message,
                retryable: false,
            } => {
                self.bar.finish_and_clear();
                line(format!("failed: {}: {message}", failure.as_str()));
                return Some(Outcome::Failed);
            }
            EventKind::Cancelled { reason, by } => {
                self.bar.finish_and_clear();
                match by {
                    Some(by) => line(format!("cancelled by {by}: {reason}")),
                    None => line(format!("cancelled: {reason}")),
                }
                return Some(Outcome::Cancelled);
            }
        }
        None
    }
}

/// The job's estimated start and finish (or why it has none), on stderr; nothing for a finished
/// job.
fn print_estimate(job: &JobView) {
    if let Some(line) = estimate_line(job, chrono::Utc::now()) {
        eprintln!("{line}");
    }
}

fn estimate_line(job: &JobView, now: chrono::DateTime<chrono::Utc>) -> Option<String> {
    if job.state.is_terminal() {
        return None;
    }
    let time = |t: chrono::DateTime<chrono::Utc>| t.format("%H:%M:%S");
    match (&job.estimate, &job.no_estimate) {
        (Some(e), _) => {
            let secs = (e.finish_at - now).num_milliseconds().max(0) as f64 / 1e3;
            let start = if job.state == JobState::Running {
                format!("started {}", time(e.start_at))
            } else {
                format!("estimated start {}", time(e.start_at))
            };
            Some(format!(
                "{start}, finish {} (in {secs:.0}s; {})",
                time(e.finish_at),
                e.basis
            ))
        }
        (None, Some(why)) => Some(format!("no estimate yet: {why}")),
        (None, None) => None,
    }
}

fn bar_style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("the bar templates are constants and valid")
        .progress_chars("=> ")
}

fn print_outputs(outputs: &[String]) {
    for key in outputs {
        println!("{key}");
    }
}

async fn watch_pipeline(api: &Api, pipeline: JobView) -> anyhow::Result<Outcome> {
    let id = pipeline.id;
    let total = pipeline.children.len();
    eprintln!("pipeline {id}: {total} jobs");
    let bar = ProgressBar::new(total as u64);
    bar.set_style(bar_style(
        "{elapsed_precise} [{bar:40}] {pos}/{len} jobs done {msg}",
    ));
    let mut done: HashSet<JobId> = HashSet::new();
    let mut retry = Retry::default();
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    loop {
        tick.tick().await;
        let polled = poll_pipeline(api, id, &mut done, &bar).await;
        let pipeline = match polled {
            Ok(JobAnswer::Live(pipeline)) => pipeline,
            Ok(JobAnswer::Archived(job)) => {
                bar.finish_and_clear();
                eprintln!("pipeline completed (archived)");
                print_outputs(&job.outputs);
                return Ok(Outcome::Completed);
            }
            Err(e) => {
                retry
                    .after(e)
                    .await
                    .with_context(|| format!("watching pipeline {id}"))?;
                continue;
            }
        };
        retry.reset();
        bar.set_position(done.len() as u64);
        if !pipeline.state.is_terminal() {
            continue;
        }
        bar.finish_and_clear();
        return Ok(match pipeline.state {
            JobState::Completed => {
                eprintln!("pipeline completed");
                print_outputs(&pipeline.outputs);
                Outcome::Completed
            }
            JobState::Cancelled => {
                eprintln!("pipeline cancelled");
                Outcome::Cancelled
            }
            JobState::Failed
            | JobState::Queued
            | JobState::Dispatched
            | JobState::Running
            | JobState::Retrying
            | JobState::Unknown => {
                eprintln!("pipeline failed: {}", failure_text(&pipeline));
                Outcome::Failed
            }
        });
    }
}

/// One poll: the pipeline, then each of its jobs not yet seen to finish (printing those that did).
async fn poll_pipeline(
    api: &Api,
    id: JobId,
    done: &mut HashSet<JobId>,
    bar: &ProgressBar,
) -> Result<JobAnswer, ApiError> {
    let answer = api.job(id).await?;
    // A pipeline leaves no manifest, so the scheduler never answers one as archived; if it did,
    // the job completed, and the caller says so.
    let JobAnswer::Live(pipeline) = &answer else {
        return Ok(answer);
    };
    let mut running = Vec::new();
    for (i, child_id) in pipeline.children.iter().enumerate() {
        if done.contains(child_id) {
            continue;
        }
        let label =
            |kind: &str| format!("[{}/{}] {kind} {child_id}", i + 1, pipeline.children.len());
        let child = match api.job(*child_id).await? {
            JobAnswer::Live(child) => child,
            JobAnswer::Archived(child) => {
                let label = label(&child.kind);
                bar.suspend(|| eprintln!("{label} completed: {}", child.outputs.join(", ")));
                done.insert(*child_id);
                continue;
            }
        };
        let label = label(&child.kind);
        // Not `bar.println`, which prints nothing when stderr is not a terminal.
        let line = |text: String| bar.suspend(|| eprintln!("{label} {text}"));
        match child.state {
            JobState::Completed => line(format!("completed: {}", child.outputs.join(", "))),
            JobState::Failed => line(format!("failed: {}", failure_text(&child))),
            JobState::Cancelled => line("cancelled".to_owned()),
            JobState::Running => running.push(match &child.progress {
                Some(p) => format!("{} {}/{}", child.kind, p.step, p.total),
                None => child.kind.clone(),
            }),
            JobState::Queued | JobState::Dispatched | JobState::Retrying | JobState::Unknown => {}
        }
        if child.state.is_terminal() {
            done.insert(*child_id);
        }
    }
    bar.set_message(running.join(", "));
    Ok(answer)
}

fn failure_text(job: &JobView) -> String {
    match &job.failure {
        Some(f) => format!("{}: {}", f.kind.as_str(), f.message),
        None => job.state.as_str().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_reads_as_start_finish_and_basis() {
        let now: chrono::DateTime<chrono::Utc> = "2026-12-04T10:00:00Z".parse().unwrap();
        let mut job: JobView = serde_json::from_value(serde_json::json!({
            "id": JobId::new(), "kind": "generate", "state": "queued", "priority": "batch",
            "created_at": now, "updated_at": now, "worker": null, "dispatches": 0,
            "attempts": 0, "progress": null, "outputs": [], "manifest": null, "failure": null,
            "estimate": {"start_at": "2026-12-04T10:00:30Z", "finish_at": "2026-12-04T10:01:15Z",
                "basis": "sdxl 1mp on w0: 3 runs measured", "made_at": now},
        }))
        .unwrap();
        assert_eq!(
            estimate_line(&job, now).unwrap(),
            "estimated start 10:00:30, finish 10:01:15 (in 75s; sdxl 1mp on w0: 3 runs measured)"
        );
        job.state = JobState::Running;
        assert!(
            estimate_line(&job, now)
                .unwrap()
                .starts_with("started 10:00:30")
        );
        job.estimate = None;
        job.no_estimate = Some("no sdxl 1mp job has finished on this farm yet".into());
        assert_eq!(
            estimate_line(&job, now).unwrap(),
            "no estimate yet: no sdxl 1mp job has finished on this farm yet"
        );
        job.state = JobState::Completed;
        assert_eq!(estimate_line(&job, now), None);
    }
}
