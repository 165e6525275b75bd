//! Batch messages on a real worker: one message carrying several jobs, published straight onto a
//! test-pattern worker's queue (the test plays the scheduler), against a real RabbitMQ and S3. Each
//! job gets its own events, outputs and manifest; a failure, a cancel or a shutdown of one job
//! never loses the others; jobs that share an input encode it once, and a later batch for the same
//! input pays no encode at all. The worker's heartbeats say what it holds.

use std::io::Cursor;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::{AMQPValue, FieldTable};
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{AmqpConfig, Publisher};
use vnfarm_proto::topology::{
    CANCEL_ROUTING_KEY, HEADER_JOB_ID, HEADER_REASON, HEADER_YIELDED, Topology, YIELD_ROUTING_KEY,
    heartbeat_routing_key, manifest_key, output_key,
};
use vnfarm_proto::{
    BatchedJob, CancelRequest, EditSpec, Event, EventKind, FailureKind, GenerateSpec, Heartbeat,
    ImageRef, JobId, Manifest, Priority, Sampler, Task, WorkMessage, WorkerId, WorkerState,
    YieldRequest, decode_json,
};
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

/// A test-pattern worker alone on a fresh installation (no scheduler), with subscriptions to every
/// job event and to its heartbeats.
struct Bench {
    farm: Farm,
    conn: lapin::Connection,
    publisher: Publisher,
    topology: Topology,
    worker: WorkerId,
    events: lapin::Consumer,
    heartbeats: lapin::Consumer,
    /// Every job event read so far.
    seen: Vec<Event>,
    /// The heartbeats before the first `ready` one.
    warming: Vec<Heartbeat>,
}

impl Bench {
    /// Starts the worker and waits until it is ready.
    async fn start(name: &str, options: WorkerOptions) -> anyhow::Result<Self> {
        let mut bench = Self::launch(name, options).await?;
        bench.wait_ready().await?;
        Ok(bench)
    }

    /// Starts the worker without waiting for it.
    async fn launch(name: &str, options: WorkerOptions) -> anyhow::Result<Self> {
        let mut farm = Farm::new(name).await?;
        let conn = farm.connect_amqp().await?;
        let config = AmqpConfig {
            prefix: farm.prefix.clone(),
            ..Default::default()
        };
        vnfarm_bus::topology::declare_core(&conn.create_channel().await?, &config).await?;
        let topology = config.topology();
        let worker: WorkerId = "w1".parse().map_err(anyhow::Error::msg)?;
        let events = vnfarm_bus::topology::subscribe_private(
            &conn,
            &topology.events_exchange(),
            "job.#",
            "batches-events",
        )
        .await?;
        let heartbeats = vnfarm_bus::topology::subscribe_private(
            &conn,
            &topology.events_exchange(),
            &heartbeat_routing_key(&worker),
            "batches-heartbeats",
        )
        .await?;
        farm.launch_worker("w1", options)?;
        let publisher = Publisher::open(&conn).await?;
        Ok(Self {
            farm,
            conn,
            publisher,
            topology,
            worker,
            events,
            heartbeats,
            seen: Vec::new(),
            warming: Vec::new(),
        })
    }

    /// Waits for a `ready` heartbeat, keeping the ones before it in `warming`.
    async fn wait_ready(&mut self) -> anyhow::Result<Heartbeat> {
        let mut before = Vec::new();
        // Loading and warming up a model engine on a loaded machine takes a while.
        let ready = self
            .heartbeat_within(Duration::from_secs(120), |hb| {
                let ready = hb.state == WorkerState::Ready;
                if !ready {
                    before.push(hb.clone());
                }
                ready
            })
            .await?;
        self.warming.extend(before);
        Ok(ready)
    }

    /// The first heartbeat made from now on that satisfies `ok`.
    async fn heartbeat(&mut self, ok: impl FnMut(&Heartbeat) -> bool) -> anyhow::Result<Heartbeat> {
        self.heartbeat_within(FINISH, ok).await
    }

