//! What the fleet benchmark reports for each policy, measured on the event log (the durable record
//! of every job) and the scheduler's metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use vnfarm_proto::event::YIELDED_REASON;
use vnfarm_proto::{EventKind, JobId, Priority, SequencedEvent};

use super::{JobTimes, RunConfig, jobs_of};

#[derive(Clone, Debug)]
pub struct PolicyReport {
    pub policy: String,
    pub jobs: usize,
    pub completed: usize,
    /// Edit jobs, the distinct input sets they edit, and how many times those were encoded.
    pub edits: usize,
    pub distinct_inputs: usize,
    pub encodes: usize,
    /// Edits whose input encodings another worker had published (read from storage).
    pub fetches: usize,
    /// Median and largest fetch, milliseconds of real time (not scaled like the profile's stages).
    pub fetch_ms: Option<(f64, f64)>,
    /// Edits that found their input already encoded on their worker.
    pub cache_hit_ratio: f64,
    /// The affinity policy's own count: messages sent to a worker holding the input, of all the
    /// messages it placed by affinity (`None` for the baselines).
    pub affinity_hit_ratio: Option<f64>,
    /// Jobs per message: mean and largest.
    pub batch_mean: f64,
    pub batch_max: usize,
    /// From the first `queued` to the last terminal event.
    pub makespan_s: f64,
    pub throughput_jobs_per_s: f64,
    /// `queued` → terminal, seconds, by priority: p50, p99.
    pub latency: BTreeMap<&'static str, (f64, f64)>,
    /// Mean over workers of the time they ran jobs over the makespan.
    pub busy_fraction: f64,
    /// Jobs given back unstarted because the scheduler asked (yields for interactive work).
    pub yielded: usize,
    /// Encodes of an input set after its first, by the encoding job: interactive, given back by a
    /// yield before, or other (work conservation, spills, expired holds, evictions).
    pub repeat_encodes: BTreeMap<&'static str, usize>,
    /// Messages by the policy's decision (`vnfarm_dispatches_total`).
    pub decisions: BTreeMap<String, f64>,
}

impl PolicyReport {
    pub fn encodes_per_input(&self) -> f64 {
        self.encodes as f64 / self.distinct_inputs.max(1) as f64
    }

