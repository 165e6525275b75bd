//! Synthetic job history written straight to a farm's event stream, in the wire format the
//! scheduler and the workers publish: an [`Event`] as JSON on `<prefix>.events` with routing key
//! `job.<id>.<event>`, persistent JSON properties, mandatory, confirmed by the broker.
//!
//! The events come in the order a busy farm writes them: a backlog of queued jobs, and `workers`
//! workers each running one job at a time, so the progress events of several jobs interleave.
//! Every job is a validated generate submission with an idempotency key; it is queued, dispatched
//! to a worker, started, reports `steps` progress events and completes with one output and its
//! manifest, as the test-pattern workers report them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Confirmation, Connection};
use serde_json::json;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::topology::{Topology, manifest_key, output_key};
use vnfarm_proto::{Event, EventKind, JobId, StageTimings, Submission, WorkerId};

/// Publishes awaiting their confirm at once, at most.
const CONFIRM_WINDOW: usize = 2_000;
/// Queued jobs waiting for a worker, at most, while the history is written.
const BACKLOG: usize = 100;

/// What the history holds.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub jobs: u64,
    /// Progress events per job (its denoising steps).
    pub steps: u32,
    /// Workers running jobs side by side.
    pub workers: usize,
}

impl Shape {
    /// Events per job: queued, dispatched, started, the progress events, completed.
    pub fn events_per_job(&self) -> u64 {
        4 + u64::from(self.steps)
    }

    pub fn events(&self) -> u64 {
        self.jobs * self.events_per_job()
    }
}

/// A job on a worker, and how far its history has been written.
struct Running {
    id: JobId,
    worker: WorkerId,
    /// Events written after `dispatched`: 0 before `started`, then one per progress step.
    written: u32,
}

/// The events of a [`Shape`], in the order a farm writes them.
struct Events {
    shape: Shape,
    topology: Topology,
    workers: Vec<WorkerId>,
    created: u64,
    pending: VecDeque<JobId>,
    running: Vec<Option<Running>>,
    turn: usize,
}

impl Events {
    fn new(shape: Shape, topology: Topology) -> Self {
        let workers = (1..=shape.workers)
            .map(|n| {
                format!("history-w{n}")
                    .parse()
                    .expect("history-wN is a valid worker id")
            })
            .collect();
        Self {
            shape,
            topology,
            workers,
            created: 0,
            pending: VecDeque::new(),
            running: (0..shape.workers).map(|_| None).collect(),
            turn: 0,
        }
    }

    fn queued(&mut self) -> anyhow::Result<Event> {
        let n = self.created;
        self.created += 1;
        let id = JobId::new();
        self.pending.push_back(id);
        let submission: Submission = serde_json::from_value(json!({
            "schema_version": vnfarm_proto::SCHEMA_VERSION,
            "idempotency_key": format!("history-{n}"),
            "job": {
                "kind": "generate",
                "prompt": format!("1girl, (silver hair:1.2), school uniform, classroom, window light, looking at viewer, take {n}"),
                "negative_prompt": "lowres, bad hands, watermark",
                "width": 832,
                "height": 1216,
                "steps": self.shape.steps,
            }
        }))?;
        // As the scheduler accepts it: validated, the seed drawn.
        let submission = submission
            .validate(&mut || rand::random::<u64>() >> 11)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Event::now(
            id,
            EventKind::Queued {
                submission: Box::new(submission),
                parent: None,
                children: Vec::new(),
                owner: None,
                files: Default::default(),
            },
        ))
    }

    /// The next event of the job on worker slot `slot`, if one runs or waits for it.
    fn advance(&mut self, slot: usize) -> Option<Event> {
        let steps = self.shape.steps;
        let Some(job) = &mut self.running[slot] else {
            let id = self.pending.pop_front()?;
            let worker = self.workers[slot].clone();
            self.running[slot] = Some(Running {
                id,
                worker: worker.clone(),
                written: 0,
            });
            return Some(Event::now(
                id,
                EventKind::Dispatched {
                    queue: self.topology.worker_queue(&worker),
                    worker: Some(worker),
                    batch: None,
                    term: Some(1),
                },
            ));
        };
        let id = job.id;
        job.written += 1;
        let kind = match job.written {
            1 => EventKind::Started {
                worker: job.worker.clone(),
                attempt: 1,
            },
            n if n <= steps + 1 => EventKind::Progress {
                step: n - 1,
                total: steps,
            },
            _ => {
                let mut timings = StageTimings::default();
                timings.add("denoise", f64::from(steps) * 0.02);
                timings.add("decode", 0.03);
                timings.add("upload", 0.01);
                let worker = Some(job.worker.clone());
                self.running[slot] = None;
                EventKind::Completed {
                    outputs: vec![output_key(id, 0)],
                    manifest: manifest_key(id),
                    worker,
                    timings,
                }
            }
        };
        Some(Event::now(id, kind))
    }

    fn next_event(&mut self) -> anyhow::Result<Option<Event>> {
        if self.created < self.shape.jobs && self.pending.len() < BACKLOG {
            return self.queued().map(Some);
        }
        for _ in 0..self.running.len() {
            let slot = self.turn % self.running.len();
            self.turn += 1;
            if let Some(event) = self.advance(slot) {
                return Ok(Some(event));
            }
        }
        Ok(None)
    }
}

