//! vnfarm scheduler: the HTTP API, the intake consumer, dispatch to workers, the live job registry
//! and the event fan-out (DESIGN §2).
//!
//! # Layout
//!
//! - [`config`]: the typed configuration, validated before any I/O.
//! - [`registry`]: jobs and workers as a projection of the event stream, with the indexes the
//!   decisions use; encapsulated (changed only by applying events and by the decision methods), a
//!   job only through the one update function of `registry/store.rs`. The dispatch policy is
//!   `registry/plan.rs`; terms, follow-ups and cancel `registry/follow_ups.rs`.
//! - [`replica`]: `Replica`, the copy of the stream every scheduler keeps: the registry behind its
//!   lock, the SSE broadcast, the notify submitters wait on, the ready flag, the markers (publishing
//!   one, waiting to read it back); applying an event.
//! - [`intake`]: accepting a submission (inline images, the one `queued` event, idempotency), the
//!   intake consumer and handling one intake delivery; a pipeline's jobs are derived by
//!   [`vnfarm_proto::pipeline_jobs`].
//! - [`dispatch`]: the dispatcher loop: publishing follow-ups and the policy's work messages, the
//!   redispatch consumer and returned jobs, the watchdog.
//! - [`dead_letters`]: the dead-letter watch: an event for what the broker dead-lettered itself.
//! - [`leader`]: active and standby schedulers: the leader token, a term's start, and
//!   `Leadership` (the active flag, its gauge, the term's number).
//! - [`snapshot`]: registry snapshots, so a restart replays only recent events: `SnapshotWriter`
//!   (the events owed a snapshot, writing one) and loading the latest.
//! - [`scheduler`]: the handle every role is given, no field public, and what every scheduler
//!   does: publish, cancel, gauges.
//! - [`session`]: one broker connection's life: load, replay, then read and lead concurrently; the
//!   active work it hands leadership.
//! - [`queue`]: queue control: pausing and resuming the farm or a person's work, moving a job to
//!   the front (people's events, read back before answering); fair share itself is part of the
//!   registry (`registry/shares.rs`, `registry/plan.rs`).
//! - [`tokens`]: making and revoking people's tokens (their events, read back before answering);
//!   people themselves are part of the registry (`registry/people.rs`).
//! - [`api`]: the HTTP API, Server-Sent Events, uploads, signed image URLs, the OpenAPI document
//!   and the web page (`web/`); it encodes the contract types of [`vnfarm_proto::http`], a job's
//!   view built in `api/jobs.rs`.
//! - [`images`]: input images verified by decoding within limits; thumbnails.
//! - [`metrics`]: Prometheus metrics.
//!
//! Durable state lives in RabbitMQ only: the event stream is the job history and the backlog, the
//! snapshot stream a shortcut into it. A restarted scheduler loads the latest snapshot, replays the
//! events after it and carries on where the last one stopped; a standby does the same continuously
//! and takes over when the active one dies.

pub mod api;
pub mod config;
pub mod dead_letters;
pub mod dispatch;
pub mod images;
pub mod intake;
pub mod leader;
pub mod metrics;
pub mod names;
pub mod queue;
pub mod registry;
pub mod replica;
pub mod scheduler;
pub mod session;
pub mod snapshot;
pub mod tokens;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use vnfarm_storage::Storage;

pub use config::Config;
use metrics::Metrics;
pub use scheduler::Scheduler;

pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    serve(config, listener, shutdown).await
}

/// [`run`] on an already bound listener. The end-to-end tests' in-process farm
/// (`tests/in_process.rs`, for the tests that kill nothing) calls it on a listener it bound itself;
/// the tests that kill or signal a scheduler run the binary, which calls [`run`].
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let storage = Storage::open(&config.storage)
        .await
        .context("opening storage")?;
    let scheduler = Scheduler::new(config, storage, Metrics::new(), shutdown.clone());
    let addr = listener.local_addr()?;
    let server = {
        let app = api::router(scheduler.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        })
    };
    tracing::info!(%addr, storage = %scheduler.storage().describe(), "scheduler listening");
    let metrics = scheduler.metrics().clone();
    let this = &scheduler;
    let stop = &shutdown;
    vnfarm_bus::run_sessions(
        &scheduler.config().amqp,
        "vnfarm-scheduler",
        &shutdown,
        || metrics.amqp_reconnects_total.inc(),
        move |connection| async move { this.session(&connection, stop).await },
    )
    .await;
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "the HTTP server failed"),
        Err(e) => tracing::error!(error = %e, "the HTTP server task panicked"),
    }
    tracing::info!("scheduler stopped");
    Ok(())
}
