//! The handle every role of the worker is given (session, job, execute, the HTTP endpoints): the
//! configuration, identity, storage, engine host, hashes, model cache and metrics, and the state of the roles,
//! each in a type of its own that keeps its rule: the jobs in hand and the cancellations
//! ([`Hand`], `worker/hand.rs`), the lifecycle ([`Lifecycle`], `worker/lifecycle.rs`) and the
//! device-loss latch ([`DeviceLoss`], `worker/device_loss.rs`). No field is public and there is no
//! `Deref`: a role reaches each part through its accessor. Cheap to clone (one `Arc`).

use std::sync::Arc;

use vnfarm_proto::WorkerId;
use vnfarm_proto::topology::Topology;
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::engine::EngineHost;
use crate::metrics::Metrics;
use crate::model_cache::ModelCache;
use crate::provenance::FileHashes;

mod device_loss;
mod hand;
mod lifecycle;

pub use device_loss::DeviceLoss;
pub use hand::Hand;
pub use lifecycle::Lifecycle;

#[derive(Clone)]
pub struct Worker(Arc<Parts>);

struct Parts {
    config: Config,
    id: WorkerId,
    topology: Topology,
    storage: Storage,
    engine: EngineHost,
    hashes: FileHashes,
    model_cache: ModelCache,
    metrics: Metrics,
    hand: Hand,
    lifecycle: Lifecycle,
    device_loss: DeviceLoss,
}

impl Worker {
    pub fn new(
        config: Config,
        storage: Storage,
        engine: EngineHost,
        hashes: FileHashes,
        model_cache: ModelCache,
        metrics: Metrics,
    ) -> Self {
        let id = config.worker_id();
        let topology = config.amqp.topology();
        Self(Arc::new(Parts {
            config,
            id,
            topology,
            storage,
            engine,
            hashes,
            model_cache,
            metrics,
            hand: Hand::default(),
            lifecycle: Lifecycle::default(),
            device_loss: DeviceLoss::default(),
        }))
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }

    pub fn id(&self) -> &WorkerId {
        &self.0.id
    }

    /// The broker names this worker's configuration gives.
    pub fn topology(&self) -> &Topology {
        &self.0.topology
    }

    pub fn storage(&self) -> &Storage {
        &self.0.storage
    }

    pub fn engine(&self) -> &EngineHost {
        &self.0.engine
    }

    /// The sha256 of the model files, for manifests.
    pub fn hashes(&self) -> &FileHashes {
        &self.0.hashes
    }

    /// The catalogue files fetched for jobs.
    pub fn model_cache(&self) -> &ModelCache {
        &self.0.model_cache
    }

    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// The jobs of the message in hand, which of them are on the engine, the cancellations.
    pub fn hand(&self) -> &Hand {
        &self.0.hand
    }

    /// Warming, ready, draining, as the heartbeats say.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.0.lifecycle
    }

    /// The device-loss latch, set by a job's `DeviceLost` failure.
    pub fn device_loss(&self) -> &DeviceLoss {
        &self.0.device_loss
    }
}
