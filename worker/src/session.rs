//! One broker session (run by [`vnfarm_bus::run_sessions`]): declare, consume the control fan-out
//! (cancels, yields),
//! heartbeat (from the start, so a worker still loading its engine is seen `warming`), consume the
//! worker's queue once the engine is ready, and handle deliveries (up to `prefetch` at once, so that
//! fetching, encoding and storing overlap the engine's runs) until shutdown or
//! until the connection, a channel or a consumer fails. A helper task that fails reports it to the
//! session, which then ends as lost, so nothing keeps running on half a session.

use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::Connection;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher, SessionEnd, topology};
use vnfarm_proto::topology::{CANCEL_ROUTING_KEY, YIELD_ROUTING_KEY, heartbeat_routing_key};
use vnfarm_proto::{CancelRequest, Heartbeat, YieldRequest, decode_json};

use crate::worker::Worker;

impl Worker {
    pub(crate) async fn session(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        let end = match self.session_inner(connection, shutdown).await {
            Ok(end) => end,
            Err(e) => SessionEnd::Lost(e.to_string()),
        };
        self.metrics().amqp_connected.set(0);
        end
    }

    async fn session_inner(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let publisher = Publisher::open(connection)
            .await?
            .with_confirm_timeout(self.config().amqp.confirm_timeout());
        let channel = connection.create_channel().await?;
        // Where the broker user may configure only this worker's own queue, the scheduler alone
        // declares the shared topology (`amqp.declare_topology`).
        if self.config().amqp.declare_topology {
            topology::declare_core(&channel, &self.config().amqp).await?;
        }
        let queue =
            topology::declare_worker_queue(&channel, &self.config().amqp, self.id()).await?;

        // Cancellations and yield requests fan out to every worker through a private,
        // auto-deleted queue.
        let mut cancels = vnfarm_bus::topology::subscribe_private_keys(
            connection,
            &self.topology().events_exchange(),
            &[CANCEL_ROUTING_KEY, YIELD_ROUTING_KEY],
            "control",
        )
        .await?;
        let session_done = CancellationToken::new();
        let _stop_helpers = session_done.clone().drop_guard();
        // Helper tasks that fail send why here; the session then ends as lost. When both helpers
        // have stopped, `recv` answers `None` and that `select!` branch is disabled.
        let (helper_lost, mut lost) = tokio::sync::mpsc::channel::<String>(2);
        {
            let this = self.clone();
            let done = session_done.clone();
            let helper_lost = helper_lost.clone();
            tokio::spawn(async move {
                let reason = loop {
                    let next =
                        tokio::select! { _ = done.cancelled() => return, n = cancels.next() => n };
                    let delivery = match next {
                        Some(Ok(delivery)) => delivery,
                        Some(Err(e)) => break format!("cancel consumer failed: {e}"),
                        None => break "cancel consumer cancelled by the broker".to_owned(),
                    };
                    if delivery.routing_key.as_str() == YIELD_ROUTING_KEY {
                        match decode_json::<YieldRequest>(&delivery.data) {
                            Ok(req) if &req.worker == this.id() => {
                                let in_hand = this.hand().yield_jobs(&req.jobs);
                                tracing::info!(
                                    jobs = req.jobs.len(),
                                    in_hand,
                                    "the scheduler asks for unstarted jobs back"
                                );
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "ignoring a malformed yield request")
                            }
                        }
                        continue;
                    }
                    match decode_json::<CancelRequest>(&delivery.data) {
                        Ok(req) => {
                            tracing::info!(job_id = %req.job_id, "cancel requested");
                            this.hand().cancel(req.job_id);
                        }
                        Err(e) => tracing::warn!(error = %e, "ignoring a malformed cancel request"),
                    }
                };
                // Without this consumer, cancels would silently stop arriving.
                tracing::warn!(%reason, "cancellations no longer arrive; ending the session");
                report_lost(&helper_lost, reason).await;
            });
        }
        {
            let this = self.clone();
            let publisher = publisher.clone();
            let done = session_done.clone();
            let shutdown = shutdown.clone();
            let helper_lost = helper_lost.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(
                    this.config().heartbeat_interval_ms,
                ));
                let mut draining = false;
                let mut announced_ready = false;
                loop {
                    tokio::select! {
                        _ = done.cancelled() => break,
                        _ = tick.tick() => {}
                        // Say "draining" the moment shutdown starts, so no new job is sent here.
                        _ = shutdown.cancelled(), if !draining => {
                            draining = true;
                            this.lifecycle().drain();
                        }
                        // Say "ready" the moment the engine is.
                        _ = this.lifecycle().warm(), if !announced_ready => {
                            announced_ready = true;
                        }
                    }
                    match this.heartbeat(&publisher).await {
                        Ok(()) => {}
                        // The broker refused this one (a resource alarm): the next may pass, and the
                        // scheduler tolerates missed beats up to its heartbeat timeout. (`heartbeat`
                        // already answers `Ok` for an unroutable beat.)
                        Err(
                            e @ (PublishError::Nacked { .. } | PublishError::Unroutable { .. }),
                        ) => {
                            tracing::warn!(worker = %this.id(), error = %e, "heartbeat refused by the broker");
                        }
                        Err(
                            e @ (PublishError::Broker(_)
                            | PublishError::ConfirmTimeout { .. }
                            | PublishError::Untrusted { .. }),
                        ) => {
                            // The publishing channel is gone (or stopped confirming), and with it
                            // every event this session could send: reconnect now rather than at
                            // the next job.
                            tracing::warn!(worker = %this.id(), error = %e, "heartbeat not delivered; ending the session");
                            report_lost(&helper_lost, format!("heartbeat: {e}")).await;
                            return;
                        }
                    }
                }
            });
        }
        drop(helper_lost);
        self.metrics().amqp_connected.set(1);

        // Jobs only once the engine is warm; until then the heartbeats say `warming`.
        if !self.lifecycle().is_warm() {
            tracing::info!(worker = %self.id(), engine = self.engine().name(), "connected; the engine is warming up");
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(self.announce_draining(&publisher).await),
            Some(reason) = lost.recv() => return Ok(SessionEnd::Lost(reason)),
            _ = self.lifecycle().warm() => {}
        }
        channel
            .basic_qos(self.config().prefetch, BasicQosOptions::default())
            .await?;
        let mut jobs = channel
            .basic_consume(
                queue.as_str().into(),
                format!("worker-{}", self.id()).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(worker = %self.id(), queue, engine = self.engine().name(), "worker ready");
        // Up to `prefetch` deliveries are handled at once: while one message runs on the engine,
        // the next one's inputs are fetched and decoded (its runs then wait on the engine's
        // channel) and the last one's outputs are encoded and stored. The broker hands no more
        // than that many unacked, so memory stays bounded by it.
        let limit = usize::from(self.config().prefetch);
        let mut in_flight: FuturesUnordered<_> = FuturesUnordered::new();
        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    // The messages in hand finish (or are interrupted past the grace period).
                    while let Some(handled) = in_flight.next().await {
                        let handled: Result<(), crate::job::Lost> = handled;
                        if let Err(lost) = handled {
                            return Ok(SessionEnd::Lost(lost.to_string()));
                        }
                    }
                    return Ok(self.announce_draining(&publisher).await);
                }
                // A helper's failure is taken between messages, as when one was handled at a time.
                Some(reason) = lost.recv(), if in_flight.is_empty() => {
                    return Ok(SessionEnd::Lost(reason));
                }
                Some(handled) = in_flight.next(), if !in_flight.is_empty() => {
                    if let Err(lost) = handled {
                        return Ok(SessionEnd::Lost(lost.to_string()));
                    }
                    continue;
                }
                next = jobs.next(), if in_flight.len() < limit => next,
            };
            match next {
                Some(Ok(delivery)) => in_flight.push(self.handle(&publisher, delivery)),
                Some(Err(e)) => return Ok(SessionEnd::Lost(e.to_string())),
                None => return Ok(SessionEnd::Lost("consumer cancelled by the broker".into())),
            }
        }
    }

    /// Shutdown: tell the scheduler at once, so it stops sending jobs here. If that fails the
    /// scheduler learns it from the missing heartbeats instead; shutdown goes on.
    async fn announce_draining(&self, publisher: &Publisher) -> SessionEnd {
        self.lifecycle().drain();
        if let Err(e) = self.heartbeat(publisher).await {
            tracing::warn!(worker = %self.id(), error = %e, "could not announce draining");
        }
        SessionEnd::Shutdown
    }

    pub(crate) async fn heartbeat(&self, publisher: &Publisher) -> Result<(), PublishError> {
        let beat = self.describe().await;
        self.metrics().set_state(beat.state);
        self.metrics().account_busy(std::time::Instant::now());
        if let Some(memory) = &beat.gpu_memory {
            let gauge = &self.metrics().gpu_memory_bytes;
            gauge
                .with_label_values(&["total"])
                .set(saturating_i64(memory.total_bytes));
            gauge
                .with_label_values(&["free"])
                .set(saturating_i64(memory.free_bytes));
        }
        let props = json_properties().with_delivery_mode(1);
        // No scheduler listening right now is not an error for a heartbeat.
        publisher
            .broadcast_json(
                &self.topology().events_exchange(),
                &heartbeat_routing_key(self.id()),
                &beat,
                props,
            )
            .await
    }

    /// What the heartbeat says: the state, what the engine serves and holds, and the jobs here.
    pub(crate) async fn describe(&self) -> Heartbeat {
        let this = self.clone();
        // A device query and a folder listing, however quick, are not made on the async runtime.
        let (gpu_memory, loras) = tokio::task::spawn_blocking(move || {
            (this.engine().gpu_memory(), this.engine().lora_names())
        })
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading the GPU's memory and the LoRA folders failed");
            (None, None)
        });
        let in_hand = self.hand().jobs();
        Heartbeat {
            schema_version: vnfarm_proto::PROTOCOL_VERSION,
            protocols: crate::job::protocols(),
            worker: self.id().clone(),
            state: self.lifecycle().state(),
            models: self.engine().models().to_vec(),
            slots: u32::from(self.config().prefetch),
            in_flight: u32::try_from(in_hand.len()).unwrap_or(u32::MAX),
            running: self.hand().running(),
            holding: Some(in_hand),
            model_cache: Some(self.model_cache().hashes()),
            loras,
            checkpoints: self.engine().checkpoints().to_vec(),
            catalogue_checkpoints: Some(self.engine().catalogue_checkpoints()).filter(|n| *n > 0),
            max_batch: self.config().batch_jobs,
            gpu_memory,
            encode_cache: self.engine().encode_cache_keys(),
            settings: self.engine().settings(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            at: chrono::Utc::now(),
        }
    }
}

fn saturating_i64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// Tells the session that a helper task failed. The send fails only when the session is already
/// over (it dropped the receiver), and then there is nobody left to tell.
async fn report_lost(to: &tokio::sync::mpsc::Sender<String>, reason: String) {
    if to.send(reason).await.is_err() {
        tracing::debug!("session already over; not reporting a helper failure");
    }
}
