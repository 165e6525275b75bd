//! SIGTERM and Ctrl-C as a cancellation: every vnfarm binary's `run` takes a shutdown token
//! (drain on the first signal), and a second signal exits at once.

use tokio_util::sync::CancellationToken;

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
