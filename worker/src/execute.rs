//! Running the jobs of one work message up to the point where each can be settled: jobs cancelled
//! or finished before are skipped, the others get `started`, their inputs (one fetch for an input
//! several of them share), the engine (progress per job; each job answered when its run ends), and
//! each its own outputs and manifest in storage. How each job ended is a [`JobEnd`], sent as soon as
//! it is known; [`crate::job`] settles it then, so a job of a batch message is reported done while
//! the engine runs the rest.
//!
//! A job finished before is one whose manifest is stored: see [`Worker::finished_before`].

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use chrono::Utc;
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use sha2::{Digest, Sha256};
use vnfarm_bus::PublishError;
use vnfarm_proto::manifest::{ManifestOutput, ModelFile, Versions};
use vnfarm_proto::spec::MAX_UPSCALE_OUTPUT_SIDE;
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{
    BatchedJob, EventKind, ImageRef, JobId, Manifest, ModelFileRole, SCHEMA_VERSION, StageTimings,
    Task, decode_json,
};
use vnfarm_storage::StorageError;

use crate::end::{Done, Ended, JobEnd, JobError};
use crate::engine::config::EngineKind;
use crate::engine::{
    Answer, Cancel, CancelReason, EngineError, EngineJob, EngineOutput, FetchedCheckpoint,
    FetchedLoras, InputImage, LoraDir, Progress, UsedFile,
};
use crate::image_io::{decode_input_as_stored, encode_png, flatten_to_rgb8};
use crate::infotext;
use crate::model_cache::{ModelCacheError, Pinned};
use crate::outbox::Outbox;
use crate::worker::Worker;

/// A job's files from the model catalogue, and its pins on them in the model cache (held until
/// the job is settled).
struct CatalogueFiles {
    loras: FetchedLoras,
    checkpoint: Option<FetchedCheckpoint>,
    pins: Vec<Pinned>,
}

