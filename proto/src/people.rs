//! People and their keys (DESIGN §7a, "People and keys"): the roles, what each role may do, and the
//! events that give a person an API token and take it away.
//!
//! A person's cancel of a job already on a worker is one of these events too (`cancel_requested`),
//! since that job's `cancelled` comes from its worker and cannot name them; so are the queue's
//! controls (DESIGN §7a, "Fair share and queue control"): pausing and resuming the farm or one
//! person's work, and moving a waiting job to the front, each by the person who did it.
//!
//! A person is a name with one role and at most one live token. The token itself never travels
//! after the answer that shows it once: the events carry its SHA-256, so the event stream (and
//! every snapshot) holds nothing that opens the API. Token events share the job events' stream
//! under routing keys of their own (`people.<name>.<event>`), so every scheduler, active or
//! standby, rebuilds the same people from it, and one that reads the stream from a snapshot gets
//! them from the snapshot. A scheduler built before people existed skips them as events it cannot
//! decode.

use std::fmt;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::JobId;
use crate::topology::PEOPLE_ROUTING_PREFIX;

/// The owner of every job no person's token submitted: jobs sent with the configuration's single
/// `api_token`, without a token to a loopback scheduler that has none, or through the intake queue
/// (whose publishers hold broker credentials), and jobs recorded before owners were. Also the name
/// the legacy token acts as, so no person may take it.
pub const ADMIN: &str = "admin";

/// What a person may do; each role includes the ones before it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Submits, uploads, and sees and cancels their own jobs.
    Artist,
    /// An artist who also sees and cancels everyone's jobs, reorders the queue and pauses a
    /// person's work.
    Lead,
    /// A lead who also makes and revokes tokens and pauses the whole farm.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Artist, Role::Lead, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Artist => "artist",
            Role::Lead => "lead",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    pub fn grants(self, permission: Permission) -> bool {
        self >= permission.least_role()
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing a route or a decision may need. A 403 names the permission and the roles that
/// hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Permission {
    /// Submit jobs and upload input images.
    Submit,
    /// Read the farm: one's own jobs, the fleet, the schema and the metrics.
    Read,
    /// Read every person's jobs and their events.
    SeeAll,
    /// Cancel one's own jobs.
    CancelOwn,
    /// Cancel anyone's jobs.
    CancelAny,
    /// Move a waiting job in the queue.
    Reorder,
    /// Pause and resume one person's work.
    PausePerson,
    /// Pause and resume the whole farm.
    PauseFarm,
    /// Create, list and revoke tokens.
    Tokens,
    /// Add a LoRA to the model catalogue under a new name (`POST /v1/models/loras`). Replacing
    /// what a name points at is left to `vnfarm models push`, which needs the bucket's keys.
    PushLoras,
}

