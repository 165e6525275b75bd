//! A farm on three boxes under real faults (step 10): each box a network namespace with a RabbitMQ
//! node (the three joined into one cluster, `pause_minority`) and a test-pattern worker, the active
//! scheduler on box 1 and the standby on box 2, S3 on a storage box of its own. The chaos test's
//! mixed workload runs while the faults hit the farm one after another; then its audit: nothing
//! lost, duplicated or stranded, and every node's copy of the event history the same.
//!
//! | file | what it owns |
//! | --- | --- |
//! | `net.rs` | the namespaces, the bridge, the veths; cutting and restoring a box's link |
//! | `broker.rs` | the RabbitMQ nodes and the cluster they form |
//! | `farm.rs` | the processes on the boxes, started through `ip netns exec` |
//! | `faults.rs` | each fault, and what it measures |
//! | `../chaos/workload.rs`, `../chaos/audit.rs` | the chaos test's client, ledger and audit, shared |
//!
//! It builds network namespaces, so it runs as root (CI does). Every address is in
//! 10.77.0.0/16; the system's RabbitMQ on 127.0.0.1:5672 is not used.
//!
//! Settings (environment): `VNFARM_CLUSTER_FAULTS`, a comma-separated list of faults to run in
//! order (default: all five, each once: `broker_node_kill,link_cut,active_partition,box_kill,
//! storage_cut`); `VNFARM_CLUSTER_ROUNDS`, how many times the list runs (default 1, the bounded
//! run; more for a longer one); `VNFARM_CHAOS_SEED`, to replay the workload's choices;
//! `VNFARM_CLUSTER_KEEP_LOGS=1` keeps the processes' logs after a run that passed too (a failed run
//! always keeps them).

mod bench;
mod broker;
mod farm;
mod faults;
mod net;

// Shared with the chaos test, which uses all of them; this test does not call every helper.
#[allow(dead_code)]
#[path = "../chaos/audit.rs"]
mod audit;
#[allow(dead_code)]
#[path = "../chaos/workload.rs"]
mod workload;

use std::time::{Duration, Instant};

use crate::farm::{ClusterFarm, PREFIX, auth_headers, worker_id};
use crate::faults::{Fault, Measurements};
use crate::workload::Client;

const BOXES: u8 = 3;
/// The farm runs undisturbed this long before the first fault and between two.
const PAUSE: Duration = Duration::from_secs(3);
/// How long the farm gets, after the last fault and the last answer, to finish every job.
const SETTLE: Duration = Duration::from_secs(180);
/// The targets.
const ACCEPT_GAP_TARGET: Duration = Duration::from_secs(5);
const TAKEOVER_TARGET: Duration = Duration::from_secs(10);

struct Settings {
    faults: Vec<Fault>,
    rounds: u32,
    seed: u64,
}

impl Settings {
    fn from_env() -> anyhow::Result<Self> {
        let faults = match std::env::var("VNFARM_CLUSTER_FAULTS") {
            Ok(list) => list
                .split(',')
                .map(|name| {
                    Fault::parse(name.trim()).ok_or_else(|| {
                        anyhow::anyhow!("VNFARM_CLUSTER_FAULTS: unknown fault {name:?}")
                    })
                })
                .collect::<anyhow::Result<_>>()?,
            Err(_) => Fault::ALL.to_vec(),
        };
        Ok(Self {
            faults,
            rounds: u32::try_from(env_number("VNFARM_CLUSTER_ROUNDS", 1)?)?,
            seed: env_number("VNFARM_CHAOS_SEED", rand::random())?,
        })
    }
}

/// The number in the environment variable `name`, or `default` when it is not set.
fn env_number(name: &str, default: u64) -> anyhow::Result<u64> {
    std::env::var(name).map_or(Ok(default), |text| {
        text.parse()
            .map_err(|e| anyhow::anyhow!("{name}={text:?}: {e}"))
    })
}