impl Worker {
    /// Runs the jobs of a message (one, or a batch), sending each job's end, tagged with its index,
    /// as soon as it has one: a job skipped or failing to start at once, a job on the engine when
    /// its run ends and its outputs are stored. Every job gets exactly one end; the channel closes
    /// after the last. They are the jobs in hand until each is settled.
    pub(crate) async fn execute(
        &self,
        outbox: &Outbox,
        jobs: &[BatchedJob],
        attempt: u32,
        ends: tokio::sync::mpsc::UnboundedSender<(usize, JobEnd)>,
    ) {
        // The receiver is gone only when settling failed (the broker is lost): the message is
        // redelivered, and these ends are not needed.
        let end = |i: usize, end: JobEnd| {
            let _ = ends.send((i, end));
        };
        let ids: Vec<JobId> = jobs.iter().map(|j| j.job_id).collect();
        let cancels = self.hand().take(&ids);
        let skipped: Vec<Option<JobEnd>> = join_all(jobs.iter().map(|job| self.skip(job))).await;

        let mut timings: Vec<StageTimings> = jobs.iter().map(|_| StageTimings::default()).collect();
        let mut fetched = HashMap::new();
        let mut engine_jobs = Vec::new();
        let mut on_engine = Vec::new();
        // The catalogue files each job uses, pinned in the model cache until it is settled (its
        // manifest hashes them after the engine is done).
        let mut pins: Vec<Vec<Pinned>> = jobs.iter().map(|_| Vec::new()).collect();
        for ((i, job), skipped) in jobs.iter().enumerate().zip(skipped) {
            if let Some(skipped) = skipped {
                end(i, skipped);
                continue;
            }
            let started = self
                .start(outbox, job, attempt, &mut fetched, &mut timings[i])
                .await;
            match (started, cancels[i].requested()) {
                (Err(e), _) => end(i, Err(e)),
                // Cancelled (or interrupted) while starting: the engine need not see it.
                (Ok(_), Some(reason)) => {
                    end(i, Err(JobError::Engine(EngineError::Cancelled(reason))));
                }
                (Ok((inputs, files)), None) => {
                    on_engine.push(i);
                    pins[i] = files.pins;
                    engine_jobs.push(EngineJob {
                        job_id: job.job_id,
                        task: job.task.clone(),
                        inputs,
                        cancel: cancels[i].clone(),
                        fetched: files.loras,
                        checkpoint: files.checkpoint,
                    });
                }
            }
        }
        if engine_jobs.is_empty() {
            return;
        }

        // Each result is stored as it comes, while the engine runs the next jobs.
        let n = on_engine.len();
        let (mut answers, forwarder) = self.run_on_engine(outbox, engine_jobs);
        let mut answered = vec![false; n];
        let mut stores = FuturesUnordered::new();
        let pins = &pins;
        let finish = |k: usize, result: Result<EngineOutput, EngineError>, timings| {
            let i = on_engine[k];
            let cancel = cancels[i].clone();
            async move {
                if let Err(e) = &result {
                    self.condemn_unusable(e, &pins[i]);
                }
                (
                    i,
                    self.finish(outbox, &jobs[i], attempt, result, timings, cancel)
                        .await,
                )
            }
        };
        loop {
            tokio::select! {
                answer = answers.recv() => {
                    let Some((k, result)) = answer else { break };
                    if k >= n || std::mem::replace(&mut answered[k], true) {
                        tracing::error!(index = k, "the engine answered a job twice or out of range");
                        continue;
                    }
                    self.hand().off_engine(ids[on_engine[k]]);
                    let job_timings = std::mem::take(&mut timings[on_engine[k]]);
                    stores.push(finish(k, result, job_timings));
                }
                Some((i, stored)) = stores.next(), if !stores.is_empty() => end(i, stored),
            }
        }
        self.engine_done(&ids, forwarder).await;
        for k in (0..n).filter(|&k| !answered[k]) {
            let dropped = Err(EngineError::Failed(
                "the engine thread dropped the job".into(),
            ));
            let job_timings = std::mem::take(&mut timings[on_engine[k]]);
            stores.push(finish(k, dropped, job_timings));
        }
        while let Some((i, stored)) = stores.next().await {
            end(i, stored);
        }
    }

    /// A job's engine result to its end: stored (unless it was cancelled meanwhile), or the
    /// engine's error.
    async fn finish(
        &self,
        outbox: &Outbox,
        job: &BatchedJob,
        attempt: u32,
        result: Result<EngineOutput, EngineError>,
        timings: StageTimings,
        cancel: Cancel,
    ) -> JobEnd {
        let output = match result {
            // A job cancelled while it ran with others: its result is discarded.
            Ok(_) if cancel.requested() == Some(CancelReason::User) => {
                return Err(JobError::Engine(EngineError::Cancelled(CancelReason::User)));
            }
            Ok(output) => output,
            Err(e) => return Err(JobError::Engine(e)),
        };
        if let Some(lookup) = output.encode_cache {
            self.metrics()
                .encode_cache_total
                .with_label_values(&[lookup.as_str()])
                .inc();
        }
        // The message's channel missed a confirm: this run cannot report any more, its session
        // ends and the message comes back (or expires) to run again. Its results are not stored,
        // so they cannot land over that run's: the three-box test saw a worker whose node stalled
        // after a heal wait 10 s on a `progress`, then store a job that had meanwhile run and
        // completed on another box, over that run's manifest.
        if let Some(end) = self.cannot_store(outbox, job.job_id).await {
            return end;
        }
        self.store(outbox, job, attempt, output, timings).await
    }