    async fn heartbeat_within(
        &mut self,
        timeout: Duration,
        mut ok: impl FnMut(&Heartbeat) -> bool,
    ) -> anyhow::Result<Heartbeat> {
        // Heartbeats queue up in the subscription: those made before this call say nothing new.
        let since = chrono::Utc::now();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let delivery = tokio::time::timeout_at(deadline, self.heartbeats.next())
                .await
                .map_err(|_| anyhow::anyhow!("no such heartbeat\n{}", self.farm.worker_logs()))?
                .ok_or_else(|| anyhow::anyhow!("heartbeat subscription ended"))??;
            let beat: Heartbeat = decode_json(&delivery.data)?;
            if beat.at >= since && ok(&beat) {
                return Ok(beat);
            }
        }
    }

    /// Publishes the jobs as one work message onto the worker's queue, as the scheduler does.
    async fn send(&self, jobs: &[BatchedJob]) -> anyhow::Result<()> {
        let message = WorkMessage::of(jobs.to_vec()).expect("at least one job");
        self.publisher
            .publish_json(
                "",
                &self.topology.worker_queue(&self.worker),
                &message,
                json_properties().with_message_id(message.job_id.to_string().into()),
            )
            .await?;
        Ok(())
    }

    async fn cancel(&self, job_id: JobId) -> anyhow::Result<()> {
        self.publisher
            .broadcast_json(
                &self.topology.events_exchange(),
                CANCEL_ROUTING_KEY,
                &CancelRequest::new(job_id),
                json_properties(),
            )
            .await?;
        Ok(())
    }

    /// Reads events until every job has a final event (`completed`, `cancelled`, or a `failed`
    /// that is not retryable).
    async fn wait_final(&mut self, jobs: &[JobId]) -> anyhow::Result<()> {
        self.wait_events(|seen| {
            jobs.iter()
                .all(|id| seen.iter().any(|e| e.job_id == *id && e.kind.is_terminal()))
        })
        .await
    }

    async fn wait_events(&mut self, done: impl Fn(&[Event]) -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + FINISH;
        while !done(&self.seen) {
            let delivery = tokio::time::timeout_at(deadline, self.events.next())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "events did not arrive; seen {:?}\n{}",
                        self.names(),
                        self.farm.worker_logs()
                    )
                })?
                .ok_or_else(|| anyhow::anyhow!("event subscription ended"))??;
            self.seen.push(decode_json(&delivery.data)?);
        }
        Ok(())
    }

    /// A job's events, by name, in order.
    fn names_of(&self, job: JobId) -> Vec<&'static str> {
        self.seen
            .iter()
            .filter(|e| e.job_id == job)
            .map(|e| e.kind.name())
            .collect()
    }

    fn names(&self) -> Vec<(String, &'static str)> {
        self.seen
            .iter()
            .map(|e| (e.job_id.to_string()[..8].to_owned(), e.kind.name()))
            .collect()
    }

    /// A job's `completed` event: `(outputs, manifest key, timings)`.
    fn completed(&self, job: JobId) -> Option<(Vec<String>, String, Vec<String>)> {
        self.seen.iter().find_map(|e| match &e.kind {
            EventKind::Completed {
                outputs,
                manifest,
                timings,
                ..
            } if e.job_id == job => Some((
                outputs.clone(),
                manifest.clone(),
                timings.0.keys().cloned().collect(),
            )),
            _ => None,
        })
    }

    fn encoded(&self, job: JobId) -> bool {
        self.completed(job)
            .is_some_and(|(_, _, stages)| stages.iter().any(|s| s == "encode"))
    }

    /// Waits until the worker process exits.
    async fn wait_exit(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + FINISH;
        loop {
            if let Some(status) = self.farm.worker_mut("w1").try_wait()? {
                return Ok(status);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the worker did not exit\n{}",
                self.farm.worker_logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until exactly the jobs `expected` are given back to the scheduler, each alone in a
    /// single-job message on the redispatch queue; `check` looks at each delivery.
    async fn given_back(
        &self,
        expected: &[JobId],
        check: impl Fn(&lapin::message::Delivery),
    ) -> anyhow::Result<()> {
        let returned = self
            .drain_queue(&self.topology.redispatch_queue(), expected.len())
            .await?;
        let mut back = Vec::new();
        for delivery in &returned {
            let message: WorkMessage = decode_json(&delivery.data)?;
            assert!(message.batch.is_empty(), "given back alone");
            check(delivery);
            back.push(message.job_id);
        }
        back.sort();
        let mut expected = expected.to_vec();
        expected.sort();
        assert_eq!(back, expected);
        Ok(())
    }

    /// Takes every message now in `queue` (acking them), waiting until there are `n`.
    async fn drain_queue(
        &self,
        queue: &str,
        n: usize,
    ) -> anyhow::Result<Vec<lapin::message::Delivery>> {
        let channel = self.conn.create_channel().await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "batches-drain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut taken = Vec::new();
        while taken.len() < n {
            let delivery = tokio::time::timeout(FINISH, consumer.next())
                .await
                .map_err(|_| anyhow::anyhow!("{} of {n} messages in {queue}", taken.len()))?
                .ok_or_else(|| anyhow::anyhow!("consumer of {queue} ended"))??;
            delivery.acker.ack(BasicAckOptions::default()).await?;
            taken.push(delivery);
        }
        Ok(taken)
    }
}

/// A test-pattern worker stepping at `step_ms`, whose encodes are long enough to tell apart from
/// none.
fn test_pattern(step_ms: u64, extra_env: &[(&str, &str)]) -> WorkerOptions {
    let mut env = vec![(
        "VNFARM_ENGINE__TEST_PATTERN__ENCODE_MS".to_owned(),
        "50".to_owned(),
    )];
    env.extend(
        extra_env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    WorkerOptions {
        step_ms,
        extra_env: env,
    }
}

fn job(task: Task) -> BatchedJob {
    BatchedJob {
        job_id: JobId::new(),
        priority: Priority::Batch,
        deadline: None,
        task,
    }
}

fn edit(input: &str, instruction: &str, steps: u32) -> BatchedJob {
    job(Task::Edit(EditSpec {
        input: Some(ImageRef::Stored(input.into())),
        inputs: Vec::new(),
        instruction: instruction.into(),
        width: None,
        height: None,
        steps,
        cfg: 1.0,
        seed: Some(11),
        loras: Vec::new(),
    }))
}

fn generate(prompt: &str) -> BatchedJob {
    job(Task::Generate(GenerateSpec {
        prompt: prompt.into(),
        negative_prompt: String::new(),
        width: 256,
        height: 256,
        steps: 3,
        cfg: 4.5,
        sampler: Sampler::Euler,
        seed: Some(5),
        count: 1,
        checkpoint: None,
        loras: Vec::new(),
    }))
}

async fn put_png(farm: &Farm, key: &str) -> anyhow::Result<()> {
    let image = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8 * 3, y as u8 * 5, 90]));
    let mut png = Cursor::new(Vec::new());
    image.write_to(&mut png, image::ImageFormat::Png)?;
    farm.storage
        .put(key, png.into_inner().into(), "image/png")
        .await?;
    Ok(())
}

