//! Who may call the API: the bearer token (a person's, or the configuration's single `api_token`,
//! compared in constant time), what their role permits, and signed URLs for what a browser fetches
//! without headers (`<img src>`, downloads).
//!
//! With `api_token` set, every route except `/healthz` and the page's static files needs
//! `Authorization: Bearer <token>`; the configuration refuses to listen beyond loopback without one.
//! The token is the configuration's (the caller is `admin`, as every caller was before people had
//! tokens, so today's deployments keep working) or a person's live token from the registry
//! (`registry/people.rs`): the caller is that person with their role. A loopback scheduler without
//! `api_token` takes requests without a token as `admin`, and a person's token as that person. An
//! unknown or revoked token is refused (401) whatever the configuration. [`gate`] puts the
//! [`Caller`] in the request; [`permit`] checks the permission each route names, and the handlers
//! check ownership (an artist's own jobs) with [`Caller::may`]. A refusal (403) names the
//! permission and the roles that hold it.
//! Image URLs the API hands out are signed instead (HMAC-SHA256 over path and expiry, keyed by a
//! key derived from the token, so every scheduler of a farm accepts the others' URLs), the way a
//! presigned S3 URL is: whoever holds the URL may fetch that one object until it expires.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use schemars::JsonSchema;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use vnfarm_proto::people::ADMIN;
use vnfarm_proto::{Permission, Role};

use super::Api;
use super::error::ApiError;

type HmacSha256 = Hmac<Sha256>;

/// Whether `given` is `expected`, in time independent of where they differ and of their lengths
/// (both are hashed first, so only equal-length digests are compared).
pub fn token_matches(given: &str, expected: &str) -> bool {
    let given = Sha256::digest(given.as_bytes());
    let expected = Sha256::digest(expected.as_bytes());
    given.ct_eq(&expected).into()
}

/// Who is calling: a person and their role, or `admin` (the configuration's token, or no token on
/// an open loopback API).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    name: String,
    role: Role,
}

impl Caller {
    pub fn admin() -> Self {
        Self {
            name: ADMIN.into(),
            role: Role::Admin,
        }
    }

    pub fn person(name: &str, role: Role) -> Self {
        Self {
            name: name.into(),
            role,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// The owner recorded on the jobs this caller submits (`None`: `admin`, as before owners).
    pub fn owner(&self) -> Option<String> {
        (self.name != ADMIN).then(|| self.name.clone())
    }

    /// 403 unless the caller's role holds `permission`; `what` says what was asked.
    pub fn require(&self, permission: Permission, what: &str) -> Result<(), ApiError> {
        if self.role.grants(permission) {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "authorization",
            format!(
                "{what} needs the permission `{}` (role {}); {} is {} {}",
                permission.as_str(),
                permission.roles(),
                self.name,
                if self.role == Role::Artist { "an" } else { "a" },
                self.role,
            ),
        ))
    }

    /// Whether the caller may act on something `owner` owns: their own with `own`, anyone's with
    /// `any` (an artist may cancel their own job; cancelling another's takes a lead).
    pub fn may(
        &self,
        own: Permission,
        any: Permission,
        owner: &str,
        what: &str,
    ) -> Result<(), ApiError> {
        if owner == self.name {
            self.require(own, what)
        } else {
            self.require(any, &format!("{what} (owned by {owner})"))
        }
    }
}

/// The token check: puts the [`Caller`] in the request, or answers 401 (503 for a person's token
/// while the stream, and so the people, are still being read).
pub async fn gate(State(api): State<Api>, mut request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match identify(&api, given) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(e) => e.into_response(),
    }
}

fn identify(api: &Api, given: Option<&str>) -> Result<Caller, ApiError> {
    let configured = api.scheduler.config().api_token.as_deref();
    let refused = |message: &str| ApiError::new(StatusCode::UNAUTHORIZED, "authorization", message);
    match (given, configured) {
        (Some(given), Some(token)) if token_matches(given, token) => Ok(Caller::admin()),
        (Some(given), _) => {
            if !api.scheduler.is_ready() {
                return Err(ApiError::unavailable(
                    "the scheduler is replaying its event stream, which holds people's tokens; retry shortly",
                ));
            }
            let reg = api.scheduler.registry();
            reg.people()
                .identify(given)
                .map(|(name, role)| Caller::person(name, role))
                .ok_or_else(|| {
                    refused(
                        "the bearer token is not a live token of this farm (unknown or revoked)",
                    )
                })
        }
        (None, Some(_)) => Err(refused(
            "a valid bearer token is required (Authorization: Bearer <token>)",
        )),
        (None, None) => Ok(Caller::admin()),
    }
}

/// The permission check of one route (its [`super::Operation::permission`]), after [`gate`].
pub async fn permit(
    State(permission): State<Permission>,
    request: Request,
    next: Next,
) -> Response {
    let allowed = match request.extensions().get::<Caller>() {
        Some(caller) => caller.require(
            permission,
            &format!("{} {}", request.method(), request.uri().path()),
        ),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authorization",
            "no caller was identified",
        )),
    };
    match allowed {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// 503 until the event stream has been replayed (the registry is not current before).
pub async fn ready(State(api): State<Api>, request: Request, next: Next) -> Response {
    if !api.scheduler.is_ready() {
        return ApiError::unavailable("the scheduler is replaying its event stream; retry shortly")
            .into_response();
    }
    next.run(request).await
}

/// Signs and checks the URLs of single objects.
#[derive(Clone)]
pub struct UrlSigner {
    key: [u8; 32],
    ttl: Duration,
}

/// The query of a signed URL.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Signed {
    /// Unix time (seconds) after which the URL is refused.
    pub expires: u64,
    /// HMAC-SHA256 of the path and `expires`, hex.
    pub signature: String,
}