    /// Why this run must not store its results, checked before its outputs and again before its
    /// manifest (an upload retried through a storage outage can take long enough for both to
    /// change): it can no longer report (a channel that missed a confirm or was lost: its
    /// delivery comes back to run again), or the job finished elsewhere meanwhile (a worker cut
    /// off from the broker runs on while the job is dispatched again, and stores once the link is
    /// back: the first stored run stands, its manifest is not overwritten). The three-box test saw
    /// a worker whose output upload took 30.8 s while the job expired, ran on another box and
    /// completed there, then store its manifest over that run's.
    async fn cannot_store(&self, outbox: &Outbox, job_id: JobId) -> Option<JobEnd> {
        if outbox.is_stuck() {
            return Some(Err(JobError::Broker(PublishError::Untrusted {
                exchange: self.topology().events_exchange(),
                routing_key: format!("job.{job_id}.completed"),
            })));
        }
        let end = self.ended_before(job_id).await;
        if let Some(Ok(Ended::FinishedBefore(manifest))) = &end {
            tracing::info!(job_id = %job_id, made_by = %manifest.worker, "job finished elsewhere while it ran here; keeping that run's results");
        }
        end
    }

    /// Whether the job ends before it starts: cancelled before it came, or finished by an earlier
    /// delivery.
    async fn skip(&self, job: &BatchedJob) -> Option<JobEnd> {
        if self.hand().is_cancelled(job.job_id) {
            tracing::info!(job_id = %job.job_id, "skipping a job cancelled before it started");
            return Some(Ok(Ended::CancelledBefore));
        }
        self.ended_before(job.job_id).await
    }

    /// The job's end when a run stored it before ([`Worker::finished_before`]); `None` when none
    /// did and this run goes on.
    async fn ended_before(&self, job_id: JobId) -> Option<JobEnd> {
        let found = self.finished_before(job_id).await.transpose()?;
        Some(found.map(|manifest| Ended::FinishedBefore(Box::new(manifest))))
    }

    /// The manifest of this job, if one is stored: then an earlier delivery ran the job to the end
    /// and it must not run again (a redelivery after the worker died or lost the broker between
    /// storing the results and the ack, or a second dispatch).
    ///
    /// Sound because the manifest is the last thing a run stores ([`Worker::store`] puts every
    /// output first), and a put is atomic in both stores (an S3 PUT; write-then-rename on disk): a
    /// manifest is there only when every output it names is. A manifest that does not decode (or
    /// names another job) proves nothing, so the job runs again and overwrites it. Storage that
    /// cannot answer is a transient failure like any other: the job is retried, not guessed about.
    async fn finished_before(&self, job_id: JobId) -> Result<Option<Manifest>, JobError> {
        let key = manifest_key(job_id);
        // `NotFound` is the usual answer here, not a storage error.
        let stored = match self.storage().get(&key).await {
            Ok(bytes) => Some(bytes),
            Err(StorageError::NotFound { .. }) => None,
            Err(e) => return Err(self.storage_failed("get", e)),
        };
        let Some(bytes) = stored else {
            return Ok(None);
        };
        match manifest_of(job_id, &bytes) {
            Ok(manifest) => Ok(Some(manifest)),
            Err(reason) => {
                tracing::warn!(job_id = %job_id, key, %reason, "stored manifest is unreadable; running the job again");
                Ok(None)
            }
        }
    }