/// Stores `inputs/base.png` and runs three edits of it (`steps` steps each) in one message, to their
/// final events.
async fn three_edits_of_base(bench: &mut Bench, steps: u32) -> anyhow::Result<Vec<JobId>> {
    put_png(&bench.farm, "inputs/base.png").await?;
    let batch = ["smile", "frown", "wave"].map(|i| edit("inputs/base.png", i, steps));
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench.wait_final(&ids).await?;
    Ok(ids)
}

fn string_header(delivery: &lapin::message::Delivery, name: &str) -> Option<String> {
    let headers = delivery.properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

/// Three edits of one input in one message: each its own `started`, progress, outputs, manifest and
/// `completed`; the input encoded once (one job reports the encode); the heartbeat then advertises
/// the input's affinity key; a later batch for the same input encodes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_together_and_each_job_ends_on_its_own() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-own", test_pattern(5, &[])).await?;
    let ids = three_edits_of_base(&mut bench, 4).await?;

    for &id in &ids {
        let names = bench.names_of(id);
        assert_eq!(names.first(), Some(&"started"), "{names:?}");
        assert_eq!(names.last(), Some(&"completed"), "{names:?}");
        assert_eq!(
            names.iter().filter(|n| **n == "progress").count(),
            4,
            "every step reported for each job: {names:?}"
        );
        let (outputs, manifest, _) = bench.completed(id).expect("completed");
        assert_eq!(outputs, [output_key(id, 0)]);
        assert_eq!(manifest, manifest_key(id));
        let stored: Manifest = decode_json(&bench.farm.storage.get(&manifest).await?)?;
        assert_eq!(stored.job_id, id);
        assert_eq!(stored.outputs.len(), 1);
        let png = bench.farm.storage.get(&outputs[0]).await?;
        assert_eq!(image::load_from_memory(&png)?.width(), 64);
    }
    let mut images = Vec::new();
    for &id in &ids {
        images.push(bench.farm.storage.get(&output_key(id, 0)).await?);
    }
    assert!(
        images[0] != images[1] && images[1] != images[2],
        "each job its own image"
    );
    let encoders: Vec<JobId> = ids
        .iter()
        .copied()
        .filter(|id| bench.encoded(*id))
        .collect();
    assert_eq!(encoders.len(), 1, "one encode for three edits of one input");

    let key = "qwen-edit:stored:inputs/base.png";
    let beat = bench
        .heartbeat(|hb| hb.in_flight == 0 && hb.encode_cache.iter().any(|k| k == key))
        .await?;
    assert_eq!(beat.max_batch, 8, "the default batch_jobs");
    assert!(beat.running.is_empty());
    assert_eq!(
        beat.gpu_memory, None,
        "the test-pattern engine runs on no GPU"
    );

    let again = [
        edit("inputs/base.png", "laugh", 2),
        edit("inputs/base.png", "cry", 2),
    ];
    let again_ids: Vec<JobId> = again.iter().map(|j| j.job_id).collect();
    bench.send(&again).await?;
    bench.wait_final(&again_ids).await?;
    for &id in &again_ids {
        assert!(bench.completed(id).is_some(), "{:?}", bench.names_of(id));
        assert!(!bench.encoded(id), "the input's encoding was kept");
    }
    Ok(())
}

