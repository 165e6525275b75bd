//! What the scheduler's estimates cost (issue 24): a registry in this process, fed the events and
//! heartbeats a farm would send (`workers` workers each running a job, runs of every class it
//! estimates already measured) and a backlog of `jobs` waiting generates of mixed sizes and steps,
//! some of them edits of earlier ones; then the time to make every job's estimate, which a job
//! request pays at most once per `ESTIMATE_REFRESH` whatever the number of requests.

use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;
use vnfarm_proto::{Event, EventKind, JobId, SequencedEvent, Submission, WorkerId};
use vnfarm_scheduler::registry::{ESTIMATE_REFRESH, Registry};

#[derive(Clone, Debug)]
pub struct Report {
    pub jobs: usize,
    pub workers: usize,
    /// Each timed refresh, sorted.
    pub refreshes: Vec<Duration>,
    /// The part of each under the registry's lock (copying the queue, storing the estimates),
    /// sorted.
    pub locked: Vec<Duration>,
    /// Jobs with an estimate after the last, of those waiting or running.
    pub estimated: usize,
}

impl Report {
    pub fn median(&self) -> Duration {
        self.refreshes
            .get(self.refreshes.len() / 2)
            .copied()
            .unwrap_or_default()
    }

    pub fn max(&self) -> Duration {
        self.refreshes.last().copied().unwrap_or_default()
    }

    pub fn locked_median(&self) -> Duration {
        self.locked
            .get(self.locked.len() / 2)
            .copied()
            .unwrap_or_default()
    }
}

struct Feed {
    seq: u64,
}

impl Feed {
    fn event(&mut self, reg: &mut Registry, job_id: JobId, kind: EventKind) {
        self.seq += 1;
        reg.apply(SequencedEvent {
            seq: self.seq,
            event: Event {
                schema_version: vnfarm_proto::PROTOCOL_VERSION,
                job_id,
                at: Utc::now(),
                kind,
            },
        });
    }

    fn queue(&mut self, reg: &mut Registry, job: serde_json::Value) -> anyhow::Result<JobId> {
        let submission: Submission = vnfarm_proto::decode_json(
            json!({"schema_version": 1, "job": job})
                .to_string()
                .as_bytes(),
        )
        .map_err(|e| anyhow::anyhow!("{}: {}", e.field, e.message))?;
        let id = JobId::new();
        self.event(
            reg,
            id,
            EventKind::Queued {
                submission: Box::new(submission),
                parent: None,
                children: vec![],
                owner: None,
                files: Default::default(),
            },
        );
        Ok(id)
    }

    fn run_on(&mut self, reg: &mut Registry, id: JobId, worker: &WorkerId) {
        self.event(
            reg,
            id,
            EventKind::Dispatched {
                queue: format!("vnfarm.worker.{worker}"),
                worker: Some(worker.clone()),
                batch: None,
                term: Some(1),
            },
        );
        self.event(
            reg,
            id,
            EventKind::Started {
                worker: worker.clone(),
                attempt: 1,
            },
        );
    }
}

fn generate(side: u32, steps: u32) -> serde_json::Value {
    json!({"kind": "generate", "prompt": "1girl", "width": side, "height": side, "steps": steps, "seed": 1})
}

pub fn run(jobs: usize, workers: usize, rounds: usize) -> anyhow::Result<Report> {
    let mut reg = Registry::default();
    let mut feed = Feed { seq: 0 };
    let ids: Vec<WorkerId> = (1..=workers)
        .map(|n| format!("w{n}").parse())
        .collect::<Result<_, String>>()
        .map_err(anyhow::Error::msg)?;
    for id in &ids {
        let hb = json!({"worker": id, "state": "ready", "models": ["sdxl", "qwen-edit", "esrgan"],
            "slots": 1, "in_flight": 1, "running": [], "checkpoints": [], "max_batch": 1,
            "encode_cache": [], "version": "bench", "at": Utc::now()});
        reg.heartbeat(serde_json::from_value(hb)?);
    }
    let sides = [512, 768, 1024];
    let steps = [12, 20, 30];
    // One measured run of each size on each worker and an edit, then one job running on each.
    for id in &ids {
        let mut made = None;
        for side in sides {
            let job = feed.queue(&mut reg, generate(side, 20))?;
            made = Some(job);
            feed.run_on(&mut reg, job, id);
            feed.event(
                &mut reg,
                job,
                EventKind::Completed {
                    outputs: vec![format!("results/{job}/0.png")],
                    manifest: format!("results/{job}/manifest.json"),
                    worker: Some(id.clone()),
                    timings: Default::default(),
                },
            );
        }
        let input = made.expect("three sizes");
        let edit = json!({"kind": "edit", "input": {"job_output": {"job": input, "index": 0}},
            "instruction": "smile", "steps": 4});
        let job = feed.queue(&mut reg, edit)?;
        feed.run_on(&mut reg, job, id);
        feed.event(
            &mut reg,
            job,
            EventKind::Completed {
                outputs: vec![format!("results/{job}/0.png")],
                manifest: format!("results/{job}/manifest.json"),
                worker: Some(id.clone()),
                timings: Default::default(),
            },
        );
        let job = feed.queue(&mut reg, generate(1024, 20))?;
        feed.run_on(&mut reg, job, id);
    }
    let mut waiting = Vec::with_capacity(jobs);
    for n in 0..jobs {
        let job = if n % 10 == 9 {
            // An edit of an earlier waiting generate: it waits for its input.
            json!({"kind": "edit", "input": {"job_output": {"job": waiting[n - 1], "index": 0}},
                "instruction": "smile", "steps": 4})
        } else {
            generate(sides[n % 3], steps[(n / 3) % 3])
        };
        waiting.push(feed.queue(&mut reg, job)?);
    }
    let timeout = Duration::from_secs(3600);
    let mut refreshes = Vec::with_capacity(rounds);
    let mut locked = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        // Past the refresh interval, so they are due again.
        std::thread::sleep(ESTIMATE_REFRESH);
        let started = Instant::now();
        let work = reg
            .estimates_due(timeout)
            .ok_or_else(|| anyhow::anyhow!("estimates not due after the refresh interval"))?;
        let copied = started.elapsed();
        let made = work.make();
        let stored = Instant::now();
        reg.store_estimates(made);
        locked.push(copied + stored.elapsed());
        refreshes.push(started.elapsed());
    }
    refreshes.sort();
    locked.sort();
    let estimated = waiting
        .iter()
        .filter_map(|id| reg.job(*id))
        .filter(|job| reg.estimate(job).is_some_and(|e| e.is_ok()))
        .count();
    Ok(Report {
        jobs,
        workers,
        refreshes,
        locked,
        estimated,
    })
}