    /// Starts a job: its deadline, `started`, its inputs (from `fetched` when another job of the
    /// message fetched them already), its LoRAs and checkpoint from the model catalogue (pinned).
    async fn start(
        &self,
        outbox: &Outbox,
        job: &BatchedJob,
        attempt: u32,
        fetched: &mut HashMap<(String, Layout), InputImage>,
        timings: &mut StageTimings,
    ) -> Result<(Vec<InputImage>, CatalogueFiles), JobError> {
        if job.deadline.is_some_and(|d| d < Utc::now()) {
            return Err(JobError::DeadlineExceeded);
        }
        outbox
            .publish(
                self,
                job.job_id,
                EventKind::Started {
                    worker: self.id().clone(),
                    attempt,
                },
            )
            .await?;
        let started = Instant::now();
        let (loras, mut pins) = self.catalogue_loras(&job.task).await?;
        let checkpoint = match self.catalogue_checkpoint(&job.task).await? {
            Some((fetched, pinned)) => {
                pins.push(pinned);
                Some(fetched)
            }
            None => None,
        };
        let files = CatalogueFiles {
            loras,
            checkpoint,
            pins,
        };
        let refs = match &job.task {
            Task::Generate(_) => {
                timings.add("download", started.elapsed().as_secs_f64());
                return Ok((Vec::new(), files));
            }
            Task::Edit(e) => e.images(),
            Task::Upscale(u) => vec![&u.input],
        };
        // Upscales keep the stored layout (alpha, grey, 16-bit); the generative models take RGB8.
        let layout = match &job.task {
            Task::Upscale(_) => Layout::AsStored,
            Task::Generate(_) | Task::Edit(_) => Layout::Rgb8,
        };
        let mut inputs = Vec::with_capacity(refs.len());
        for input in refs {
            let name = shared_name(input).map(|n| (n, layout));
            let image = match name.as_ref().and_then(|n| fetched.get(n)) {
                Some(image) => image.clone(),
                None => {
                    let image = self.fetch_input(input, layout).await?;
                    if let Some(name) = name {
                        fetched.insert(name, image.clone());
                    }
                    image
                }
            };
            inputs.push(image);
        }
        if let (Task::Upscale(u), Some(input)) = (&job.task, inputs.first()) {
            let img = &input.image;
            let longest = img.width().max(img.height()).saturating_mul(u.scale);
            if longest > MAX_UPSCALE_OUTPUT_SIDE {
                return Err(JobError::InvalidSpec(format!(
                    "scale: output side {longest} exceeds {MAX_UPSCALE_OUTPUT_SIDE} for a {}x{} input",
                    img.width(),
                    img.height()
                )));
            }
        }
        timings.add("download", started.elapsed().as_secs_f64());
        Ok((inputs, files))
    }

    /// The job's LoRAs that its engine's folder lacks, from the model catalogue: found in the
    /// model cache or fetched into it, and pinned. Only for an engine that takes LoRAs (the test
    /// pattern ignores them, and fetches none).
    async fn catalogue_loras(&self, task: &Task) -> Result<(FetchedLoras, Vec<Pinned>), JobError> {
        let engine = &self.config().engine;
        let tch = engine.kind() == EngineKind::Tch;
        let (loras, folder, setting) = match task {
            Task::Generate(g) if tch && engine.sdxl.is_some() => (
                &g.loras,
                engine.sdxl.as_ref().and_then(|c| c.lora_dir.clone()),
                "engine.sdxl.lora_dir",
            ),
            Task::Edit(e) if tch && engine.qwen_edit.is_some() => (
                &e.loras,
                engine.qwen_edit.as_ref().and_then(|c| c.lora_dir.clone()),
                "engine.qwen_edit.lora_dir",
            ),
            Task::Generate(_) | Task::Edit(_) | Task::Upscale(_) => {
                return Ok((FetchedLoras::default(), Vec::new()));
            }
        };
        let folder = LoraDir::new(folder, setting);
        let mut fetched = FetchedLoras::default();
        let mut pins = Vec::new();
        for lora in loras {
            if folder.local(&lora.name).is_some() || fetched.get(&lora.name).is_some() {
                continue;
            }
            let pinned = match self
                .model_cache()
                .fetch_as(&lora.name, ModelFileRole::Lora)
                .await
            {
                Ok(pinned) => pinned,
                Err(e) => {
                    let failed = match e {
                        // The folder's own words: neither there nor in the catalogue.
                        ModelCacheError::Unknown(_) => match folder
                            .resolve(std::slice::from_ref(lora), &FetchedLoras::default())
                        {
                            Err(e) => JobError::Engine(e),
                            Ok(_) => unreachable!("a LoRA the folder lacks does not resolve"),
                        },
                        ModelCacheError::Bad { .. } | ModelCacheError::WrongRole { .. } => {
                            JobError::BadInput(format!("LoRA `{}`: {e}", lora.name))
                        }
                        ModelCacheError::NoRoom { .. } | ModelCacheError::Failed(_) => {
                            JobError::Engine(EngineError::Failed(format!(
                                "LoRA `{}`: {e}",
                                lora.name
                            )))
                        }
                        ModelCacheError::Storage(e) => self.storage_failed("get", e),
                    };
                    return Err(failed);
                }
            };
            fetched.push(lora.name.clone(), pinned.path().to_owned());
            pins.push(pinned);
        }
        Ok((fetched, pins))
    }

