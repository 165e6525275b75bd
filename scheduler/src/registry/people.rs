//! People and their tokens, as the event stream says (`people.<name>.<event>`): every scheduler
//! applies the same events in the same order, so all of them know the same tokens, and a revoked
//! token stops opening the API on each as soon as it reads the revocation.
//!
//! Only a token's SHA-256 is kept. A token is checked by hashing it and comparing the digest with
//! every live one in constant time (a studio has tens of people, not millions), so the time taken
//! says nothing about which digest, or how much of one, matched.
//!
//! Invariants: a name has at most one live token; a `token_created` for a name that has one is
//! ignored (the first in the stream wins, so two schedulers creating the same name at once make
//! one token, and the API tells the other caller so); a revoked name may be given a new token.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use vnfarm_proto::{PersonEvent, PersonEventKind, Role};

/// One person's token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Person {
    role: Role,
    /// SHA-256 of the token.
    #[serde(with = "digest_hex")]
    token_sha256: [u8; 32],
    created_at: DateTime<Utc>,
    created_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    revoked_at: Option<DateTime<Utc>>,
}

impl Person {
    pub fn role(&self) -> Role {
        self.role
    }

    pub fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }

    pub fn created_by(&self) -> &str {
        &self.created_by
    }

    pub fn revoked_at(&self) -> Option<DateTime<Utc>> {
        self.revoked_at
    }

    pub fn is_live(&self) -> bool {
        self.revoked_at.is_none()
    }

    /// Whether this person's token was made from `digest`.
    pub fn has_token(&self, digest: &[u8; 32]) -> bool {
        self.token_sha256 == *digest
    }
}

/// Every person the stream has named, by name; part of the registry's snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct People(BTreeMap<String, Person>);

/// The digest a token is kept and checked as.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl People {
    /// Applies one event; returns whether it changed anything (a second token for a live name, a
    /// revocation of a name with none, or a digest that is not 32 bytes of hex change nothing).
    pub fn apply(&mut self, ev: &PersonEvent) -> bool {
        match &ev.kind {
            PersonEventKind::TokenCreated {
                role,
                token_sha256,
                by,
            } => {
                if self.0.get(&ev.person).is_some_and(Person::is_live) {
                    return false;
                }
                let mut digest = [0u8; 32];
                if hex::decode_to_slice(token_sha256, &mut digest).is_err() {
                    tracing::warn!(person = %ev.person, "a token event whose digest is not 32 bytes of hex; ignored");
                    return false;
                }
                self.0.insert(
                    ev.person.clone(),
                    Person {
                        role: *role,
                        token_sha256: digest,
                        created_at: ev.at,
                        created_by: by.clone(),
                        revoked_at: None,
                    },
                );
                true
            }
            PersonEventKind::TokenRevoked { .. } => match self.0.get_mut(&ev.person) {
                Some(p) if p.is_live() => {
                    p.revoked_at = Some(ev.at);
                    true
                }
                Some(_) | None => false,
            },
            // A job's or the queue's, not a token's: the registry records them elsewhere.
            PersonEventKind::CancelRequested { .. }
            | PersonEventKind::FarmPaused
            | PersonEventKind::FarmResumed
            | PersonEventKind::WorkPaused { .. }
            | PersonEventKind::WorkResumed { .. }
            | PersonEventKind::MovedToFront { .. } => false,
        }
    }

    /// The person whose live token `token` is, and their role. Every live digest is compared, in
    /// constant time each, whichever matches.
    pub fn identify(&self, token: &str) -> Option<(&str, Role)> {
        let given = token_digest(token);
        let mut found = None;
        for (name, p) in &self.0 {
            let equal: bool = p.token_sha256.ct_eq(&given).into();
            if equal && p.is_live() {
                found = Some((name.as_str(), p.role));
            }
        }
        found
    }

    pub fn get(&self, name: &str) -> Option<&Person> {
        self.0.get(name)
    }

    /// Everyone, live and revoked, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Person)> {
        self.0.iter().map(|(n, p)| (n.as_str(), p))
    }
}

/// A digest as the hex a snapshot keeps it in.
mod digest_hex {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(digest: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(digest))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        let mut digest = [0u8; 32];
        hex::decode_to_slice(&text, &mut digest).map_err(D::Error::custom)?;
        Ok(digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(name: &str, role: Role, token: &str) -> PersonEvent {
        PersonEvent::now(
            name,
            PersonEventKind::TokenCreated {
                role,
                token_sha256: hex::encode(token_digest(token)),
                by: "admin".into(),
            },
        )
    }

    fn revoked(name: &str) -> PersonEvent {
        PersonEvent::now(name, PersonEventKind::TokenRevoked { by: "admin".into() })
    }

    #[test]
    fn a_token_names_its_person_until_it_is_revoked() {
        let mut people = People::default();
        assert!(people.apply(&created("ann", Role::Artist, "token-of-ann")));
        assert!(people.apply(&created("lee", Role::Lead, "token-of-lee")));
        assert_eq!(people.identify("token-of-ann"), Some(("ann", Role::Artist)));
        assert_eq!(people.identify("token-of-lee"), Some(("lee", Role::Lead)));
        assert_eq!(people.identify("token-of-an"), None);
        assert_eq!(people.identify(""), None);
        assert!(people.apply(&revoked("ann")));
        assert_eq!(
            people.identify("token-of-ann"),
            None,
            "refused once revoked"
        );
        assert!(!people.apply(&revoked("ann")), "revoked once");
        assert!(!people.apply(&revoked("nobody")));
        assert!(people.get("ann").unwrap().revoked_at().is_some());
        assert_eq!(people.identify("token-of-lee"), Some(("lee", Role::Lead)));
    }

    #[test]
    fn the_first_token_of_a_live_name_wins_and_a_revoked_name_may_have_a_new_one() {
        let mut people = People::default();
        assert!(people.apply(&created("ann", Role::Artist, "first")));
        assert!(!people.apply(&created("ann", Role::Admin, "second")));
        assert_eq!(people.identify("first"), Some(("ann", Role::Artist)));
        assert_eq!(people.identify("second"), None);
        people.apply(&revoked("ann"));
        assert!(people.apply(&created("ann", Role::Lead, "third")));
        assert_eq!(people.identify("third"), Some(("ann", Role::Lead)));
        assert_eq!(
            people.identify("first"),
            None,
            "the old token stays refused"
        );
    }

    #[test]
    fn only_digests_are_kept_and_they_survive_a_snapshot() {
        let mut people = People::default();
        people.apply(&created("ann", Role::Artist, "secret-token-value"));
        let json = serde_json::to_string(&people).unwrap();
        assert!(!json.contains("secret-token-value"), "{json}");
        assert!(json.contains(&hex::encode(token_digest("secret-token-value"))));
        let back: People = serde_json::from_str(&json).unwrap();
        assert_eq!(back, people);
        assert_eq!(
            back.identify("secret-token-value"),
            Some(("ann", Role::Artist))
        );
    }

    #[test]
    fn a_digest_that_is_not_hex_changes_nothing() {
        let mut people = People::default();
        let mut ev = created("ann", Role::Artist, "t");
        if let PersonEventKind::TokenCreated { token_sha256, .. } = &mut ev.kind {
            *token_sha256 = "zz".into();
        }
        assert!(!people.apply(&ev));
        assert!(people.get("ann").is_none());
    }
}
