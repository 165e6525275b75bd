//! Configuration loading shared by the vnfarm binaries: an optional TOML file, overlaid by environment
//! variables `VNFARM_<SECTION>__<KEY>=value` (`VNFARM_AMQP__URL`, `VNFARM_STORAGE__BUCKET`), decoded
//! into the binary's typed `Config`. The environment is passed in, so tests never touch the process's.
//!
//! Errors name the field (`storage.bucket: missing field`), and binaries exit with status 64
//! (`EX_USAGE`) on them before doing any I/O.

use std::path::Path;

pub mod process;

use serde::de::DeserializeOwned;

/// Exit status for a configuration error (`EX_USAGE` from sysexits.h).
pub const EXIT_CONFIG: i32 = 64;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    pub fn invalid(message: impl Into<String>) -> Self {
        // Validation messages are written as "field.path: what is wrong".
        let message = message.into();
        match message.split_once(": ") {
            Some((field, rest)) => ConfigError::Invalid {
                field: field.to_owned(),
                message: rest.to_owned(),
            },
            None => ConfigError::Invalid {
                field: ".".to_owned(),
                message,
            },
        }
    }
}

/// Loads `T` from `file` (if any) overlaid by the `VNFARM_`-prefixed entries of `env`.
pub fn load<T: DeserializeOwned>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError> {
    let mut table = match file {
        Some(path) => {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: shown.clone(),
                source,
            })?;
            text.parse::<toml::Table>()
                .map_err(|e| ConfigError::Syntax {
                    path: shown,
                    message: e.to_string(),
                })?
        }
        None => toml::Table::new(),
    };
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("VNFARM_") && k.len() > "VNFARM_".len() && !is_reserved(k))
        .collect();
    // By key only, and stable: of a key given twice (an in-process test's list of settings, where
    // a test's own value follows the farm's default) the later one wins, as in a process's
    // environment. Sorting whole pairs made the larger value win, whichever came last.
    overrides.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, value) in overrides {
        let path: Vec<String> = key["VNFARM_".len()..]
            .split("__")
            .map(str::to_lowercase)
            .collect();
        set_path(&mut table, &path, parse_env_value(&value)).map_err(|message| {
            ConfigError::Invalid {
                field: path.join("."),
                message,
            }
        })?;
    }
    serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| ConfigError::Invalid {
        field: e.path().to_string(),
        message: e.into_inner().to_string(),
    })
}

/// A configuration that checks its own bounds after decoding. Messages are written
/// `"field.path: what is wrong"`, so the error names the field.
pub trait Validate {
    fn validate(&self) -> Result<(), String>;
}

/// [`load`], then [`Validate::validate`]: what every binary's `Config::load` does.
pub fn load_validated<T: DeserializeOwned + Validate>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError> {
    let config: T = load(file, env)?;
    config.validate().map_err(ConfigError::invalid)?;
    Ok(config)
}

/// `VNFARM_` variables that are not configuration keys: the config file path, the log format (see
/// [`process`]), the command line's settings, and the test harness's. A user may export them in the same shell as a binary's settings.
fn is_reserved(key: &str) -> bool {
    matches!(
        key,
        "VNFARM_CONFIG" | "VNFARM_URL" | "VNFARM_TOKEN" | process::LOG_FORMAT_VAR
    ) || key.starts_with("VNFARM_TEST_")
}

/// An environment value is read as a TOML value when it is one (`3`, `true`, `["a", "b"]`), else as a string.
fn parse_env_value(value: &str) -> toml::Value {
    let wrapped = format!("v = {value}");
    match wrapped.parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(value.to_owned())),
        Err(_) => toml::Value::String(value.to_owned()),
    }
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty variable name")?;
    let mut node = table;
    for part in parents {
        let entry = node
            .entry(part.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = entry
            .as_table_mut()
            .ok_or_else(|| format!("{part} is not a section"))?;
    }
    node.insert(last.clone(), value);
    Ok(())
}

/// The process's environment as `load` wants it.
pub fn process_env() -> Vec<(String, String)> {
    std::env::vars().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Demo {
        name: String,
        #[serde(default)]
        inner: Inner,
    }

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(default)]
        port: u16,
        #[serde(default)]
        tags: Vec<String>,
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn file_then_environment() {
        let dir = std::env::temp_dir().join(format!("vnfarm-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(&path, "name = \"a\"\n[inner]\nport = 1\n").unwrap();
        let vars = [
            ("VNFARM_INNER__PORT", "8080"),
            ("VNFARM_INNER__TAGS", "[\"x\"]"),
            ("OTHER", "1"),
            ("VNFARM_URL", "http://x"),
            ("VNFARM_LOG_FORMAT", "json"),
        ];
        let got: Demo = load(Some(&path), env(&vars)).unwrap();
        assert_eq!(
            got,
            Demo {
                name: "a".into(),
                inner: Inner {
                    port: 8080,
                    tags: vec!["x".into()]
                }
            }
        );
    }

    #[test]
    fn of_a_key_given_twice_the_later_value_wins() {
        for (first, last) in [("b", "a"), ("a", "b")] {
            let got: Demo =
                load(None, env(&[("VNFARM_NAME", first), ("VNFARM_NAME", last)])).unwrap();
            assert_eq!(got.name, last);
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = load::<Demo>(
            None,
            env(&[("VNFARM_NAME", "a"), ("VNFARM_INNER__PORT", "99999")]),
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("inner.port: "), "{e}");
        let e = load::<Demo>(
            None,
            env(&[("VNFARM_NAME", "a"), ("VNFARM_INNER__COLOUR", "1")]),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("inner.colour: unknown field `colour`"),
            "{e}"
        );
        let e = load::<Demo>(None, env(&[])).unwrap_err();
        assert!(e.to_string().contains("missing field `name`"), "{e}");
    }

    #[test]
    fn the_log_format_is_text_or_json() {
        use process::LogFormat;
        assert_eq!(LogFormat::parse(None).unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::parse(Some("text")).unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::parse(Some("json")).unwrap(), LogFormat::Json);
        let e = LogFormat::parse(Some("yaml")).unwrap_err();
        assert!(e.to_string().starts_with("VNFARM_LOG_FORMAT: "), "{e}");
    }
}