    /// A generate's checkpoint from the model catalogue, found in the model cache or fetched
    /// into it, and pinned: only on a worker that serves catalogue checkpoints, and only for a
    /// name that is not its own checkpoint (its own shadows the catalogue's).
    async fn catalogue_checkpoint(
        &self,
        task: &Task,
    ) -> Result<Option<(FetchedCheckpoint, Pinned)>, JobError> {
        let Task::Generate(g) = task else {
            return Ok(None);
        };
        let Some(name) = &g.checkpoint else {
            return Ok(None);
        };
        if self.engine().catalogue_checkpoints() == 0 || self.engine().checkpoints().contains(name)
        {
            return Ok(None);
        }
        let pinned = match self
            .model_cache()
            .fetch_as(name, ModelFileRole::Checkpoint)
            .await
        {
            Ok(pinned) => pinned,
            Err(e) => {
                return Err(match e {
                    // Routed here for a name the catalogue no longer holds: as on a worker that
                    // lacks the checkpoint.
                    ModelCacheError::Unknown(_) => {
                        JobError::Engine(EngineError::NoCheckpoint(name.clone()))
                    }
                    ModelCacheError::Bad { .. } | ModelCacheError::WrongRole { .. } => {
                        JobError::BadInput(format!("checkpoint `{name}`: {e}"))
                    }
                    ModelCacheError::NoRoom { .. } | ModelCacheError::Failed(_) => {
                        JobError::Engine(EngineError::Failed(format!("checkpoint `{name}`: {e}")))
                    }
                    ModelCacheError::Storage(e) => self.storage_failed("get", e),
                });
            }
        };
        let fetched = FetchedCheckpoint {
            name: name.clone(),
            sha256: pinned.sha256().clone(),
            path: pinned.path().to_owned(),
        };
        Ok(Some((fetched, pinned)))
    }

    /// A catalogue file the engine could not use (a LoRA that matches nothing, a header it
    /// refuses: its error names the file's path) is condemned, so it never reaches the engine
    /// again.
    fn condemn_unusable(&self, error: &EngineError, pins: &[Pinned]) {
        let message = match error {
            EngineError::InvalidInput(m) | EngineError::Failed(m) => m,
            EngineError::Cancelled(_)
            | EngineError::OutOfMemory(_)
            | EngineError::DeviceLost(_)
            | EngineError::Unsupported(_)
            | EngineError::NoCheckpoint(_)
            | EngineError::Yielded => return,
        };
        for pin in pins {
            if message.contains(&*pin.path().to_string_lossy()) {
                self.model_cache()
                    .condemn(pin.sha256(), format!("the engine refused it: {message}"));
            }
        }
    }

