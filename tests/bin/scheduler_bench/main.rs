//! `scheduler-bench`: the scheduler's evidence for issue 8, measured on real processes (the
//! harness of `tests/lib.rs`: a real RabbitMQ, an `s3s-fs` S3 server, the scheduler and
//! test-pattern worker binaries of the same build).
//!
//! | subcommand | what it measures |
//! | --- | --- |
//! | `replay` | a long history written to the event stream (default 100 000 jobs, 1 000 000 events): resident memory and CPU of the scheduler that applied it live; time to serve, memory and CPU of schedulers started on it with a snapshot and without |
//! | `backlog` | submit rate (HTTP) and drain rate (3 test-pattern workers) with 100 and with 10 000 jobs queued, and the scheduler's CPU per job |
//! | `estimates` | the time to make every job's estimate, in this process, with 10 000 jobs waiting on 8 workers |
//! | `all` (default) | all three |
//!
//! `--quick` scales everything down for a check of the benchmark itself. Every run has its own
//! broker prefix, deletes its queues at the end, and kills every process it started, also when it
//! fails, panics or is interrupted (Ctrl-C). Build the binaries first, in the same profile:
//! `cargo build --release -p vnfarm-tests --bin scheduler-bench -p vnfarm-scheduler -p vnfarm-worker --bins`.
//!
//! | file | what it owns |
//! | --- | --- |
//! | `history.rs` | synthetic job history in the wire format, written to the event stream |
//! | `replay.rs` | measurements over a long history: live, restarts with and without a snapshot |
//! | `backlog.rs` | submit and drain rates at a backlog depth |
//! | `estimates.rs` | what making the estimates costs at a backlog depth |
//! | `probe.rs` | a scheduler seen from outside: metrics, time to serve, log fields |
//! | `process.rs` | `/proc`: resident memory and CPU time |
//! | `report.rs` | the tables |

mod backlog;
mod estimates;
mod history;
mod probe;
mod process;
mod replay;
mod report;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    about = "Measures the scheduler: memory, time to serve after a restart, submit and drain rates"
)]
struct Cli {
    #[command(subcommand)]
    what: Option<What>,
    /// Scaled down (10 000 jobs of history, backlogs of 100 and 1 000, one round): checks the
    /// benchmark, not the scheduler.
    #[arg(long, global = true)]
    quick: bool,
    /// Jobs in the history of `replay` [default: 100000; quick: 10000].
    #[arg(long, global = true)]
    jobs: Option<u64>,
    /// Progress events per job of that history.
    #[arg(long, global = true, default_value_t = 6)]
    steps: u32,
    /// Timed starts with a snapshot, and as many without [default: 3; quick: 1].
    #[arg(long, global = true)]
    restarts: Option<usize>,
    /// Backlog depths of `backlog`, comma-separated, each on a farm of its own; a depth may come
    /// again, and the summary takes the medians of all its rounds [default: 100,10000,10000,100,
    /// so that a drift of the machine's speed falls on both depths alike; quick: 100,1000].
    #[arg(long, global = true, value_delimiter = ',')]
    depths: Option<Vec<usize>>,
    /// Jobs per timed submit or drain window [default: 500; quick: 200].
    #[arg(long, global = true)]
    window: Option<usize>,
    /// Submit and drain windows per farm [default: 2; quick: 1].
    #[arg(long, global = true)]
    rounds: Option<usize>,
    /// Test-pattern workers draining the backlog (and workers in the synthetic history).
    #[arg(long, global = true, default_value_t = 3)]
    workers: usize,
    /// Submissions in flight at once.
    #[arg(long, global = true, default_value_t = 8)]
    concurrency: usize,
    /// Extra setting of every scheduler started, as `VNFARM_KEY=value` (repeatable), to measure
    /// the effect of one (`VNFARM_SNAPSHOT_EVERY_EVENTS=1000000000000`: no snapshots).
    #[arg(long = "scheduler-env", global = true, value_parser = parse_setting)]
    scheduler_env: Vec<(String, String)>,
}

fn parse_setting(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if key.starts_with("VNFARM_") => Ok((key.into(), value.into())),
        _ => Err(format!("{text:?}: expected VNFARM_KEY=value")),
    }
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum What {
    /// Memory and time to serve over a long event history.
    Replay,
    /// Submit and drain rates at two backlog depths.
    Backlog,
    /// The cost of the estimates with a deep backlog.
    Estimates,
    /// All three.
    All,
}

impl Cli {
    fn replay(&self) -> replay::Options {
        replay::Options {
            shape: history::Shape {
                jobs: self
                    .jobs
                    .unwrap_or(if self.quick { 10_000 } else { 100_000 }),
                steps: self.steps,
                workers: self.workers,
            },
            restarts: self.restarts.unwrap_or(if self.quick { 1 } else { 3 }),
            scheduler_env: self.scheduler_env.clone(),
        }
    }

    fn backlog(&self) -> backlog::Options {
        backlog::Options {
            depths: self.depths.clone().unwrap_or(if self.quick {
                vec![100, 1_000]
            } else {
                vec![100, 10_000, 10_000, 100]
            }),
            window: self.window.unwrap_or(if self.quick { 200 } else { 500 }),
            rounds: self.rounds.unwrap_or(if self.quick { 1 } else { 2 }),
            workers: self.workers,
            concurrency: self.concurrency,
            scheduler_env: self.scheduler_env.clone(),
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let what = cli.what.unwrap_or(What::All);
    print!("{}", report::machine());
    let args: Vec<String> = std::env::args().skip(1).collect();
    println!("  arguments: {}", args.join(" "));
    // The farms live inside `run`: interrupting drops it, and a farm dropped kills its processes
    // and deletes its queues.
    tokio::select! {
        result = run(&cli, what) => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; processes stopped, queues deleted"),
    }
}

async fn run(cli: &Cli, what: What) -> anyhow::Result<()> {
    let replay = match what {
        What::Replay | What::All => Some(replay::run(cli.replay()).await?),
        What::Backlog | What::Estimates => None,
    };
    let backlog = match what {
        What::Backlog | What::All => Some(backlog::run(&cli.backlog()).await?),
        What::Replay | What::Estimates => None,
    };
    let estimates = match what {
        What::Estimates | What::All => {
            let jobs = if cli.quick { 1_000 } else { 10_000 };
            Some(tokio::task::block_in_place(|| estimates::run(jobs, 8, 20))?)
        }
        What::Replay | What::Backlog => None,
    };
    println!();
    if let Some(replay) = &replay {
        print!("{}", report::replay(replay));
    }
    if let Some(backlog) = &backlog {
        print!("{}", report::backlog(backlog));
    }
    if let Some(e) = &estimates {
        println!(
            "estimates: {} jobs waiting, {} workers: every estimate made in {:.1} ms (median of {}; max {:.1} ms), {:.1} ms of it under the registry's lock; {} of the waiting jobs estimated",
            e.jobs,
            e.workers,
            e.median().as_secs_f64() * 1e3,
            e.refreshes.len(),
            e.max().as_secs_f64() * 1e3,
            e.locked_median().as_secs_f64() * 1e3,
            e.estimated
        );
    }
    println!("at the end: {}", report::load());
    Ok(())
}
