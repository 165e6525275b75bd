//! `vnfarm-worker [--config FILE]`: parses configuration, starts logging, runs [`vnfarm_worker::run`].
//! SIGTERM or Ctrl-C drains (the job in hand finishes); a second signal exits at once.
//! `vnfarm-worker check [--config FILE] [--out DIR]` checks and tunes the box instead
//! ([`vnfarm_worker::check`]). `vnfarm-worker bench --config FILE --work FILE --out DIR` runs work
//! messages from a file through the worker without a broker and measures it
//! ([`vnfarm_worker::bench`]).

use std::process::ExitCode;

use vnfarm_config::process;

fn main() -> anyhow::Result<ExitCode> {
    allocator_defaults();
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("check") => return Ok(vnfarm_worker::check::main(&args[1..])),
        Some("bench") => return Ok(vnfarm_worker::bench::main(&args[1..])),
        Some("check-engine") => return Ok(vnfarm_worker::check::engine_main(&args[1..])),
        _ => {}
    }
    let config = process::load_or_exit("vnfarm-worker", vnfarm_worker::Config::load);
    for note in vnfarm_worker::tuning::apply_environment(config.engine.settings_file.as_deref()) {
        tracing::info!("{note}");
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let shutdown = vnfarm_signals::shutdown_on_signals("finishing the job in hand");
            vnfarm_worker::run(config, shutdown).await
        })?;
    Ok(ExitCode::SUCCESS)
}

/// libtorch's GPU caching allocator reads `PYTORCH_CUDA_ALLOC_CONF` once, when it first allocates.
/// Expandable segments cut the SDXL process's peak GPU memory by 15 % at no measured time cost
/// (docs/performance.md), so they are the worker's default; an operator's own setting, even an empty
/// one, is left alone.
#[allow(unsafe_code)]
fn allocator_defaults() {
    if std::env::var_os("PYTORCH_CUDA_ALLOC_CONF").is_none() {
        // SAFETY: this runs first in `main`, before the async runtime, the engine thread or anything
        // else that could read the environment concurrently exists.
        unsafe { std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True") };
    }
}