    pub fn fetches_per_input(&self) -> f64 {
        self.fetches as f64 / self.distinct_inputs.max(1) as f64
    }
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Sums a counter family's samples whose labels contain `label`, from Prometheus text.
fn counter(metrics: &str, name: &str, label: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn measure(
    policy: &str,
    events: &[SequencedEvent],
    metrics: &str,
    workers: usize,
) -> anyhow::Result<PolicyReport> {
    let jobs = jobs_of(events);
    let first = jobs.values().filter_map(|j| j.queued).min();
    let last = jobs.values().filter_map(|j| j.ended).max();
    let (Some(first), Some(last)) = (first, last) else {
        anyhow::bail!("the run has no finished jobs");
    };
    let makespan_s = (last - first).as_seconds_f64();
    let edits: Vec<&JobTimes> = jobs.values().filter(|j| j.kind == "edit").collect();
    let distinct: BTreeSet<&str> = edits
        .iter()
        .filter_map(|j| j.affinity_key.as_deref())
        .collect();
    let encodes = edits.iter().filter(|j| j.encoded).count();
    let mut fetch_ms: Vec<f64> = edits
        .iter()
        .filter_map(|j| j.fetched.map(|s| 1000.0 * s))
        .collect();
    fetch_ms.sort_by(f64::total_cmp);
    let fetches = fetch_ms.len();
    let yielded_jobs: BTreeSet<JobId> = events
        .iter()
        .filter(
            |e| matches!(&e.event.kind, EventKind::Requeued { reason, .. } if reason == YIELDED_REASON),
        )
        .map(|e| e.event.job_id)
        .collect();
    let mut encoders: Vec<(&JobId, &JobTimes)> = jobs
        .iter()
        .filter(|(_, j)| j.kind == "edit" && j.encoded)
        .collect();
    encoders.sort_by_key(|(_, j)| j.started);
    let mut first_encoded = BTreeSet::new();
    let mut repeat_encodes: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (id, j) in encoders {
        let Some(key) = j.affinity_key.as_deref() else {
            continue;
        };
        if first_encoded.insert(key) {
            continue;
        }
        let cause = if j.priority == Some(Priority::Interactive) {
            "interactive"
        } else if yielded_jobs.contains(id) {
            "yielded"
        } else {
            "other"
        };
        *repeat_encodes.entry(cause).or_default() += 1;
    }
    let decisions: BTreeMap<String, f64> = metrics
        .lines()
        .filter(|l| l.starts_with("vnfarm_dispatches_total{"))
        .filter_map(|l| {
            let decision = l.split("decision=\"").nth(1)?.split('"').next()?;
            let value = l.rsplit(' ').next()?.parse::<f64>().ok()?;
            (value > 0.0).then(|| (decision.to_owned(), value))
        })
        .collect();
    let completed_edits = edits.iter().filter(|j| j.completed).count();
    let mut latency = BTreeMap::new();
    for (name, priority) in [
        ("interactive", Priority::Interactive),
        ("batch", Priority::Batch),
    ] {
        let mut l: Vec<f64> = jobs
            .values()
            .filter(|j| j.priority == Some(priority))
            .filter_map(|j| Some((j.ended? - j.queued?).as_seconds_f64()))
            .collect();
        l.sort_by(f64::total_cmp);
        latency.insert(name, (percentile(&l, 0.5), percentile(&l, 0.99)));
    }
    // Messages: a batch is named by its first job; a job dispatched alone is its own message.
    let mut messages: BTreeMap<JobId, usize> = BTreeMap::new();
    for (id, j) in &jobs {
        if j.started.is_some() {
            *messages.entry(j.batch.unwrap_or(*id)).or_default() += 1;
        }
    }
    let batch_mean = messages.values().sum::<usize>() as f64 / messages.len().max(1) as f64;
    let batch_max = messages.values().copied().max().unwrap_or(0);
    // Busy: the union of each worker's [started, ended] intervals.
    let mut by_worker: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for j in jobs.values() {
        if let (Some(w), Some(s), Some(e)) = (j.worker.as_deref(), j.started, j.ended) {
            by_worker
                .entry(w)
                .or_default()
                .push(((s - first).as_seconds_f64(), (e - first).as_seconds_f64()));
        }
    }
    let busy: f64 = by_worker
        .values_mut()
        .map(|spans| {
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (mut total, mut end) = (0.0, f64::MIN);
            for &(s, e) in spans.iter() {
                let from = s.max(end);
                if e > from {
                    total += e - from;
                }
                end = end.max(e);
            }
            total
        })
        .sum();
    let placed: f64 = [
        "affinity_hit",
        "affinity_miss",
        "affinity_spill",
        "affinity_wait_expired",
        "affinity_imbalance",
        "affinity_idle",
        "affinity_interactive",
    ]
    .iter()
    .map(|d| {
        counter(
            metrics,
            "vnfarm_dispatches_total",
            &format!("decision=\"{d}\""),
        )
    })
    .sum();
    let hits = counter(
        metrics,
        "vnfarm_dispatches_total",
        "decision=\"affinity_hit\"",
    );
    Ok(PolicyReport {
        policy: policy.to_owned(),
        jobs: jobs.len(),
        completed: jobs.values().filter(|j| j.completed).count(),
        edits: edits.len(),
        distinct_inputs: distinct.len(),
        encodes,
        fetches,
        fetch_ms: fetch_ms
            .last()
            .map(|&max| (percentile(&fetch_ms, 0.5), max)),
        cache_hit_ratio: (completed_edits.saturating_sub(encodes + fetches)) as f64
            / completed_edits.max(1) as f64,
        affinity_hit_ratio: (placed > 0.0).then(|| hits / placed),
        batch_mean,
        batch_max,
        makespan_s,
        throughput_jobs_per_s: jobs.len() as f64 / makespan_s,
        latency,
        busy_fraction: busy / (makespan_s * workers as f64),
        yielded: yielded_jobs.len(),
        repeat_encodes,
        decisions,
    })
}

/// The comparison as a Markdown table, ratios against `least_loaded`.
pub fn render(config: &RunConfig, reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let p = &config.profile;
    let _ = writeln!(
        out,
        "profile {} ({}), time scale 1/{}, {} workers, seed {}: {} backlog items + {} interactive over {} s\n",
        p.name,
        p.source,
        config.scale,
        config.workers,
        config.seed,
        config.backlog_items,
        config.interactive_items,
        config.arrival_seconds
    );
    let _ = writeln!(
        out,
        "| policy | jobs | completed | edits / inputs | encodes per input | fetches per input | cache hits | affinity hits | batch mean (max) | makespan s | jobs/s | ÷ least_loaded | interactive p50 / p99 s | batch p50 / p99 s | busy | yielded |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let base = reports
        .iter()
        .find(|r| r.policy == "least_loaded")
        .map(|r| r.throughput_jobs_per_s);
    for r in reports {
        let (ip50, ip99) = r.latency["interactive"];
        let (bp50, bp99) = r.latency["batch"];
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} | {:.2} | {:.2} | {:.0} % | {} | {:.2} ({}) | {:.2} | {:.2} | {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} % | {} |",
            r.policy,
            r.jobs,
            r.completed,
            r.edits,
            r.distinct_inputs,
            r.encodes_per_input(),
            r.fetches_per_input(),
            100.0 * r.cache_hit_ratio,
            r.affinity_hit_ratio
                .map_or("-".to_owned(), |h| format!("{:.0} %", 100.0 * h)),
            r.batch_mean,
            r.batch_max,
            r.makespan_s,
            r.throughput_jobs_per_s,
            base.map_or("-".to_owned(), |b| format!(
                "{:.2}",
                r.throughput_jobs_per_s / b
            )),
            ip50,
            ip99,
            bp50,
            bp99,
            100.0 * r.busy_fraction,
            r.yielded
        );
    }
    let _ = writeln!(out);
    for r in reports {
        let _ = writeln!(
            out,
            "{}: repeat encodes {:?}; fetch ms (real) p50 / max {}; messages by decision {:?}",
            r.policy,
            r.repeat_encodes,
            r.fetch_ms
                .map_or("-".to_owned(), |(p50, max)| format!("{p50:.1} / {max:.1}")),
            r.decisions
        );
    }
    out
}