/// One member's input is not an image: that job alone fails (`bad_input`, final) and is
/// dead-lettered alone; the others complete and the message is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_a_bad_input_is_dead_lettered_alone() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-bad", test_pattern(5, &[])).await?;
    put_png(&bench.farm, "inputs/good.png").await?;
    vnfarm_tests::put_undecodable(&bench.farm.storage, "inputs/garbage.png").await?;
    let batch = [
        edit("inputs/good.png", "a", 3),
        edit("inputs/garbage.png", "b", 3),
        edit("inputs/good.png", "c", 3),
    ];
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench.wait_final(&ids).await?;

    assert!(bench.completed(ids[0]).is_some(), "{:?}", bench.names());
    assert!(bench.completed(ids[2]).is_some(), "{:?}", bench.names());
    let failure = bench.seen.iter().find_map(|e| match &e.kind {
        EventKind::Failed {
            failure, retryable, ..
        } if e.job_id == ids[1] => Some((*failure, *retryable)),
        _ => None,
    });
    assert_eq!(failure, Some((FailureKind::BadInput, false)));
    assert!(
        bench.farm.storage.get(&manifest_key(ids[1])).await.is_err(),
        "no manifest for the failed job"
    );

    let dead = bench.drain_queue(&bench.topology.dead_queue(), 1).await?;
    let copy: WorkMessage = decode_json(&dead[0].data)?;
    assert_eq!(copy.job_id, ids[1]);
    assert!(copy.batch.is_empty(), "dead-lettered alone");
    assert_eq!(
        string_header(&dead[0], HEADER_JOB_ID),
        Some(ids[1].to_string())
    );
    // Every job settled: nothing of the message is in hand any more.
    let beat = bench.heartbeat(|hb| hb.in_flight == 0).await?;
    assert!(beat.running.is_empty());
    Ok(())
}

/// A job cancelled before the batch came is reported cancelled without starting; one cancelled
/// while the batch runs is reported cancelled and stores nothing; the others complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_members_are_reported_and_the_rest_complete() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-cancel", test_pattern(40, &[])).await?;
    put_png(&bench.farm, "inputs/base.png").await?;
    let batch = [
        edit("inputs/base.png", "early", 20),
        edit("inputs/base.png", "late", 20),
        edit("inputs/base.png", "kept", 20),
    ];
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.cancel(ids[0]).await?;
    let early = ids[0].to_string();
    wait_for("the worker to take the first cancel", FINISH, || async {
        bench.farm.log("w1.log").contains(&early).then_some(())
    })
    .await?;
    bench.send(&batch).await?;
    // Cancel the second once the batch is denoising.
    bench
        .wait_events(|seen| {
            seen.iter().any(|e| {
                e.job_id == ids[1] && matches!(e.kind, EventKind::Progress { step: 2, .. })
            })
        })
        .await?;
    bench.cancel(ids[1]).await?;
    bench.wait_final(&ids).await?;

    assert_eq!(bench.names_of(ids[0]), ["cancelled"], "never started");
    let late = bench.names_of(ids[1]);
    assert_eq!(late.last(), Some(&"cancelled"), "{late:?}");
    assert!(!late.contains(&"completed"), "{late:?}");
    assert!(
        bench.farm.storage.get(&manifest_key(ids[1])).await.is_err(),
        "a cancelled job stores no manifest"
    );
    let kept = bench.names_of(ids[2]);
    assert_eq!(kept.last(), Some(&"completed"), "{kept:?}");
    assert_eq!(
        kept.iter().filter(|n| **n == "progress").count(),
        20,
        "the rest ran to the end: {kept:?}"
    );
    Ok(())
}

