//! Submit and drain rates at a given backlog depth (issue 8, measurements 3 and 4), through the
//! real farm: a scheduler, test-pattern workers with minimal stage delays, jobs submitted over
//! HTTP.
//!
//! For each depth a farm of its own is filled with that many queued jobs while no worker runs.
//! Then, each round: `window` more jobs are submitted and timed (the submit rate at that depth);
//! the backlog is topped up to depth + window + a margin for the workers' start; the workers start,
//! and once all of them serve, the time the backlog takes to go from depth + window down to depth
//! is measured (the drain rate); the workers are stopped with SIGTERM (they finish the job in hand)
//! and the backlog is topped up to the depth again. The backlog is the jobs submitted and not yet
//! completed, which includes the few on the workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::probe;
use crate::process::{self, Memory};

/// Jobs beyond depth + window submitted before the workers start: they drain some while they
/// register, and the timed window starts only once all of them serve.
const START_MARGIN: usize = 300;
/// Denoising steps of each job (a progress event each).
const STEPS: u32 = 4;
/// How often the backlog is read while a drain is timed.
const POLL: Duration = Duration::from_millis(25);
const DRAIN_LIMIT: Duration = Duration::from_secs(900);

#[derive(Clone, Debug)]
pub struct Options {
    pub depths: Vec<usize>,
    pub window: usize,
    pub rounds: usize,
    pub workers: usize,
    /// Submissions in flight at once.
    pub concurrency: usize,
    /// Extra settings of every scheduler (`VNFARM_*`).
    pub scheduler_env: Vec<(String, String)>,
}

/// One timed stretch: `jobs` submitted or completed in `elapsed`, the backlog going from `from`
/// to `to`, and the scheduler's CPU time meanwhile.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub jobs: u64,
    pub elapsed: Duration,
    pub from: u64,
    pub to: u64,
    pub scheduler_cpu: Duration,
}

impl Window {
    pub fn rate(&self) -> f64 {
        self.jobs as f64 / self.elapsed.as_secs_f64()
    }

    pub fn cpu_ms_per_job(&self) -> f64 {
        self.scheduler_cpu.as_secs_f64() * 1000.0 / self.jobs as f64
    }
}

/// Latencies of the submissions of a window, sorted.
#[derive(Clone, Debug, Default)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    pub fn quantile(&self, q: f64) -> Duration {
        let n = self.0.len();
        if n == 0 {
            return Duration::ZERO;
        }
        let i = ((n as f64 * q).ceil() as usize).clamp(1, n) - 1;
        self.0[i]
    }
}

#[derive(Clone, Debug)]
pub struct Round {
    pub submit: Window,
    pub submit_latency: Latencies,
    pub drain: Window,
}

#[derive(Clone, Debug)]
pub struct DepthReport {
    pub depth: usize,
    pub rounds: Vec<Round>,
    /// The scheduler's memory at the end, with the backlog back at the depth.
    pub memory: Memory,
}

pub async fn run(options: &Options) -> anyhow::Result<Vec<DepthReport>> {
    let mut reports = Vec::new();
    for &depth in &options.depths {
        println!("backlog of {depth} jobs");
        reports.push(at_depth(options, depth).await?);
    }
    Ok(reports)
}

/// A job of the benchmark: a small generate, with an idempotency key as a front end sends.
fn job(prefix: &str, n: u64) -> Value {
    json!({
        "schema_version": vnfarm_proto::SCHEMA_VERSION,
        "idempotency_key": format!("{prefix}-{n}"),
        "job": {
            "kind": "generate",
            "prompt": format!("1girl, (silver hair:1.2), school uniform, classroom, window light, take {n}"),
            "width": 256,
            "height": 256,
            "steps": STEPS,
        }
    })
}

/// Submits jobs over HTTP, numbering them, and keeps the count.
struct Submitter {
    url: String,
    http: reqwest::Client,
    prefix: Arc<str>,
    next: Arc<AtomicU64>,
    concurrency: usize,
}

impl Submitter {
    fn submitted(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    /// Submits `count` jobs, `concurrency` at a time; returns their latencies, sorted.
    async fn submit(&self, count: usize) -> anyhow::Result<Latencies> {
        let remaining = Arc::new(AtomicU64::new(count as u64));
        let mut tasks = JoinSet::new();
        for _ in 0..self.concurrency.min(count) {
            let (remaining, next) = (remaining.clone(), self.next.clone());
            let (http, url, prefix) = (self.http.clone(), self.url.clone(), self.prefix.clone());
            tasks.spawn(async move {
                let mut latencies = Vec::new();
                while remaining
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1))
                    .is_ok()
                {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    let sent = Instant::now();
                    let response = http.post(&url).json(&job(&prefix, n)).send().await?;
                    let status = response.status();
                    if status != reqwest::StatusCode::CREATED {
                        let text = response.text().await.unwrap_or_default();
                        bail!("submission {n}: {status} {text}");
                    }
                    latencies.push(sent.elapsed());
                }
                anyhow::Ok(latencies)
            });
        }
        let mut all = Vec::with_capacity(count);
        while let Some(done) = tasks.join_next().await {
            all.extend(done??);
        }
        all.sort();
        Ok(Latencies(all))
    }
}

/// Jobs submitted and not yet completed.
async fn backlog(farm: &Farm, submitter: &Submitter) -> anyhow::Result<u64> {
    let submitted = submitter.submitted();
    Ok(submitted.saturating_sub(probe::completed(farm).await?))
}

