//! A scheduler over a long history (issue 8, measurements 1, 2 and 4): one scheduler runs while
//! the history is written to its event stream and applies it live; then schedulers are started on
//! the finished stream, first with the snapshots the live one wrote, then with none (the snapshot
//! stream deleted), and timed until they serve. Resident memory and CPU time of each come from
//! `/proc`.

use std::time::{Duration, Instant};

use lapin::options::QueueDeleteOptions;
use vnfarm_proto::topology::Topology;
use vnfarm_tests::{Farm, wait_for};

use crate::history::{self, Shape};
use crate::probe::{self, ServeTimes};
use crate::process::{self, Memory};

/// How long a start may take before the run fails.
const SERVE_LIMIT: Duration = Duration::from_secs(900);
/// A restarted scheduler's memory is read again this long after it serves (it has written its
/// first snapshot by then).
const SETTLE: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct Options {
    pub shape: Shape,
    /// Starts timed with a snapshot, and as many without.
    pub restarts: usize,
    /// Extra settings of every scheduler (`VNFARM_*`).
    pub scheduler_env: Vec<(String, String)>,
}

/// The scheduler that applied the history as it was written.
#[derive(Clone, Copy, Debug)]
pub struct Live {
    /// Before any event.
    pub empty: Memory,
    /// Once it had applied the last event.
    pub memory: Memory,
    pub written: history::Written,
    /// From the end of writing until it had applied the last event.
    pub lag: Duration,
    pub cpu: Duration,
    pub registry_jobs: u64,
    pub snapshots: u64,
    pub snapshot_bytes: u64,
}

/// One scheduler started on the finished history.
#[derive(Clone, Debug)]
pub struct Start {
    pub snapshot: bool,
    pub times: ServeTimes,
    /// When it first reported itself active.
    pub serving: Memory,
    /// [`SETTLE`] later.
    pub settled: Memory,
    pub cpu_to_serve: Duration,
    pub registry_jobs: u64,
    /// From its log: reading and decoding the snapshot, and replaying the events after it.
    pub snapshot_seconds: Option<f64>,
    pub replayed_events: Option<u64>,
    pub replay_seconds: Option<f64>,
}

pub struct Report {
    pub options: Options,
    pub live: Live,
    pub starts: Vec<Start>,
}

pub async fn run(options: Options) -> anyhow::Result<Report> {
    let mut farm = Farm::with_own_s3("bench-replay").await?;
    farm.scheduler_env
        .extend(options.scheduler_env.iter().cloned());
    farm.start_scheduler().await?;
    probe::wait_serving(&farm, 0, Instant::now(), SERVE_LIMIT).await?;
    let live = live(&farm, options.shape).await?;
    farm.kill_scheduler();

    // A scheduler writes its first snapshot as soon as it is active (none written yet counts as
    // due), so the first start with a snapshot reads the live scheduler's last one, as after a
    // crash, and the later ones the snapshot of the start before them.
    let mut starts = Vec::new();
    for n in 1..=options.restarts {
        println!("start {n} of {} with a snapshot", options.restarts);
        starts.push(start(&mut farm, true).await?);
        farm.kill_scheduler();
    }
    let topology = Topology::new(farm.prefix.clone());
    for n in 1..=options.restarts {
        println!("start {n} of {} without a snapshot", options.restarts);
        let connection = farm.connect_amqp().await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_delete(
                topology.snapshot_stream().as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await?;
        connection.close(200, "snapshots deleted".into()).await?;
        starts.push(start(&mut farm, false).await?);
        farm.kill_scheduler();
    }
    Ok(Report {
        options,
        live,
        starts,
    })
}

async fn live(farm: &Farm, shape: Shape) -> anyhow::Result<Live> {
    let pid = farm.scheduler_pid(0).expect("started above");
    let empty = process::memory(pid)?;
    let cpu_before = process::cpu(pid)?;
    println!(
        "writing {} jobs ({} events) to the event stream while the scheduler runs",
        shape.jobs,
        shape.events()
    );
    let connection = farm.connect_amqp().await?;
    let topology = Topology::new(farm.prefix.clone());
    let written =
        history::write(&connection, &topology, shape, (shape.events() / 10).max(1)).await?;
    connection.close(200, "history written".into()).await?;
    let writing_done = Instant::now();
    let last = written.last_job;
    wait_for(
        "the live scheduler to apply the whole history",
        SERVE_LIMIT,
        || async {
            let job = farm.job(last).await.ok()?;
            (job.state == vnfarm_proto::http::JobState::Completed).then_some(())
        },
    )
    .await?;
    let lag = writing_done.elapsed();
    let memory = process::memory(pid)?;
    let cpu = process::cpu(pid)? - cpu_before;
    let gauge = |name: &'static str, labels: &'static [(&str, &str)]| async move {
        probe::metric(farm, name, labels).await.map(|v| v as u64)
    };
    Ok(Live {
        empty,
        memory,
        written,
        lag,
        cpu,
        registry_jobs: gauge("vnfarm_registry_jobs", &[]).await?,
        snapshots: gauge("vnfarm_snapshots_total", &[("outcome", "written")]).await?,
        snapshot_bytes: gauge("vnfarm_snapshot_bytes", &[]).await?,
    })
}

async fn start(farm: &mut Farm, snapshot: bool) -> anyhow::Result<Start> {
    let log_before = farm.full_log(farm.scheduler_log(0)).len();
    let launched = Instant::now();
    farm.launch_scheduler_at(0)?;
    let times = probe::wait_serving(farm, 0, launched, SERVE_LIMIT).await?;
    let pid = farm.scheduler_pid(0).expect("launched above");
    let serving = process::memory(pid)?;
    let cpu_to_serve = process::cpu(pid)?;
    tokio::time::sleep(SETTLE).await;
    let settled = process::memory(pid)?;
    let registry_jobs = probe::metric(farm, "vnfarm_registry_jobs", &[]).await? as u64;
    let log = farm.full_log(farm.scheduler_log(0));
    let log = &log[log_before.min(log.len())..];
    let number = |message: &str, field: &str| probe::log_field(log, message, field);
    let start = Start {
        snapshot,
        times,
        serving,
        settled,
        cpu_to_serve,
        registry_jobs,
        snapshot_seconds: number("registry snapshot loaded", "seconds")
            .and_then(|s| s.parse().ok()),
        replayed_events: number("event stream replayed", "events").and_then(|s| s.parse().ok()),
        replay_seconds: number("event stream replayed", "seconds").and_then(|s| s.parse().ok()),
    };
    println!(
        "  ready {:.2} s, active {:.2} s, RSS {:.0} MiB ({:.0} MiB {} s later, peak {:.0} MiB), {} jobs held{}",
        start.times.ready.as_secs_f64(),
        start.times.active.as_secs_f64(),
        process::mib(serving.rss_kib),
        process::mib(settled.rss_kib),
        SETTLE.as_secs(),
        process::mib(settled.hwm_kib),
        registry_jobs,
        match (start.replayed_events, start.replay_seconds) {
            (Some(events), Some(seconds)) =>
                format!(", {events} stream messages replayed in {seconds:.2} s"),
            _ => String::new(),
        }
    );
    Ok(start)
}
