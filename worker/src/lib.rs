//! vnfarm worker: keeps its models warm on one GPU, takes jobs from its RabbitMQ queue, writes results
//! to storage and reports every step as an event.
//!
//! # Layout
//!
//! - [`config`]: the typed configuration, validated before any I/O.
//! - [`tuning`]: the kernel and layout settings an engine may run (presets, or the box's settings
//!   file with its fingerprint).
//! - [`check`]: `vnfarm-worker check`, the box's self-test and tuning, which writes that file.
//! - [`bench`]: `vnfarm-worker bench`, the offline benchmark mode: work messages from a local file
//!   through the same path from dequeue to upload, results on local disk, the GPU's busy time.
//! - [`engine`]: the engines and the dedicated engine thread they run on, and which settings they
//!   run (`engine/settings.rs`).
//! - [`gpu_runtime`]: the GPU runtime libtorch loaded, looked up by name (memory, device facts).
//! - [`worker`]: the handle every role is given (configuration, identity, storage, engine host,
//!   hashes, model cache, metrics), behind accessors, and each role's state in a type of its own: the jobs in
//!   hand, those on the engine and the cancellations in `worker/hand.rs`, the lifecycle (warming,
//!   ready, draining) in `worker/lifecycle.rs`, the device-loss latch in `worker/device_loss.rs`.
//! - [`session`]: one broker connection's life: declare, consume, heartbeat, handle.
//! - [`job`]: one delivery from message to ack (one job, or a batch of jobs each settled on its own).
//! - [`execute`]: running a message's jobs: skipped, started, inputs, the engine, outputs stored.
//! - [`outbox`]: where a run's events go (the broker, or the benchmark's local record).
//! - [`end`]: how a job ended, handed from `execute` to `job`, and the classification of every
//!   failure (one exhaustive `match`).
//! - [`image_io`]: decoding inputs within limits, encoding PNG outputs with their parameters.
//! - [`infotext`]: those parameters, in the layout AUTOMATIC1111 writes.
//! - [`provenance`]: the sha256 of the model files, hashed once in the background, for manifests.
//! - [`model_cache`]: files of the model catalogue fetched for the jobs that name them, into a
//!   directory bounded in bytes (verified, pinned while used, one fetch per file).
//! - [`metrics`], [`http`]: Prometheus metrics and the `/metrics` and `/healthz` endpoints.
//!
//! [`run`] is the whole worker; `main` only parses configuration and handles signals.

pub mod bench;
pub mod check;
pub mod config;
pub mod end;
pub mod engine;
pub mod execute;
pub mod gpu_runtime;
pub mod http;
pub mod image_io;
pub mod infotext;
pub mod job;
pub mod metrics;
pub mod model_cache;
pub mod outbox;
pub mod provenance;
pub mod session;
pub mod tuning;
pub mod worker;

use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use vnfarm_storage::{Retries, Storage};

pub use config::Config;
use engine::EngineHost;
use engine::shared_encodings::SharedEncodings;
use metrics::Metrics;
use model_cache::ModelCache;
use provenance::FileHashes;
use worker::Worker;

/// Runs the worker until `shutdown` is cancelled: the job in hand finishes (or, past the drain grace
/// period, is interrupted and given back to the queue), then the function returns. An engine that
/// fails to load ends the worker with that error.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    // The bound address, not the configured one: port 0 asks the kernel for a free port.
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving health and metrics");
    }
    serve(config, listener, shutdown).await
}