/// The same batch delivered again after some of its jobs finished (a redelivery after the worker
/// lost the broker): the finished ones report `completed` from their manifests without running,
/// the others run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_batch_skips_its_finished_jobs() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-redelivered", test_pattern(5, &[])).await?;
    let finished = generate("a lighthouse");
    bench.send(std::slice::from_ref(&finished)).await?;
    bench.wait_final(&[finished.job_id]).await?;
    let stored = bench
        .farm
        .storage
        .get(&manifest_key(finished.job_id))
        .await?;
    let first_events = bench.names_of(finished.job_id).len();

    let fresh = generate("a harbour");
    let batch = [finished.clone(), fresh.clone()];
    bench.send(&batch).await?;
    bench
        .wait_events(|seen| {
            seen.iter()
                .filter(|e| e.job_id == finished.job_id && e.kind.is_terminal())
                .count()
                == 2
                && seen
                    .iter()
                    .any(|e| e.job_id == fresh.job_id && e.kind.is_terminal())
        })
        .await?;
    assert_eq!(
        bench.names_of(finished.job_id)[first_events..],
        ["completed"],
        "only `completed`, nothing run"
    );
    assert_eq!(
        bench
            .farm
            .storage
            .get(&manifest_key(finished.job_id))
            .await?,
        stored,
        "the finished job's manifest was not rewritten"
    );
    let names = bench.names_of(fresh.job_id);
    assert_eq!(names.first(), Some(&"started"), "{names:?}");
    assert_eq!(names.last(), Some(&"completed"), "{names:?}");
    Ok(())
}

/// A worker heartbeats from the moment it connects, `warming` while its engine loads, and takes
/// jobs only once it is `ready`: a job sent meanwhile waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_heartbeats_warming_and_takes_jobs_once_ready() -> anyhow::Result<()> {
    let options = test_pattern(
        5,
        &[
            ("VNFARM_ENGINE__TEST_PATTERN__LOAD_MS", "2000"),
            ("VNFARM_ENGINE__TEST_PATTERN__CHECKPOINTS", "[\"nova\"]"),
            ("VNFARM_BATCH_JOBS", "4"),
        ],
    );
    let mut bench = Bench::launch("batch-warming", options).await?;
    let first = bench.heartbeat(|_| true).await?;
    assert_eq!(first.state, WorkerState::Warming, "{first:?}");
    let early = generate("a lighthouse");
    bench.send(std::slice::from_ref(&early)).await?;
    bench.wait_ready().await?;
    bench.warming.insert(0, first);
    for beat in &bench.warming {
        assert_eq!(beat.state, WorkerState::Warming);
        assert_eq!((beat.in_flight, beat.running.len()), (0, 0), "{beat:?}");
        assert_eq!(beat.max_batch, 4);
        assert_eq!(beat.checkpoints, ["nova"]);
        assert_eq!(
            beat.models.len(),
            3,
            "the test-pattern engine serves every family"
        );
    }
    bench.wait_final(&[early.job_id]).await?;
    let started = bench
        .seen
        .iter()
        .find(|e| e.job_id == early.job_id && e.kind.name() == "started")
        .expect("started");
    let last_warming = bench.warming.iter().map(|b| b.at).max().expect("a beat");
    assert!(
        started.at > last_warming,
        "started at {} while the worker still said warming at {last_warming}",
        started.at
    );
    assert!(bench.completed(early.job_id).is_some());
    Ok(())
}

/// A worker shut down past its grace period gives each job of the batch in hand back to the
/// scheduler, alone, on the redispatch queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_each_job_of_a_batch_back_alone() -> anyhow::Result<()> {
    let options = test_pattern(50, &[("VNFARM_DRAIN_GRACE_S", "0")]);
    let mut bench = Bench::start("batch-shutdown", options).await?;
    let batch = [generate("one"), generate("two"), generate("three")];
    let mut batch = batch.to_vec();
    for job in &mut batch {
        if let Task::Generate(g) = &mut job.task {
            g.steps = 100;
        }
    }
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    let beat = bench.heartbeat(|hb| hb.running.len() == 3).await?;
    assert_eq!(beat.in_flight, 3);
    bench.farm.signal_worker("w1", libc::SIGTERM);

    bench
        .given_back(&ids, |delivery| {
            assert!(
                string_header(delivery, HEADER_REASON).is_some_and(|r| r.contains("shut down")),
                "{:?}",
                delivery.properties.headers()
            );
        })
        .await?;
    let status = bench.wait_exit().await?;
    assert!(status.success(), "{}", bench.farm.worker_logs());
    for id in ids {
        assert!(
            !bench
                .names_of(id)
                .iter()
                .any(|n| *n == "failed" || *n == "completed"),
            "{:?}",
            bench.names_of(id)
        );
    }
    Ok(())
}

