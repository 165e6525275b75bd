//! The chaos test: a realistic mixed workload on a farm of two schedulers (one active, one standby)
//! and four test-pattern workers, while faults hit it on a schedule: workers SIGKILLed, RabbitMQ
//! restarted, the S3 server stopped, the active scheduler SIGKILLed (also a few milliseconds into
//! accepting a pipeline). At the end every submission has exactly one completed output set or an
//! explicit failed/cancelled state: nothing duplicated, lost or stranded (see `audit.rs`).
//!
//! | file | what it owns |
//! | --- | --- |
//! | `workload.rs` | the client: submissions with idempotency keys, retries, simultaneous pairs, cancels; its ledger (shared with the cluster test) |
//! | `faults.rs` | the fault schedule and each fault |
//! | `stream.rs` | reading the whole event stream back |
//! | `audit.rs` | the verdict: ledger, stream, API and S3 compared; the summary table (shared with the cluster test) |
//!
//! Settings (environment): `VNFARM_CHAOS_SECONDS`, the length of the workload (default 90, the
//! bounded run of the test suite; `./farm chaos 600` runs ten minutes); `VNFARM_CHAOS_SEED`, to
//! replay the workload's and the schedule's choices (their timing depends on the machine);
//! `VNFARM_CHAOS_SCHEDULERS`, how many schedulers share the farm (default 2);
//! `VNFARM_CHAOS_POLICY`, the dispatch policy (default `affinity`, with batch messages of up to 8
//! jobs: the policy with the most state to lose; `least_loaded` and `round_robin` run too).
//!
//! It restarts the shared RabbitMQ, so it is a test binary of its own (cargo runs test binaries one
//! after another, never beside the end-to-end tests).

mod audit;
mod faults;

mod workload;

use std::time::{Duration, Instant};

use vnfarm_tests::{Farm, WorkerOptions};

use crate::faults::Fault;
use crate::workload::Client;

const WORKERS: usize = 4;
/// How long the farm gets, after the last fault and the last answer, to finish every job.
const SETTLE: Duration = Duration::from_secs(180);

/// The run's settings, from the environment.
struct Settings {
    workload: Duration,
    seed: u64,
    schedulers: usize,
    policy: String,
}

impl Settings {
    fn from_env() -> anyhow::Result<Self> {
        let var = |name: &str, default: u64| -> anyhow::Result<u64> {
            match std::env::var(name) {
                Ok(text) => text
                    .parse()
                    .map_err(|e| anyhow::anyhow!("{name}={text:?}: {e}")),
                Err(_) => Ok(default),
            }
        };
        let settings = Self {
            workload: Duration::from_secs(var("VNFARM_CHAOS_SECONDS", 90)?),
            seed: var("VNFARM_CHAOS_SEED", rand::random())?,
            schedulers: usize::try_from(var("VNFARM_CHAOS_SCHEDULERS", 2)?)?,
            policy: std::env::var("VNFARM_CHAOS_POLICY").unwrap_or_else(|_| "affinity".into()),
        };
        anyhow::ensure!(
            settings.schedulers >= 1,
            "VNFARM_CHAOS_SCHEDULERS: at least 1"
        );
        Ok(settings)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_chaos_every_submission_ends_exactly_once() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    println!(
        "chaos: {} s of workload, {} schedulers, {WORKERS} workers, dispatch policy {}, \
         VNFARM_CHAOS_SEED={}",
        settings.workload.as_secs(),
        settings.schedulers,
        settings.policy,
        settings.seed
    );
    let mut farm = Farm::with_own_s3("chaos").await?;
    // Snapshots every few hundred events, so that replacement schedulers start from one.
    farm.scheduler_env
        .push(("VNFARM_SNAPSHOT_EVERY_EVENTS".into(), "500".into()));
    farm.scheduler_env.extend([
        ("VNFARM_DISPATCH__POLICY".into(), settings.policy.clone()),
        ("VNFARM_DISPATCH__MAX_BATCH".into(), "8".into()),
    ]);
    while farm.scheduler_slots() < settings.schedulers {
        farm.add_scheduler();
    }
    for slot in 0..settings.schedulers {
        farm.start_scheduler_at(slot).await?;
    }
    for n in 1..=WORKERS {
        let options = WorkerOptions {
            step_ms: 10,
            ..WorkerOptions::default()
        };
        farm.start_worker(&format!("w{n}"), options).await?;
    }

    // The workload and the faults run side by side until `until`; then the client gets the answers
    // it still waits for, and the farm finishes its jobs.
    let client = Client::new(farm.scheduler_urls());
    let until = Instant::now() + settings.workload;
    let workload = tokio::spawn(client.clone().run(until, settings.seed));
    let injected = match faults::inject(&mut farm, &client, until, settings.seed ^ 1).await {
        Ok(injected) => injected,
        Err(e) => {
            let logs = farm.keep_logs();
            return Err(e.context(format!(
                "the processes' logs are kept in {}",
                logs.display()
            )));
        }
    };
    workload.await?;
    let draining = Instant::now();
    client.drain().await;
    println!(
        "workload over; the last answers came {:.1} s later",
        draining.elapsed().as_secs_f64()
    );
    let ledger = client.ledger();
    let target = audit::Target {
        schedulers: farm.scheduler_urls(),
        http: &farm.http,
        storage: &farm.storage,
        brokers: vec![vnfarm_tests::amqp_url()],
        prefix: &farm.prefix,
    };
    let report = audit::audit(&target, &ledger, SETTLE).await?;

    println!("faults injected: {}", injected.len());
    for fault in Fault::ALL {
        let n = injected.iter().filter(|i| **i == fault).count();
        println!("  {:<40} {n}", fault.name());
    }
    let stats = &ledger.stats;
    println!(
        "client: {} POSTs ({} without an answer, retried), {} resubmissions, {} simultaneous \
         pairs, {} cancels",
        stats.posts,
        stats.failed_posts,
        stats.resubmissions,
        stats.simultaneous_pairs,
        stats.cancels
    );
    println!("{report}");
    if !report.is_clean() {
        let logs = farm.keep_logs();
        anyhow::bail!(
            "the chaos run broke the job system's promises (see the table above); the processes' \
             logs are kept in {}",
            logs.display()
        );
    }
    Ok(())
}
