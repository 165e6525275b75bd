//! What every vnfarm binary does before and around its `run`: find the config file, load the typed
//! config or exit 64 naming the field, start logging, turn SIGTERM / Ctrl-C into a cancellation
//! (a second signal exits at once), and serve its Prometheus metrics.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::{ConfigError, EXIT_CONFIG};

/// `--config FILE`, else `VNFARM_CONFIG`; anything else prints usage and exits 64.
pub fn config_path(binary: &str) -> Option<PathBuf> {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next()) {
        (Some("--config"), Some(path)) => Some(PathBuf::from(path)),
        (None, _) => std::env::var_os("VNFARM_CONFIG").map(PathBuf::from),
        _ => {
            eprintln!(
                "usage: {binary} [--config FILE]   (or VNFARM_CONFIG=FILE; VNFARM_<SECTION>__<KEY> overrides)"
            );
            std::process::exit(EXIT_CONFIG);
        }
    }
}

/// Loads the binary's config from its file and the process environment with `load`, or exits 64
/// with the error; then starts logging (`RUST_LOG`, default `info,lapin=warn`, and lapin's notice of
/// every returned message silenced: the publisher reports an unroutable message itself, through the
/// confirm, and a heartbeat nobody listens to is normal).
pub fn load_or_exit<T: DeserializeOwned>(
    binary: &str,
    load: impl FnOnce(Option<&std::path::Path>, Vec<(String, String)>) -> Result<T, ConfigError>,
) -> T {
    let config = match load(config_path(binary).as_deref(), crate::process_env()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{binary}: configuration error: {e}");
            std::process::exit(EXIT_CONFIG);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=warn,lapin::returned_messages=error".into()),
        )
        .init();
    config
}

/// A token cancelled on the first SIGTERM or SIGINT (logging `on_first`); the second exits at once.
pub fn shutdown_on_signals(on_first: &'static str) -> CancellationToken {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("shutdown requested: {on_first} (signal again to exit now)");
        token.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::warn!("second signal: exiting now");
        std::process::exit(1);
    });
    shutdown
}

/// The registry a binary's metrics live in: every name gets the `vnfarm_` prefix.
pub fn metrics_registry() -> prometheus::Registry {
    prometheus::Registry::new_custom(Some("vnfarm".into()), None)
        .expect("the prefix 'vnfarm' is a valid metric name")
}

/// `registry` in the Prometheus text format, for `/metrics`.
pub fn render_metrics(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .expect("text encoding into a Vec cannot fail");
    String::from_utf8(buf).expect("the Prometheus text format is UTF-8")
}