/// A device failure in a batch is nobody's fault: the job it hit and every job after it get a
/// retryable `failed` and go back to the scheduler alone (the device may be unusable, so nothing
/// more runs here), a job that finished before it is kept, and the worker exits with an error for
/// its supervisor to restart it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_failure_gives_the_rest_of_the_batch_back_to_be_retried() -> anyhow::Result<()> {
    let options = test_pattern(
        5,
        &[("VNFARM_ENGINE__TEST_PATTERN__DEVICE_FAILURE_PROMPT", "boom")],
    );
    let mut bench = Bench::start("batch-device", options).await?;
    let batch = [generate("fine"), generate("boom"), generate("also fine")];
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench.given_back(&ids[1..], |_| {}).await?;
    bench.wait_final(&ids[..1]).await?;
    assert!(
        bench.completed(ids[0]).is_some(),
        "the job that ran before the failure is kept: {:?}",
        bench.names_of(ids[0])
    );
    bench
        .wait_events(|seen| {
            ids[1..].iter().all(|id| {
                seen.iter()
                    .any(|e| e.job_id == *id && e.kind.name() == "failed")
            })
        })
        .await?;
    for &id in &ids[1..] {
        let failed = bench.seen.iter().find_map(|e| match &e.kind {
            EventKind::Failed {
                failure, retryable, ..
            } if e.job_id == id => Some((*failure, *retryable)),
            _ => None,
        });
        assert_eq!(
            failed,
            Some((FailureKind::Engine, true)),
            "{:?}",
            bench.names_of(id)
        );
    }
    let status = bench.wait_exit().await?;
    assert!(
        !status.success(),
        "a device failure ends the worker with an error"
    );
    Ok(())
}

/// Without a batch gain each job of a message runs alone and is reported as soon as it is done:
/// the first edit completes while the last has not begun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_job_of_a_batch_is_reported_when_it_is_done() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-stream", test_pattern(50, &[])).await?;
    let ids = three_edits_of_base(&mut bench, 5).await?;
    let at = |id: JobId, name: &str| {
        bench
            .seen
            .iter()
            .position(|e| e.job_id == id && e.kind.name() == name)
            .unwrap_or_else(|| panic!("no {name} for {id}: {:?}", bench.names()))
    };
    assert!(
        at(ids[0], "completed") < at(ids[2], "progress"),
        "the first job is reported before the last one steps: {:?}",
        bench.names()
    );
    let encoders = ids.iter().filter(|id| bench.encoded(**id)).count();
    assert_eq!(
        encoders, 1,
        "one encode for the message, kept between its jobs"
    );
    Ok(())
}

/// The scheduler asks for a batch message's jobs back (a yield, for interactive work): the job on
/// the engine finishes and is reported; the others go back to the scheduler unstarted, alone, marked
/// as yielded, with no event of their own. A yield naming another worker is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yield_gives_back_the_unstarted_jobs_of_a_batch() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-yield", test_pattern(60, &[])).await?;
    put_png(&bench.farm, "inputs/base.png").await?;
    let batch: Vec<BatchedJob> = ["a", "b", "c", "d"]
        .iter()
        .map(|i| edit("inputs/base.png", i, 5))
        .collect();
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench
        .wait_events(|seen| {
            seen.iter()
                .any(|e| e.job_id == ids[0] && e.kind.name() == "progress")
        })
        .await?;
    let ask = |worker: WorkerId| YieldRequest::new(worker, ids.clone());
    for request in [
        ask("someone-else".parse().map_err(anyhow::Error::msg)?),
        ask(bench.worker.clone()),
    ] {
        bench
            .publisher
            .broadcast_json(
                &bench.topology.events_exchange(),
                YIELD_ROUTING_KEY,
                &request,
                json_properties(),
            )
            .await?;
    }
    bench
        .given_back(&ids[1..], |delivery| {
            assert_eq!(
                string_header(delivery, HEADER_YIELDED).as_deref(),
                Some("true")
            );
        })
        .await?;
    bench.wait_final(&ids[..1]).await?;
    assert!(bench.completed(ids[0]).is_some(), "{:?}", bench.names());
    for &id in &ids[1..] {
        let names = bench.names_of(id);
        assert!(
            !names
                .iter()
                .any(|n| ["progress", "failed", "completed"].contains(n)),
            "{names:?}"
        );
        assert!(bench.farm.storage.get(&manifest_key(id)).await.is_err());
    }
    let beat = bench.heartbeat(|hb| hb.in_flight == 0).await?;
    assert!(beat.running.is_empty(), "the worker is free again");
    Ok(())
}