    /// Starts the jobs on the engine; they are `running` until each is answered. Progress events
    /// go out from their own task, so the engine never waits on the broker. Progress is advisory:
    /// after a failed publish (logged in `publish_event`) the rest of this message's progress is
    /// dropped rather than sent into a broken channel, and the jobs go on; their final events,
    /// which must arrive, meet the same broker and end the session if it is gone. Call
    /// [`Worker::engine_done`] with the forwarder when the answers' channel closes.
    fn run_on_engine(
        &self,
        outbox: &Outbox,
        jobs: Vec<EngineJob>,
    ) -> (
        tokio::sync::mpsc::UnboundedReceiver<Answer>,
        tokio::task::JoinHandle<()>,
    ) {
        let ids: Vec<JobId> = jobs.iter().map(|j| j.job_id).collect();
        self.hand().add_running(&ids);
        let (progress_tx, mut progress_rx) =
            tokio::sync::mpsc::unbounded_channel::<(usize, Progress)>();
        let forwarder = {
            let outbox = outbox.clone();
            let this = self.clone();
            tokio::spawn(async move {
                while let Some((i, p)) = progress_rx.recv().await {
                    let Some(&job_id) = ids.get(i) else {
                        continue;
                    };
                    let progress = EventKind::Progress {
                        step: p.step,
                        total: p.total,
                    };
                    if outbox.publish(&this, job_id, progress).await.is_err() {
                        tracing::warn!(job_id = %job_id, "no more progress events for this message");
                        break;
                    }
                }
            })
        };
        self.metrics().engine_busy(Instant::now());
        (self.engine().run_batch(jobs, progress_tx), forwarder)
    }

    /// The engine has answered every job of the message: idle, and its progress events are out.
    async fn engine_done(&self, ids: &[JobId], forwarder: tokio::task::JoinHandle<()>) {
        self.metrics().engine_idle(Instant::now());
        for id in ids {
            self.hand().off_engine(*id);
        }
        if let Err(e) = forwarder.await {
            tracing::warn!(error = %e, "progress forwarder failed");
        }
    }

