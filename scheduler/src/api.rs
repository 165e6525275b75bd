//! The HTTP API (for the web page, the studio's front end and the `vnfarm` command line), and the
//! page itself.
//!
//! | method and path | what |
//! | --- | --- |
//! | `POST /v1/jobs` | submit a [`Submission`]; 201 with `{"job_id"}` (200 for an idempotent repeat) |
//! | `GET /v1/jobs?state=&kind=&limit=&all=` | list jobs, newest first, with signed image links |
//! | `GET /v1/jobs/{id}` | one job |
//! | `POST /v1/jobs/{id}/cancel` | cancel a job or a pipeline |
//! | `GET /v1/jobs/{id}/events` | Server-Sent Events of one job (history, then live; ends after a final event) |
//! | `GET /v1/events` | Server-Sent Events of every job (live; `Last-Event-ID` resumes) |
//! | `GET /v1/jobs/{id}/outputs/{n}` | output image `n` (PNG) |
//! | `POST /v1/uploads` | store an input image (raw body or multipart), verified by decoding |
//! | `GET /v1/files/{key}`, `GET /v1/thumbnails/{key}` | an image or its thumbnail, by signed URL |
//! | `GET /v1/workers` | known workers and their last heartbeat |
//! | `GET /v1/models`, `POST /v1/models/loras?name=` | the model catalogue's names; add a LoRA (raw body, streamed) |
//! | `POST /v1/tokens`, `GET /v1/tokens`, `POST /v1/tokens/{name}/revoke` | people's tokens (admins) |
//! | `GET /v1/queue`, `POST /v1/queue/{pause,resume}` | the queue's controls and people's shares; pausing the farm |
//! | `POST /v1/people/{name}/{pause,resume}`, `POST /v1/jobs/{id}/front` | pausing a person's work; moving a job to the front |
//! | `GET /v1/schema`, `GET /v1/openapi.json` | JSON Schema of a submission; this API's OpenAPI document |
//! | `GET /metrics`, `GET /healthz` | Prometheus metrics; readiness |
//! | `GET /`, `GET /ui/app.js`, `GET /ui/app.css` | the web page |
//!
//! The router is built from [`operations`], the same table the OpenAPI document is generated from
//! ([`openapi`]), so a route cannot exist without its description. Every error has one shape
//! ([`error`]). With a token configured every route but `/healthz`, the page and signed URLs needs
//! one, the configuration's or a person's; each route names the permission it needs and the
//! handlers check who owns a job ([`auth`]). Bodies are bounded per route (a submission `MAX_MESSAGE_BYTES`, an upload
//! `upload_max_bytes`, a LoRA `lora_upload_max_bytes`, anything else 64 KiB). CORS answers the origins in `cors_origins`.

pub mod auth;
pub mod drain;
pub mod error;
pub mod events;
pub mod extract;
pub mod files;
pub mod fleet;
pub mod jobs;
pub mod models;
pub mod openapi;
pub mod page;
pub mod queue;
pub mod tokens;
pub mod uploads;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use axum::{Json, Router};
use tower_http::cors::{AllowOrigin, CorsLayer};
use vnfarm_proto::catalogue::CatalogueEntry;
use vnfarm_proto::http::{
    CreatedToken, Fleet, JobView, ModelList, QueueView, RevokedToken, Submitted, TokenList,
    TokenRequest,
};
use vnfarm_proto::{JobId, MAX_MESSAGE_BYTES, Permission, SequencedEvent, Submission};

use crate::config::Config;
use crate::scheduler::Scheduler;
use auth::{Signed, UrlSigner};
use openapi::{SchemaFn, schema};

/// What every handler gets: the scheduler and the URL signer.
#[derive(Clone)]
pub struct Api {
    pub scheduler: Scheduler,
    pub signer: Arc<UrlSigner>,
}

