//! The price of replication (step 10's goal: the three-box farm on the cluster within 15 % of the
//! same farm on one node). The same seeded workload runs on the three boxes twice over: with a
//! RabbitMQ node on each box joined into the cluster (quorum queues and streams on three nodes), and
//! with one node on box 1 that every process of every box uses. No faults; the same schedulers,
//! workers, users and definitions. A benchmark, not a timed test: it prints what it measured and
//! fails only when the workload does not finish.

use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::task::JoinSet;
use vnfarm_proto::Priority;

use crate::farm::ClusterFarm;
use crate::workload::{self, Client, Kind};

/// Submissions posted at once at most: enough to keep three workers busy.
const IN_FLIGHT: usize = 16;
/// How long a workload may take before the run is called failed.
const FINISH_WITHIN: Duration = Duration::from_secs(600);

/// One run's figures.
pub struct Throughput {
    pub jobs: usize,
    /// First post to the last job seen finished.
    pub seconds: f64,
}

impl Throughput {
    pub fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / self.seconds
    }
}

/// The workload: `items` submissions from `seed`, 60 % generates and 40 % pipelines (a base and
/// 3–10 edits, sometimes an upscale), every one batch priority; with the number of jobs each makes.
pub fn workload(items: usize, seed: u64) -> Vec<(Kind, Value, usize)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..items)
        .map(|_| {
            if rng.random_bool(0.6) {
                (Kind::Generate, workload::generate(&mut rng), 1)
            } else {
                let job = workload::pipeline(&mut rng);
                let count = |field: &str| job[field].as_array().map_or(0, Vec::len);
                let jobs = 1 + count("edits") + count("upscales");
                (Kind::Pipeline, job, jobs)
            }
        })
        .collect()
}

/// Starts the three-box farm with `nodes` broker nodes (1 or 3), runs `items` and stops the farm.
pub async fn run(nodes: usize, items: &[(Kind, Value, usize)]) -> anyhow::Result<Throughput> {
    let farm = ClusterFarm::start_on(3, nodes).await?;
    let client = Client::with_headers(farm.scheduler_urls(), crate::farm::auth_headers());
    let active = farm.wait_active(Duration::from_secs(60)).await?;
    let began = Instant::now();
    let mut posts = JoinSet::new();
    let mut ids = Vec::new();
    for (kind, job, _) in items {
        if posts.len() >= IN_FLIGHT
            && let Some(id) = posts.join_next().await
        {
            ids.push(id?);
        }
        let (key, body) = client.register(*kind, job.clone(), Priority::Batch);
        let client = client.clone();
        posts.spawn(async move { client.submit(&key, &body, active).await });
    }
    ids.extend(posts.join_all().await);
    let ids: Vec<String> = ids
        .into_iter()
        .collect::<Option<_>>()
        .context("a submission got no job id")?;
    let mut pending = ids;
    let deadline = Instant::now() + FINISH_WITHIN;
    while !pending.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of the {nodes}-node run's submissions not finished within {FINISH_WITHIN:?}",
            pending.len()
        );
        let mut still = Vec::new();
        for id in pending {
            let view: Value = farm
                .http
                .get(format!("{}/v1/jobs/{id}", farm.scheduler_urls()[active]))
                .send()
                .await?
                .json()
                .await?;
            match view["state"].as_str() {
                Some("completed") => {}
                Some(state @ ("failed" | "cancelled")) => {
                    anyhow::bail!("job {id} ended {state} in the {nodes}-node run: {view}")
                }
                _ => still.push(id),
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(Throughput {
        jobs: items.iter().map(|(_, _, jobs)| jobs).sum(),
        seconds: began.elapsed().as_secs_f64(),
    })
}
