//! The chaos client: a realistic mixed workload over the HTTP API, and its ledger of what it sent
//! and what it was told.
//!
//! Every submission carries an idempotency key of its own. Whatever goes wrong (a refused
//! connection, a 503, a timeout, a scheduler killed mid-request) the client retries the *same*
//! body with the *same* key on the next scheduler, as a careful real client would; so a key is one
//! job, however many POSTs it took. Some keys are resubmitted on purpose after an answer, and some
//! are sent as simultaneous pairs to two different schedulers. The ledger records every job id any
//! scheduler answered for a key: more than one is a duplicate the audit reports.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use vnfarm_proto::Priority;

/// How long one submission is retried before the client gives up on it (the audit counts it as
/// lost). Outlasts any single fault of the schedule by far.
const RETRY_FOR: Duration = Duration::from_secs(90);
/// Pause before the first retry of one request; it doubles with each retry up to the maximum.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(2);
/// Bound of one HTTP request. A POST may wait up to 10 s for its job to appear in the registry.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Submissions in flight at most (being posted or retried); the workload waits beyond it, as a
/// client with a bounded connection pool would while the farm is down.
const IN_FLIGHT: usize = 16;

/// The kinds of submission the workload makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Generate,
    /// A base generate, 3–10 edits of it, sometimes an upscale.
    Pipeline,
    /// An edit whose input is image 0 of an earlier generate's outputs.
    Edit,
}

/// What the client knows about one idempotency key.
#[derive(Clone, Debug)]
pub struct Submitted {
    pub kind: Kind,
    /// The exact body every POST of this key carried.
    pub body: Value,
    /// Every job id a scheduler answered for this key; exactly one when all is well.
    pub ids: BTreeSet<String>,
    pub posts: u32,
    /// Why the client stopped trying without an answer (retries exhausted, or a 4xx).
    pub unanswered: Option<String>,
    pub cancel_requested: bool,
}

/// Counters of what the client did, for the summary.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub posts: u64,
    /// POSTs that got no job id (connection refused or reset, timeout, 5xx): each one retried.
    pub failed_posts: u64,
    pub resubmissions: u64,
    pub simultaneous_pairs: u64,
    pub cancels: u64,
}

/// The client's record of the run: every key it used, and its counters.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    pub submissions: BTreeMap<String, Submitted>,
    pub stats: Stats,
}

/// The answer to one POST.
enum Answer {
    Accepted(String),
    /// Worth retrying (on another scheduler): the farm is down or busy.
    Retry(String),
    /// A 4xx: the submission itself is wrong, retrying cannot help.
    Rejected(String),
}

/// A cheap handle on the client; clones share the ledger and the set of submission tasks.
#[derive(Clone)]
pub struct Client(Arc<Inner>);

struct Inner {
    http: reqwest::Client,
    /// Base URL of every scheduler slot; a slot's address survives its scheduler being replaced.
    schedulers: Vec<String>,
    /// Prefix of this run's idempotency keys.
    run: String,
    next_key: std::sync::atomic::AtomicU64,
    ledger: Mutex<Ledger>,
    /// Submissions being posted or retried, so that the end of the run can wait for them.
    tasks: Mutex<JoinSet<()>>,
    in_flight: Arc<Semaphore>,
}

impl Client {
    pub fn new(schedulers: Vec<String>) -> Self {
        Self::with_headers(schedulers, reqwest::header::HeaderMap::new())
    }

    /// A client that sends `headers` (the API token of a farm that wants one) on every request.
    pub fn with_headers(schedulers: Vec<String>, headers: reqwest::header::HeaderMap) -> Self {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .default_headers(headers)
            .build()
            .expect("a reqwest client with default TLS settings builds");
        Self(Arc::new(Inner {
            http,
            schedulers,
            run: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
            next_key: Default::default(),
            ledger: Mutex::default(),
            tasks: Mutex::default(),
            in_flight: Arc::new(Semaphore::new(IN_FLIGHT)),
        }))
    }

    fn ledger_mut(&self) -> MutexGuard<'_, Ledger> {
        // Ledger updates are plain inserts that do not panic midway.
        self.0.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the ledger as it stands.
    pub fn ledger(&self) -> Ledger {
        self.ledger_mut().clone()
    }

