//! `fleet-bench`: the fleet benchmark of issue 9 (see `vnfarm_tests::fleet`). One workload, run
//! against the `affinity` policy and the baselines `least_loaded` and `round_robin`, each on a fresh
//! farm of test-pattern workers whose stage delays follow a measured GPU profile; prints one
//! comparison table per profile. With `--estimates`, the workload mixed in sizes and steps runs on
//! the default dispatch alone and the accuracy of the scheduler's estimates is measured
//! (`vnfarm_tests::fleet::run_estimates`). Build the binaries first, in the same profile:
//! `cargo build --release -p vnfarm-tests --bin fleet-bench -p vnfarm-scheduler -p vnfarm-worker --bins`.

use clap::Parser;
use vnfarm_tests::fleet::{self, H200, RunConfig, STRIX_HALO, Workload};

#[derive(Parser, Debug)]
#[command(about = "Affinity dispatch and batching against round-robin and least-loaded")]
struct Cli {
    /// Profiles to run: h200, strix-halo.
    #[arg(long, value_delimiter = ',', default_value = "h200,strix-halo")]
    profiles: Vec<String>,
    /// Batch work submitted at the start.
    #[arg(long, default_value_t = 40)]
    backlog: usize,
    /// Interactive work arriving during the run.
    #[arg(long, default_value_t = 24)]
    interactive: usize,
    /// Seconds over which the interactive work arrives.
    #[arg(long, default_value_t = 20.0)]
    arrival_seconds: f64,
    #[arg(long, default_value_t = 4)]
    workers: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The short form the test suite runs.
    #[arg(long)]
    quick: bool,
    /// Instead of the policies: fair share, one person's N batch jobs queued, then another's 5.
    #[arg(long, value_name = "N")]
    fair_share: Option<usize>,
    /// Measure the estimates' accuracy on a workload of mixed sizes and steps (default dispatch
    /// only) instead of comparing policies.
    #[arg(long)]
    estimates: bool,
    /// Real time per profile time, instead of the profile's own (6 for the H200, 200 for the
    /// Strix Halo): a smaller scale makes jobs longer and the machine's own noise smaller.
    #[arg(long)]
    scale: Option<f64>,
    /// With `--estimates`: run the workload this many times, unmeasured, before the measured run
    /// (a farm that has seen its users' interactive work arrive before).
    #[arg(long, default_value_t = 0)]
    history: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    for name in &cli.profiles {
        let (profile, scale) = match name.as_str() {
            // Scaled so that a job takes about as long in real time on both (an edit ≈ 0.25 s):
            // the same workload then saturates both farms, and throughput tells policies apart.
            "h200" => (H200, 6.0),
            "strix-halo" => (STRIX_HALO, 200.0),
            other => anyhow::bail!("unknown profile {other:?} (h200, strix-halo)"),
        };
        let scale = cli.scale.unwrap_or(scale);
        let config = if cli.quick {
            RunConfig {
                profile,
                scale,
                mixed: cli.estimates,
                ..RunConfig::quick()
            }
        } else {
            RunConfig {
                profile,
                scale,
                workers: cli.workers,
                backlog_items: cli.backlog,
                interactive_items: cli.interactive,
                arrival_seconds: cli.arrival_seconds,
                seed: cli.seed,
                mixed: cli.estimates,
            }
        };
        if let Some(backlog) = cli.fair_share {
            let report = fleet::run_fair_share(&fleet::FairConfig {
                run: config.clone(),
                backlog,
                others: 5,
            })
            .await?;
            println!("profile {}\n{}", profile.name, report.render());
            continue;
        }
        let workload = Workload::new(&config);
        eprintln!(
            "profile {}: {} items, {} jobs per policy",
            profile.name,
            workload.items.len(),
            workload.jobs()
        );
        if cli.estimates {
            let started = std::time::Instant::now();
            let (report, accuracy) = fleet::run_estimates(&config, &workload, cli.history).await?;
            eprintln!(
                "  estimates: {} jobs in {:.1} s (wall {:.1} s)",
                report.jobs,
                report.makespan_s,
                started.elapsed().as_secs_f64()
            );
            println!("{}", fleet::render(&config, &[report]));
            println!("{}", fleet::render_accuracy(&config, &accuracy));
            continue;
        }
        let mut reports = Vec::new();
        for variant in fleet::VARIANTS {
            let started = std::time::Instant::now();
            let report = fleet::run_policy(variant, &config, &workload).await?;
            eprintln!(
                "  {}: {} jobs in {:.1} s (wall {:.1} s)",
                variant.name,
                report.jobs,
                report.makespan_s,
                started.elapsed().as_secs_f64()
            );
            reports.push(report);
        }
        println!("{}", fleet::render(&config, &reports));
    }
    Ok(())
}
