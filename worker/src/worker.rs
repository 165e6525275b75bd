//! The worker's shared state: identity, storage, the engine host, metrics, and the state of the
//! roles, each in a type of its own that keeps its rule: the jobs in hand and the cancellations
//! ([`Hand`]), the lifecycle ([`Lifecycle`]) and the device-loss latch ([`DeviceLoss`]). Cheap to
//! clone (one `Arc`).

use std::ops::Deref;
use std::sync::Arc;

use vnfarm_proto::WorkerId;
use vnfarm_proto::topology::Topology;
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::engine::EngineHost;
use crate::metrics::Metrics;
use crate::provenance::FileHashes;

mod device_loss;
mod hand;
mod lifecycle;

pub use device_loss::DeviceLoss;
pub use hand::Hand;
pub use lifecycle::Lifecycle;

#[derive(Clone)]
pub struct Worker(Arc<Inner>);

pub struct Inner {
    pub config: Config,
    pub id: WorkerId,
    pub topology: Topology,
    pub storage: Storage,
    pub engine: EngineHost,
    /// The sha256 of the model files, for manifests.
    pub hashes: FileHashes,
    pub metrics: Metrics,
    hand: Hand,
    lifecycle: Lifecycle,
    device_loss: DeviceLoss,
}

impl Deref for Worker {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl Worker {
    pub fn new(
        config: Config,
        storage: Storage,
        engine: EngineHost,
        hashes: FileHashes,
        metrics: Metrics,
    ) -> Self {
        let id = config.worker_id();
        let topology = config.amqp.topology();
        Self(Arc::new(Inner {
            config,
            id,
            topology,
            storage,
            engine,
            hashes,
            metrics,
            hand: Hand::default(),
            lifecycle: Lifecycle::default(),
            device_loss: DeviceLoss::default(),
        }))
    }

    /// The jobs of the message in hand, which of them are on the engine, the cancellations.
    pub fn hand(&self) -> &Hand {
        &self.hand
    }

    /// Warming, ready, draining, as the heartbeats say.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// The device-loss latch, set by a job's `DeviceLost` failure.
    pub fn device_loss(&self) -> &DeviceLoss {
        &self.device_loss
    }
}