    pub fn schedulers(&self) -> usize {
        self.0.schedulers.len()
    }

    /// Makes submissions until `until`: one action every 100–400 ms, each to a random scheduler. The
    /// mix: 45 % generates, 25 % pipelines, 15 % edits of an earlier generate's output, 7 % a
    /// simultaneous same-key pair, 5 % a resubmission of an answered key, 3 % a cancel. Submissions
    /// still being retried then go on in the background; [`Client::drain`] waits for them.
    pub async fn run(self, until: Instant, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
            // Waits while `IN_FLIGHT` submissions are unanswered (the farm is down).
            let permit = Arc::clone(&self.0.in_flight)
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            let roll = rng.random_range(0..100);
            let slot = rng.random_range(0..self.schedulers());
            let priority = priority(&mut rng);
            match roll {
                0..45 => self.spawn_new(Kind::Generate, generate(&mut rng), priority, slot, permit),
                45..70 => {
                    self.spawn_new(Kind::Pipeline, pipeline(&mut rng), priority, slot, permit)
                }
                70..85 => {
                    let (kind, job) = match self.earlier_generate(&mut rng).await {
                        Some(input) => (Kind::Edit, edit(&input, &mut rng)),
                        None => (Kind::Generate, generate(&mut rng)),
                    };
                    self.spawn_new(kind, job, priority, slot, permit);
                }
                85..92 => {
                    let (kind, job) = generate_or_pipeline(&mut rng);
                    self.spawn_pair(kind, job, priority, permit);
                }
                92..97 => self.spawn_resubmission(&mut rng, permit),
                _ => self.spawn_cancel(&mut rng, permit),
            }
        }
    }

    /// Waits until every submission got its answer or its retries ran out.
    pub async fn drain(&self) {
        let tasks = std::mem::take(&mut *self.0.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        tasks.join_all().await;
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.0
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .spawn(task);
    }

    /// Records a new key for `job` (a submission without its envelope) and returns the key and the
    /// full body.
    pub fn register(&self, kind: Kind, job: Value, priority: Priority) -> (String, Value) {
        let n = self
            .0
            .next_key
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Zero-padded, so the ledger's key order is the order of submission.
        let key = format!("chaos-{}-{n:06}", self.0.run);
        let body =
            json!({"schema_version": 1, "idempotency_key": key, "priority": priority, "job": job});
        self.ledger_mut().submissions.insert(
            key.clone(),
            Submitted {
                kind,
                body: body.clone(),
                ids: BTreeSet::new(),
                posts: 0,
                unanswered: None,
                cancel_requested: false,
            },
        );
        (key, body)
    }

    fn spawn_new(
        &self,
        kind: Kind,
        job: Value,
        priority: Priority,
        slot: usize,
        permit: OwnedSemaphorePermit,
    ) {
        let (key, body) = self.register(kind, job, priority);
        let client = self.clone();
        self.spawn(async move {
            client.submit(&key, &body, slot).await;
            drop(permit);
        });
    }

    /// The same submission sent at the same moment to two schedulers (the same one when there is
    /// only one): both must answer with one job id.
    fn spawn_pair(&self, kind: Kind, job: Value, priority: Priority, permit: OwnedSemaphorePermit) {
        let (key, body) = self.register(kind, job, priority);
        self.ledger_mut().stats.simultaneous_pairs += 1;
        let client = self.clone();
        let other = 1 % self.schedulers();
        self.spawn(async move {
            tokio::join!(
                client.submit(&key, &body, 0),
                client.submit(&key, &body, other)
            );
            drop(permit);
        });
    }

    /// An answered key sent again, to any scheduler: the answer must be the same job.
    fn spawn_resubmission(&self, rng: &mut StdRng, permit: OwnedSemaphorePermit) {
        let answered: Vec<(String, Value)> = self
            .ledger_mut()
            .submissions
            .iter()
            .filter(|(_, s)| !s.ids.is_empty())
            .map(|(k, s)| (k.clone(), s.body.clone()))
            .collect();
        let Some((key, body)) = answered.choose(rng).cloned() else {
            return;
        };
        self.ledger_mut().stats.resubmissions += 1;
        let client = self.clone();
        let slot = rng.random_range(0..self.schedulers());
        self.spawn(async move {
            client.submit(&key, &body, slot).await;
            drop(permit);
        });
    }

    /// Cancels one of the latest jobs the client was told about (it may have finished already).
    fn spawn_cancel(&self, rng: &mut StdRng, permit: OwnedSemaphorePermit) {
        let candidates: Vec<(String, String)> = self
            .ledger_mut()
            .submissions
            .iter()
            .rev()
            .filter(|(_, s)| !s.cancel_requested)
            .filter_map(|(k, s)| Some((k.clone(), s.ids.first()?.clone())))
            .take(8)
            .collect();
        let Some((key, id)) = candidates.choose(rng).cloned() else {
            return;
        };
        {
            let mut ledger = self.ledger_mut();
            ledger.stats.cancels += 1;
            if let Some(s) = ledger.submissions.get_mut(&key) {
                s.cancel_requested = true;
            }
        }
        let client = self.clone();
        let slot = rng.random_range(0..self.schedulers());
        self.spawn(async move {
            client.cancel(&id, slot).await;
            drop(permit);
        });
    }

    /// The id of an earlier generate for an edit to take as input: a completed one when one of a
    /// few picks has completed, else any (the edit then waits for it, or fails with it).
    async fn earlier_generate(&self, rng: &mut StdRng) -> Option<String> {
        let generates: Vec<String> = self
            .ledger_mut()
            .submissions
            .values()
            .filter(|s| s.kind == Kind::Generate)
            .filter_map(|s| s.ids.first().cloned())
            .collect();
        for _ in 0..3 {
            let id = generates.choose(rng)?;
            let url = format!("{}/v1/jobs/{id}", self.0.schedulers.choose(rng)?);
            let job = async { self.0.http.get(url).send().await?.json::<Value>().await };
            if job.await.is_ok_and(|j| j["state"] == "completed") {
                return Some(id.clone());
            }
        }
        generates.choose(rng).cloned()
    }

    /// POSTs `body` until some scheduler answers with a job id, starting at `slot` and moving to
    /// the next one after each failure; records the answer (or why there was none) in the ledger,
    /// and returns the job id when there was one.
    pub async fn submit(&self, key: &str, body: &Value, mut slot: usize) -> Option<String> {
        let give_up = Instant::now() + RETRY_FOR;
        let mut pause = RETRY_PAUSE;
        loop {
            match self.post(slot, key, body).await {
                Answer::Accepted(id) => {
                    self.answered(key, id.clone());
                    return Some(id);
                }
                Answer::Rejected(why) => {
                    self.unanswered(key, why);
                    return None;
                }
                Answer::Retry(why) if Instant::now() > give_up => {
                    self.unanswered(key, format!("no answer after {RETRY_FOR:?}: {why}"));
                    return None;
                }
                Answer::Retry(_) => {
                    slot = (slot + 1) % self.schedulers();
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
            }
        }
    }

    /// One POST of `key`'s body to the scheduler in `slot`, counted in the ledger.
    async fn post(&self, slot: usize, key: &str, body: &Value) -> Answer {
        {
            let mut ledger = self.ledger_mut();
            ledger.stats.posts += 1;
            if let Some(s) = ledger.submissions.get_mut(key) {
                s.posts += 1;
            }
        }
        let url = format!("{}/v1/jobs", self.0.schedulers[slot]);
        let answer = match self.0.http.post(url).json(body).send().await {
            Err(e) => Answer::Retry(e.to_string()),
            Ok(r) => {
                let status = r.status();
                let reply: Value = r.json().await.unwrap_or_default();
                match (status.as_u16(), reply["job_id"].as_str()) {
                    (200 | 201, Some(id)) => Answer::Accepted(id.to_owned()),
                    (400..500, _) => Answer::Rejected(format!("{status}: {reply}")),
                    _ => Answer::Retry(format!("{status}: {reply}")),
                }
            }
        };
        if !matches!(answer, Answer::Accepted(_)) {
            self.ledger_mut().stats.failed_posts += 1;
        }
        answer
    }

    /// Sends one POST of a registered key to `slot` in the background, and hands back its answer:
    /// the job id, or `None` when it got none (the caller then retries with [`Client::resubmit`]).
    pub fn post_in_background(
        &self,
        key: &str,
        body: &Value,
        slot: usize,
    ) -> tokio::task::JoinHandle<Option<String>> {
        let (client, key, body) = (self.clone(), key.to_owned(), body.clone());
        tokio::spawn(async move {
            match client.post(slot, &key, &body).await {
                Answer::Accepted(id) => {
                    client.answered(&key, id.clone());
                    Some(id)
                }
                Answer::Retry(_) | Answer::Rejected(_) => None,
            }
        })
    }

    /// Retries a registered key in the background, starting at `slot` (see [`Client::submit`]).
    pub fn resubmit(&self, key: &str, body: &Value, slot: usize) {
        let (client, key, body) = (self.clone(), key.to_owned(), body.clone());
        self.spawn(async move {
            client.submit(&key, &body, slot).await;
        });
    }

    fn answered(&self, key: &str, id: String) {
        if let Some(s) = self.ledger_mut().submissions.get_mut(key) {
            s.ids.insert(id);
            s.unanswered = None;
        }
    }

    fn unanswered(&self, key: &str, why: String) {
        if let Some(s) = self.ledger_mut().submissions.get_mut(key)
            && s.ids.is_empty()
        {
            s.unanswered = Some(why);
        }
    }

    /// Asks for a cancel until a scheduler takes the request (202) or says it cannot be had (409:
    /// already finished); a 404 is retried too, since a scheduler may not have seen the job yet.
    async fn cancel(&self, id: &str, mut slot: usize) {
        let give_up = Instant::now() + RETRY_FOR;
        let mut pause = RETRY_PAUSE;
        while Instant::now() < give_up {
            let url = format!("{}/v1/jobs/{id}/cancel", self.0.schedulers[slot]);
            if let Ok(r) = self.0.http.post(url).send().await
                && matches!(r.status().as_u16(), 202 | 409)
            {
                return;
            }
            slot = (slot + 1) % self.schedulers();
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_PAUSE_MAX);
        }
    }
}

