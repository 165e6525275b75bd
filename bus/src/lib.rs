//! vnfarm's RabbitMQ plumbing, shared by the scheduler and the worker.
//!
//! # Layout
//!
//! - [`config`]: the `[amqp]` section both binaries read.
//! - [`topology`]: declares exchanges and queues (DESIGN §4) with their limits and dead-lettering.
//! - [`publisher`]: a confirm-mode channel; a publish returns only once the broker has the message.
//! - [`headers`]: reading and writing the message headers vnfarm uses.
//! - [`connect`]: connecting with exponential backoff until shutdown.
//! - [`session`]: the reconnect loop both binaries run: connect, run a *session* (channels,
//!   consumers, helper tasks) until it ends in shutdown or is lost, close, connect again.
//!
//! What a session does is the binary's: [`run_sessions`] hands it each new connection and acts on
//! the [`SessionEnd`] it returns.

pub mod config;
pub mod connect;
pub mod headers;
pub mod publisher;
pub mod session;
pub mod topology;

pub use config::AmqpConfig;
pub use connect::connect_with_backoff;
pub use publisher::{PublishError, Publisher};
pub use session::{SessionEnd, run_sessions};
