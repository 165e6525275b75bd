//! Running the jobs of one work message up to the point where each can be settled: jobs cancelled
//! or finished before are skipped, the others get `started`, their inputs (one fetch for an input
//! several of them share), one run on the engine together (progress per job), and each its own
//! outputs and manifest in storage. How each job ended is a [`JobEnd`]; [`crate::job`] settles it.
//!
//! A job finished before is one whose manifest is stored: see [`Worker::finished_before`].

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use chrono::Utc;
use futures::future::join_all;
use sha2::{Digest, Sha256};
use vnfarm_bus::Publisher;
use vnfarm_proto::manifest::{ManifestOutput, Versions};
use vnfarm_proto::spec::MAX_UPSCALE_OUTPUT_SIDE;
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{
    BatchedJob, EventKind, ImageRef, JobId, Manifest, SCHEMA_VERSION, StageTimings, Task,
    decode_json,
};
use vnfarm_storage::StorageError;

use crate::engine::{CancelReason, EngineError, EngineJob, EngineOutput, InputImage, Progress};
use crate::image_io::{decode_input_as_stored, encode_png, flatten_to_rgb8};
use crate::job::JobError;
use crate::worker::Worker;

/// A job run to the end here: its outputs and manifest are stored.
#[derive(Debug)]
pub(crate) struct Done {
    pub outputs: Vec<String>,
    pub manifest: String,
    pub timings: StageTimings,
}

/// How a job of a message ended here without failing, before its message is settled.
#[derive(Debug)]
pub(crate) enum Ended {
    Completed(Done),
    /// An earlier delivery finished it: its stored manifest.
    FinishedBefore(Box<Manifest>),
    CancelledBefore,
}

/// How a job of a message ended here: the failures are settled by their disposition.
pub(crate) type JobEnd = Result<Ended, JobError>;

impl Worker {
    /// Runs the jobs of a message (one, or a batch): one end per job, in order. They are the jobs
    /// in hand until each is settled.
    pub(crate) async fn execute(
        &self,
        publisher: &Publisher,
        jobs: &[BatchedJob],
        attempt: u32,
    ) -> Vec<JobEnd> {
        let ids: Vec<JobId> = jobs.iter().map(|j| j.job_id).collect();
        let cancels = self.take_in_hand(&ids);
        let mut ends: Vec<Option<JobEnd>> = join_all(jobs.iter().map(|job| self.skip(job))).await;

        let mut timings: Vec<StageTimings> = jobs.iter().map(|_| StageTimings::default()).collect();
        let mut fetched = HashMap::new();
        let mut engine_jobs = Vec::new();
        let mut on_engine = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            if ends[i].is_some() {
                continue;
            }
            let started = self
                .start(publisher, job, attempt, &mut fetched, &mut timings[i])
                .await;
            match (started, cancels[i].requested()) {
                (Err(e), _) => ends[i] = Some(Err(e)),
                // Cancelled (or interrupted) while starting: the engine need not see it.
                (Ok(_), Some(reason)) => {
                    ends[i] = Some(Err(JobError::Engine(EngineError::Cancelled(reason))));
                }
                (Ok(inputs), None) => {
                    on_engine.push(i);
                    engine_jobs.push(EngineJob {
                        job_id: job.job_id,
                        task: job.task.clone(),
                        inputs,
                        cancel: cancels[i].clone(),
                    });
                }
            }
        }

