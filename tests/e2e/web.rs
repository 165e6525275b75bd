//! The HTTP API against its OpenAPI document, and the web page driven in a real headless Chromium
//! (Debian's `chromium` through `chromedriver`, WebDriver by `fantoccini`), both against a real
//! farm: scheduler, test-pattern workers, RabbitMQ and the s3s-fs S3 server.
//!
//! Screenshots of the page go to `$VNFARM_ARTIFACTS/web` (default `target/<profile>/artifacts/web`);
//! the test prints where.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use fantoccini::{Client, Locator};
use futures::StreamExt;
use serde_json::{Value, json};
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, bin_dir, free_port, png_bytes, wait_for};

use crate::FINISH;

const TOKEN: &str = "web-test-token-0123456789";
const STUDIO: &str = "http://studio.test:3000";
/// Small, so that a test body just over it is sent whole before the answer comes.
const UPLOAD_MAX_BYTES: usize = 1024 * 1024;

/// `farm` with a scheduler that wants the token and answers the studio's origin, and `workers`
/// test-pattern workers; the farm's own HTTP client sends the token.
async fn serve(mut farm: Farm, workers: &[&str], step_ms: u64) -> anyhow::Result<Farm> {
    farm.scheduler_env.extend([
        ("VNFARM_API_TOKEN".to_owned(), TOKEN.to_owned()),
        ("VNFARM_CORS_ORIGINS".to_owned(), format!(r#"["{STUDIO}"]"#)),
        (
            "VNFARM_UPLOAD_MAX_BYTES".to_owned(),
            UPLOAD_MAX_BYTES.to_string(),
        ),
    ]);
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {TOKEN}").parse()?,
    );
    farm.http = reqwest::Client::builder()
        .default_headers(headers)
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    farm.start_scheduler().await?;
    for id in workers {
        farm.start_worker(
            id,
            WorkerOptions {
                step_ms,
                ..Default::default()
            },
        )
        .await?;
    }
    Ok(farm)
}

// ------------------------------------------------------------------------------------------
// The API against its document

/// Checks answers against the OpenAPI document and remembers which operations were called.
struct Conformance {
    doc: Value,
    called: BTreeSet<(String, String)>,
    validators: HashMap<(String, String, String), jsonschema::Validator>,
}

impl Conformance {
    fn new(doc: Value) -> Self {
        Self {
            doc,
            called: BTreeSet::new(),
            validators: HashMap::new(),
        }
    }

    /// The document's components, each closed at its top level: an answer with a field the
    /// document does not name disagrees with it as much as one lacking a field.
    fn closed_components(&self) -> Value {
        let mut components = self.doc["components"].clone();
        if let Some(schemas) = components["schemas"].as_object_mut() {
            for schema in schemas.values_mut() {
                if schema.get("properties").is_some()
                    && schema.get("additionalProperties").is_none()
                {
                    schema["unevaluatedProperties"] = json!(false);
                }
            }
        }
        components
    }

    /// Checks that `template` `method` documents `status` with `media`, and that `body` (JSON)
    /// validates against the documented schema.
    fn check(
        &mut self,
        method: &str,
        template: &str,
        status: u16,
        media: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<()> {
        let method = method.to_ascii_lowercase();
        self.called.insert((method.clone(), template.to_owned()));
        let op = &self.doc["paths"][template][&method];
        ensure!(op.is_object(), "{method} {template} is not in the document");
        let answer = &op["responses"][status.to_string()];
        ensure!(
            answer.is_object(),
            "{method} {template} answered {status}, which the document does not list"
        );
        if status == 302 {
            return Ok(());
        }
        let content = answer["content"]
            .as_object()
            .with_context(|| format!("{method} {template} {status} documents no body"))?;
        let media = media.split(';').next().unwrap_or("").trim();
        ensure!(
            content.contains_key(media),
            "{method} {template} {status} answered {media:?}; the document says {:?}",
            content.keys().collect::<Vec<_>>()
        );
        let Some(body) = body else {
            return Ok(());
        };
        let key = (method.clone(), template.to_owned(), status.to_string());
        if !self.validators.contains_key(&key) {
            let schema = if media == "text/event-stream" {
                content[media]["x-event-data"].clone()
            } else {
                content[media]["schema"].clone()
            };
            // The answer's schema, in a document that holds the components it refers to.
            let root = json!({ "components": self.closed_components(), "allOf": [schema] });
            let validator = jsonschema::validator_for(&root)
                .map_err(|e| anyhow::anyhow!("the document's schema does not compile: {e}"))?;
            self.validators.insert(key.clone(), validator);
        }
        let errors: Vec<String> = self.validators[&key]
            .iter_errors(body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        ensure!(
            errors.is_empty(),
            "{method} {template} {status}: the answer disagrees with the document:\n{}\n{body:#}",
            errors.join("\n")
        );
        Ok(())
    }

    /// Checks that an accepted JSON request body is one the document describes.
    fn check_request(&mut self, method: &str, template: &str, sent: &Value) -> anyhow::Result<()> {
        let method = method.to_ascii_lowercase();
        let schema = self.doc["paths"][template][&method]["requestBody"]["content"]
            ["application/json"]["schema"]
            .clone();
        ensure!(
            schema.is_object(),
            "{method} {template} took a JSON body the document does not describe"
        );
        let root = json!({ "components": self.doc["components"], "allOf": [schema] });
        let validator = jsonschema::validator_for(&root)
            .map_err(|e| anyhow::anyhow!("the document's schema does not compile: {e}"))?;
        let errors: Vec<String> = validator.iter_errors(sent).map(|e| e.to_string()).collect();
        ensure!(
            errors.is_empty(),
            "{method} {template} accepted a body the document refuses:\n{}\n{sent:#}",
            errors.join("\n")
        );
        Ok(())
    }

    /// Sends `request`, checks the answer, and returns its status and JSON body (Null if none).
    async fn call(
        &mut self,
        request: reqwest::RequestBuilder,
        template: &str,
    ) -> anyhow::Result<(u16, Value)> {
        let (client, request) = request.build_split();
        let request = request?;
        let method = request.method().as_str().to_owned();
        let sent: Option<Value> = request
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .filter(|v| v.as_bytes().starts_with(b"application/json"))
            .and_then(|_| request.body()?.as_bytes())
            .and_then(|b| serde_json::from_slice(b).ok());
        let response = client.execute(request).await?;
        let status = response.status().as_u16();
        let media = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let bytes = response.bytes().await?;
        let body = if media.starts_with("application/json") {
            Some(serde_json::from_slice::<Value>(&bytes)?)
        } else {
            None
        };
        self.check(&method, template, status, &media, body.as_ref())?;
        // A request the API accepted must be one the document describes.
        if let Some(sent) = sent.filter(|_| (200..300).contains(&status)) {
            self.check_request(&method, template, &sent)?;
        }
        Ok((status, body.unwrap_or(Value::Null)))
    }
}

/// A `multipart/form-data` body with one file field, as a browser's form sends it.
fn multipart(
    request: reqwest::RequestBuilder,
    field: &str,
    bytes: &[u8],
) -> reqwest::RequestBuilder {
    const BOUNDARY: &str = "vnfarm-test-boundary-7MA4YWxkTrZu0gW";
    let mut body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"a.png\"\r\n\
         Content-Type: image/png\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    request
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
}

fn error_field(body: &Value) -> &str {
    body["error"]["field"].as_str().unwrap_or("<none>")
}

/// Reads Server-Sent Events until `n` events came (or the stream ended); returns their JSON.
async fn sse_data(response: reqwest::Response, n: usize) -> anyhow::Result<Vec<Value>> {
    let mut events = std::pin::pin!(vnfarm_tests::sse::json(response.bytes_stream()));
    let mut out = Vec::new();
    while out.len() < n {
        let Some(event) = tokio::time::timeout(FINISH, events.next()).await? else {
            break;
        };
        out.push(event?);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_answers_as_its_document_says() -> anyhow::Result<()> {
    let farm = serve(Farm::in_process("web-api").await?, &["api-1"], 5).await?;
    // Without the token, and without following redirects (a signed URL's 302 is checked).
    let anonymous = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let url = |p: &str| farm.url(p);

    // The document the scheduler serves is the one committed beside it.
    let r = anonymous.get(url("/v1/openapi.json")).send().await?;
    ensure!(
        r.status() == 401,
        "the document wants the token: {}",
        r.status()
    );
    let served: Value = farm.get_json("/v1/openapi.json").await?;
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scheduler/openapi.json"
    ))?)?;
    ensure!(
        served == committed,
        "the served OpenAPI document differs from scheduler/openapi.json"
    );
    let mut c = Conformance::new(served);
    let h = &farm.http;

    // The checks can fail: answers the document does not describe are caught.
    let wrong = [
        ("post", "/v1/jobs", 201, json!({"job_id": 5})),
        (
            "post",
            "/v1/jobs",
            201,
            json!({"job_id": "01a23149-0cac-738b-894d-923026fb42cd", "extra": 1}),
        ),
        (
            "post",
            "/v1/jobs",
            422,
            json!({"error": {"field": "job.width"}}),
        ),
        ("get", "/v1/workers", 200, json!({"workers": [{"id": "x"}]})),
    ];
    for (method, template, status, body) in wrong {
        ensure!(
            c.check(method, template, status, "application/json", Some(&body))
                .is_err(),
            "{method} {template} {status} {body} passed"
        );
    }
    ensure!(
        c.check("post", "/v1/jobs", 204, "application/json", None)
            .is_err()
    );
    ensure!(c.check("get", "/v1/jobs", 200, "text/html", None).is_err());
    c.called.clear();

    // Token: only health and the page go without it; errors are the one shape.
    let (status, body) = c.call(anonymous.get(url("/v1/jobs")), "/v1/jobs").await?;
    ensure!(
        status == 401 && error_field(&body) == "authorization",
        "{body}"
    );
    let (status, _) = c
        .call(
            anonymous
                .get(url("/v1/jobs"))
                .bearer_auth("web-test-token-0123456780"),
            "/v1/jobs",
        )
        .await?;
    ensure!(status == 401, "a wrong token of the same length is refused");
    let (status, body) = c.call(anonymous.get(url("/healthz")), "/healthz").await?;
    ensure!(status == 200 && body["ready"] == true, "{body}");
    for (path, media) in [
        ("/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let (status, _) = c.call(anonymous.get(url(path)), path).await?;
        ensure!(status == 200, "{path}: {status} ({media})");
    }
    let (status, _) = c.call(h.get(url("/metrics")), "/metrics").await?;
    ensure!(status == 200);
    let (status, _) = c.call(h.get(url("/v1/schema")), "/v1/schema").await?;
    ensure!(status == 200);
    let (status, _) = c
        .call(h.get(url("/v1/openapi.json")), "/v1/openapi.json")
        .await?;
    ensure!(status == 200);

    // Submissions: a rule broken names its field; too large a body is refused before decoding.
    let generate = |extra: Value| {
        let mut job =
            json!({"kind": "generate", "prompt": "api", "width": 256, "height": 256, "steps": 3});
        for (k, v) in extra.as_object().unwrap() {
            job[k] = v.clone();
        }
        json!({"schema_version": 1, "job": job})
    };
    let (status, body) = c
        .call(
            h.post(url("/v1/jobs"))
                .json(&generate(json!({"width": 1001}))),
            "/v1/jobs",
        )
        .await?;
    ensure!(status == 422 && error_field(&body) == "job.width", "{body}");
    let (status, body) = c
        .call(
            h.post(url("/v1/jobs"))
                .json(&generate(json!({"colour": 1}))),
            "/v1/jobs",
        )
        .await?;
    ensure!(
        status == 422 && error_field(&body).starts_with("job"),
        "{body}"
    );
    let huge = vec![b' '; vnfarm_proto::MAX_MESSAGE_BYTES + 1];
    let (status, body) = c
        .call(
            h.post(url("/v1/jobs"))
                .header("content-type", "application/json")
                .body(huge),
            "/v1/jobs",
        )
        .await?;
    ensure!(
        status == 413 && error_field(&body) == "body",
        "{status} {body}"
    );
    let keyed = {
        let mut s = generate(json!({"count": 2}));
        s["idempotency_key"] = json!("api-conformance");
        s
    };
    let (status, body) = c
        .call(h.post(url("/v1/jobs")).json(&keyed), "/v1/jobs")
        .await?;
    ensure!(status == 201, "{status} {body}");
    let id = body["job_id"].as_str().context("job_id")?.to_owned();
    let (status, again) = c
        .call(h.post(url("/v1/jobs")).json(&keyed), "/v1/jobs")
        .await?;
    ensure!(
        status == 200 && again["job_id"] == id.as_str(),
        "a repeat of {id}: {status} {again}"
    );

    // Lists and jobs; query parameters are decoded strictly.
    let (status, _) = c
        .call(h.get(url("/v1/jobs?limit=5&all=true")), "/v1/jobs")
        .await?;
    ensure!(status == 200);
    let (status, body) = c
        .call(h.get(url("/v1/jobs?colour=red")), "/v1/jobs")
        .await?;
    ensure!(status == 400 && error_field(&body) == "colour", "{body}");
    let (status, body) = c
        .call(h.get(url("/v1/jobs?limit=many")), "/v1/jobs")
        .await?;
    ensure!(status == 400 && error_field(&body) == "limit", "{body}");
    let (status, body) = c
        .call(h.get(url("/v1/jobs?state=done")), "/v1/jobs")
        .await?;
    ensure!(status == 400 && error_field(&body) == "state", "{body}");
    let (status, body) = c.call(h.get(url("/v1/jobs/nope")), "/v1/jobs/{id}").await?;
    ensure!(status == 400 && error_field(&body) == "id", "{body}");
    let unknown = uuid::Uuid::now_v7();
    let (status, _) = c
        .call(h.get(url(&format!("/v1/jobs/{unknown}"))), "/v1/jobs/{id}")
        .await?;
    ensure!(status == 404);

    // One job's events, to its end, each event as documented.
    let events = h.get(url(&format!("/v1/jobs/{id}/events"))).send().await?;
    c.check(
        "get",
        "/v1/jobs/{id}/events",
        events.status().as_u16(),
        "text/event-stream",
        None,
    )?;
    for ev in sse_data(events, usize::MAX).await? {
        c.check(
            "get",
            "/v1/jobs/{id}/events",
            200,
            "text/event-stream",
            Some(&ev),
        )?;
    }
    let job = farm.wait_finished(&id, FINISH).await?;
    ensure!(job.state == JobState::Completed, "{job:?}");
    let (status, job) = c
        .call(h.get(url(&format!("/v1/jobs/{id}"))), "/v1/jobs/{id}")
        .await?;
    ensure!(
        status == 200 && job["images"].as_array().map(Vec::len) == Some(2),
        "{job}"
    );
    let all = h.get(url("/v1/events?after=0")).send().await?;
    c.check(
        "get",
        "/v1/events",
        all.status().as_u16(),
        "text/event-stream",
        None,
    )?;
    let first = sse_data(all, 3).await?;
    for ev in &first {
        c.check("get", "/v1/events", 200, "text/event-stream", Some(ev))?;
    }
    // A client that lost the stream after the second event resumes at the third.
    let resumed = h
        .get(url("/v1/events"))
        .header("last-event-id", first[1]["seq"].to_string())
        .send()
        .await?;
    let next = sse_data(resumed, 1).await?;
    ensure!(
        next.first().map(|e| &e["seq"]) == Some(&first[2]["seq"]),
        "resumed at {next:?}, not at {}",
        first[2]
    );
    let (status, body) = c
        .call(h.get(url("/v1/events?after=x")), "/v1/events")
        .await?;
    ensure!(status == 400 && error_field(&body) == "after", "{body}");

    // Images: the token route, and signed URLs a browser follows to a presigned S3 URL.
    let (status, _) = c
        .call(
            h.get(url(&format!("/v1/jobs/{id}/outputs/1"))),
            "/v1/jobs/{id}/outputs/{n}",
        )
        .await?;
    ensure!(status == 200);
    let (status, body) = c
        .call(
            h.get(url(&format!("/v1/jobs/{id}/outputs/9"))),
            "/v1/jobs/{id}/outputs/{n}",
        )
        .await?;
    ensure!(status == 404 && error_field(&body) == "n", "{body}");
    let image_url = job["images"][0]["url"].as_str().context("url")?.to_owned();
    let (status, _) = c
        .call(anonymous.get(url(&image_url)), "/v1/files/{key}")
        .await?;
    ensure!(
        status == 302,
        "S3 storage redirects to a presigned URL: {status}"
    );
    let followed = reqwest::get(url(&image_url)).await?;
    ensure!(
        followed.status() == 200,
        "the presigned URL serves: {}",
        followed.status()
    );
    let png = followed.bytes().await?;
    ensure!(
        png.starts_with(b"\x89PNG"),
        "the presigned URL serves the PNG"
    );
    let tampered = image_url.replace("/0.png", "/1.png");
    let (status, body) = c
        .call(anonymous.get(url(&tampered)), "/v1/files/{key}")
        .await?;
    ensure!(status == 403 && error_field(&body) == "signature", "{body}");
    let (status, body) = c
        .call(
            anonymous.get(url("/v1/files/results/x/0.png")),
            "/v1/files/{key}",
        )
        .await?;
    ensure!(status == 400 && error_field(&body) == "expires", "{body}");
    let thumb = job["images"][1]["thumbnail_url"]
        .as_str()
        .context("thumbnail")?;
    let response = anonymous.get(url(thumb)).send().await?;
    ensure!(response.status() == 200);
    c.check("get", "/v1/thumbnails/{key}", 200, "image/jpeg", None)?;
    let small = image::load_from_memory(&response.bytes().await?)?;
    ensure!(small.width() <= 320 && small.height() <= 320);

    // Uploads: raw and multipart, verified by decoding; what is not an image is refused by name.
    let picture = png_bytes(96, 64, 3);
    let (status, up) = c
        .call(
            h.post(url("/v1/uploads"))
                .header("content-type", "image/png")
                .body(picture.clone()),
            "/v1/uploads",
        )
        .await?;
    ensure!(
        status == 201 && up["width"] == 96 && up["image"]["stored"] == up["key"],
        "{up}"
    );
    let (status, again) = c
        .call(
            multipart(h.post(url("/v1/uploads")), "file", &picture),
            "/v1/uploads",
        )
        .await?;
    ensure!(
        status == 201 && again["key"] == up["key"],
        "same bytes, same key: {again}"
    );
    let (status, body) = c
        .call(
            h.post(url("/v1/uploads"))
                .header("content-type", "text/plain")
                .body("hi"),
            "/v1/uploads",
        )
        .await?;
    ensure!(
        status == 415 && error_field(&body) == "content-type",
        "{body}"
    );
    let (status, body) = c
        .call(
            h.post(url("/v1/uploads"))
                .header("content-type", "image/png")
                .body(picture[..picture.len() / 2].to_vec()),
            "/v1/uploads",
        )
        .await?;
    ensure!(
        status == 422 && error_field(&body) == "file",
        "a truncated PNG: {body}"
    );
    let (status, body) = c
        .call(
            multipart(h.post(url("/v1/uploads")), "other", b"x"),
            "/v1/uploads",
        )
        .await?;
    ensure!(status == 400 && error_field(&body) == "file", "{body}");
    let (status, body) = c
        .call(
            h.post(url("/v1/uploads"))
                .header("content-type", "application/octet-stream")
                .body(vec![0u8; UPLOAD_MAX_BYTES + 128 * 1024]),
            "/v1/uploads",
        )
        .await?;
    ensure!(
        status == 413 && error_field(&body) == "body",
        "{status} {body}"
    );

    // An edit of the upload.
    let edit = json!({"schema_version": 1, "job": {"kind": "edit", "input": up["image"], "instruction": "make it blue", "width": 256, "height": 256}});
    let (status, body) = c
        .call(h.post(url("/v1/jobs")).json(&edit), "/v1/jobs")
        .await?;
    ensure!(status == 201, "{body}");
    let edit_id = body["job_id"].as_str().context("job_id")?.to_owned();
    let done = farm.wait_finished(&edit_id, FINISH).await?;
    ensure!(done.state == JobState::Completed, "{done:?}");

    // Cancel: finished and unknown jobs are refused by name.
    let (status, body) = c
        .call(
            h.post(url(&format!("/v1/jobs/{id}/cancel"))),
            "/v1/jobs/{id}/cancel",
        )
        .await?;
    ensure!(status == 409 && error_field(&body) == "id", "{body}");
    let (status, _) = c
        .call(
            h.post(url(&format!("/v1/jobs/{unknown}/cancel"))),
            "/v1/jobs/{id}/cancel",
        )
        .await?;
    ensure!(status == 404);
    let slow = generate(json!({"steps": 150}));
    let (_, body) = c
        .call(h.post(url("/v1/jobs")).json(&slow), "/v1/jobs")
        .await?;
    let slow_id = body["job_id"].as_str().context("job_id")?.to_owned();
    let (status, body) = c
        .call(
            h.post(url(&format!("/v1/jobs/{slow_id}/cancel"))),
            "/v1/jobs/{id}/cancel",
        )
        .await?;
    ensure!(
        status == 202 && body["job_id"] == slow_id.as_str(),
        "{body}"
    );

    let (status, fleet) = c.call(h.get(url("/v1/workers")), "/v1/workers").await?;
    ensure!(
        status == 200 && fleet["workers"][0]["id"] == "api-1",
        "{fleet}"
    );

    // The queue: its state; the farm paused (a job submitted now waits), a waiting job moved to
    // the front (a finished or unknown one refused by name), a person's work paused and resumed
    // (a name that is no person's refused), the farm resumed.
    let (status, queue) = c.call(h.get(url("/v1/queue")), "/v1/queue").await?;
    ensure!(
        status == 200 && queue["you"] == "admin" && queue["role"] == "admin",
        "{queue}"
    );
    let (status, queue) = c
        .call(h.post(url("/v1/queue/pause")), "/v1/queue/pause")
        .await?;
    ensure!(
        status == 200 && queue["farm_paused"]["by"] == "admin",
        "{queue}"
    );
    let (_, body) = c
        .call(
            h.post(url("/v1/jobs")).json(&generate(json!({}))),
            "/v1/jobs",
        )
        .await?;
    let waiting = body["job_id"].as_str().context("job_id")?.to_owned();
    let (status, moved) = c
        .call(
            h.post(url(&format!("/v1/jobs/{waiting}/front"))),
            "/v1/jobs/{id}/front",
        )
        .await?;
    ensure!(status == 200 && moved["moved_by"] == "admin", "{moved}");
    ensure!(
        moved["waiting_for"]
            .as_str()
            .is_some_and(|w| w.starts_with("the farm to be resumed")),
        "{moved}"
    );
    let (status, body) = c
        .call(
            h.post(url(&format!("/v1/jobs/{id}/front"))),
            "/v1/jobs/{id}/front",
        )
        .await?;
    ensure!(status == 409 && error_field(&body) == "id", "{body}");
    let (status, _) = c
        .call(
            h.post(url(&format!("/v1/jobs/{unknown}/front"))),
            "/v1/jobs/{id}/front",
        )
        .await?;
    ensure!(status == 404);
    let (status, queue) = c
        .call(
            h.post(url("/v1/people/web-lead/pause")),
            "/v1/people/{name}/pause",
        )
        .await?;
    ensure!(
        status == 200
            && queue["people"].as_array().is_some_and(|p| p
                .iter()
                .any(|p| p["name"] == "web-lead" && p["paused"]["by"] == "admin")),
        "{queue}"
    );
    let (status, body) = c
        .call(
            h.post(url("/v1/people/Not%20A%20Name/pause")),
            "/v1/people/{name}/pause",
        )
        .await?;
    ensure!(
        status == 422 && error_field(&body) == "name",
        "{status} {body}"
    );
    let (status, queue) = c
        .call(
            h.post(url("/v1/people/web-lead/resume")),
            "/v1/people/{name}/resume",
        )
        .await?;
    ensure!(
        status == 200 && !queue.to_string().contains("\"paused\""),
        "{queue}"
    );
    let (status, queue) = c
        .call(h.post(url("/v1/queue/resume")), "/v1/queue/resume")
        .await?;
    ensure!(
        status == 200 && queue.get("farm_paused").is_none(),
        "{queue}"
    );
    ensure!(farm.wait_finished(&waiting, FINISH).await?.state == JobState::Completed);
    // The model catalogue: a LoRA added by upload (201, then 200 for the same bytes), listed;
    // a taken name, a file that is no LoRA, a body of another type are refused naming the field.
    let lora = std::fs::read(crate::engines::models().join("sdxl/lora/kohya.safetensors"))?;
    let post_lora = |name: &str, body: Vec<u8>, media: &str| {
        h.post(url(&format!("/v1/models/loras?name={name}")))
            .header("content-type", media)
            .body(body)
    };
    let octets = "application/octet-stream";
    let (status, added) = c
        .call(
            post_lora("api_ink", lora.clone(), octets),
            "/v1/models/loras",
        )
        .await?;
    ensure!(
        status == 201 && added["name"] == "api_ink" && added["role"] == "lora",
        "{status} {added}"
    );
    let (status, again) = c
        .call(
            post_lora("api_ink.safetensors", lora.clone(), octets),
            "/v1/models/loras",
        )
        .await?;
    ensure!(
        status == 200 && again["sha256"] == added["sha256"],
        "{status} {again}"
    );
    let mut other = lora.clone();
    let last = other.len() - 1;
    other[last] ^= 0xff;
    let not_lora = {
        let header = br#"{"unet.conv_in.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0; 4]);
        file
    };
    for (name, body, media, want, field, says) in [
        (
            "api_ink",
            other,
            octets,
            409,
            "name",
            "already names another file",
        ),
        ("api_ckpt", not_lora, octets, 422, "file", "no LoRA tensors"),
        (
            "api_png",
            png_bytes(8, 8, 1),
            octets,
            422,
            "file",
            "not a safetensors file",
        ),
        (
            "api_text",
            lora.clone(),
            "text/plain",
            415,
            "content-type",
            "application/octet-stream",
        ),
        (
            ".hidden",
            lora.clone(),
            octets,
            422,
            "name",
            "not a catalogue name",
        ),
    ] {
        let (status, answer) = c
            .call(post_lora(name, body, media), "/v1/models/loras")
            .await?;
        ensure!(
            status == want
                && error_field(&answer) == field
                && answer["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(says)),
            "{name}: {status} {answer}"
        );
    }
    let (status, listed) = c.call(h.get(url("/v1/models")), "/v1/models").await?;
    ensure!(
        status == 200
            && listed["models"]
                .as_array()
                .is_some_and(|m| m.len() == 1 && m[0]["name"] == "api_ink"),
        "{listed}"
    );

    // People's tokens: made (shown once), refused twice for one name and for `admin`, listed
    // without the token, revoked (then unknown); a person's token opens what their role allows.
    let made_body = json!({"name": "web-artist", "role": "artist"});
    let (status, made) = c
        .call(h.post(url("/v1/tokens")).json(&made_body), "/v1/tokens")
        .await?;
    ensure!(status == 201, "{made}");
    let artist = made["token"].as_str().context("token")?.to_owned();
    for (body, field, want) in [
        (json!({"name": "web-artist", "role": "lead"}), "name", 409),
        (json!({"name": "admin", "role": "lead"}), "name", 422),
        (json!({"name": "x", "role": "boss"}), "role", 422),
    ] {
        let (status, answer) = c
            .call(h.post(url("/v1/tokens")).json(&body), "/v1/tokens")
            .await?;
        ensure!(
            status == want && error_field(&answer) == field,
            "{body}: {status} {answer}"
        );
    }
    let (status, list) = c.call(h.get(url("/v1/tokens")), "/v1/tokens").await?;
    ensure!(
        status == 200
            && list["tokens"][0]["name"] == "web-artist"
            && !list.to_string().contains(&artist),
        "{list}"
    );
    let (status, body) = c
        .call(
            anonymous.get(url("/v1/tokens")).bearer_auth(&artist),
            "/v1/tokens",
        )
        .await?;
    ensure!(
        status == 403 && error_field(&body) == "authorization",
        "{body}"
    );
    let (status, body) = c
        .call(
            anonymous
                .get(url(&format!("/v1/jobs/{id}")))
                .bearer_auth(&artist),
            "/v1/jobs/{id}",
        )
        .await?;
    ensure!(status == 403, "the admin's job is not the artist's: {body}");
    let (status, body) = c
        .call(
            h.post(url("/v1/tokens/web-artist/revoke")),
            "/v1/tokens/{name}/revoke",
        )
        .await?;
    ensure!(status == 200 && body["name"] == "web-artist", "{body}");
    let (status, body) = c
        .call(
            h.post(url("/v1/tokens/web-artist/revoke")),
            "/v1/tokens/{name}/revoke",
        )
        .await?;
    ensure!(status == 404 && error_field(&body) == "name", "{body}");
    let (status, _) = c
        .call(
            anonymous.get(url("/v1/jobs")).bearer_auth(&artist),
            "/v1/jobs",
        )
        .await?;
    ensure!(status == 401, "a revoked token is refused");

    // Routes and methods that do not exist answer in the same shape.
    let r = h.get(url("/v1/nothing")).send().await?;
    ensure!(r.status() == 404);
    let body: Value = r.json().await?;
    ensure!(error_field(&body) == "path", "{body}");
    let r = h.delete(url("/v1/jobs")).send().await?;
    ensure!(r.status() == 405);
    let body: Value = r.json().await?;
    ensure!(error_field(&body) == "method", "{body}");

    // CORS: the studio's origin may call from a browser, another may not.
    let preflight = |origin: &str| {
        anonymous
            .request(reqwest::Method::OPTIONS, url("/v1/jobs"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
    };
    let allowed = preflight(STUDIO).await?;
    ensure!(
        allowed
            .headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok())
            == Some(STUDIO),
        "{:?}",
        allowed.headers()
    );
    let refused = preflight("http://elsewhere.test").await?;
    ensure!(
        refused
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );

    // Every operation the document lists was called.
    let mut documented = BTreeSet::new();
    for (path, ops) in c.doc["paths"].as_object().context("paths")? {
        for method in ops.as_object().context("operations")?.keys() {
            documented.insert((method.clone(), path.clone()));
        }
    }
    let missed: Vec<_> = documented.difference(&c.called).collect();
    ensure!(
        missed.is_empty(),
        "operations the test did not call: {missed:?}"
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The page in a headless Chromium

/// `chromedriver` on a free port, and a WebDriver session of headless Chromium on it.
struct Browser {
    client: Client,
    driver: Child,
    shots: PathBuf,
    shot: u32,
}

impl Browser {
    async fn start(name: &str) -> anyhow::Result<Self> {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context(
                "starting chromedriver (`./farm setup` installs chromium and chromium-driver)",
            )?;
        let webdriver = format!("http://127.0.0.1:{port}");
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,960"],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = wait_for("chromedriver to answer", Duration::from_secs(30), || {
            let caps = caps.clone();
            let webdriver = webdriver.clone();
            let connector = connector.clone();
            async move {
                fantoccini::ClientBuilder::new(connector)
                    .capabilities(caps)
                    .connect(&webdriver)
                    .await
                    .ok()
            }
        })
        .await?;
        let shots = match std::env::var_os("VNFARM_ARTIFACTS") {
            Some(dir) => PathBuf::from(dir),
            None => bin_dir().join("artifacts"),
        }
        .join("web")
        .join(name);
        std::fs::create_dir_all(&shots)?;
        println!("screenshots of {name}: {}", shots.display());
        Ok(Self {
            client,
            driver,
            shots,
            shot: 0,
        })
    }

    async fn screenshot(&mut self, what: &str) -> anyhow::Result<()> {
        self.shot += 1;
        let png = self.client.screenshot().await?;
        std::fs::write(self.shots.join(format!("{:02}-{what}.png", self.shot)), png)?;
        Ok(())
    }

    /// Runs `script` (a function body) in the page and returns its value.
    async fn js(&self, script: &str) -> anyhow::Result<Value> {
        Ok(self.client.execute(script, Vec::new()).await?)
    }

    /// Waits until `script` returns something truthy; returns it.
    async fn until(&self, what: &str, timeout: Duration, script: &str) -> anyhow::Result<Value> {
        wait_for(what, timeout, || async move {
            let v = self.js(script).await.ok()?;
            match &v {
                Value::Null | Value::Bool(false) => None,
                Value::Number(n) if n.as_f64() == Some(0.0) => None,
                Value::String(s) if s.is_empty() => None,
                _ => Some(v),
            }
        })
        .await
    }

    async fn css(&self, selector: &str) -> anyhow::Result<fantoccini::elements::Element> {
        self.client
            .find(Locator::Css(selector))
            .await
            .with_context(|| format!("no element {selector}"))
    }

    async fn fill(&self, selector: &str, text: &str) -> anyhow::Result<()> {
        let el = self.css(selector).await?;
        el.clear().await?;
        el.send_keys(text).await?;
        Ok(())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver ends its Chromium when it exits on SIGTERM.
        #[allow(unsafe_code)]
        // kill(2) on the pid of a child this test spawned and has not reaped.
        let _ = unsafe { libc::kill(self.driver.id() as i32, libc::SIGTERM) };
        let _ = self.driver.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_runs_a_pipeline_from_submit_to_compare() -> anyhow::Result<()> {
    // Slow enough steps that progress shows between events (the 40-step base takes about 4 s).
    // Processes: the page's event stream is dropped by killing the scheduler.
    let mut farm = serve(Farm::new("web-page").await?, &["page-1", "page-2"], 100).await?;
    let mut b = Browser::start("page").await?;
    let result = drive_page(&mut farm, &mut b).await;
    if result.is_err() {
        let _ = b.screenshot("failure").await;
        println!("{}\n{}", farm.scheduler_logs(), farm.worker_logs());
    }
    let Browser { client, .. } = &b;
    client.clone().close().await.ok();
    result
}

async fn drive_page(farm: &mut Farm, b: &mut Browser) -> anyhow::Result<()> {
    // For what the page shows on its own; jobs get `FINISH`.
    let t = Duration::from_secs(30);
    b.client.goto(&farm.url("/")).await?;

    // The API wants a token: the page asks for it once.
    b.until(
        "the token form",
        t,
        "return !document.querySelector('#token-form').hidden",
    )
    .await?;
    b.screenshot("token").await?;
    b.fill("#token", TOKEN).await?;
    b.css("#token-form button").await?.click().await?;
    b.until(
        "the event stream",
        t,
        "return document.querySelector('#stream-status').dataset.state === 'live'",
    )
    .await?;
    b.until(
        "the fleet panel to list both workers",
        t,
        "return document.querySelectorAll('#fleet li[data-worker]').length === 2",
    )
    .await?;

    // Rejected input: the API's message, the field marked.
    b.fill("#form-generate textarea[name=prompt]", "1girl, silver hair")
        .await?;
    b.fill("#form-generate input[name=width]", "1001").await?;
    b.css("#form-generate button[type=submit]")
        .await?
        .click()
        .await?;
    let message = b
        .until(
            "the validation error",
            t,
            "const e = document.querySelector('#form-error'); return !e.hidden && e.textContent",
        )
        .await?;
    ensure!(
        message
            .as_str()
            .is_some_and(|m| m.starts_with("job.width:")),
        "{message}"
    );
    let marked = b.js("return document.querySelector('#form-generate input[name=width]').getAttribute('aria-invalid')").await?;
    ensure!(marked == "true", "the width field is marked: {marked}");
    b.screenshot("validation-error").await?;
    b.fill("#form-generate input[name=width]", "256").await?;
    // LoRAs typed as "name:weight": a weight out of range names the LoRA's own field.
    b.fill("#form-generate input[name=loras]", "style:5")
        .await?;
    b.css("#form-generate button[type=submit]")
        .await?
        .click()
        .await?;
    let message = b
        .until(
            "the LoRA's validation error",
            t,
            "const e = document.querySelector('#form-error'); return !e.hidden && e.textContent.startsWith('job.loras') && e.textContent",
        )
        .await?;
    ensure!(
        message
            .as_str()
            .is_some_and(|m| m.starts_with("job.loras[0].weight:")),
        "{message}"
    );
    let marked = b.js("return document.querySelector('#form-generate input[name=loras]').getAttribute('aria-invalid')").await?;
    ensure!(marked == "true", "the LoRAs field is marked: {marked}");
    b.fill("#form-generate input[name=loras]", "").await?;

    // A pipeline: a base, three variants, an upscale of the base; chosen from the keyboard.
    b.css("#tab-generate").await?.click().await?;
    b.client
        .active_element()
        .await?
        .send_keys("\u{E014}")
        .await?; // ArrowRight: Edit
    b.client
        .active_element()
        .await?
        .send_keys("\u{E014}")
        .await?; // ArrowRight: Pipeline
    b.until(
        "the pipeline form",
        t,
        "return !document.querySelector('#form-pipeline').hidden",
    )
    .await?;
    b.fill("#form-pipeline textarea[name=prompt]", "1girl, classroom")
        .await?;
    b.fill("#form-pipeline input[name=width]", "512").await?;
    b.fill("#form-pipeline input[name=height]", "512").await?;
    b.fill("#form-pipeline input[name=seed]", "4242").await?;
    b.fill("#form-pipeline input[name=steps]", "40").await?;
    b.fill(
        "#form-pipeline textarea[name=variants]",
        "make her smile\nmake her angry\nmake her cry",
    )
    .await?;
    b.js("const s = document.querySelector('#form-pipeline select[name=upscale]'); s.value = 'base'; return true").await?;
    b.css("#form-pipeline button[type=submit]")
        .await?
        .click()
        .await?;
    let pipeline = b
        .until("the pipeline's card", t, "const c = document.querySelector('#jobs article[data-kind=pipeline]'); return c && c.dataset.jobId")
        .await?;
    let pipeline = pipeline.as_str().context("a job id")?.to_owned();
    let card = format!("#jobs article[data-job-id='{pipeline}']");

    // Progress moves: the base's bar strictly between empty and full, then further.
    let first = b
        .until(
            "the base to show progress",
            FINISH,
            &format!("const p = document.querySelector(\"{card} .children li progress\"); return p && p.value > 0 && p.value < 1 && p.value"),
        )
        .await?;
    let first = first.as_f64().unwrap_or(0.0);
    b.until(
        "the base's progress to move",
        FINISH,
        &format!("const p = document.querySelector(\"{card} .children li progress\"); return p && p.value > {first}"),
    )
    .await?;
    b.screenshot("progress").await?;

    // Drop the event stream: the scheduler dies and comes back; the page resumes where it was.
    farm.kill_scheduler();
    b.until(
        "the page to notice",
        t,
        "return document.querySelector('#stream-status').dataset.state === 'reconnecting'",
    )
    .await?;
    b.screenshot("stream-dropped").await?;
    farm.start_scheduler().await?;
    b.until(
        "the stream to resume",
        t,
        "return document.querySelector('#stream-status').dataset.state === 'live'",
    )
    .await?;

    // The pipeline completes, and every image of it loads.
    b.until(
        "the pipeline to complete",
        FINISH,
        &format!("return document.querySelector(\"{card}\").dataset.state === 'completed'"),
    )
    .await?;
    let images = b
        .until(
            "every image of the pipeline to load",
            t,
            &format!(
                "const imgs = [...document.querySelectorAll(\"{card} .gallery img\")]; \
                 return imgs.length === 5 && imgs.every(i => i.complete && i.naturalWidth > 0) && imgs.length"
            ),
        )
        .await?;
    ensure!(images == 5, "base, three variants and an upscale: {images}");
    // The card names who submitted it: the configuration's token is the admin's.
    let owner = b
        .js(&format!(
            "return document.querySelector(\"{card} .owner\").textContent"
        ))
        .await?;
    ensure!(owner == "by admin", "{owner}");
    let captions = b
        .js(&format!(
            "return [...document.querySelectorAll(\"{card} figcaption\")].map(f => f.textContent)"
        ))
        .await?;
    ensure!(
        captions.to_string().contains("seed 4242")
            && captions.to_string().contains("variant 2: make her angry"),
        "each image says what made it: {captions}"
    );
    b.screenshot("gallery").await?;

    // Compare the variants side by side (full images, from S3 through presigned URLs).
    b.css(&format!("{card} .compare-button"))
        .await?
        .click()
        .await?;
    b.until(
        "the variants side by side",
        t,
        "const d = document.querySelector('#compare'); const imgs = [...d.querySelectorAll('img')]; \
         return d.open && imgs.length === 4 && imgs.every(i => i.complete && i.naturalWidth > 0)",
    )
    .await?;
    b.screenshot("compare").await?;
    b.client
        .active_element()
        .await?
        .send_keys("\u{E00C}")
        .await?; // Escape closes it.
    b.until(
        "the compare view to close",
        t,
        "return !document.querySelector('#compare').open",
    )
    .await?;

    // Download links point at the images; "re-run with this seed" fills the form.
    let download = b
        .js(&format!(
            "const a = document.querySelector(\"{card} a.download\"); return a.download && a.href"
        ))
        .await?;
    let response = reqwest::get(download.as_str().context("a download URL")?).await?;
    ensure!(
        response.status() == 200,
        "the download link serves: {}",
        response.status()
    );
    b.css(&format!("{card} button.rerun"))
        .await?
        .click()
        .await?;
    let filled = b
        .until("the generate form filled", t, "return !document.querySelector('#form-generate').hidden && document.querySelector('#form-generate input[name=seed]').value")
        .await?;
    ensure!(filled == "4242", "the base's seed: {filled}");

    // An edit of an uploaded image: the file chosen in the form is uploaded, then edited.
    let upload = tempfile::Builder::new().suffix(".png").tempfile()?;
    std::fs::write(upload.path(), png_bytes(320, 240, 9))?;
    b.css("#tab-edit").await?.click().await?;
    b.css("#form-edit input[type=file]")
        .await?
        .send_keys(&upload.path().display().to_string())
        .await?;
    b.until(
        "the upload",
        t,
        "return document.querySelector('#edit-input').textContent.includes('320×240')",
    )
    .await?;
    b.fill("#form-edit textarea[name=instruction]", "make her wave")
        .await?;
    b.css("#form-edit button[type=submit]")
        .await?
        .click()
        .await?;
    b.until(
        "the edit of the upload to complete with its image",
        FINISH,
        "const c = [...document.querySelectorAll('#jobs article[data-kind=edit]')][0]; \
         const i = c && c.querySelector('.gallery img'); \
         return c && c.dataset.state === 'completed' && i && i.complete && i.naturalWidth > 0",
    )
    .await?;
    b.screenshot("edit-of-upload").await?;

    // The queue panel: the admin pauses the farm; a job submitted now waits, shows "Move to
    // front", is moved (its card says by whom); the farm resumed, it completes.
    b.until(
        "the queue panel",
        t,
        "return document.querySelector('#farm-state').dataset.paused === 'false' \
         && !document.querySelector('#farm-pause').hidden",
    )
    .await?;
    b.css("#farm-pause").await?.click().await?;
    b.until(
        "the farm to show paused",
        t,
        "return document.querySelector('#farm-state').dataset.paused === 'true' \
         && document.querySelector('#farm-pause').textContent === 'Resume the farm'",
    )
    .await?;
    b.css("#tab-generate").await?.click().await?;
    b.fill("#form-generate textarea[name=prompt]", "1girl, paused farm")
        .await?;
    b.fill("#form-generate input[name=steps]", "2").await?;
    // A LoRA added to the catalogue from the page: a file that is none is refused with the
    // API's words and the file control marked; a LoRA is stored (its progress and result shown),
    // listed, and a generate names it.
    b.css("#lora-form input[type=file]")
        .await?
        .send_keys(&upload.path().display().to_string())
        .await?;
    b.fill("#lora-form input[name=name]", "web_png").await?;
    b.css("#lora-form button[type=submit]")
        .await?
        .click()
        .await?;
    let message = b
        .until(
            "the refusal of a file that is no LoRA",
            t,
            "const e = document.querySelector('#lora-error'); return !e.hidden && e.textContent",
        )
        .await?;
    ensure!(
        message
            .as_str()
            .is_some_and(|m| m.starts_with("file: not a safetensors file")),
        "{message}"
    );
    let marked = b
        .js("return document.querySelector('#lora-form input[type=file]').getAttribute('aria-invalid')")
        .await?;
    ensure!(marked == "true", "the file control is marked: {marked}");
    // WebDriver takes only a canonical path.
    let lora = crate::engines::models()
        .join("sdxl/lora/kohya.safetensors")
        .canonicalize()?;
    b.css("#lora-form input[type=file]")
        .await?
        .send_keys(&lora.display().to_string())
        .await?;
    b.fill("#lora-form input[name=name]", "web_ink").await?;
    b.css("#lora-form button[type=submit]")
        .await?
        .click()
        .await?;
    let added = b
        .until(
            "the LoRA to be added and listed",
            t,
            "const n = document.querySelector('#lora-note').textContent; \
             return document.querySelector('#lora-error').hidden \
               && document.querySelector('#lora-progress').value === 1 \
               && document.querySelector('#models li[data-model=web_ink]') && n",
        )
        .await?;
    ensure!(
        added
            .as_str()
            .is_some_and(|n| n.starts_with("Added web_ink (sha256:")),
        "{added}"
    );
    b.screenshot("lora-added").await?;
    ensure!(
        b.js("return document.querySelector('#form-error').hidden")
            .await?
            == true,
        "the upload left the job forms alone"
    );
    let listed = farm.get_json("/v1/models").await?;
    let entry = listed["models"]
        .as_array()
        .and_then(|m| m.iter().find(|e| e["name"] == "web_ink"))
        .with_context(|| format!("web_ink in {listed}"))?;
    ensure!(
        entry["role"] == "lora" && entry["size"] == std::fs::metadata(&lora)?.len(),
        "{entry}"
    );
    b.css("#tab-generate").await?.click().await?;
    b.fill("#form-generate input[name=steps]", "2").await?;
    b.fill("#form-generate input[name=loras]", "web_ink:0.8")
        .await?;
    b.css("#form-generate button[type=submit]")
        .await?
        .click()
        .await?;
    let waiting = b
        .until(
            "the new job's card to offer a move to the front",
            t,
            "const c = [...document.querySelectorAll('#jobs article[data-kind=generate]')] \
               .find(c => c.dataset.state === 'queued' && !c.querySelector('.front-button').hidden); \
             return c && c.dataset.jobId",
        )
        .await?;
    let waiting_card = format!(
        "#jobs article[data-job-id='{}']",
        waiting.as_str().context("id")?
    );
    b.screenshot("farm-paused").await?;
    b.css(&format!("{waiting_card} .front-button"))
        .await?
        .click()
        .await?;
    b.until(
        "the card to say who moved it",
        t,
        &format!(
            "return document.querySelector(\"{waiting_card} .owner\").textContent.includes('moved to the front by admin')"
        ),
    )
    .await?;
    b.css("#farm-pause").await?.click().await?;
    b.until(
        "the moved job to complete once the farm resumes",
        FINISH,
        &format!(
            "return document.querySelector(\"{waiting_card}\").dataset.state === 'completed' \
                  && document.querySelector('#farm-state').dataset.paused === 'false'"
        ),
    )
    .await?;
    let used = b
        .until(
            "the generate naming the uploaded LoRA to complete",
            FINISH,
            "const c = [...document.querySelectorAll('#jobs article[data-kind=generate]')][0]; \
             return c && c.dataset.state === 'completed' && c.dataset.jobId",
        )
        .await?;
    let used = farm.job(used.as_str().context("id")?).await?;
    ensure!(
        used.submission
            .as_ref()
            .and_then(|s| serde_json::to_string(s).ok())
            .is_some_and(|s| s.contains("web_ink")),
        "{used:?}"
    );
    b.fill("#form-generate input[name=loras]", "").await?;

    // Cancel a long job from its card.
    b.css("#tab-generate").await?.click().await?;
    b.fill("#form-generate input[name=steps]", "150").await?;
    b.fill("#form-generate input[name=width]", "256").await?;
    b.fill("#form-generate input[name=height]", "256").await?;
    b.css("#form-generate button[type=submit]")
        .await?
        .click()
        .await?;
    let slow = b
        .until(
            "the long job to run",
            FINISH,
            "const c = [...document.querySelectorAll('#jobs article[data-kind=generate]')].find(c => c.dataset.state === 'running'); return c && c.dataset.jobId",
        )
        .await?;
    let slow_card = format!(
        "#jobs article[data-job-id='{}']",
        slow.as_str().context("id")?
    );
    // Its card says when it should be done (generates of its size have run here), and on what
    // the estimate rests.
    let estimate = b
        .until(
            "the long job's estimate",
            FINISH,
            &format!(
                "const e = document.querySelector(\"{slow_card} .estimate\"); \
                 return e && e.textContent.startsWith('done ≈') && [e.textContent, e.title]"
            ),
        )
        .await?;
    ensure!(
        estimate[1]
            .as_str()
            .is_some_and(|t| t.contains("sdxl 0.25mp")),
        "{estimate}"
    );
    b.css(&format!("{slow_card} .cancel-button"))
        .await?
        .click()
        .await?;
    b.until(
        "the job to be cancelled",
        FINISH,
        &format!("return document.querySelector(\"{slow_card}\").dataset.state === 'cancelled'"),
    )
    .await?;
    b.screenshot("cancelled").await?;
    if b.js("return document.querySelector('#form-error').hidden")
        .await?
        != true
    {
        bail!("no error is left on the page");
    }
    Ok(())
}