/// What [`write`] wrote.
#[derive(Clone, Copy, Debug)]
pub struct Written {
    pub events: u64,
    pub elapsed: Duration,
    /// The job of the last event (a completion): a reader that knows it completed has read all.
    pub last_job: JobId,
}

/// Writes the history to the farm's event stream, each event confirmed by the broker, and prints
/// its progress every `report_every` events.
pub async fn write(
    connection: &Connection,
    topology: &Topology,
    shape: Shape,
    report_every: u64,
) -> anyhow::Result<Written> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let exchange = topology.events_exchange();
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let started = Instant::now();
    let mut events = Events::new(shape, topology.clone());
    let mut in_flight = VecDeque::new();
    let mut written = 0u64;
    let mut last_job = None;
    while let Some(event) = events.next_event()? {
        let payload = serde_json::to_vec(&event)?;
        let confirm = channel
            .basic_publish(
                exchange.as_str().into(),
                event.routing_key().as_str().into(),
                mandatory,
                &payload,
                json_properties(),
            )
            .await?;
        in_flight.push_back(confirm);
        if in_flight.len() >= CONFIRM_WINDOW {
            let oldest = in_flight.pop_front().expect("the window is full");
            settle(oldest.await?)?;
        }
        written += 1;
        last_job = Some(event.job_id);
        if written.is_multiple_of(report_every) {
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "  written {written} of {} events ({:.0} events/s)",
                shape.events(),
                written as f64 / seconds
            );
        }
    }
    for confirm in in_flight {
        settle(confirm.await?)?;
    }
    channel.close(200, "history written".into()).await?;
    Ok(Written {
        events: written,
        elapsed: started.elapsed(),
        last_job: last_job.context("an empty history")?,
    })
}

fn settle(confirmation: Confirmation) -> anyhow::Result<()> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => bail!("an event was unroutable: is the stream declared?"),
        Confirmation::Nack(_) => bail!("the broker refused an event"),
        Confirmation::NotRequested => bail!("the channel is not in confirm mode"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_has_its_whole_history_in_order() {
        let shape = Shape {
            jobs: 250,
            steps: 3,
            workers: 3,
        };
        let mut events = Events::new(shape, Topology::default());
        let mut seen: std::collections::HashMap<JobId, Vec<&'static str>> = Default::default();
        let mut total = 0;
        while let Some(e) = events.next_event().unwrap() {
            seen.entry(e.job_id).or_default().push(e.kind.name());
            total += 1;
        }
        assert_eq!(total, shape.events());
        assert_eq!(seen.len(), 250);
        let expected = [
            "queued",
            "dispatched",
            "started",
            "progress",
            "progress",
            "progress",
            "completed",
        ];
        assert!(seen.values().all(|names| names == &expected));
    }
}
