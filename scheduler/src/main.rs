//! `vnfarm-scheduler [--config FILE]`: parses configuration, starts logging, runs [`vnfarm_scheduler::run`].
//! SIGTERM or Ctrl-C stops it; a second signal exits at once.

use vnfarm_config::process;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = process::load_or_exit("vnfarm-scheduler", vnfarm_scheduler::Config::load);
    let shutdown = vnfarm_signals::shutdown_on_signals("stopping");
    vnfarm_scheduler::run(config, shutdown).await
}
