//! Making and revoking people's tokens: a person's event published to the stream, then waited for
//! until this scheduler has read it back, so that the answer tells the truth about this scheduler
//! (every other one reads the same event from the same stream within moments).
//!
//! A token is 32 random bytes (`vnfarm_` and 64 hex digits); only its SHA-256 leaves this module,
//! in the event. The token itself is in the one answer that creates it, and nowhere else.

use vnfarm_proto::{PersonEvent, PersonEventKind, Role};

use crate::registry::token_digest;
use crate::scheduler::Scheduler;

/// Why a token was not made or revoked.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The name has a live token (made here or, a moment earlier, by another scheduler).
    #[error("{0} already has a token; revoke it first")]
    Taken(String),
    #[error("{0} has no token to revoke")]
    NotFound(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// A new token, for its one answer.
pub struct NewToken {
    pub token: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// A fresh token: `vnfarm_` and 32 random bytes in hex.
fn fresh_token() -> String {
    format!("vnfarm_{}", hex::encode(rand::random::<[u8; 32]>()))
}

impl Scheduler {
    /// Gives `name` a new token with `role`, made by `by`. The name is checked by the caller.
    pub async fn create_token(
        &self,
        name: &str,
        role: Role,
        by: &str,
    ) -> Result<NewToken, TokenError> {
        if self
            .registry()
            .people()
            .get(name)
            .is_some_and(|p| p.is_live())
        {
            return Err(TokenError::Taken(name.to_owned()));
        }
        let token = fresh_token();
        let digest = token_digest(&token);
        let event = PersonEvent::now(
            name,
            PersonEventKind::TokenCreated {
                role,
                token_sha256: hex::encode(digest),
                by: by.to_owned(),
            },
        );
        self.publish_person(&event)
            .await
            .map_err(|e| TokenError::Unavailable(e.to_string()))?;
        // The stream's first token for the name wins: ours, or another scheduler's made at once.
        let person = self
            .read_back(|reg| reg.people().get(name).filter(|p| p.is_live()).cloned())
            .await?;
        if !person.has_token(&digest) {
            return Err(TokenError::Taken(name.to_owned()));
        }
        Ok(NewToken {
            token,
            created_at: person.created_at(),
        })
    }

    /// Revokes `name`'s token, by `by`. Returns once this scheduler refuses it.
    pub async fn revoke_token(
        &self,
        name: &str,
        by: &str,
    ) -> Result<chrono::DateTime<chrono::Utc>, TokenError> {
        let live = {
            let reg = self.registry();
            reg.people()
                .get(name)
                .filter(|p| p.is_live())
                .map(|p| p.created_at())
        };
        let Some(created) = live else {
            return Err(TokenError::NotFound(name.to_owned()));
        };
        let event = PersonEvent::now(name, PersonEventKind::TokenRevoked { by: by.to_owned() });
        self.publish_person(&event)
            .await
            .map_err(|e| TokenError::Unavailable(e.to_string()))?;
        // That token revoked (by this event or another scheduler's a moment before).
        self.read_back(|reg| {
            reg.people()
                .get(name)
                .filter(|p| p.created_at() == created)
                .and_then(|p| p.revoked_at())
        })
        .await
    }

    /// Waits until `found` finds what a token's event published here did to the registry.
    async fn read_back<T>(
        &self,
        found: impl Fn(&crate::registry::Registry) -> Option<T>,
    ) -> Result<T, TokenError> {
        self.read_back_event(found).await.ok_or_else(|| {
            TokenError::Unavailable(
                "the token's event was confirmed but has not been read back yet; list the tokens to see whether it took".into(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_random_bytes() {
        let (a, b) = (fresh_token(), fresh_token());
        assert_ne!(a, b);
        let hex = a.strip_prefix("vnfarm_").unwrap();
        assert_eq!(hex::decode(hex).unwrap().len(), 32);
    }
}
