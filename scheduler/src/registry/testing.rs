//! What the registry's tests share: submissions, heartbeats, and a stream that writes events with
//! increasing offsets and times.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use vnfarm_proto::catalogue::ContentHash;
use vnfarm_proto::spec::{PipelineEdit, PipelineSpec};
use vnfarm_proto::{
    EditSpec, Event, EventKind, FailureKind, GenerateSpec, Heartbeat, ImageRef, JobId, JobSpec,
    ModelFamily, Priority, Sampler, SequencedEvent, Submission, WorkerId, WorkerState,
};

use super::{Dispatch, Registry};
use crate::config::{DispatchConfig, Policy};

impl Registry {
    /// One job per message to the least-loaded worker, as (job, worker) pairs.
    pub(super) fn plan_ll(&mut self) -> Vec<(JobId, WorkerId)> {
        let config = DispatchConfig {
            policy: Policy::LeastLoaded,
            ..DispatchConfig::default()
        };
        self.plan_dispatch(&config, Instant::now(), T)
            .dispatches
            .into_iter()
            .map(|d| {
                assert_eq!(d.jobs.len(), 1, "least_loaded sends one job per message");
                (d.jobs[0], d.worker)
            })
            .collect()
    }
}

pub(super) fn generate() -> Submission {
    Submission {
        schema_version: 1,
        job_id: None,
        idempotency_key: None,
        priority: Priority::Batch,
        deadline: None,
        job: JobSpec::Generate(GenerateSpec {
            prompt: "x".into(),
            negative_prompt: String::new(),
            width: 256,
            height: 256,
            steps: 1,
            cfg: 1.0,
            sampler: Sampler::Euler,
            seed: Some(1),
            count: 1,
            checkpoint: None,
            loras: Vec::new(),
        }),
    }
}

pub(super) fn keyed(key: &str) -> Submission {
    Submission {
        idempotency_key: Some(key.into()),
        ..generate()
    }
}

pub(super) fn edit_of(job: JobId) -> Submission {
    Submission {
        job: JobSpec::Edit(EditSpec {
            input: Some(ImageRef::JobOutput { job, index: 0 }),
            inputs: vec![],
            width: None,
            height: None,
            instruction: "smile".into(),
            steps: 4,
            cfg: 1.0,
            seed: Some(1),
            loras: vec![],
        }),
        ..generate()
    }
}

pub(super) fn pipeline(edits: usize) -> Submission {
    let JobSpec::Generate(base) = generate().job else {
        unreachable!()
    };
    Submission {
        job: JobSpec::Pipeline(PipelineSpec {
            base,
            edits: (0..edits)
                .map(|i| PipelineEdit {
                    instruction: format!("variant {i}"),
                    references: vec![],
                    steps: 4,
                    cfg: 1.0,
                    seed: Some(1),
                    loras: vec![],
                })
                .collect(),
            upscales: vec![],
        }),
        ..generate()
    }
}

pub(super) fn worker(id: &str, slots: u32) -> Heartbeat {
    Heartbeat {
        schema_version: vnfarm_proto::PROTOCOL_VERSION,
        protocols: vnfarm_proto::work::decodable_protocols(),
        worker: id.parse().unwrap(),
        state: WorkerState::Ready,
        models: ModelFamily::ALL.to_vec(),
        slots,
        in_flight: 0,
        running: vec![],
        holding: None,
        model_cache: None,
        catalogue_checkpoints: None,
        loras: None,
        checkpoints: vec![],
        max_batch: 1,
        gpu_memory: None,
        encode_cache: vec![],
        settings: None,
        version: "t".into(),
        at: Utc::now(),
    }
}

/// Writes events with increasing offsets and times.
pub(super) struct Stream {
    pub(super) seq: u64,
    pub(super) at: DateTime<Utc>,
}

