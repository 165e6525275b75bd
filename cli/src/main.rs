//! `vnfarm`, the render farm's command line: parses the arguments, runs the command, maps the
//! result to an exit status (0 done, 1 failed, 2 usage error as clap reports it).
//!
//! # Layout
//!
//! - [`args`]: the grammar (commands, flags, defaults).
//! - [`values`]: what one flag's value means (`--input`, `--lora`, `--upscale`, `--scale`).
//! - [`submission`]: flags → a `vnfarm_proto::Submission`.
//! - [`client`]: the scheduler's HTTP API and its error shapes.
//! - [`watch`]: following a job (its events) or a pipeline (polling) to the end.
//! - [`fetch`]: downloading output images.
//! - [`models`]: the model catalogue in the bucket (`vnfarm models push|list`).
//! - [`commands`]: dispatch, and the small commands.
//! - [`table`]: the listings' columns.

mod args;
mod client;
mod commands;
mod fetch;
mod models;
mod submission;
mod table;
mod values;
mod watch;

use std::process::ExitCode;

use clap::Parser as _;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = args::Cli::parse();
    match commands::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
