//! Which kernel and layout settings each engine runs, and where they came from.
//!
//! - [`choice`]: an engine's `settings` key in the configuration (a preset's name or a table);
//! - [`file`]: the settings file `vnfarm-worker check` writes, its format and its verification;
//! - [`fingerprint`]: what a file was measured on (device, libtorch build, model files, vnfarm).
//!
//! With `engine.settings_file` set, the file decides every configured engine's settings and the
//! configuration may name none; without it, each engine runs its configured choice, by default
//! the portable preset (the choice is made in [`crate::engine::settings`]). Either way the worker
//! reports what it runs in its heartbeat ([`vnfarm_proto::SettingsInUse`]).

pub mod choice;
pub mod file;
pub mod fingerprint;

use std::path::Path;

pub use choice::SettingsChoice;
pub use file::{BoxSettings, LoadedSettings, SettingsFileError};
use vnfarm_proto::{SettingsInUse, SettingsSource};

/// Sets the variables the settings file (`engine.settings_file`) chose, before libtorch starts
/// (call it first in `main`, before any thread exists). A variable the operator set is left alone and logged, since their
/// word wins over a measurement. Reading errors are left to the engine's load, which reports them.
#[allow(unsafe_code)]
pub fn apply_environment(settings_file: Option<&Path>) -> Vec<String> {
    let Some(path) = settings_file else {
        return Vec::new();
    };
    let Ok(loaded) = BoxSettings::read(path) else {
        return Vec::new();
    };
    let mut notes = Vec::new();
    for (key, value) in &loaded.settings.environment {
        match std::env::var(key) {
            Ok(own) if &own != value => notes.push(format!(
                "{key}={own} is set; the settings file measured {key}={value}"
            )),
            Ok(_) => {}
            Err(_) => {
                // SAFETY: called at the start of `main`, before the async runtime, the engine
                // thread or anything else that could read the environment concurrently exists.
                unsafe { std::env::set_var(key, value) };
                notes.push(format!("{key}={value} (from the settings file)"));
            }
        }
    }
    notes
}

/// What the heartbeat says for a verified file.
pub fn file_in_use(loaded: &LoadedSettings) -> SettingsInUse {
    SettingsInUse {
        source: SettingsSource::Measured,
        id: loaded.id.clone(),
        measured_at: Some(loaded.settings.measured_at),
        warning: loaded.warning.clone(),
    }
}