impl Stream {
    pub(super) fn new() -> Self {
        Self {
            seq: 0,
            at: Utc::now(),
        }
    }
    pub(super) fn ev(&mut self, id: JobId, kind: EventKind) -> SequencedEvent {
        self.seq += 1;
        self.at += chrono::Duration::milliseconds(1);
        SequencedEvent {
            seq: self.seq,
            event: Event {
                schema_version: vnfarm_proto::PROTOCOL_VERSION,
                job_id: id,
                at: self.at,
                kind,
            },
        }
    }
    pub(super) fn queue(&mut self, r: &mut Registry, sub: Submission) -> JobId {
        self.queue_full(r, sub, None, BTreeMap::new())
    }
    /// Queues `sub` as `owner`'s (`None`: the admin's).
    pub(super) fn queue_as(
        &mut self,
        r: &mut Registry,
        sub: Submission,
        owner: Option<&str>,
    ) -> JobId {
        self.queue_full(r, sub, owner, BTreeMap::new())
    }

    /// A job whose LoRA names stood for these catalogue files at acceptance.
    pub(super) fn queue_with_files(
        &mut self,
        r: &mut Registry,
        sub: Submission,
        files: BTreeMap<String, ContentHash>,
    ) -> JobId {
        self.queue_full(r, sub, None, files)
    }

    fn queue_full(
        &mut self,
        r: &mut Registry,
        sub: Submission,
        owner: Option<&str>,
        files: BTreeMap<String, ContentHash>,
    ) -> JobId {
        let id = JobId::new();
        let children = match &sub.job {
            JobSpec::Pipeline(p) => (0..1 + p.edits.len() + p.upscales.len())
                .map(|_| JobId::new())
                .collect(),
            _ => vec![],
        };
        r.apply(self.ev(
            id,
            EventKind::Queued {
                submission: Box::new(sub),
                parent: None,
                children,
                owner: owner.map(str::to_owned),
                files,
            },
        ));
        id
    }
    pub(super) fn complete(&mut self, r: &mut Registry, id: JobId) {
        r.apply(self.ev(
            id,
            EventKind::Completed {
                outputs: vec![format!("results/{id}/0.png")],
                manifest: format!("results/{id}/manifest.json"),
                worker: None,
                timings: Default::default(),
            },
        ));
    }
    pub(super) fn fail(&mut self, r: &mut Registry, id: JobId) {
        r.apply(self.ev(
            id,
            EventKind::Failed {
                failure: FailureKind::BadInput,
                message: "x".into(),
                retryable: false,
            },
        ));
    }
}

pub(super) const T: Duration = Duration::from_secs(5);

pub(super) fn affinity() -> DispatchConfig {
    DispatchConfig {
        policy: Policy::Affinity,
        max_batch: 8,
        affinity_wait_ms: 1_000,
        coalesce_window_ms: 50,
        spill_after: 6,
        ..DispatchConfig::default()
    }
}

pub(super) fn batching_worker(id: &str, slots: u32, max_batch: u32) -> Heartbeat {
    Heartbeat {
        max_batch,
        ..worker(id, slots)
    }
}

pub(super) fn wid(id: &str) -> WorkerId {
    id.parse().unwrap()
}

pub(super) fn later(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

impl Stream {
    pub(super) fn dispatched(&mut self, r: &mut Registry, d: &Dispatch) {
        let batch = (d.jobs.len() > 1).then_some(d.jobs[0]);
        for id in &d.jobs {
            r.apply(self.ev(
                *id,
                EventKind::Dispatched {
                    queue: "q".into(),
                    worker: Some(d.worker.clone()),
                    batch,
                    term: Some(1),
                },
            ));
        }
    }
    pub(super) fn started_on(&mut self, r: &mut Registry, id: JobId, worker: &str) {
        r.apply(self.ev(
            id,
            EventKind::Started {
                worker: worker.parse().unwrap(),
                attempt: 1,
            },
        ));
    }
    pub(super) fn completed_on(&mut self, r: &mut Registry, id: JobId, worker: &str) {
        r.apply(self.ev(
            id,
            EventKind::Completed {
                outputs: vec![format!("results/{id}/0.png")],
                manifest: format!("results/{id}/manifest.json"),
                worker: Some(worker.parse().unwrap()),
                timings: Default::default(),
            },
        ));
    }
}