/// Who may call an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The bearer token, when one is configured.
    Token,
    /// Anyone (health, the page).
    Public,
    /// Whoever holds a URL signed by the scheduler.
    Signed,
}

/// What a request or response carries.
#[derive(Clone, Copy)]
pub enum Content {
    Json(SchemaFn),
    /// Server-Sent Events whose `data` is JSON of this schema.
    EventStream(SchemaFn),
    /// Bytes of this media type.
    Binary(&'static str),
    /// A `multipart/form-data` form with the image in `file`.
    Multipart,
    /// No body; `Location` says where to go.
    Redirect,
}

/// A path parameter.
#[derive(Clone, Copy)]
pub struct Param {
    pub name: &'static str,
    pub description: &'static str,
    pub schema: SchemaFn,
}

/// One route: its handler and its description.
pub struct Operation {
    pub method: Method,
    pub path: &'static str,
    pub id: &'static str,
    pub tag: &'static str,
    pub summary: &'static str,
    pub description: &'static str,
    pub access: Access,
    /// What the caller's role must hold (routes with [`Access::Token`]); the handlers of job
    /// routes also check who owns the job.
    pub permission: Permission,
    /// Answers 503 until the scheduler has replayed its event stream.
    pub needs_registry: bool,
    pub path_params: Vec<Param>,
    pub query: Option<SchemaFn>,
    pub headers: Vec<(&'static str, &'static str)>,
    pub body: Vec<Content>,
    pub body_limit: usize,
    pub responses: Vec<(u16, &'static str, Content)>,
    pub errors: Vec<(u16, &'static str)>,
    pub handler: MethodRouter<Api>,
}

/// Largest body of a route that takes none worth speaking of.
const SMALL_BODY: usize = 64 * 1024;

impl Operation {
    fn new(
        method: Method,
        path: &'static str,
        id: &'static str,
        tag: &'static str,
        summary: &'static str,
        handler: MethodRouter<Api>,
    ) -> Self {
        Self {
            method,
            path,
            id,
            tag,
            summary,
            description: "",
            access: Access::Token,
            permission: Permission::Read,
            needs_registry: true,
            path_params: Vec::new(),
            query: None,
            headers: Vec::new(),
            body: Vec::new(),
            body_limit: SMALL_BODY,
            responses: Vec::new(),
            errors: Vec::new(),
            handler,
        }
    }
    fn describe(mut self, description: &'static str) -> Self {
        self.description = description;
        self
    }
    fn access(mut self, access: Access) -> Self {
        self.access = access;
        self.needs_registry = false;
        self
    }
    /// The permission the route needs; beyond an artist's, a refusal (403) is documented.
    fn needs(mut self, permission: Permission) -> Self {
        self.permission = permission;
        if permission.least_role() > vnfarm_proto::Role::Artist {
            self.errors.push((
                403,
                "the caller's role lacks the permission (field `authorization`; the message names the permission and the roles that hold it)",
            ));
        }
        self
    }
    fn without_registry(mut self) -> Self {
        self.needs_registry = false;
        self
    }
    fn param(mut self, name: &'static str, description: &'static str, schema: SchemaFn) -> Self {
        self.path_params.push(Param {
            name,
            description,
            schema,
        });
        self
    }
    fn query(mut self, schema: SchemaFn) -> Self {
        self.query = Some(schema);
        self
    }
    fn header(mut self, name: &'static str, description: &'static str) -> Self {
        self.headers.push((name, description));
        self
    }
    fn body(mut self, content: Content, limit: usize) -> Self {
        self.body.push(content);
        self.body_limit = limit;
        self
    }
    fn answers(mut self, status: u16, description: &'static str, content: Content) -> Self {
        self.responses.push((status, description, content));
        self
    }
    fn error(mut self, status: u16, description: &'static str) -> Self {
        self.errors.push((status, description));
        self
    }
}

/// The largest upload body: the image and a form's framing.
fn upload_body_limit(config: &Config) -> usize {
    config.upload_max_bytes + 64 * 1024
}

/// The largest LoRA upload body (the stream itself is counted by the handler).
fn lora_body_limit(config: &Config) -> usize {
    usize::try_from(config.lora_upload_max_bytes).unwrap_or(usize::MAX)
}

/// Every route of the scheduler, described.
pub fn operations(config: &Config) -> Vec<Operation> {
    use Method as M;
    let job_id = ("id", "a job id (UUID)", schema::<JobId> as SchemaFn);
    let key = (
        "key",
        "an image's key in storage (`results/<job>/<n>.png`, `inputs/<sha256>.<ext>`)",
        schema::<String> as SchemaFn,
    );
    vec![
        Operation::new(M::POST, "/v1/jobs", "submit", "jobs", "Submit a job or a pipeline", post(jobs::submit))
            .describe("The body is a `Submission`, decoded strictly (unknown fields and schema versions are refused) and validated; a refusal names the field. A repeat of an idempotency key or job id answers 200 with the first job's id. The job (a pipeline and its jobs) is owned by the caller.")
            .needs(Permission::Submit)
            .body(Content::Json(schema::<Submission>), MAX_MESSAGE_BYTES)
            .answers(201, "accepted; `Location` names the job", Content::Json(schema::<Submitted>))
            .answers(200, "a repeat of a known idempotency key or job id", Content::Json(schema::<Submitted>))
            .error(413, "the body exceeds the submission limit (field `body`)")
            .error(422, "the submission does not decode or breaks a rule (field: its path)"),
        Operation::new(M::GET, "/v1/jobs", "list_jobs", "jobs", "List jobs, newest first", get(jobs::list_jobs))
            .describe("A caller whose role lacks `see_all` (an artist) gets their own jobs only.")
            .query(schema::<jobs::ListQuery>)
            .answers(200, "the jobs", Content::Json(schema::<jobs::JobList>))
            .error(400, "a query parameter is unknown or invalid (field: its name)"),
        Operation::new(M::GET, "/v1/jobs/{id}", "get_job", "jobs", "One job", get(jobs::get_job))
            .describe("A job the registry holds, or a completed one past its retention answered from its manifest (`archived`). Another person's job, or an archived one (which records no owner), needs `see_all`.")
            .param(job_id.0, job_id.1, job_id.2)
            .answers(200, "the job", Content::Json(schema::<jobs::JobResource>))
            .error(400, "`id` is not a job id")
            .error(403, "the job is another person's and the caller's role lacks `see_all` (field `authorization`)")
            .error(404, "no such job"),
        Operation::new(M::POST, "/v1/jobs/{id}/cancel", "cancel_job", "jobs", "Cancel a job or a pipeline", post(jobs::cancel))
            .describe("Queued jobs are cancelled at once; running ones stop between steps. Watch the job's events for `cancelled`; the job's `cancelled_by` names who asked. One's own job needs `cancel_own`, another person's `cancel_any`.")
            .needs(Permission::CancelOwn)
            .param(job_id.0, job_id.1, job_id.2)
            .error(403, "the job is another person's and the caller's role lacks `cancel_any` (field `authorization`)")
            .answers(202, "the cancel is on its way", Content::Json(schema::<jobs::CancelRequested>))
            .error(400, "`id` is not a job id")
            .error(404, "no such job")
            .error(409, "the job already finished"),
        Operation::new(M::POST, "/v1/jobs/{id}/front", "move_to_front", "queue", "Move a waiting job to the front", post(queue::front))
            .describe("It goes before every job of its class (interactive work still goes before batch work) that was not moved, ahead of every person's turn; the latest move goes first. A pipeline's waiting jobs move with it. The job's `moved_by` and the event stream (`moved_to_front`) record who moved it.")
            .needs(Permission::Reorder)
            .param(job_id.0, job_id.1, job_id.2)
            .answers(200, "moved: this scheduler dispatches it first", Content::Json(schema::<JobView>))
            .error(400, "`id` is not a job id")
            .error(404, "no such job")
            .error(409, "the job is not waiting in the queue (dispatched, running or finished)")
            .error(503, "the event was not read back in time, or the broker is unavailable"),
        Operation::new(M::GET, "/v1/jobs/{id}/events", "job_events", "events", "Server-Sent Events of one job", get(events::job_events))
            .describe("Its history after the resume point, then live events until its final one. Each event's `id` is its sequence number and its `event` its kind. Another person's job needs `see_all`.")
            .param(job_id.0, job_id.1, job_id.2)
            .error(403, "the job is another person's and the caller's role lacks `see_all` (field `authorization`)")
            .query(schema::<events::StreamQuery>)
            .header("Last-Event-ID", "resume after this sequence number (as `after`)")
            .answers(200, "the event stream", Content::EventStream(schema::<SequencedEvent>))
            .error(400, "`id` or a query parameter is invalid")
            .error(404, "no such job"),
        Operation::new(M::GET, "/v1/events", "events", "events", "Server-Sent Events of every job", get(events::all_events))
            .describe("Live events of every job; with a resume point (`Last-Event-ID` or `after`), the recent history after it first, so a client that lost its connection misses nothing. A caller whose role lacks `see_all` (an artist) gets their own jobs' events only.")
            .query(schema::<events::StreamQuery>)
            .header("Last-Event-ID", "resume after this sequence number (as `after`)")
            .answers(200, "the event stream", Content::EventStream(schema::<SequencedEvent>))
            .error(400, "a query parameter is invalid"),
        Operation::new(M::GET, "/v1/jobs/{id}/outputs/{n}", "job_output", "images", "Output image `n` of a job", get(jobs::output))
            .param(job_id.0, job_id.1, job_id.2)
            .param("n", "the image's index", schema::<u32>)
            .describe("Another person's job, or one the registry no longer holds, needs `see_all`.")
            .answers(200, "the PNG", Content::Binary("image/png"))
            .error(400, "`id` or `n` is invalid")
            .error(403, "the job is another person's (or past the retention) and the caller's role lacks `see_all` (field `authorization`)")
            .error(404, "no such image"),
        Operation::new(M::POST, "/v1/uploads", "upload", "images", "Store an input image", post(uploads::upload))
            .without_registry()
            .needs(Permission::Submit)
            .describe("The image as the raw body (`image/png`, `image/jpeg`, `image/webp`, `application/octet-stream`) or as the `file` field of a form. It is decoded whole within the size and pixel limits (a decompression bomb is refused from its header) and stored under `inputs/` by its sha256. Give the answer's `image` as an edit's or upscale's input.")
            .body(Content::Binary("image/png"), upload_body_limit(config))
            .body(Content::Binary("image/jpeg"), upload_body_limit(config))
            .body(Content::Binary("image/webp"), upload_body_limit(config))
            .body(Content::Binary("application/octet-stream"), upload_body_limit(config))
            .body(Content::Multipart, upload_body_limit(config))
            .answers(201, "stored", Content::Json(schema::<uploads::Upload>))
            .error(400, "the form has no `file`, or the image is empty")
            .error(413, "the body exceeds `upload_max_bytes` (field `body`)")
            .error(415, "not an image body or a form (field `content-type`)")
            .error(422, "not a PNG, JPEG or WebP image within the limits, or it does not decode (field `file`)"),
        Operation::new(M::GET, "/v1/files/{*key}", "file", "images", "An image, by signed URL", get(files::file))
            .describe("The `url` of an image in a job or upload. With S3 storage it redirects to a presigned URL of the bucket; with a local directory the scheduler sends the image.")
            .access(Access::Signed)
            .param(key.0, key.1, key.2)
            .query(schema::<Signed>)
            .answers(200, "the image (local storage)", Content::Binary("image/png"))
            .answers(302, "a presigned URL of the bucket (S3 storage)", Content::Redirect)
            .error(400, "a query parameter is missing or invalid")
            .error(404, "no such image")
            .error(503, "storage is unavailable"),
        Operation::new(M::GET, "/v1/thumbnails/{*key}", "thumbnail", "images", "A thumbnail, by signed URL", get(files::thumbnail))
            .describe("A JPEG of at most 320 pixels a side, made on first request and kept under `thumbnails/`.")
            .access(Access::Signed)
            .param(key.0, key.1, key.2)
            .query(schema::<Signed>)
            .answers(200, "the thumbnail", Content::Binary("image/jpeg"))
            .error(400, "a query parameter is missing or invalid")
            .error(404, "no such image")
            .error(422, "the stored object does not decode")
            .error(503, "storage is unavailable"),
        Operation::new(M::GET, "/v1/workers", "workers", "fleet", "The workers and their last heartbeat", get(fleet::workers))
            .answers(200, "the fleet", Content::Json(schema::<Fleet>)),
        Operation::new(M::GET, "/v1/models", "list_models", "models", "The model catalogue's names", get(models::list))
            .without_registry()
            .describe("Every name of the model catalogue in the bucket (LoRAs, checkpoints, ...), with its file's sha256, role, size and when it was added. A job names a LoRA or checkpoint by one of these names or by `sha256:<hex>`.")
            .answers(200, "the entries", Content::Json(schema::<ModelList>))
            .error(503, "storage is unavailable"),
        Operation::new(M::POST, "/v1/models/loras", "upload_lora", "models", "Add a LoRA to the model catalogue", post(models::upload_lora))
            .without_registry()
            .needs(Permission::PushLoras)
            .describe("The LoRA file as the raw body (`application/octet-stream`), its catalogue name in `name`. It is streamed to a temporary file on the scheduler (never held in memory), checked (a safetensors header, tensors named as LoRA weights) and stored as `vnfarm models push --role lora` stores it: the bytes under their sha256, then the name. The same bytes under the same name again answer 200; a name that points at another file is refused.")
            .query(schema::<models::LoraUploadQuery>)
            .body(Content::Binary("application/octet-stream"), lora_body_limit(config))
            .answers(201, "added", Content::Json(schema::<CatalogueEntry>))
            .answers(200, "the name already names these bytes", Content::Json(schema::<CatalogueEntry>))
            .error(400, "`name` is missing, or the upload broke off")
            .error(409, "the name points at another file (field `name`)")
            .error(413, "the file exceeds `lora_upload_max_bytes` (field `body`)")
            .error(415, "not an `application/octet-stream` body (field `content-type`)")
            .error(422, "the name is not a catalogue name (field `name`), or the file is empty, not safetensors or holds no LoRA tensors (field `file`)")
            .error(503, "storage is unavailable"),
        Operation::new(M::POST, "/v1/tokens", "create_token", "people", "Give a person a token", post(tokens::create))
            .describe("The token is in this answer only: the farm keeps its SHA-256, in the event stream every scheduler reads, so every scheduler takes it within moments. A name has one live token at a time.")
            .needs(Permission::Tokens)
            .body(Content::Json(schema::<TokenRequest>), SMALL_BODY)
            .answers(201, "the token, shown once", Content::Json(schema::<CreatedToken>))
            .error(409, "the name has a live token; revoke it first (field `name`)")
            .error(422, "the body does not decode, or the name is not a person's (field: its path)"),
        Operation::new(M::GET, "/v1/tokens", "list_tokens", "people", "Everyone who has had a token", get(tokens::list))
            .describe("Names, roles, who made each token and when, and when it was revoked; never the tokens.")
            .needs(Permission::Tokens)
            .answers(200, "the tokens", Content::Json(schema::<TokenList>)),
        Operation::new(M::POST, "/v1/tokens/{name}/revoke", "revoke_token", "people", "Revoke a person's token", post(tokens::revoke))
            .describe("Answers once this scheduler refuses the token (401); every other scheduler reads the revocation from the same stream within moments. The person's jobs stay theirs.")
            .needs(Permission::Tokens)
            .param("name", "the person's name", schema::<String>)
            .answers(200, "revoked", Content::Json(schema::<RevokedToken>))
            .error(404, "the name has no live token (field `name`)"),
        Operation::new(M::GET, "/v1/queue", "queue", "queue", "The queue's controls and each person's share", get(queue::show))
            .describe("Whether the farm is paused, and per person: jobs waiting and on workers, GPU minutes today (UTC), their limits, whether their work is paused, and why it does not start now. A caller whose role lacks `see_all` (an artist) gets their own share only.")
            .answers(200, "the queue", Content::Json(schema::<QueueView>)),
        Operation::new(M::POST, "/v1/queue/pause", "pause_farm", "queue", "Pause the farm", post(queue::pause_farm))
            .describe("Nothing more is dispatched until someone resumes; running jobs finish and waiting ones keep their places. Recorded as a `farm_paused` event naming the caller, so every scheduler, a standby and a restarted one hold the same. Pausing a paused farm changes nothing.")
            .needs(Permission::PauseFarm)
            .answers(200, "paused: this scheduler dispatches nothing", Content::Json(schema::<QueueView>))
            .error(503, "the event was not read back in time, or the broker is unavailable"),
        Operation::new(M::POST, "/v1/queue/resume", "resume_farm", "queue", "Resume the farm", post(queue::resume_farm))
            .needs(Permission::PauseFarm)
            .answers(200, "resumed", Content::Json(schema::<QueueView>))
            .error(503, "the event was not read back in time, or the broker is unavailable"),
        Operation::new(M::POST, "/v1/people/{name}/pause", "pause_person", "queue", "Pause one person's work", post(queue::pause_person))
            .describe("None of their waiting work is dispatched until resumed; their running jobs finish. Recorded as a `work_paused` event naming the caller.")
            .needs(Permission::PausePerson)
            .param("name", "the person's name (or `admin`)", schema::<String>)
            .answers(200, "paused", Content::Json(schema::<QueueView>))
            .error(422, "the name is not a person's (field `name`)")
            .error(503, "the event was not read back in time, or the broker is unavailable"),
        Operation::new(M::POST, "/v1/people/{name}/resume", "resume_person", "queue", "Resume one person's work", post(queue::resume_person))
            .needs(Permission::PausePerson)
            .param("name", "the person's name (or `admin`)", schema::<String>)
            .answers(200, "resumed", Content::Json(schema::<QueueView>))
            .error(422, "the name is not a person's (field `name`)")
            .error(503, "the event was not read back in time, or the broker is unavailable"),
        Operation::new(M::GET, "/v1/schema", "submission_schema", "meta", "JSON Schema of a submission", get(submission_schema))
            .without_registry()
            .answers(200, "the schema", Content::Json(schema::<serde_json::Value>)),
        Operation::new(M::GET, "/v1/openapi.json", "openapi", "meta", "This document", get(openapi_json))
            .without_registry()
            .answers(200, "the OpenAPI document", Content::Json(schema::<serde_json::Value>)),
        Operation::new(M::GET, "/metrics", "metrics", "meta", "Prometheus metrics", get(metrics))
            .without_registry()
            .answers(200, "the text exposition format", Content::Binary("text/plain")),
        Operation::new(M::GET, "/healthz", "health", "meta", "Readiness", get(healthz))
            .describe("200 once the scheduler has replayed its event stream and holds a broker connection; 503 until then. Needs no token.")
            .access(Access::Public)
            .answers(200, "ready", Content::Json(schema::<Health>))
            .answers(503, "not ready", Content::Json(schema::<Health>)),
        Operation::new(M::GET, "/", "page", "page", "The web page", get(page::index))
            .access(Access::Public)
            .answers(200, "HTML", Content::Binary("text/html")),
        Operation::new(M::GET, "/ui/app.js", "page_script", "page", "The page's script", get(page::script))
            .access(Access::Public)
            .answers(200, "JavaScript", Content::Binary("text/javascript")),
        Operation::new(M::GET, "/ui/app.css", "page_style", "page", "The page's style sheet", get(page::style))
            .access(Access::Public)
            .answers(200, "CSS", Content::Binary("text/css")),
    ]
}

/// The OpenAPI document of the default configuration (limits do not appear in it).
pub fn openapi_document() -> serde_json::Value {
    let config = Config::load(None, Vec::new()).expect("the default configuration is valid");
    openapi::document(&operations(&config))
}

pub fn router(scheduler: Scheduler) -> Router {
    let config = scheduler.config().clone();
    let signer = UrlSigner::new(
        config.api_token.as_deref(),
        Duration::from_secs(config.url_ttl_s),
    );
    let api = Api {
        scheduler,
        signer: Arc::new(signer),
    };
    let (mut replayed, mut gated, mut open) = (Router::new(), Router::new(), Router::new());
    for op in operations(&config) {
        let mut handler = op.handler.layer(DefaultBodyLimit::max(op.body_limit));
        if op.access == Access::Token {
            handler = handler.layer(middleware::from_fn_with_state(op.permission, auth::permit));
        }
        match (op.access, op.needs_registry) {
            (Access::Token, true) => replayed = replayed.route(op.path, handler),
            (Access::Token, false) => gated = gated.route(op.path, handler),
            (Access::Public | Access::Signed, _) => open = open.route(op.path, handler),
        }
    }
    let replayed = replayed.route_layer(middleware::from_fn_with_state(api.clone(), auth::ready));
    let gated = gated
        .merge(replayed)
        .route_layer(middleware::from_fn_with_state(api.clone(), auth::gate));
    let app = gated
        .merge(open)
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::wrong_method)
        .layer(DefaultBodyLimit::max(SMALL_BODY))
        .with_state(api)
        .layer(middleware::from_fn(drain::drain_unread));
    match cors(&config) {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

/// CORS for the studio's own front end: its origins may call the API from a browser with the
/// token (no cookies are involved, so no credentials mode).
fn cors(config: &Config) -> Option<CorsLayer> {
    if config.cors_origins.is_empty() {
        return None;
    }
    let origins: Vec<HeaderValue> = config
        .cors_origins
        .iter()
        .map(|o| HeaderValue::from_str(o).expect("origins are validated with the configuration"))
        .collect();
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("last-event-id"),
            ])
            .expose_headers([header::LOCATION])
            .max_age(Duration::from_secs(3600)),
    )
}

async fn submission_schema() -> Json<serde_json::Value> {
    Json(vnfarm_proto::submission_schema())
}

async fn openapi_json(State(api): State<Api>) -> Json<serde_json::Value> {
    Json(openapi::document(&operations(api.scheduler.config())))
}

async fn metrics(State(api): State<Api>) -> Response {
    api.scheduler.update_gauges();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        api.scheduler.metrics().render(),
    )
        .into_response()
}

/// `GET /healthz`.
#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
pub struct Health {
    /// The event stream has been replayed.
    pub ready: bool,
    pub amqp_connected: bool,
    /// `active` (holds the leader token) or `standby`.
    pub role: &'static str,
}

async fn healthz(State(api): State<Api>) -> (StatusCode, Json<Health>) {
    let s = &api.scheduler;
    let ready = s.is_ready();
    let connected = s.metrics().amqp_connected.get() == 1;
    let status = if ready && connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let role = if s.is_active() { "active" } else { "standby" };
    (
        status,
        Json(Health {
            ready,
            amqp_connected: connected,
            role,
        }),
    )
}