        let results = self.run_on_engine(publisher, engine_jobs).await;
        let stored = join_all(on_engine.iter().zip(results).map(|(&i, result)| {
            let timings = std::mem::take(&mut timings[i]);
            let cancel = cancels[i].clone();
            async move {
                let output = match result {
                    // A job cancelled while it ran with others: its result is discarded.
                    Ok(_) if cancel.requested() == Some(CancelReason::User) => {
                        return (
                            i,
                            Err(JobError::Engine(EngineError::Cancelled(CancelReason::User))),
                        );
                    }
                    Ok(output) => output,
                    Err(e) => return (i, Err(JobError::Engine(e))),
                };
                if let Some(lookup) = output.encode_cache {
                    self.metrics
                        .encode_cache_total
                        .with_label_values(&[lookup.as_str()])
                        .inc();
                }
                match self.store(&jobs[i], attempt, output, timings).await {
                    Ok(done) => (i, Ok(Ended::Completed(done))),
                    Err(e) => (i, Err(e)),
                }
            }
        }))
        .await;
        for (i, end) in stored {
            ends[i] = Some(end);
        }
        ends.into_iter()
            .map(|end| {
                // Every job is skipped, fails to start, or runs on the engine and is stored.
                end.unwrap_or_else(|| {
                    Err(JobError::Engine(EngineError::Failed(
                        "the job was never run".into(),
                    )))
                })
            })
            .collect()
    }

    /// Whether the job ends before it starts: cancelled before it came, or finished by an earlier
    /// delivery.
    async fn skip(&self, job: &BatchedJob) -> Option<JobEnd> {
        if self.is_cancelled(job.job_id) {
            tracing::info!(job_id = %job.job_id, "skipping a job cancelled before it started");
            return Some(Ok(Ended::CancelledBefore));
        }
        match self.finished_before(job.job_id).await {
            Ok(None) => None,
            Ok(Some(manifest)) => Some(Ok(Ended::FinishedBefore(Box::new(manifest)))),
            Err(e) => Some(Err(e)),
        }
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
        // `NotFound` is the usual answer here, not a storage error: it is a value for the retries.
        let stored = self
            .with_storage_retries("get", &key, || async {
                match self.storage.get(&key).await {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(StorageError::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .await?;
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
    /// message fetched them already).
    async fn start(
        &self,
        publisher: &Publisher,
        job: &BatchedJob,
        attempt: u32,
        fetched: &mut HashMap<(String, Layout), InputImage>,
        timings: &mut StageTimings,
    ) -> Result<Vec<InputImage>, JobError> {
        if job.deadline.is_some_and(|d| d < Utc::now()) {
            return Err(JobError::DeadlineExceeded);
        }
        self.publish_event(
            publisher,
            job.job_id,
            EventKind::Started {
                worker: self.id.clone(),
                attempt,
            },
        )
        .await?;
        let started = Instant::now();
        let refs = match &job.task {
            Task::Generate(_) => return Ok(Vec::new()),
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
        Ok(inputs)
    }

    /// Runs the jobs on the engine together; they are `running` meanwhile. Progress events go out
    /// from their own task, so the engine never waits on the broker. Progress is advisory: after a
    /// failed publish (logged in `publish_event`) the rest of this message's progress is dropped
    /// rather than sent into a broken channel, and the jobs go on; their final events, which must
    /// arrive, meet the same broker and end the session if it is gone.
    async fn run_on_engine(
        &self,
        publisher: &Publisher,
        jobs: Vec<EngineJob>,
    ) -> Vec<Result<EngineOutput, EngineError>> {
        if jobs.is_empty() {
            return Vec::new();
        }
        let ids: Vec<JobId> = jobs.iter().map(|j| j.job_id).collect();
        self.set_running(ids.clone());
        let (progress_tx, mut progress_rx) =
            tokio::sync::mpsc::unbounded_channel::<(usize, Progress)>();
        let forwarder = {
            let publisher = publisher.clone();
            let this = self.clone();
            let ids = ids.clone();
            tokio::spawn(async move {
                while let Some((i, p)) = progress_rx.recv().await {
                    let Some(&job_id) = ids.get(i) else {
                        continue;
                    };
                    let progress = EventKind::Progress {
                        step: p.step,
                        total: p.total,
                    };
                    if this
                        .publish_event(&publisher, job_id, progress)
                        .await
                        .is_err()
                    {
                        tracing::warn!(job_id = %job_id, "no more progress events for this message");
                        break;
                    }
                }
            })
        };
        self.metrics.engine_busy(Instant::now());
        let results = self.engine.run_batch(jobs, progress_tx).await;
        self.metrics.engine_idle(Instant::now());
        self.set_running(Vec::new());
        if let Err(e) = forwarder.await {
            tracing::warn!(jobs = ids.len(), error = %e, "progress forwarder failed");
        }
        results
    }

    /// Stores a job's outputs, then its manifest (last: see [`Worker::finished_before`]).
    async fn store(
        &self,
        job: &BatchedJob,
        attempt: u32,
        output: EngineOutput,
        mut timings: StageTimings,
    ) -> Result<Done, JobError> {
        let job_id = job.job_id;
        let kind = job.task.kind_name();
        for (stage, seconds) in &output.timings.0 {
            timings.add(stage, *seconds);
        }
        self.observe_denoise_steps(&job.task, &output);

        // PNG encoding is CPU work: off the async runtime.
        let started = Instant::now();
        let parameters = parameters_text(job_id, &job.task);
        let images = output.images;
        let encoded = tokio::task::spawn_blocking(move || {
            images
                .iter()
                .map(|img| (img.width(), img.height(), encode_png(img, &parameters)))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| JobError::Engine(EngineError::Failed(format!("PNG encoder panicked: {e}"))))?;
        timings.add("encode_png", started.elapsed().as_secs_f64());

        let started = Instant::now();
        let mut outputs = Vec::new();
        let mut manifest_outputs = Vec::new();
        for (n, ((width, height, png), seed)) in encoded.into_iter().zip(output.seeds).enumerate() {
            let key = output_key(job_id, n as u32);
            let sha256 = hex::encode(Sha256::digest(&png));
            self.put_with_retries(&key, Bytes::from(png), "image/png")
                .await?;
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
            self.metrics
                .stage_seconds
                .with_label_values(&[kind, stage])
                .observe(*seconds);
        }
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: job.task.clone(),
            outputs: manifest_outputs,
            worker: self.id.clone(),
            attempt,
            engine: self.engine.name().to_owned(),
            model_files: Vec::new(),
            timings: timings.clone(),
            versions: Versions {
                vnfarm: env!("CARGO_PKG_VERSION").to_owned(),
            },
            finished_at: Utc::now(),
        };
        // The manifest goes last, after every output: a stored manifest is what `finished_before`
        // takes as proof that the job is done, so it must never exist before its outputs do.
        let key = manifest_key(job_id);
        let body = serde_json::to_vec_pretty(&manifest).expect("manifests serialize to JSON");
        self.put_with_retries(&key, Bytes::from(body), "application/json")
            .await?;
        Ok(Done {
            outputs,
            manifest: key,
            timings,
        })
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
        if steps == 0 {
            return;
        }
        self.metrics
            .denoise_step_seconds
            .with_label_values(&[
                task.model().as_str(),
                crate::metrics::resolution(image.width(), image.height()),
            ])
            .observe(seconds / f64::from(steps));
    }

    /// Downloads (or decodes inline) one input image, with the sha256 of its bytes.
    async fn fetch_input(&self, input: &ImageRef, layout: Layout) -> Result<InputImage, JobError> {
        let bytes =
            match input {
                ImageRef::Stored(key) => self.get_with_retries(key).await?,
                ImageRef::JobOutput { job, index } => {
                    self.get_with_retries(&output_key(*job, *index)).await?
                }
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

    async fn get_with_retries(&self, key: &str) -> Result<Bytes, JobError> {
        self.with_storage_retries("get", key, || self.storage.get(key))
            .await
    }

    async fn put_with_retries(
        &self,
        key: &str,
        body: Bytes,
        content_type: &str,
    ) -> Result<(), JobError> {
        self.with_storage_retries("put", key, || {
            self.storage.put(key, body.clone(), content_type)
        })
        .await
    }

    /// Retries `attempt` while storage is unavailable, with exponential backoff (200 ms doubling to
    /// 5 s), up to `storage_attempts` times; other errors and the last failure are returned.
    async fn with_storage_retries<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut attempt: F,
    ) -> Result<T, JobError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StorageError>>,
    {
        let mut delay = std::time::Duration::from_millis(200);
        let mut tries = 1;
        loop {
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    self.metrics
                        .storage_errors_total
                        .with_label_values(&[op])
                        .inc();
                    let transient = matches!(e, StorageError::Unavailable { .. });
                    if !transient || tries >= self.config.storage_attempts {
                        return Err(JobError::Storage(e));
                    }
                    tracing::warn!(key, op, error = %e, "storage operation failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(5));
                    tries += 1;
                }
            }
        }
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

/// Generation parameters for the PNG text chunk: A1111's layout for generates, JSON otherwise.
fn parameters_text(job_id: JobId, task: &Task) -> String {
    match task {
        Task::Generate(g) => format!(
            "{}\nNegative prompt: {}\nSteps: {}, Sampler: {:?}, CFG scale: {}, Seed: {}, Size: {}x{}, vnfarm job: {job_id}",
            g.prompt,
            g.negative_prompt,
            g.steps,
            g.sampler,
            g.cfg,
            g.seed.unwrap_or_default(),
            g.width,
            g.height
        ),
        other => format!(
            "{}\nvnfarm job: {job_id}",
            serde_json::to_string(other).expect("tasks serialize to JSON")
        ),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn manifest(job_id: JobId) -> Manifest {
        let mut timings = StageTimings::default();
        timings.add("denoise", 1.5);
        Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: decode_json(br#"{"kind": "generate", "prompt": "a lighthouse"}"#)
                .expect("a valid task"),
            outputs: (0..2)
                .map(|n| ManifestOutput {
                    key: output_key(job_id, n),
                    width: 512,
                    height: 512,
                    seed: Some(7 + u64::from(n)),
                    sha256: "00".repeat(32),
                })
                .collect(),
            worker: "w-first".parse().expect("a valid worker id"),
            attempt: 1,
            engine: "test-pattern".into(),
            model_files: Vec::new(),
            timings,
            versions: Versions {
                vnfarm: "0.0.0".into(),
            },
            finished_at: Utc::now(),
        }
    }

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

/// What an input image is decoded to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Layout {
    /// 8-bit RGB with alpha flattened onto white (the generative models).
    Rgb8,
    /// Also as stored: alpha, greyscale and 16-bit samples kept (upscales).
    AsStored,
}