/// One worker with the tiny SDXL (diffusers folder, so its checkpoint is named `sdxl_tiny`) and the
/// tiny Qwen edit model (ComfyUI-style files, written from its diffusers folder at test time) on the
/// CPU in fp32, Qwen taking two edits per forward
/// and small conditioning images (the tiny model's speed on a CPU).
fn models_worker() -> WorkerOptions {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/models/fixtures");
    let qwen = fixtures.join("qwen");
    let path = |p: std::path::PathBuf| p.display().to_string();
    let sdxl = [
        ("CHECKPOINT", path(fixtures.join("sdxl/sdxl_tiny"))),
        ("DEVICE", "cpu".into()),
        ("DTYPE", "fp32".into()),
        ("VAE_DTYPE", "fp32".into()),
        ("WARM_UP", "[[256, 256]]".into()),
        ("VAE_TILING", "never".into()),
        ("MAX_BATCH", "4".into()),
    ];
    let qwen_edit = [
        (
            "TRANSFORMER",
            path(crate::derived::qwen_transformer_fp8(&fixtures)),
        ),
        (
            "TEXT_ENCODER",
            path(crate::derived::qwen_text_encoder_fp8_scaled(&fixtures)),
        ),
        ("VAE", path(crate::derived::qwen_vae_wan(&fixtures))),
        ("CONFIG_DIR", path(qwen.join("qwen_tiny"))),
        ("DEVICE", "cpu".into()),
        ("DTYPE", "fp32".into()),
        ("VAE_DTYPE", "fp32".into()),
        ("CONDITION_IMAGE_AREA", (64 * 64).to_string()),
        ("VAE_IMAGE_AREA", (128 * 128).to_string()),
        ("WARM_UP", "[]".into()),
        ("MAX_BATCH", "2".into()),
    ];
    let extra_env = sdxl
        .into_iter()
        .map(|(k, v)| (format!("VNFARM_ENGINE__SDXL__{k}"), v))
        .chain(
            qwen_edit
                .into_iter()
                .map(|(k, v)| (format!("VNFARM_ENGINE__QWEN_EDIT__{k}"), v)),
        )
        .collect();
    WorkerOptions {
        extra_env,
        ..WorkerOptions::default()
    }
}

/// Mean absolute difference of two PNGs of one size, in 1/255 units.
fn mae(a: &[u8], b: &[u8]) -> anyhow::Result<f64> {
    let (a, b) = (
        image::load_from_memory(a)?.to_rgb8(),
        image::load_from_memory(b)?.to_rgb8(),
    );
    anyhow::ensure!(a.dimensions() == b.dimensions(), "sizes differ");
    let sum: u64 = a
        .as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    Ok(sum as f64 / a.as_raw().len() as f64)
}

/// A copy of a job under a new id: the same work, so the same images.
fn again(job: &BatchedJob) -> BatchedJob {
    BatchedJob {
        job_id: JobId::new(),
        ..job.clone()
    }
}