    /// Stores a job's outputs, then its manifest (last: see [`Worker::finished_before`]), unless
    /// by then this run must not ([`Worker::cannot_store`]).
    async fn store(
        &self,
        outbox: &Outbox,
        job: &BatchedJob,
        attempt: u32,
        output: EngineOutput,
        mut timings: StageTimings,
    ) -> JobEnd {
        let job_id = job.job_id;
        let kind = job.task.kind_name();
        for (stage, seconds) in &output.timings.0 {
            timings.add(stage, *seconds);
        }
        self.observe_denoise_steps(&job.task, &output);

        // Provenance first: the PNG's parameters name the model by its hash.
        let model_files = self.model_files(job_id, &output.files).await?;

        // Finishing the images (an upscale's resampling) and PNG encoding are CPU work: off the
        // async runtime and off the engine thread. Their memory is bounded as the images' is: by
        // the jobs in hand (`prefetch` messages).
        let started = Instant::now();
        let parameters = infotext::parameters_text(job_id, &job.task, &model_files);
        let images = output.images;
        let (encoded, finished) = tokio::task::spawn_blocking(move || {
            let mut finishing = 0.0;
            let encoded = images
                .into_iter()
                .map(|img| {
                    let started = Instant::now();
                    let img = img.finish();
                    finishing += started.elapsed().as_secs_f64();
                    (img.width(), img.height(), encode_png(&img, &parameters))
                })
                .collect::<Vec<_>>();
            (encoded, finishing)
        })
        .await
        .map_err(|e| JobError::Engine(EngineError::Failed(format!("PNG encoder panicked: {e}"))))?;
        if matches!(job.task, Task::Upscale(_)) {
            timings.add("resample", finished);
        }
        timings.add("encode_png", started.elapsed().as_secs_f64() - finished);

        let started = Instant::now();
        let mut outputs = Vec::new();
        let mut manifest_outputs = Vec::new();
        for (n, ((width, height, png), seed)) in encoded.into_iter().zip(output.seeds).enumerate() {
            let key = output_key(job_id, n as u32);
            let sha256 = hex::encode(Sha256::digest(&png));
            self.put(&key, Bytes::from(png), "image/png").await?;
            manifest_outputs.push(ManifestOutput {
                key: key.clone(),
                width,
                height,
                seed,
                sha256,
            });
            outputs.push(key);
        }
        timings.add("upload", started.elapsed().as_secs_f64());
        for (stage, seconds) in &timings.0 {
            self.metrics()
                .stage_seconds
                .with_label_values(&[kind, stage])
                .observe(*seconds);
        }
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: job.task.clone(),
            outputs: manifest_outputs,
            worker: self.id().clone(),
            attempt,
            engine: self.engine().name().to_owned(),
            model_files,
            timings: timings.clone(),
            versions: Versions {
                vnfarm: env!("CARGO_PKG_VERSION").to_owned(),
            },
            finished_at: Utc::now(),
        };
        // The manifest goes last, after every output: a stored manifest is what `finished_before`
        // takes as proof that the job is done, so it must never exist before its outputs do.
        if let Some(end) = self.cannot_store(outbox, job_id).await {
            return end;
        }
        let key = manifest_key(job_id);
        let body = serde_json::to_vec_pretty(&manifest).expect("manifests serialize to JSON");
        self.put(&key, Bytes::from(body), "application/json")
            .await?;
        Ok(Ended::Completed(Done {
            outputs,
            manifest: key,
            timings,
        }))
    }

    /// The manifest's record of the files the images were made from: each with its sha256 and
    /// size as the file is now, awaited from the hashing threads (at once when it was hashed
    /// before). A file that cannot be read any more cannot be vouched for: the job fails and is
    /// tried again, here or elsewhere.
    async fn model_files(
        &self,
        job_id: JobId,
        files: &[UsedFile],
    ) -> Result<Vec<ModelFile>, JobError> {
        let started = Instant::now();
        let hashed = join_all(files.iter().map(|f| self.hashes().hash(&f.path))).await;
        let seconds = started.elapsed().as_secs_f64();
        if seconds > 1.0 {
            tracing::info!(job_id = %job_id, seconds, "waited for model files to be hashed");
        }
        files
            .iter()
            .zip(hashed)
            .map(|(file, hashed)| {
                let hashed = hashed.map_err(|e| {
                    JobError::Engine(EngineError::Failed(format!(
                        "cannot hash a model file for the manifest: {e}"
                    )))
                })?;
                Ok(ModelFile {
                    name: file.name.clone(),
                    sha256: hashed.sha256,
                    size: hashed.size,
                    path: Some(hashed.path.to_string_lossy().into_owned()),
                    role: Some(file.role),
                    data_sha256: hashed.data_sha256,
                    strength: file.strength,
                })
            })
            .collect()
    }

    /// `denoise_step_seconds`: the job's `denoise` time over its steps, by model and the
    /// resolution class of its first output. Upscales do not denoise.
    fn observe_denoise_steps(&self, task: &Task, output: &EngineOutput) {
        let steps = match task {
            Task::Generate(g) => g.steps,
            Task::Edit(e) => e.steps,
            Task::Upscale(_) => return,
        };
        let (Some(seconds), Some(image)) = (output.timings.0.get("denoise"), output.images.first())
        else {
            return;
        };
        let (width, height) = image.size();
        if steps == 0 {
            return;
        }
        self.metrics()
            .denoise_step_seconds
            .with_label_values(&[
                task.model().as_str(),
                crate::metrics::resolution(width, height),
            ])
            .observe(seconds / f64::from(steps));
    }

    /// Downloads (or decodes inline) one input image, with the sha256 of its bytes.
    async fn fetch_input(&self, input: &ImageRef, layout: Layout) -> Result<InputImage, JobError> {
        let bytes =
            match input {
                ImageRef::Stored(key) => self.get(key).await?,
                ImageRef::JobOutput { job, index } => self.get(&output_key(*job, *index)).await?,
                ImageRef::Inline(_) => {
                    let Some(decoded) = input.inline_bytes() else {
                        unreachable!("inline_bytes is Some for Inline")
                    };
                    Bytes::from(decoded.map_err(|e| {
                        JobError::BadInput(format!("inline image is not base64: {e}"))
                    })?)
                }
            };
        let decoded = tokio::task::spawn_blocking(move || {
            decode_input_as_stored(&bytes).map(|decoded| {
                let keep = layout == Layout::AsStored
                    && !matches!(decoded, image::DynamicImage::ImageRgb8(_));
                let (image, stored) = if keep {
                    (flatten_to_rgb8(decoded.clone()), Some(decoded))
                } else {
                    (flatten_to_rgb8(decoded), None)
                };
                InputImage {
                    image,
                    stored,
                    sha256: hex::encode(Sha256::digest(&bytes)),
                }
            })
        })
        .await
        .map_err(|e| {
            JobError::Engine(EngineError::Failed(format!("image decoder panicked: {e}")))
        })?;
        decoded.map_err(|e| JobError::BadInput(e.to_string()))
    }

    /// `key` from storage, which retries it while unavailable (`storage_attempts` times in all).
    async fn get(&self, key: &str) -> Result<Bytes, JobError> {
        self.storage()
            .get(key)
            .await
            .map_err(|e| self.storage_failed("get", e))
    }

    async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<(), JobError> {
        self.storage()
            .put(key, body, content_type)
            .await
            .map_err(|e| self.storage_failed("put", e))
    }

    /// A storage operation's failure after its retries, counted, as the job's error.
    fn storage_failed(&self, op: &'static str, e: StorageError) -> JobError {
        self.metrics()
            .storage_errors_total
            .with_label_values(&[op])
            .inc();
        JobError::Storage(e)
    }
}