/// [`run`] on an already bound listener. The end-to-end tests' in-process farm
/// (`tests/in_process.rs`, for the tests that kill nothing) calls it on a listener it bound itself;
/// the tests that kill or signal a worker run the binary, which calls [`run`].
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let (worker, loading) = assemble(config).await?;
    // Set before the failed load stops the worker, so the exit says why whichever task ends first.
    let load_failure: std::sync::Arc<std::sync::Mutex<Option<anyhow::Error>>> = Default::default();
    let loaded = {
        let worker = worker.clone();
        let shutdown = shutdown.clone();
        let load_failure = load_failure.clone();
        tokio::spawn(async move {
            let loaded = loading.finished().await;
            match &loaded {
                Ok(()) => {
                    let seconds = started.elapsed().as_secs_f64();
                    worker.metrics().model_load_seconds.observe(seconds);
                    tracing::info!(engine = worker.engine().name(), seconds, "engine loaded");
                    let settings = worker.engine().settings();
                    let (source, id) = match &settings {
                        Some(s) => (
                            match s.source {
                                vnfarm_proto::SettingsSource::Measured => "measured",
                                vnfarm_proto::SettingsSource::Presets => "presets",
                            },
                            s.id.as_str(),
                        ),
                        // The test pattern has no kernels to set.
                        None => ("none", ""),
                    };
                    worker
                        .metrics()
                        .settings_info
                        .with_label_values(&[source, id])
                        .set(1);
                    worker.lifecycle().engine_ready();
                }
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "the engine failed to load; stopping");
                    *load_failure.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(anyhow::anyhow!("{e:#}"));
                    shutdown.cancel();
                }
            }
        })
    };

    let http_stop = CancellationToken::new();
    let server = {
        let stop = http_stop.clone();
        let app = http::router(worker.clone());
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        })
    };
    {
        // A device failure drains the worker like a SIGTERM; `serve` then returns the error.
        let lost = worker.device_loss().latched();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            lost.await;
            shutdown.cancel();
        });
    }
    {
        let worker = worker.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tokio::time::sleep(Duration::from_secs(worker.config().drain_grace_s)).await;
            tracing::warn!("drain grace period over; interrupting the job in hand");
            worker.hand().interrupt_for_shutdown();
        });
    }

    let name = format!("vnfarm-worker {}", worker.id());
    let this = &worker;
    let until = &shutdown;
    vnfarm_bus::run_sessions(
        &worker.config().amqp,
        &name,
        &shutdown,
        || worker.metrics().amqp_reconnects_total.inc(),
        move |connection| async move { this.session(&connection, until).await },
    )
    .await;
    http_stop.cancel();
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "the metrics server failed"),
        Err(e) => tracing::warn!(error = %e, "the metrics server task panicked"),
    }
    tracing::info!(worker = %worker.id(), "worker stopped");
    // Stopped while still loading: the load's outcome no longer matters.
    loaded.abort();
    if let Some(e) = load_failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        return Err(e.context("loading the engine"));
    }
    match worker.device_loss().reason() {
        Some(reason) => anyhow::bail!("stopped after a device failure: {reason}"),
        None => Ok(()),
    }
}

/// The worker's parts, as [`serve`] and `vnfarm-worker bench` both run it: metrics, shared
/// encodings, the engine host (loading on its thread from now on), storage with its retries, model
/// hashing (started in the background), the model cache.
pub(crate) async fn assemble(config: Config) -> anyhow::Result<(Worker, engine::EngineLoading)> {
    let metrics = Metrics::new();
    let shared = SharedEncodings::new(
        &config.shared_encodings,
        tokio::runtime::Handle::current(),
        metrics.shared_encodings_total.clone(),
    );
    // The engine loads on its own thread while the worker connects and heartbeats `warming`.
    let (engine, loading) =
        EngineHost::start(config.engine.clone(), shared.clone()).context("starting the engine")?;
    let storage = Storage::open(&config.storage)
        .await
        .context("opening storage")?
        .with_retries(Retries::attempts(config.storage_attempts));
    if let Some(shared) = &shared {
        shared.attach(storage.clone());
    }
    // Hashing the model files takes as long as reading them: in the background, from now on.
    let hashes =
        FileHashes::start(Some(&config.hash_cache_dir)).context("starting model hashing")?;
    hashes.prefetch(config.engine.files().into_iter().map(|f| f.path));
    let model_cache =
        ModelCache::open(&config.model_cache, storage.clone()).context("opening model_cache")?;
    let worker = Worker::new(config, storage, engine, hashes, model_cache, metrics);
    worker
        .metrics()
        .info
        .with_label_values(&[
            worker.id().as_str(),
            worker.engine().name(),
            env!("CARGO_PKG_VERSION"),
        ])
        .set(1);
    Ok((worker, loading))
}
