//! What every vnfarm binary does before its `run`: find the config file, load the typed config or
//! exit 64 naming the field, and start logging. (Signals are `vnfarm_signals`', the metrics
//! registry `vnfarm_metrics`'.)
//!
//! Logs are text, or with `VNFARM_LOG_FORMAT=json` one JSON object a line: the event's fields at the
//! top level, and the spans it is in under `span` (the innermost) and `spans`, so a line about a
//! job carries the `job_id` of its `job` span. The variable is read by the process, not the
//! configuration (logging must be chosen before the configuration is known to be valid, and it is
//! not a setting of the binary's work), so the loader sets it aside like `VNFARM_CONFIG`.

use std::path::PathBuf;

use serde::de::DeserializeOwned;

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

/// The variable that chooses the log format.
pub const LOG_FORMAT_VAR: &str = "VNFARM_LOG_FORMAT";

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// `tracing_subscriber`'s human-readable lines (the default).
    Text,
    /// One JSON object a line.
    Json,
}

impl LogFormat {
    /// `VNFARM_LOG_FORMAT`'s value: unset or `text`, or `json`.
    pub fn parse(value: Option<&str>) -> Result<Self, ConfigError> {
        match value {
            None | Some("text") => Ok(LogFormat::Text),
            Some("json") => Ok(LogFormat::Json),
            Some(other) => Err(ConfigError::invalid(format!(
                "{LOG_FORMAT_VAR}: `{other}` is neither `text` nor `json`"
            ))),
        }
    }
}

/// Loads the binary's config from its file and the process environment with `load`, or exits 64
/// with the error (or with a bad `VNFARM_LOG_FORMAT`); then starts logging in that format (`RUST_LOG`, default `info,lapin=warn`, and lapin's notice of
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
    let format = match LogFormat::parse(std::env::var(LOG_FORMAT_VAR).ok().as_deref()) {
        Ok(format) => format,
        Err(e) => {
            eprintln!("{binary}: configuration error: {e}");
            std::process::exit(EXIT_CONFIG);
        }
    };
    let logs = tracing_subscriber::fmt().with_env_filter(
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| "info,lapin=warn,lapin::returned_messages=error".into()),
    );
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    config
}
