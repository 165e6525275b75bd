//! `vnfarm-worker [--config FILE]`: parses configuration, starts logging, runs [`vnfarm_worker::run`].
//! SIGTERM or Ctrl-C drains (the job in hand finishes); a second signal exits at once.

use vnfarm_config::process;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = process::load_or_exit("vnfarm-worker", vnfarm_worker::Config::load);
    let shutdown = process::shutdown_on_signals("finishing the job in hand");
    vnfarm_worker::run(config, shutdown).await
}