async fn at_depth(options: &Options, depth: usize) -> anyhow::Result<DepthReport> {
    let mut farm = Farm::with_own_s3("bench-backlog").await?;
    farm.scheduler_env
        .extend(options.scheduler_env.iter().cloned());
    farm.start_scheduler().await?;
    let pid = farm.scheduler_pid(0).expect("started above");
    let submitter = Submitter {
        url: farm.url("/v1/jobs"),
        http: farm.http.clone(),
        prefix: farm.prefix.as_str().into(),
        next: Arc::default(),
        concurrency: options.concurrency,
    };

    let fill = timed(
        pid,
        || submitter.submit(depth),
        || backlog(&farm, &submitter),
    )
    .await?
    .0;
    println!(
        "  filled to {depth} in {:.1} s ({:.0} jobs/s)",
        fill.elapsed.as_secs_f64(),
        fill.rate()
    );

    let ids: Vec<String> = (1..=options.workers).map(|n| format!("w{n}")).collect();
    let worker_options = WorkerOptions {
        step_ms: 1,
        extra_env: vec![
            ("VNFARM_ENGINE__TEST_PATTERN__ENCODE_MS".into(), "0".into()),
            ("VNFARM_ENGINE__TEST_PATTERN__DECODE_MS".into(), "0".into()),
        ],
    };
    let mut rounds = Vec::new();
    for round in 1..=options.rounds {
        let (submit, submit_latency) = timed(
            pid,
            || submitter.submit(options.window),
            || backlog(&farm, &submitter),
        )
        .await?;
        println!(
            "  round {round}: submitted {} at {:.0} jobs/s (backlog {} → {}; p50 {:.1} ms, p99 {:.1} ms)",
            submit.jobs,
            submit.rate(),
            submit.from,
            submit.to,
            ms(submit_latency.quantile(0.5)),
            ms(submit_latency.quantile(0.99)),
        );
        let target = depth + options.window + START_MARGIN;
        let now = backlog(&farm, &submitter).await? as usize;
        submitter.submit(target.saturating_sub(now)).await?;

        for id in &ids {
            if farm.worker_ids().contains(id) {
                farm.relaunch_worker(id)?;
            } else {
                farm.launch_worker(id, worker_options.clone())?;
            }
        }
        for id in &ids {
            wait_ready(&farm, id).await?;
        }
        let drain = drain(&farm, pid, depth, options.window, || {
            backlog(&farm, &submitter)
        })
        .await?;
        println!(
            "  round {round}: drained {} at {:.0} jobs/s (backlog {} → {})",
            drain.jobs,
            drain.rate(),
            drain.from,
            drain.to
        );
        for id in &ids {
            farm.signal_worker(id, libc::SIGTERM);
        }
        for id in &ids {
            let child = farm.worker_mut(id);
            tokio::task::block_in_place(|| child.wait())?;
        }
        let now = backlog(&farm, &submitter).await? as usize;
        submitter.submit(depth.saturating_sub(now)).await?;
        rounds.push(Round {
            submit,
            submit_latency,
            drain,
        });
    }
    let memory = process::memory(pid)?;
    Ok(DepthReport {
        depth,
        rounds,
        memory,
    })
}

/// Times `work`, with the backlog before and after and the scheduler's CPU time meanwhile.
async fn timed<F, Fut, B, BFut>(
    pid: u32,
    work: F,
    backlog: B,
) -> anyhow::Result<(Window, Latencies)>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = anyhow::Result<Latencies>>,
    B: Fn() -> BFut,
    BFut: Future<Output = anyhow::Result<u64>>,
{
    let from = backlog().await?;
    let cpu = process::cpu(pid)?;
    let started = Instant::now();
    let latencies = work().await?;
    let elapsed = started.elapsed();
    let scheduler_cpu = process::cpu(pid)? - cpu;
    let to = backlog().await?;
    Ok((
        Window {
            jobs: latencies.0.len() as u64,
            elapsed,
            from,
            to,
            scheduler_cpu,
        },
        latencies,
    ))
}

/// Waits until the backlog is at most depth + window, then times its fall to the depth.
async fn drain<B, BFut>(
    farm: &Farm,
    pid: u32,
    depth: usize,
    window: usize,
    backlog: B,
) -> anyhow::Result<Window>
where
    B: Fn() -> BFut,
    BFut: Future<Output = anyhow::Result<u64>>,
{
    let (depth, top) = (depth as u64, (depth + window) as u64);
    let deadline = Instant::now() + DRAIN_LIMIT;
    let from = loop {
        let now = backlog().await?;
        if now <= top {
            break now;
        }
        ensure!(Instant::now() < deadline, "the backlog stopped draining");
        tokio::time::sleep(POLL).await;
    };
    let completed = probe::completed(farm).await?;
    let cpu = process::cpu(pid)?;
    let started = Instant::now();
    let to = loop {
        let now = backlog().await?;
        if now <= depth {
            break now;
        }
        ensure!(
            Instant::now() < deadline,
            "the backlog stopped draining at {now}\n{}",
            farm.scheduler_logs()
        );
        tokio::time::sleep(POLL).await;
    };
    let elapsed = started.elapsed();
    let scheduler_cpu = process::cpu(pid)? - cpu;
    Ok(Window {
        jobs: probe::completed(farm).await? - completed,
        elapsed,
        from,
        to,
        scheduler_cpu,
    })
}

/// Waits until the scheduler lists worker `id` ready (a restarted worker replaces the draining
/// heartbeats of its previous process).
async fn wait_ready(farm: &Farm, id: &str) -> anyhow::Result<()> {
    farm.wait_worker(id).await?;
    wait_for(
        &format!("worker {id} to be ready"),
        Duration::from_secs(60),
        || async {
            let workers = farm.get_json("/v1/workers").await.ok()?;
            workers["workers"]
                .as_array()?
                .iter()
                .any(|w| w["id"] == id && w["state"] == "ready")
                .then_some(())
        },
    )
    .await
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