/// The models' engines run batches: compatible generates share SDXL's forwards, edits of one input
/// share Qwen's encoding and forwards; every job's image is the one it gets alone, a generate naming
/// a checkpoint the worker does not hold fails alone, and the heartbeat names the one it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_run_batches_and_each_image_is_the_one_it_gets_alone() -> anyhow::Result<()> {
    let mut bench = Bench::start("batch-models", models_worker()).await?;
    let beat = bench.heartbeat(|_| true).await?;
    assert_eq!(beat.checkpoints, ["sdxl_tiny"], "named after its folder");
    let storage = bench.farm.storage.clone();
    let png = |id: JobId, n: u32| {
        let storage = storage.clone();
        async move { anyhow::Ok(storage.get(&output_key(id, n)).await?.to_vec()) }
    };

    // SDXL: two images alone, then the same job in a batch beside another compatible one (one
    // forward of three images), and one naming another checkpoint.
    let generate = |prompt: &str, seed: u64, count: u32, checkpoint: Option<&str>| {
        job(Task::Generate(GenerateSpec {
            prompt: prompt.into(),
            negative_prompt: "blurry".into(),
            width: 256,
            height: 256,
            steps: 3,
            cfg: 4.5,
            sampler: Sampler::EulerAncestral,
            seed: Some(seed),
            count,
            checkpoint: checkpoint.map(Into::into),
            loras: Vec::new(),
        }))
    };
    let alone = generate("a lighthouse", 7, 2, None);
    bench.send(std::slice::from_ref(&alone)).await?;
    bench.wait_final(&[alone.job_id]).await?;
    let batch = [
        again(&alone),
        generate("a harbour at night", 40, 1, Some("sdxl_tiny")),
        generate("a castle", 1, 1, Some("pony")),
    ];
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench.wait_final(&ids).await?;
    for n in 0..2 {
        let diff = mae(&png(alone.job_id, n).await?, &png(ids[0], n).await?)?;
        assert!(diff <= 0.5, "image {n}: {diff}/255 from the job alone");
    }
    let other = mae(&png(alone.job_id, 0).await?, &png(ids[1], 0).await?)?;
    assert!(other > 5.0, "another job's image: {other}/255");
    let progress: Vec<(u32, u32)> = bench
        .seen
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Progress { step, total } if e.job_id == ids[0] => Some((step, total)),
            _ => None,
        })
        .collect();
    assert_eq!(progress, [(1, 3), (2, 3), (3, 3)], "one shared forward");
    let misrouted = bench.seen.iter().find_map(|e| match &e.kind {
        EventKind::Failed {
            failure, retryable, ..
        } if e.job_id == ids[2] => Some((*failure, *retryable)),
        _ => None,
    });
    assert_eq!(misrouted, Some((FailureKind::NoWorker, false)));

    // Qwen: an edit alone, then the same edit in a batch (its input still encoded) beside two edits
    // of another input, which encode it once between them.
    put_png(&bench.farm, "inputs/base.png").await?;
    let pose = image::RgbImage::from_fn(48, 64, |x, y| image::Rgb([200, x as u8 * 4, y as u8 * 2]));
    let mut bytes = Cursor::new(Vec::new());
    pose.write_to(&mut bytes, image::ImageFormat::Png)?;
    bench
        .farm
        .storage
        .put("inputs/pose.png", bytes.into_inner().into(), "image/png")
        .await?;
    let edit = |input: &str, instruction: &str, seed: u64| {
        let mut job = edit(input, instruction, 2);
        if let Task::Edit(e) = &mut job.task {
            (e.width, e.height, e.seed) = (Some(256), Some(256), Some(seed));
        }
        job
    };
    let alone = edit("inputs/base.png", "make her smile", 3);
    bench.send(std::slice::from_ref(&alone)).await?;
    bench.wait_final(&[alone.job_id]).await?;
    assert!(bench.encoded(alone.job_id));
    let batch = [
        again(&alone),
        edit("inputs/pose.png", "wave", 4),
        edit("inputs/pose.png", "bow", 5),
    ];
    let ids: Vec<JobId> = batch.iter().map(|j| j.job_id).collect();
    bench.send(&batch).await?;
    bench.wait_final(&ids).await?;
    for &id in &ids {
        assert!(bench.completed(id).is_some(), "{:?}", bench.names_of(id));
    }
    let diff = mae(&png(alone.job_id, 0).await?, &png(ids[0], 0).await?)?;
    assert!(diff <= 0.5, "{diff}/255 from the edit alone");
    assert!(!bench.encoded(ids[0]), "its input was still cached");
    assert_eq!(
        [bench.encoded(ids[1]), bench.encoded(ids[2])]
            .iter()
            .filter(|e| **e)
            .count(),
        1,
        "one encode for two edits of one input"
    );
    let beat = bench
        .heartbeat(|hb| hb.in_flight == 0 && hb.encode_cache.len() == 2)
        .await?;
    assert_eq!(
        beat.encode_cache,
        [
            "qwen-edit:stored:inputs/base.png",
            "qwen-edit:stored:inputs/pose.png"
        ]
    );
    Ok(())
}
