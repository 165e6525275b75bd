//! The scheduler's HTTP API as the command line uses it; the job and worker views it reads back are
//! `vnfarm_proto::http`'s (a job as its [`JobAnswer`]: the registry's view, or an archived job's).
//!
//! Every request carries the bearer token when one is set. A non-2xx answer becomes an
//! [`ApiError::Api`] holding the scheduler's `{"error": {"field", "message"}}`, and a connection that
//! cannot be made becomes [`ApiError::Unreachable`] naming the URL, so `main` can print either as is.

use std::fmt;
use std::time::Duration;

use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use vnfarm_proto::http::{
    CreatedToken, ErrorBody, Fleet, JobAnswer, JobView, QueueView, RevokedToken, Submitted,
    TokenList, TokenRequest, TokenView, Worker,
};
use vnfarm_proto::{JobId, Submission};

/// How long a plain request (not an event stream) may take, downloads included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug)]
pub enum ApiError {
    /// The scheduler answered with an error.
    Api {
        status: StatusCode,
        field: String,
        message: String,
    },
    /// The request never reached the scheduler.
    Unreachable { url: String, cause: String },
    /// A job's event stream ended (or broke) before the job's final event.
    StreamEnded(JobId),
    /// Anything else on the way (a reset connection, a body that is not what the API promises).
    Transport(reqwest::Error),
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Api { field, message, .. } => write!(f, "{field}: {message}"),
            ApiError::Unreachable { url, cause } => write!(
                f,
                "cannot connect to the scheduler at {url} ({cause}); is it running? (set --url or VNFARM_URL)"
            ),
            ApiError::StreamEnded(id) => {
                write!(f, "the event stream of job {id} ended before the job did")
            }
            ApiError::Transport(e) => write!(f, "{e}: {}", root_cause(e)),
        }
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    /// Whether trying the same request again later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::Api { status, .. } => *status == StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unreachable { .. } | ApiError::StreamEnded(_) | ApiError::Transport(_) => {
                true
            }
        }
    }
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[derive(Clone, Debug)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    pub fn new(url: &str, token: Option<String>) -> anyhow::Result<Self> {
        let base = url.trim_end_matches('/').to_owned();
        reqwest::Url::parse(&base)
            .map_err(|e| anyhow::anyhow!("--url {url:?} is not a URL: {e}"))?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("vnfarm-cli/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self { http, base, token })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// Sends a request; a non-success status becomes an [`ApiError::Api`].
    async fn send(&self, request: RequestBuilder) -> Result<Response, ApiError> {
        let response = request.send().await.map_err(|e| self.transport(e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = response.bytes().await.map_err(|e| self.transport(e))?;
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(ErrorBody { error }) => ApiError::Api {
                status,
                field: error.field,
                message: error.message,
            },
            Err(_) => ApiError::Api {
                status,
                field: format!("HTTP {status}"),
                message: String::from_utf8_lossy(&body).chars().take(200).collect(),
            },
        })
    }

    fn transport(&self, e: reqwest::Error) -> ApiError {
        if e.is_connect() {
            ApiError::Unreachable {
                url: self.base.clone(),
                cause: root_cause(&e),
            }
        } else {
            ApiError::Transport(e)
        }
    }

    async fn json<T: DeserializeOwned>(&self, request: RequestBuilder) -> Result<T, ApiError> {
        let response = self.send(request.timeout(REQUEST_TIMEOUT)).await?;
        response.json().await.map_err(ApiError::Transport)
    }

    pub async fn submit(&self, submission: &Submission) -> Result<JobId, ApiError> {
        let accepted: Submitted = self
            .json(self.request(Method::POST, "/v1/jobs").json(submission))
            .await?;
        Ok(accepted.job_id)
    }

    /// A job: the registry's view, or a completed job's past the retention (from its manifest).
    pub async fn job(&self, id: JobId) -> Result<JobAnswer, ApiError> {
        self.json(self.request(Method::GET, &format!("/v1/jobs/{id}")))
            .await
    }

    /// A job exactly as the scheduler shows it.
    pub async fn job_json(&self, id: JobId) -> Result<serde_json::Value, ApiError> {
        self.json(self.request(Method::GET, &format!("/v1/jobs/{id}")))
            .await
    }

    pub async fn jobs(&self, query: &[(&str, String)]) -> Result<Vec<JobView>, ApiError> {
        /// `GET /v1/jobs`, read as views (the image links beside each are for browsers).
        #[derive(Deserialize)]
        struct Jobs {
            jobs: Vec<JobView>,
        }
        let jobs: Jobs = self
            .json(self.request(Method::GET, "/v1/jobs").query(query))
            .await?;
        Ok(jobs.jobs)
    }

    pub async fn cancel(&self, id: JobId) -> Result<(), ApiError> {
        let _: serde_json::Value = self
            .json(self.request(Method::POST, &format!("/v1/jobs/{id}/cancel")))
            .await?;
        Ok(())
    }

    pub async fn output(&self, id: JobId, n: usize) -> Result<Vec<u8>, ApiError> {
        let request = self
            .request(Method::GET, &format!("/v1/jobs/{id}/outputs/{n}"))
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        Ok(response
            .bytes()
            .await
            .map_err(ApiError::Transport)?
            .to_vec())
    }

    pub async fn create_token(&self, request: &TokenRequest) -> Result<CreatedToken, ApiError> {
        self.json(self.request(Method::POST, "/v1/tokens").json(request))
            .await
    }

    pub async fn tokens(&self) -> Result<Vec<TokenView>, ApiError> {
        let list: TokenList = self.json(self.request(Method::GET, "/v1/tokens")).await?;
        Ok(list.tokens)
    }

    pub async fn revoke_token(&self, name: &str) -> Result<RevokedToken, ApiError> {
        self.json(self.request(Method::POST, &format!("/v1/tokens/{name}/revoke")))
            .await
    }

    pub async fn queue(&self) -> Result<QueueView, ApiError> {
        self.json(self.request(Method::GET, "/v1/queue")).await
    }

    /// Pauses or resumes the farm (`person` none) or one person's work.
    pub async fn set_paused(
        &self,
        person: Option<&str>,
        pause: bool,
    ) -> Result<QueueView, ApiError> {
        let verb = if pause { "pause" } else { "resume" };
        let path = match person {
            None => format!("/v1/queue/{verb}"),
            Some(name) => format!("/v1/people/{name}/{verb}"),
        };
        self.json(self.request(Method::POST, &path)).await
    }

    pub async fn move_to_front(&self, id: JobId) -> Result<JobView, ApiError> {
        self.json(self.request(Method::POST, &format!("/v1/jobs/{id}/front")))
            .await
    }

    pub async fn workers(&self) -> Result<Vec<Worker>, ApiError> {
        let fleet: Fleet = self.json(self.request(Method::GET, "/v1/workers")).await?;
        Ok(fleet.workers)
    }

    /// Opens a job's event stream, resuming after `last_event_id` when given. No timeout: the
    /// stream lasts as long as the job (the scheduler sends keep-alive comments meanwhile).
    pub async fn events(
        &self,
        id: JobId,
        last_event_id: Option<&str>,
    ) -> Result<Response, ApiError> {
        let mut request = self
            .request(Method::GET, &format!("/v1/jobs/{id}/events"))
            .header("accept", "text/event-stream");
        if let Some(last) = last_event_id {
            request = request.header("last-event-id", last);
        }
        self.send(request).await
    }
}
