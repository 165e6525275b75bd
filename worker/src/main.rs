//! `vnfarm-worker [--config FILE]`: parses configuration, starts logging, runs [`vnfarm_worker::run`].
//! SIGTERM or Ctrl-C drains (the job in hand finishes); a second signal exits at once.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;
use vnfarm_worker::Config;

fn config_path() -> Option<PathBuf> {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next()) {
        (Some("--config"), Some(path)) => Some(PathBuf::from(path)),
        (None, _) => std::env::var_os("VNFARM_CONFIG").map(PathBuf::from),
        _ => {
            eprintln!(
                "usage: vnfarm-worker [--config FILE]   (or VNFARM_CONFIG=FILE; VNFARM_<SECTION>__<KEY> overrides)"
            );
            std::process::exit(vnfarm_config::EXIT_CONFIG);
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = match Config::load(config_path().as_deref(), vnfarm_config::process_env()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("vnfarm-worker: configuration error: {e}");
            std::process::exit(vnfarm_config::EXIT_CONFIG);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=warn".into()),
        )
        .init();
    let shutdown = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone()));
    vnfarm_worker::run(config, shutdown).await
}

async fn signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("shutdown requested: finishing the job in hand (signal again to exit now)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::warn!("second signal: exiting now");
    std::process::exit(1);
}