/// A small generate: one or two 256² images, a few steps.
pub fn generate(rng: &mut StdRng) -> Value {
    json!({"kind": "generate", "prompt": format!("chaos generate {}", rng.random::<u32>()),
        "width": 256, "height": 256, "steps": rng.random_range(3..=8), "count": rng.random_range(1..=2)})
}

/// A pipeline: a base, 3–10 edits of it, and in a third of them an upscale of the base or an edit.
pub fn pipeline(rng: &mut StdRng) -> Value {
    let edits: Vec<Value> = (0..rng.random_range(3..=10))
        .map(|n| json!({"instruction": format!("variant {n}"), "steps": rng.random_range(1..=3)}))
        .collect();
    let upscales = if rng.random_bool(0.3) {
        let of = match rng.random_range(0..=edits.len()) {
            0 => json!("base"),
            n => json!({"edit": n - 1}),
        };
        vec![json!({"of": of, "scale": 2})]
    } else {
        Vec::new()
    };
    json!({"kind": "pipeline",
        "base": {"prompt": format!("chaos pipeline {}", rng.random::<u32>()), "width": 256, "height": 256,
            "steps": rng.random_range(3..=8)},
        "edits": edits, "upscales": upscales})
}

/// An edit of image 0 of job `input`.
fn edit(input: &str, rng: &mut StdRng) -> Value {
    json!({"kind": "edit", "input": {"job_output": {"job": input, "index": 0}},
        "instruction": format!("chaos edit {}", rng.random::<u32>()),
        "width": 256, "height": 256, "steps": rng.random_range(1..=3)})
}

/// One submission in five is interactive (overtakes batch work).
pub fn priority(rng: &mut StdRng) -> Priority {
    if rng.random_bool(0.2) {
        Priority::Interactive
    } else {
        Priority::Batch
    }
}

fn generate_or_pipeline(rng: &mut StdRng) -> (Kind, Value) {
    if rng.random_bool(0.5) {
        (Kind::Generate, generate(rng))
    } else {
        (Kind::Pipeline, pipeline(rng))
    }
}