impl Permission {
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::Submit => "submit",
            Permission::Read => "read",
            Permission::SeeAll => "see_all",
            Permission::CancelOwn => "cancel_own",
            Permission::CancelAny => "cancel_any",
            Permission::Reorder => "reorder",
            Permission::PausePerson => "pause_person",
            Permission::PauseFarm => "pause_farm",
            Permission::Tokens => "tokens",
            Permission::PushLoras => "push_loras",
        }
    }

    /// The least role that holds it (the roles after it hold it too).
    pub fn least_role(self) -> Role {
        match self {
            Permission::Submit
            | Permission::Read
            | Permission::CancelOwn
            | Permission::PushLoras => Role::Artist,
            Permission::SeeAll
            | Permission::CancelAny
            | Permission::Reorder
            | Permission::PausePerson => Role::Lead,
            Permission::PauseFarm | Permission::Tokens => Role::Admin,
        }
    }

    /// The roles that hold it, in words (`lead or admin`).
    pub fn roles(self) -> String {
        Role::ALL
            .into_iter()
            .filter(|r| r.grants(self))
            .map(Role::as_str)
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

/// Whether `name` may name a person: `[a-z0-9][a-z0-9_-]{0,63}`, and not [`ADMIN`]. The error
/// says what is wrong.
pub fn check_name(name: &str) -> Result<(), String> {
    let first = name.chars().next();
    let ok = (1..=64).contains(&name.len())
        && first.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if !ok {
        return Err(format!(
            "{name:?} is not a person's name: 1-64 of a-z, 0-9, `_` and `-`, starting with a letter or digit"
        ));
    }
    if name == ADMIN {
        return Err(format!(
            "{ADMIN:?} is the configuration's api_token; give the person another name"
        ));
    }
    Ok(())
}

/// A change to one person's token, as published to the event exchange and kept in the event
/// stream (under `people.<person>.<event>`). Like job events, not `deny_unknown_fields`: a newer
/// writer's extra field is harmless to an older reader.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PersonEvent {
    /// The protocol version it is written in.
    pub schema_version: u32,
    pub person: String,
    pub at: DateTime<Utc>,
    #[serde(flatten)]
    pub kind: PersonEventKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum PersonEventKind {
    /// The person's token, from now on: the one before it (if any) no longer opens the API.
    TokenCreated {
        role: Role,
        /// SHA-256 of the token, hex. Tokens are 32 random bytes, so a plain hash cannot be
        /// reversed by guessing.
        token_sha256: String,
        /// Who made it.
        by: String,
    },
    /// The person's token no longer opens the API.
    TokenRevoked {
        by: String,
    },
    /// The person asked for a job on a worker to be cancelled. The worker writes the job's
    /// `cancelled` event, from a version 1 control message that cannot name the person, so who
    /// asked is recorded here, where every scheduler reads it.
    CancelRequested {
        job_id: JobId,
    },
    /// The person paused the whole farm: nothing more is dispatched until someone resumes it;
    /// running jobs finish and waiting ones keep their places.
    FarmPaused,
    FarmResumed,
    /// The person paused `whose` work: none of it is dispatched until resumed; their running
    /// jobs finish.
    WorkPaused {
        whose: String,
    },
    WorkResumed {
        whose: String,
    },
    /// The person moved a waiting job to the front of its class (interactive or batch), ahead
    /// of every person's turn; the latest move goes first.
    MovedToFront {
        job_id: JobId,
    },
}

impl PersonEvent {
    pub fn now(person: impl Into<String>, kind: PersonEventKind) -> Self {
        Self {
            schema_version: crate::PROTOCOL_VERSION,
            person: person.into(),
            at: Utc::now(),
            kind,
        }
    }

    /// Routing key on the event exchange: `people.<person>.<event>`.
    pub fn routing_key(&self) -> String {
        let event = match self.kind {
            PersonEventKind::TokenCreated { .. } => "token_created",
            PersonEventKind::TokenRevoked { .. } => "token_revoked",
            PersonEventKind::CancelRequested { .. } => "cancel_requested",
            PersonEventKind::FarmPaused => "farm_paused",
            PersonEventKind::FarmResumed => "farm_resumed",
            PersonEventKind::WorkPaused { .. } => "work_paused",
            PersonEventKind::WorkResumed { .. } => "work_resumed",
            PersonEventKind::MovedToFront { .. } => "moved_to_front",
        };
        format!("{PEOPLE_ROUTING_PREFIX}.{}.{event}", self.person)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_holds_what_the_ones_before_it_hold() {
        assert!(Role::Artist.grants(Permission::Submit));
        assert!(Role::Artist.grants(Permission::CancelOwn));
        assert!(!Role::Artist.grants(Permission::SeeAll));
        assert!(!Role::Artist.grants(Permission::CancelAny));
        assert!(Role::Lead.grants(Permission::CancelAny));
        assert!(Role::Lead.grants(Permission::Reorder));
        assert!(!Role::Lead.grants(Permission::Tokens));
        assert!(!Role::Lead.grants(Permission::PauseFarm));
        assert!(Role::Admin.grants(Permission::Tokens));
        assert_eq!(Permission::CancelAny.roles(), "lead or admin");
        assert_eq!(Permission::Tokens.roles(), "admin");
        for role in Role::ALL {
            assert_eq!(Role::parse(role.as_str()), Some(role));
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(json, format!("\"{role}\""));
        }
    }

    #[test]
    fn names_are_checked_and_admin_is_taken() {
        assert!(check_name("ann").is_ok());
        assert!(check_name("lead-2_b").is_ok());
        for bad in ["", "Ann", "-ann", "a b", "a.b", &"a".repeat(65), ADMIN] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn person_events_round_trip_and_route() {
        let ev = PersonEvent::now(
            "ann",
            PersonEventKind::TokenCreated {
                role: Role::Lead,
                token_sha256: "00".repeat(32),
                by: ADMIN.into(),
            },
        );
        assert_eq!(ev.routing_key(), "people.ann.token_created");
        let json = serde_json::to_string(&ev).unwrap();
        assert!(json.contains("\"event\":\"token_created\""), "{json}");
        let back: PersonEvent = crate::decode_json(json.as_bytes()).unwrap();
        assert_eq!(back, ev);
        let revoked = PersonEvent::now("ann", PersonEventKind::TokenRevoked { by: "bo".into() });
        assert_eq!(revoked.routing_key(), "people.ann.token_revoked");
        // The queue's controls: a unit variant is only its tag.
        let paused = PersonEvent::now("bo", PersonEventKind::FarmPaused);
        assert_eq!(paused.routing_key(), "people.bo.farm_paused");
        let json = serde_json::to_string(&paused).unwrap();
        assert!(json.contains("\"event\":\"farm_paused\""), "{json}");
        assert_eq!(
            crate::decode_json::<PersonEvent>(json.as_bytes()).unwrap(),
            paused
        );
        let moved = PersonEvent::now(
            "bo",
            PersonEventKind::MovedToFront {
                job_id: JobId::new(),
            },
        );
        let json = serde_json::to_string(&moved).unwrap();
        assert_eq!(
            crate::decode_json::<PersonEvent>(json.as_bytes()).unwrap(),
            moved
        );
    }
}
