//! vnfarm's RabbitMQ plumbing, shared by the scheduler and the worker.
//!
//! # Layout
//!
//! - [`config`]: the `[amqp]` section both binaries read.
//! - [`topology`]: declares exchanges and queues (DESIGN §4) with their limits and dead-lettering.
//! - [`publisher`]: a confirm-mode channel; a publish returns only once the broker has the message.
//! - [`headers`]: reading and writing the message headers vnfarm uses.
//! - [`connect`]: connecting with exponential backoff until shutdown.
//!
//! Reconnection policy lives in the binaries: each runs a *session* (connection, channels, consumers)
//! until the connection fails, then connects again with backoff and re-declares the topology.

pub mod config;
pub mod connect;
pub mod headers;
pub mod publisher;
pub mod topology;

pub use config::AmqpConfig;
pub use connect::connect_with_backoff;
pub use publisher::{PublishError, Publisher};