impl UrlSigner {
    /// Keyed from the token when there is one (every scheduler of the farm derives the same key);
    /// otherwise from a random key of this process (no token: the API is on loopback and open).
    pub fn new(token: Option<&str>, ttl: Duration) -> Self {
        let key = match token {
            Some(token) => {
                let mut mac = HmacSha256::new_from_slice(b"vnfarm signed URLs v1")
                    .expect("HMAC takes a key of any length");
                mac.update(token.as_bytes());
                mac.finalize().into_bytes().into()
            }
            None => rand::random(),
        };
        Self { key, ttl }
    }

    fn mac(&self, path: &str, expires: u64) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        mac.update(path.as_bytes());
        mac.update(b"\n");
        mac.update(expires.to_string().as_bytes());
        mac
    }

    /// `path?expires=..&signature=..`, valid for the signer's time to live.
    pub fn sign(&self, path: &str) -> String {
        let expires = unix_now() + self.ttl.as_secs();
        let signature = hex::encode(self.mac(path, expires).finalize().into_bytes());
        format!("{path}?expires={expires}&signature={signature}")
    }

    /// Checks a signed URL's query for `path`.
    pub fn verify(&self, path: &str, signed: &Signed) -> Result<(), ApiError> {
        let forbidden = |message: &str| ApiError::new(StatusCode::FORBIDDEN, "signature", message);
        let given = hex::decode(&signed.signature).map_err(|_| forbidden("not hex"))?;
        self.mac(path, signed.expires)
            .verify_slice(&given)
            .map_err(|_| forbidden("the signature does not match this URL"))?;
        if signed.expires < unix_now() {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "expires",
                "the URL has expired; fetch the job again for a fresh one",
            ));
        }
        Ok(())
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(token_matches("0123456789abcdef", "0123456789abcdef"));
        assert!(!token_matches("0123456789abcdeF", "0123456789abcdef"));
        assert!(!token_matches("0123456789abcdef0", "0123456789abcdef"));
        assert!(!token_matches("", "0123456789abcdef"));
    }

    #[test]
    fn a_refusal_names_the_permission_and_the_roles_that_hold_it() {
        let bo = Caller::person("bo", Role::Artist);
        let e = bo
            .may(
                Permission::CancelOwn,
                Permission::CancelAny,
                "ann",
                "cancelling job x",
            )
            .unwrap_err();
        assert_eq!(
            (e.status, e.field.as_str()),
            (StatusCode::FORBIDDEN, "authorization")
        );
        assert_eq!(
            e.message,
            "cancelling job x (owned by ann) needs the permission `cancel_any` (role lead or admin); bo is an artist"
        );
        assert!(
            bo.may(Permission::CancelOwn, Permission::CancelAny, "bo", "x")
                .is_ok()
        );
        let lee = Caller::person("lee", Role::Lead);
        assert!(
            lee.may(Permission::CancelOwn, Permission::CancelAny, "ann", "x")
                .is_ok()
        );
        let e = lee
            .require(Permission::Tokens, "POST /v1/tokens")
            .unwrap_err();
        assert!(
            e.message.contains("`tokens` (role admin); lee is a lead"),
            "{}",
            e.message
        );
        assert!(Caller::admin().require(Permission::Tokens, "x").is_ok());
        assert_eq!(Caller::admin().owner(), None);
        assert_eq!(bo.owner().as_deref(), Some("bo"));
    }

    #[test]
    fn signed_urls_name_their_path_and_expire() {
        let signer = UrlSigner::new(Some("0123456789abcdef"), Duration::from_secs(60));
        let url = signer.sign("/v1/files/results/a/0.png");
        let query = url.split_once('?').unwrap().1;
        let signed: Signed = crate::api::extract::decode_query(query).unwrap();
        signer.verify("/v1/files/results/a/0.png", &signed).unwrap();
        let other = signer
            .verify("/v1/files/results/a/1.png", &signed)
            .unwrap_err();
        assert_eq!(other.field, "signature");
        // Another scheduler with the same token accepts it; one with another token does not.
        let twin = UrlSigner::new(Some("0123456789abcdef"), Duration::from_secs(60));
        twin.verify("/v1/files/results/a/0.png", &signed).unwrap();
        let stranger = UrlSigner::new(Some("fedcba9876543210"), Duration::from_secs(60));
        assert!(
            stranger
                .verify("/v1/files/results/a/0.png", &signed)
                .is_err()
        );
        let old = Signed {
            expires: 1,
            signature: hex::encode(signer.mac("/p", 1).finalize().into_bytes()),
        };
        assert_eq!(signer.verify("/p", &old).unwrap_err().field, "expires");
    }
}
