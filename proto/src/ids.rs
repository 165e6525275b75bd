//! Identifiers: [`JobId`] (UUIDv7, time-ordered) and [`WorkerId`] (a short operator-chosen name).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A job's identity. New ids are UUIDv7, so they sort by creation time.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(transparent)]
pub struct JobId(pub uuid::Uuid);

impl JobId {
    pub fn new() -> Self {
        Self(uuid::Uuid::now_v7())
    }
}

impl Default for JobId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for JobId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        uuid::Uuid::parse_str(s).map(Self)
    }
}

/// A worker's name: 1–64 characters of `[a-z0-9_-]`, so it can sit in a queue name and a metric label.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(String);

impl WorkerId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for WorkerId {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        let ok_char =
            |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        if s.is_empty() || s.len() > 64 || !s.chars().all(ok_char) {
            return Err(format!(
                "worker id {s:?} must be 1-64 characters of [a-z0-9_-]"
            ));
        }
        Ok(Self(s))
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> Self {
        id.0
    }
}

impl FromStr for WorkerId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::try_from(s.to_owned())
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_checked() {
        assert!(WorkerId::from_str("box-1").is_ok());
        assert!(WorkerId::from_str("").is_err());
        assert!(WorkerId::from_str("Box 1").is_err());
        assert!(WorkerId::from_str(&"a".repeat(65)).is_err());
    }

    #[test]
    fn job_ids_sort_by_creation() {
        let a = JobId::new();
        let b = JobId::new();
        assert!(a < b);
        assert_eq!(a, a.to_string().parse().unwrap());
    }
}
