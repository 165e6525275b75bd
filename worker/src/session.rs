//! One broker session: connect, declare, consume the worker's queue and the cancel fan-out, heartbeat,
//! and handle deliveries one at a time until shutdown or until the connection is lost.

use std::time::Duration;

use futures::StreamExt;
use lapin::Connection;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;
use vnfarm_bus::publisher::json_properties;
use vnfarm_bus::{PublishError, Publisher, topology};
use vnfarm_proto::topology::{CANCEL_ROUTING_KEY, heartbeat_routing_key};
use vnfarm_proto::{CancelRequest, Heartbeat, WorkerState, decode_json};

use crate::worker::Worker;

pub enum SessionEnd {
    Shutdown,
    Lost(String),
}

impl Worker {
    pub(crate) async fn session(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        match self.session_inner(connection, shutdown).await {
            Ok(end) => end,
            Err(e) => SessionEnd::Lost(e.to_string()),
        }
    }

    async fn session_inner(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let publisher = Publisher::open(connection).await?;
        let channel = connection.create_channel().await?;
        topology::declare_core(&channel, &self.config.amqp).await?;
        let queue = topology::declare_worker_queue(&channel, &self.config.amqp, &self.id).await?;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await?;
        let mut jobs = channel
            .basic_consume(
                queue.as_str().into(),
                format!("worker-{}", self.id).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;

        // Cancellations fan out to every worker through a private, auto-deleted queue.
        let mut cancels = vnfarm_bus::topology::subscribe_private(
            connection,
            &self.topology.events_exchange(),
            CANCEL_ROUTING_KEY,
            "cancels",
        )
        .await?;
        let session_done = CancellationToken::new();
        let _stop_helpers = session_done.clone().drop_guard();
        {
            let this = self.clone();
            let done = session_done.clone();
            tokio::spawn(async move {
                loop {
                    let next =
                        tokio::select! { _ = done.cancelled() => break, n = cancels.next() => n };
                    let Some(Ok(delivery)) = next else { break };
                    match decode_json::<CancelRequest>(&delivery.data) {
                        Ok(req) => {
                            tracing::info!(job_id = %req.job_id, "cancel requested");
                            this.cancel(req.job_id);
                        }
                        Err(e) => tracing::warn!(error = %e, "ignoring a malformed cancel request"),
                    }
                }
            });
        }
        {
            let this = self.clone();
            let publisher = publisher.clone();
            let done = session_done.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval(Duration::from_millis(this.config.heartbeat_interval_ms));
                let mut draining = false;
                loop {
                    tokio::select! {
                        _ = done.cancelled() => break,
                        _ = tick.tick() => {}
                        // Say "draining" the moment shutdown starts, so no new job is sent here.
                        _ = shutdown.cancelled(), if !draining => {
                            draining = true;
                            this.set_state(WorkerState::Draining);
                        }
                    }
                    if let Err(e) = this.heartbeat(&publisher).await {
                        tracing::debug!(error = %e, "heartbeat not delivered");
                    }
                }
            });
        }

        self.metrics.amqp_connected.set(1);
        tracing::info!(worker = %self.id, queue, engine = self.engine.name(), "worker ready");
        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    self.set_state(WorkerState::Draining);
                    // Tell the scheduler at once, so it stops sending jobs here.
                    let _ = self.heartbeat(&publisher).await;
                    return Ok(SessionEnd::Shutdown);
                }
                next = jobs.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    if let Err(lost) = self.handle(&publisher, delivery).await {
                        return Ok(SessionEnd::Lost(lost.to_string()));
                    }
                }
                Some(Err(e)) => return Ok(SessionEnd::Lost(e.to_string())),
                None => return Ok(SessionEnd::Lost("consumer cancelled by the broker".into())),
            }
        }
    }

    pub(crate) async fn heartbeat(&self, publisher: &Publisher) -> Result<(), PublishError> {
        let running = self.running();
        let beat = Heartbeat {
            worker: self.id.clone(),
            state: self.state(),
            models: self.engine.models().to_vec(),
            slots: u32::from(self.config.prefetch),
            in_flight: u32::from(running.is_some()),
            running,
            gpu_memory_bytes: None,
            encode_cache: self.engine.encode_cache_keys(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            at: chrono::Utc::now(),
        };
        let props = json_properties().with_delivery_mode(1);
        match publisher
            .publish_json(
                &self.topology.events_exchange(),
                &heartbeat_routing_key(&self.id),
                &beat,
                props,
            )
            .await
        {
            // No scheduler listening right now is not an error for a heartbeat.
            Err(PublishError::Unroutable { .. }) => Ok(()),
            other => other,
        }
    }
}
