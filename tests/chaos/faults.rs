//! The fault schedule: every few seconds one fault, in rounds that hold each kind once in a random
//! order, until the workload ends. Each fault ends with the farm whole again (the killed process
//! replaced, the broker or S3 back), so the next one starts from a working farm.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use vnfarm_tests::{Farm, restart_rabbitmq};

use crate::workload::{self, Client, Kind};

/// Pause between two faults (the farm runs undisturbed meanwhile).
const PAUSE_MS: std::ops::Range<u64> = 2_000..5_000;
/// How long a scheduler gets to become active after the active one was killed.
const FAILOVER: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL a random worker (whatever it is doing) and start it again.
    WorkerKill,
    /// `rabbitmqctl stop_app`, 2–4 s down, `start_app`.
    BrokerRestart,
    /// The farm's S3 server stopped for 5 s.
    S3Outage,
    /// SIGKILL the active scheduler; a replacement starts in its slot.
    SchedulerKill,
    /// SIGKILL the active scheduler 0–20 ms after a pipeline POST was sent to it; the client
    /// retries the POST with the same key on the next scheduler.
    SchedulerKillMidPipeline,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::WorkerKill,
        Fault::BrokerRestart,
        Fault::S3Outage,
        Fault::SchedulerKill,
        Fault::SchedulerKillMidPipeline,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::WorkerKill => "worker SIGKILL",
            Fault::BrokerRestart => "RabbitMQ restart",
            Fault::S3Outage => "S3 outage",
            Fault::SchedulerKill => "active scheduler SIGKILL",
            Fault::SchedulerKillMidPipeline => "scheduler SIGKILL mid pipeline POST",
        }
    }
}

/// Injects faults until `until`, printing each as it ends, and returns them. Errors when the farm
/// cannot be made whole again after a fault (a replacement scheduler never became ready, ...).
pub async fn inject(
    farm: &mut Farm,
    client: &Client,
    until: Instant,
    seed: u64,
) -> anyhow::Result<Vec<Fault>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut round: Vec<Fault> = Vec::new();
    let mut log = Vec::new();
    loop {
        let pause = Duration::from_millis(rng.random_range(PAUSE_MS));
        if Instant::now() + pause >= until {
            break;
        }
        tokio::time::sleep(pause).await;
        if round.is_empty() {
            round = Fault::ALL.to_vec();
            round.shuffle(&mut rng);
        }
        let fault = round.pop().expect("refilled above");
        let at = start.elapsed();
        let detail = match fault {
            Fault::WorkerKill => kill_worker(farm, &mut rng).await?,
            Fault::BrokerRestart => {
                let down = Duration::from_millis(rng.random_range(2_000..4_000));
                restart_rabbitmq(down).await?;
                format!("down {down:?}")
            }
            Fault::S3Outage => s3_outage(farm).await?,
            Fault::SchedulerKill => kill_active_scheduler(farm).await?,
            Fault::SchedulerKillMidPipeline => kill_mid_pipeline(farm, client, &mut rng).await?,
        };
        println!(
            "[{:6.1} s] {}: {detail} (took {:.1} s)",
            at.as_secs_f64(),
            fault.name(),
            (start.elapsed() - at).as_secs_f64()
        );
        log.push(fault);
    }
    Ok(log)
}

async fn kill_worker(farm: &mut Farm, rng: &mut StdRng) -> anyhow::Result<String> {
    let id = farm
        .worker_ids()
        .choose(rng)
        .cloned()
        .expect("the farm has workers");
    farm.kill_worker(&id);
    // Long enough for its queue consumer to be gone, so its unacked job is redelivered.
    tokio::time::sleep(Duration::from_millis(rng.random_range(200..2_000))).await;
    farm.relaunch_worker(&id)?;
    Ok(id)
}

async fn s3_outage(farm: &mut Farm) -> anyhow::Result<String> {
    const DOWN: Duration = Duration::from_secs(5);
    let s3 = farm.own_s3.as_mut().expect("the chaos farm has its own S3");
    // Stopping and starting the server wait on its process: not on the runtime's time.
    tokio::task::block_in_place(|| s3.stop());
    tokio::time::sleep(DOWN).await;
    tokio::task::block_in_place(|| s3.restart())?;
    Ok(format!("down {DOWN:?}"))
}

async fn kill_active_scheduler(farm: &mut Farm) -> anyhow::Result<String> {
    let slot = farm.active_scheduler(FAILOVER).await?;
    farm.kill_scheduler_at(slot);
    farm.start_scheduler_at(slot).await?;
    Ok(format!("slot {slot}, replaced"))
}

/// The worst case: a scheduler killed while it accepts a pipeline. The client does not know
/// whether the pipeline was recorded, so it sends the same key again elsewhere; afterwards there
/// must be exactly one pipeline for the key, whole (base and every edit), and it must finish.
async fn kill_mid_pipeline(
    farm: &mut Farm,
    client: &Client,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    let slot = farm.active_scheduler(FAILOVER).await?;
    let job = workload::pipeline(rng);
    let (key, body) = client.register(Kind::Pipeline, job, workload::priority(rng));
    let post = client.post_in_background(&key, &body, slot);
    let delay = Duration::from_millis(rng.random_range(0..=20));
    tokio::time::sleep(delay).await;
    farm.kill_scheduler_at(slot);
    let answered = post.await?;
    if answered.is_none() {
        client.resubmit(&key, &body, (slot + 1) % client.schedulers());
    }
    farm.start_scheduler_at(slot).await?;
    Ok(format!(
        "slot {slot}, {delay:?} after the POST of {key}; {}",
        match answered {
            Some(id) => format!("answered {id} before dying"),
            None => "no answer, retried elsewhere".into(),
        }
    ))
}