/// Ignored by `cargo test --workspace` only because it needs root: `./farm test` runs it (as root,
/// after the other suites), and `./farm cluster [ROUNDS]` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (network namespaces): ./farm test runs it as root, ./farm cluster alone"]
async fn a_three_box_farm_loses_nothing_under_real_faults() -> anyhow::Result<()> {
    let whoami = std::process::Command::new("id").arg("-u").output()?;
    anyhow::ensure!(
        String::from_utf8_lossy(&whoami.stdout).trim() == "0",
        "the cluster test builds network namespaces: run it as root (CI does)"
    );
    let settings = Settings::from_env()?;
    let names: Vec<&str> = settings.faults.iter().map(|f| f.name()).collect();
    println!(
        "cluster: {BOXES} boxes, faults {} × {}, VNFARM_CHAOS_SEED={}",
        names.join(","),
        settings.rounds,
        settings.seed
    );
    let began = Instant::now();
    let mut farm = ClusterFarm::start(BOXES).await?;

    let client = Client::with_headers(farm.scheduler_urls(), auth_headers());
    // The workload runs until it is aborted after the last fault. Aborting it is safe: it is
    // stopped at an await, and it never awaits between registering a key and spawning its
    // submission (which goes on in the client's own tasks until `drain`).
    let workload = tokio::spawn(client.clone().run(
        Instant::now() + Duration::from_secs(24 * 3600),
        settings.seed,
    ));
    let mut measured = Measurements::default();
    let mut injected = 0;
    for _ in 0..settings.rounds {
        for &fault in &settings.faults {
            tokio::time::sleep(PAUSE).await;
            let at = began.elapsed();
            match faults::inject(fault, &mut farm, &client, &mut measured).await {
                Ok(line) => println!(
                    "[{:6.1} s] {}: {line} (took {:.1} s)",
                    at.as_secs_f64(),
                    fault.name(),
                    (began.elapsed() - at).as_secs_f64()
                ),
                Err(e) => {
                    workload.abort();
                    let logs = farm.keep_logs();
                    return Err(e.context(format!(
                        "fault {} failed; logs kept in {}",
                        fault.name(),
                        logs.display()
                    )));
                }
            }
            injected += 1;
        }
    }
    tokio::time::sleep(PAUSE).await;
    workload.abort();
    let draining = Instant::now();
    client.drain().await;
    println!(
        "workload over after {injected} faults; the last answers came {:.1} s later",
        draining.elapsed().as_secs_f64()
    );

    let ledger = client.ledger();
    let target = audit::Target {
        schedulers: farm.scheduler_urls(),
        http: &farm.http,
        storage: &farm.storage,
        brokers: farm.cluster.urls(),
        prefix: PREFIX,
    };
    let report = audit::audit(&target, &ledger, SETTLE).await?;
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
    let worst = |all: &[Duration]| all.iter().max().copied();
    let verdict = |worst: Option<Duration>, target: Duration| match worst {
        None => "not measured".to_owned(),
        Some(d) if d < target => format!("{:.2} s, target < {target:?}: met", d.as_secs_f64()),
        Some(d) => format!("{:.2} s, target < {target:?}: MISSED", d.as_secs_f64()),
    };
    println!(
        "longest gap in accepted submissions during a broker node loss: {}",
        verdict(worst(&measured.accept_gaps), ACCEPT_GAP_TARGET)
    );
    println!(
        "standby takeover after the active scheduler's box was cut: {}",
        verdict(worst(&measured.takeovers), TAKEOVER_TARGET)
    );
    if let Some(both) = worst(&measured.both_active) {
        println!(
            "both schedulers said active at once for at most {:.2} s (the cut one cannot reach \
             the broker then)",
            both.as_secs_f64()
        );
    }
    println!("whole run {:.1} s", began.elapsed().as_secs_f64());
    // A takeover starts a term of its own: the term check had two to tell apart.
    anyhow::ensure!(
        measured.takeovers.is_empty() || report.terms >= 2,
        "a takeover was measured but the stream shows {} dispatching term(s)",
        report.terms
    );
    if std::env::var_os("VNFARM_CLUSTER_KEEP_LOGS").is_some_and(|v| v == "1") {
        println!("logs kept in {}", farm.keep_logs().display());
    }
    if !report.is_clean() {
        let logs = farm.keep_logs();
        anyhow::bail!(
            "the cluster run broke the job system's promises (see the table above); logs kept in {}",
            logs.display()
        );
    }

    // Least privilege on the cluster the farm ran on under its definitions' users: each role
    // tried at what it must and must not do (the e2e test `permissions`' matrix). Last, on the
    // quiet farm: the probes publish and consume for real.
    let wrong = farm
        .cluster
        .wrong_outcomes(&worker_id(0), &worker_id(1))
        .await?;
    anyhow::ensure!(
        wrong.is_empty(),
        "a role could do what it must not, or not what it must:\n{}",
        wrong.join("\n")
    );
    println!("least privilege: every role did its work and nothing else");
    Ok(())
}

/// The price of replication: one seeded workload on the three boxes with a broker node on each
/// (the cluster) and with one node for all, alternately (cluster, one, one, cluster, … so a drift in
/// the machine's load falls on both). `VNFARM_CLUSTER_BENCH_ITEMS` submissions (default 120),
/// `VNFARM_CLUSTER_BENCH_ROUNDS` pairs (default 2). Prints each run and the ratio of the medians.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark, as root: ./farm cluster-bench"]
async fn the_cluster_and_one_node_run_the_same_workload() -> anyhow::Result<()> {
    let items = usize::try_from(env_number("VNFARM_CLUSTER_BENCH_ITEMS", 120)?)?;
    let rounds = env_number("VNFARM_CLUSTER_BENCH_ROUNDS", 2)?;
    let seed = env_number("VNFARM_CHAOS_SEED", 7)?;
    let workload = bench::workload(items, seed);
    let jobs: usize = workload.iter().map(|(_, _, jobs)| jobs).sum();
    println!(
        "replication bench: {items} submissions ({jobs} jobs), seed {seed}, {rounds} round(s)"
    );
    let mut per_nodes: [Vec<f64>; 2] = Default::default();
    for round in 0..rounds {
        let order = if round % 2 == 0 { [3, 1] } else { [1, 3] };
        for nodes in order {
            let run = bench::run(nodes, &workload).await?;
            println!(
                "round {round}: {nodes} node(s): {} jobs in {:.1} s = {:.2} jobs/s",
                run.jobs,
                run.seconds,
                run.jobs_per_second()
            );
            per_nodes[usize::from(nodes == 3)].push(run.jobs_per_second());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        (v[(n - 1) / 2] + v[n / 2]) / 2.0
    };
    let (one, three) = (median(&mut per_nodes[0]), median(&mut per_nodes[1]));
    println!(
        "median jobs/s: one node {one:.2}, cluster {three:.2}; cluster ÷ one node = {:.3} (goal ≥ 0.85)",
        three / one
    );
    Ok(())
}