/// The name under which jobs of one message share a fetched input: stored objects and other jobs'
/// outputs. An inline image is its job's own.
fn shared_name(input: &ImageRef) -> Option<String> {
    match input {
        ImageRef::Stored(key) => Some(format!("stored:{key}")),
        ImageRef::JobOutput { job, index } => Some(format!("job:{job}/{index}")),
        ImageRef::Inline(_) => None,
    }
}

/// Decodes a stored manifest and checks that it is `job_id`'s.
fn manifest_of(job_id: JobId, bytes: &[u8]) -> Result<Manifest, String> {
    let manifest: Manifest = decode_json(bytes).map_err(|e| e.to_string())?;
    if manifest.job_id != job_id {
        return Err(format!("job_id: {} is another job's", manifest.job_id));
    }
    Ok(manifest)
}

/// What an input image is decoded to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Layout {
    /// 8-bit RGB with alpha flattened onto white (the generative models).
    Rgb8,
    /// Also as stored: alpha, greyscale and 16-bit samples kept (upscales).
    AsStored,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::end::tests::manifest;

    #[test]
    fn a_stored_manifest_counts_only_for_its_own_job_and_only_when_whole() {
        let id = JobId::new();
        let stored = manifest(id);
        let bytes = serde_json::to_vec_pretty(&stored).unwrap();
        assert_eq!(manifest_of(id, &bytes), Ok(stored));
        let other = manifest_of(JobId::new(), &bytes).unwrap_err();
        assert!(other.starts_with("job_id"), "{other}");
        let truncated = manifest_of(id, &bytes[..bytes.len() / 2]);
        assert!(truncated.is_err(), "{truncated:?}");
        assert!(manifest_of(id, b"").is_err());
    }

    #[test]
    fn jobs_share_fetches_of_named_inputs_only() {
        let job = JobId::new();
        assert_eq!(
            shared_name(&ImageRef::JobOutput { job, index: 2 }),
            Some(format!("job:{job}/2"))
        );
        assert_eq!(
            shared_name(&ImageRef::Stored("inputs/a.png".into())).as_deref(),
            Some("stored:inputs/a.png")
        );
        assert_eq!(shared_name(&ImageRef::Inline("aGk=".into())), None);
    }
}
