//! Harness for vnfarm's end-to-end tests: real RabbitMQ (on `VNFARM_TEST_AMQP_URL`, default
//! 127.0.0.1:5672), a real S3 server (`s3s-fs`, started here on a free port), and the real scheduler
//! and worker: the binaries as child processes, so that tests can SIGKILL and SIGTERM them, or, for
//! the tests that kill nothing, the crates' `serve` in the test's own process ([`in_process`]).
//!
//! Every test gets its own broker prefix (queues, exchanges, stream) and its own bucket, so tests run
//! side by side on one broker. Waits poll a condition with a deadline; there are no fixed sleeps.
//!
//! A farm may run several schedulers on one prefix (each on its own HTTP port: standbys, and
//! replacements for killed ones) and restart its workers; [`restart_rabbitmq`] restarts the shared
//! broker, so only a test binary of its own may call it. No process outlives the test binary: the
//! S3 server runs under a guard, and a [`Farm`] kills its schedulers and workers when dropped.

pub mod access;
pub mod fleet;
mod in_process;
pub mod sse;
pub mod stream;

use std::fmt::Display;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use in_process::InProcess;
use serde_json::Value;
use vnfarm_proto::JobId;
use vnfarm_proto::http::{ErrorBody, Fleet, JobAnswer, JobView, Submitted, Worker};
use vnfarm_storage::{Storage, StorageConfig};

pub const S3_KEY: &str = "vnfarm-test";
pub const S3_SECRET: &str = "vnfarm-test-secret";

pub fn amqp_url() -> String {
    std::env::var("VNFARM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Directory of the workspace's binaries (`target/<profile>`), found from this executable's path:
/// a test runs from `target/<profile>/deps`, a program of this crate (the benchmarks) from
/// `target/<profile>` itself.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running program knows its path");
    let parent = exe.parent().expect("an executable lies in a directory");
    let dir = if parent.file_name().is_some_and(|name| name == "deps") {
        parent.parent().expect("deps lies in target/<profile>")
    } else {
        parent
    }
    .to_path_buf();
    for bin in ["vnfarm-scheduler", "vnfarm-worker"] {
        assert!(
            dir.join(bin).exists(),
            "{} missing: `cargo build --workspace --bins` first (`./farm test` does)",
            dir.join(bin).display()
        );
    }
    dir
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Waits until `f` returns `Some`, or fails after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An `s3s-fs` S3 server serving a directory on a port.
pub struct S3Server {
    pub endpoint: String,
    port: u16,
    root: PathBuf,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl S3Server {
    /// Starts a server on a free port over a fresh directory.
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let port = free_port();
        let mut server = S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
            port,
            root: dir.path().to_path_buf(),
            child: None,
            _dir: dir,
        };
        server.restart()?;
        Ok(server)
    }

    /// Stops the server (an outage); its data stays. Closing the guard's stdin makes it stop
    /// `s3s-fs` and wait for it, so the port is free when this returns.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data, and waits until it listens.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        // `s3s-fs` runs under a small shell guard that stops it when the guard's stdin closes: when
        // `stop` drops the pipe, and when the test binary exits however it exits (the shared
        // server lives in a static, which is never dropped), so no server outlives the suite.
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"s3s-fs "$@" & pid=$!; trap 'kill $pid 2>/dev/null; wait $pid' EXIT; read -r _; exit 0"#)
            .arg("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
            .arg(&self.root)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting sh for s3s-fs")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "s3s-fs did not start listening on {} (is it installed? \
                     `cargo install s3s-fs@0.14.1 --features binary --locked`; .ci/run does it)",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The S3 server shared by all tests of one test binary.
pub fn s3() -> &'static S3Server {
    static S3: OnceLock<S3Server> = OnceLock::new();
    S3.get_or_init(|| S3Server::start().expect("the shared S3 server"))
}

/// Runs `rabbitmqctl <verb>` against the broker of the tests (the node in `RABBITMQ_NODENAME`, by
/// default the local one). Needs the right to administer it (root, as in CI).
pub fn rabbitmqctl(verb: &str) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl")
        .arg(verb)
        .output()
        .context("running rabbitmqctl (./farm setup installs RabbitMQ)")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl {verb} failed (restarting the broker needs the right to administer it):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Restarts the RabbitMQ application (`stop_app`, `down` of outage, `start_app`) and waits until it
/// serves again. Every test on the broker loses its connections: call it only from a test binary
/// of its own (cargo runs test binaries one after another).
pub async fn restart_rabbitmq(down: Duration) -> anyhow::Result<()> {
    let ctl = |verb: &'static str| async move {
        tokio::task::spawn_blocking(move || rabbitmqctl(verb))
            .await
            .context("rabbitmqctl task")?
    };
    ctl("stop_app").await?;
    tokio::time::sleep(down).await;
    ctl("start_app").await?;
    ctl("await_startup").await
}

/// A PNG of `width`×`height` whose pixels depend on `seed`.
pub fn png_bytes(width: u32, height: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([x as u8 ^ seed, y as u8, seed.wrapping_mul(31)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)
        .expect("encoding a PNG in memory cannot fail");
    out.into_inner()
}

/// What a scheduler says it is doing (`GET /healthz`, field `role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Holds the leader token: consumes intake, dispatches, runs the watchdog.
    Active,
    /// Serves the API from the stream and waits for the token.
    Standby,
}

/// How a farm runs its schedulers and workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Servers {
    /// The binaries as child processes, which a test may SIGKILL, SIGTERM and start again.
    Processes,
    /// The crates' `serve` in this process, for tests that kill nothing (see [`in_process`]).
    InProcess,
}

/// A running scheduler or worker.
enum Running {
    Process(Child),
    InProcess(InProcess),
}

impl Running {
    /// Stops it at once: SIGKILLs and reaps a process, drops an in-process server.
    fn kill(self) {
        match self {
            Running::Process(mut child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Running::InProcess(server) => drop(server),
        }
    }

    fn child(&mut self) -> &mut Child {
        match self {
            Running::Process(child) => child,
            Running::InProcess(_) => panic!("an in-process server has no process: use Farm::new"),
        }
    }
}

/// One scheduler of a farm: a fixed HTTP port and log, and the server while one runs there. A
/// replacement for a killed scheduler starts in the same slot, so clients keep their addresses.
struct SchedulerSlot {
    port: u16,
    log: String,
    running: Option<Running>,
}

/// A worker, with the options it was started with (to start it again after a kill).
struct WorkerProcess {
    id: String,
    options: WorkerOptions,
    running: Option<Running>,
}

/// One test's installation: a broker prefix, a bucket, and the processes it started.
pub struct Farm {
    pub prefix: String,
    pub bucket: String,
    /// The S3 endpoint of this farm: the shared server, or [`Farm::own_s3`]'s.
    pub s3_endpoint: String,
    /// A server of this farm's own, for tests that take S3 down.
    pub own_s3: Option<S3Server>,
    /// The port of the first scheduler, which [`Farm::url`] and the helpers built on it address.
    pub scheduler_port: u16,
    /// Extra environment for schedulers started from now on (settings a test needs).
    pub scheduler_env: Vec<(String, String)>,
    pub http: reqwest::Client,
    pub storage: Storage,
    servers: Servers,
    schedulers: Vec<SchedulerSlot>,
    workers: Vec<WorkerProcess>,
    logs: tempfile::TempDir,
}

/// Settings a test may change on the workers it starts.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub step_ms: u64,
    pub extra_env: Vec<(String, String)>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            step_ms: 5,
            extra_env: Vec::new(),
        }
    }
}

impl WorkerOptions {
    /// These options with `env` added to the worker's settings (later ones win, for a process and
    /// for an in-process worker alike).
    pub fn with_env(mut self, env: impl IntoIterator<Item = (String, String)>) -> Self {
        self.extra_env.extend(env);
        self
    }
}

/// The scheduler's answer to a submission: the job it made (or the one of the same key), or why
/// it refused.
pub type Reply = Result<Submitted, ErrorBody>;

impl Farm {
    /// A farm of processes on the shared S3 server.
    pub async fn new(name: &str) -> anyhow::Result<Self> {
        Self::on(name, None, Servers::Processes).await
    }

    /// A farm whose servers run in this process, on the shared S3 server: for a test that kills
    /// no scheduler or worker and reads no log file.
    pub async fn in_process(name: &str) -> anyhow::Result<Self> {
        Self::on(name, None, Servers::InProcess).await
    }

    /// A farm of processes with an S3 server of its own (`own_s3`), which the test may stop and
    /// restart.
    pub async fn with_own_s3(name: &str) -> anyhow::Result<Self> {
        Self::on(name, Some(S3Server::start()?), Servers::Processes).await
    }

    async fn on(name: &str, own_s3: Option<S3Server>, servers: Servers) -> anyhow::Result<Self> {
        let unique = format!("{name}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let prefix = format!("t-{unique}");
        let bucket = format!("t-{unique}").to_lowercase().replace('_', "-");
        let s3_endpoint = own_s3
            .as_ref()
            .map_or_else(|| s3().endpoint.clone(), |s| s.endpoint.clone());
        let storage = Storage::open(&Self::storage_config(&bucket, &s3_endpoint))
            .await
            .context("creating the test bucket")?;
        let first = SchedulerSlot {
            port: free_port(),
            log: "scheduler.log".into(),
            running: None,
        };
        Ok(Self {
            prefix,
            bucket,
            s3_endpoint,
            own_s3,
            scheduler_port: first.port,
            scheduler_env: Vec::new(),
            http: reqwest::Client::new(),
            storage,
            servers,
            schedulers: vec![first],
            workers: Vec::new(),
            logs: tempfile::tempdir()?,
        })
    }

    fn storage_config(bucket: &str, endpoint: &str) -> StorageConfig {
        StorageConfig::S3 {
            bucket: bucket.to_owned(),
            endpoint: Some(endpoint.to_owned()),
            region: "us-east-1".into(),
            path_style: true,
            access_key_id: Some(S3_KEY.into()),
            secret_access_key: Some(S3_SECRET.into()),
            create_bucket: true,
            public_endpoint: None,
        }
    }

    fn common_env(&self) -> Vec<(String, String)> {
        [
            ("VNFARM_AMQP__URL", amqp_url()),
            ("VNFARM_AMQP__PREFIX", self.prefix.clone()),
            ("VNFARM_STORAGE__BACKEND", "s3".into()),
            ("VNFARM_STORAGE__BUCKET", self.bucket.clone()),
            ("VNFARM_STORAGE__ENDPOINT", self.s3_endpoint.clone()),
            ("VNFARM_STORAGE__ACCESS_KEY_ID", S3_KEY.into()),
            ("VNFARM_STORAGE__SECRET_ACCESS_KEY", S3_SECRET.into()),
            ("RUST_LOG", in_process::LOG_FILTER.into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Starts the binary `bin` with `env`, or for an in-process farm its crate's `serve` with the
    /// configuration that `env` gives.
    fn spawn(&self, bin: &str, log: &str, env: Vec<(String, String)>) -> anyhow::Result<Running> {
        if self.servers == Servers::InProcess {
            let server = match bin {
                "vnfarm-scheduler" => {
                    InProcess::scheduler(vnfarm_scheduler::Config::load(None, env)?)
                }
                _ => InProcess::worker(vnfarm_worker::Config::load(None, env)?),
            };
            return Ok(Running::InProcess(server?));
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.path().join(log))?;
        Ok(Command::new(bin_dir().join(bin))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map(Running::Process)?)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.scheduler_port)
    }

    /// Starts the (first) scheduler and waits until it has replayed its stream and answers.
    pub async fn start_scheduler(&mut self) -> anyhow::Result<()> {
        self.start_scheduler_at(0).await
    }

    /// Adds a scheduler slot on a port of its own (same prefix and bucket); returns its index for
    /// [`Farm::start_scheduler_at`]. Nothing runs there until it is started.
    pub fn add_scheduler(&mut self) -> usize {
        let slot = self.schedulers.len();
        self.schedulers.push(SchedulerSlot {
            port: free_port(),
            log: format!("scheduler-{slot}.log"),
            running: None,
        });
        slot
    }

    /// How many scheduler slots the farm has (see [`Farm::add_scheduler`]).
    pub fn scheduler_slots(&self) -> usize {
        self.schedulers.len()
    }

    /// The base URL (`http://127.0.0.1:<port>`) of every scheduler slot, by index.
    pub fn scheduler_urls(&self) -> Vec<String> {
        self.schedulers
            .iter()
            .map(|s| format!("http://127.0.0.1:{}", s.port))
            .collect()
    }

    /// Starts a scheduler in `slot` (killing one still running there) and waits until it has
    /// replayed its stream and answers `/healthz`, as active or standby.
    pub async fn start_scheduler_at(&mut self, slot: usize) -> anyhow::Result<()> {
        self.launch_scheduler_at(slot)?;
        let log = self.schedulers[slot].log.clone();
        wait_for("the scheduler to be ready", Duration::from_secs(60), || {
            self.role(slot)
        })
        .await
        .map_err(|e| e.context(self.log(&log)))?;
        Ok(())
    }

    /// Starts a scheduler process in `slot` (killing one still running there) without waiting
    /// for it.
    pub fn launch_scheduler_at(&mut self, slot: usize) -> anyhow::Result<()> {
        self.kill_scheduler_at(slot);
        let port = self.schedulers[slot].port;
        let mut env = self.common_env();
        env.push(("VNFARM_LISTEN".into(), format!("127.0.0.1:{port}")));
        env.push(("VNFARM_HEARTBEAT_TIMEOUT_MS".into(), "3000".into()));
        env.push(("VNFARM_DISPATCH_TTL_MS".into(), "2000".into()));
        env.extend(self.scheduler_env.iter().cloned());
        let log = self.schedulers[slot].log.clone();
        self.schedulers[slot].running = Some(self.spawn("vnfarm-scheduler", &log, env)?);
        Ok(())
    }

    /// The process id of the scheduler running in `slot`, if a process runs there.
    pub fn scheduler_pid(&self, slot: usize) -> Option<u32> {
        match &self.schedulers[slot].running {
            Some(Running::Process(child)) => Some(child.id()),
            Some(Running::InProcess(_)) | None => None,
        }
    }

    /// The name of the log file of `slot`'s schedulers (for [`Farm::full_log`]).
    pub fn scheduler_log(&self, slot: usize) -> &str {
        &self.schedulers[slot].log
    }

    /// The role of the scheduler in `slot`, or `None` while it is not ready (or not running). A
    /// scheduler that does not report a role acts on its own, as an active one does.
    pub async fn role(&self, slot: usize) -> Option<Role> {
        let url = format!("{}/healthz", self.scheduler_urls()[slot]);
        let response = self
            .http
            .get(url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())?;
        let health: Value = response.json().await.ok()?;
        match health["role"].as_str() {
            Some("standby") => Some(Role::Standby),
            Some(_) | None => Some(Role::Active),
        }
    }

    /// Waits until some scheduler reports itself active and returns its slot.
    pub async fn active_scheduler(&self, timeout: Duration) -> anyhow::Result<usize> {
        wait_for("an active scheduler", timeout, || async {
            for slot in 0..self.schedulers.len() {
                if self.role(slot).await == Some(Role::Active) {
                    return Some(slot);
                }
            }
            None
        })
        .await
    }

    /// Starts a worker and waits until the scheduler lists it alive.
    pub async fn start_worker(&mut self, id: &str, options: WorkerOptions) -> anyhow::Result<()> {
        self.launch_worker(id, options)?;
        self.wait_worker(id).await
    }

    /// Waits until the scheduler lists the worker `id` alive.
    pub async fn wait_worker(&self, id: &str) -> anyhow::Result<()> {
        let id = id.to_owned();
        wait_for(
            &format!("worker {id} to register"),
            // Covers loading and warming up a model engine on a loaded CI machine.
            Duration::from_secs(120),
            || async {
                let workers = self.workers().await.ok()?;
                workers
                    .iter()
                    .any(|w| w.id.as_str() == id && w.alive)
                    .then_some(())
            },
        )
        .await
        .map_err(|e| e.context(self.log(&format!("{id}.log"))))
    }

    /// Starts a worker process without waiting for it.
    pub fn launch_worker(&mut self, id: &str, options: WorkerOptions) -> anyhow::Result<()> {
        let mut env = self.common_env();
        env.push(("VNFARM_WORKER_ID".into(), id.into()));
        // Port 0: the worker binds whatever port the kernel gives it (no test reads a worker's
        // port unless it sets VNFARM_LISTEN itself in `extra_env`). A port picked here and handed
        // over could be taken by a parallel test's process in between ("Address already in use").
        env.push(("VNFARM_LISTEN".into(), "127.0.0.1:0".into()));
        env.push(("VNFARM_HEARTBEAT_INTERVAL_MS".into(), "300".into()));
        // The farm's own, not the default beside the test's working directory.
        env.push((
            "VNFARM_HASH_CACHE_DIR".into(),
            self.logs.path().join("hash-cache").display().to_string(),
        ));
        env.push((
            "VNFARM_MODEL_CACHE__DIR".into(),
            self.logs
                .path()
                .join(format!("model-cache-{id}"))
                .display()
                .to_string(),
        ));
        env.push((
            "VNFARM_ENGINE__TEST_PATTERN__STEP_MS".into(),
            options.step_ms.to_string(),
        ));
        env.push(("VNFARM_ENGINE__TEST_PATTERN__ENCODE_MS".into(), "5".into()));
        env.push(("VNFARM_ENGINE__TEST_PATTERN__DECODE_MS".into(), "5".into()));
        env.extend(options.extra_env.iter().cloned());
        let running = self.spawn("vnfarm-worker", &format!("{id}.log"), env)?;
        match self.workers.iter_mut().find(|w| w.id == id) {
            Some(known) => {
                // Started again: reap the old process (killed, or exited on its own) first.
                if let Some(old) = known.running.replace(running) {
                    old.kill();
                }
                known.options = options;
            }
            None => self.workers.push(WorkerProcess {
                id: id.to_owned(),
                options,
                running: Some(running),
            }),
        }
        Ok(())
    }

    /// SIGKILLs a worker and reaps it; [`Farm::relaunch_worker`] starts it again.
    pub fn kill_worker(&mut self, id: &str) {
        if let Some(running) = self.worker(id).running.take() {
            running.kill();
        }
    }

    /// Starts a worker again with the id and options it had, without waiting for it.
    pub fn relaunch_worker(&mut self, id: &str) -> anyhow::Result<()> {
        let options = self.worker(id).options.clone();
        self.launch_worker(id, options)
    }

    /// The ids of the workers this farm started.
    pub fn worker_ids(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.id.clone()).collect()
    }

    fn worker(&mut self, id: &str) -> &mut WorkerProcess {
        self.workers
            .iter_mut()
            .find(|w| w.id == id)
            .expect("a started worker")
    }

    /// The process of a worker that runs (not killed by [`Farm::kill_worker`]).
    pub fn worker_mut(&mut self, id: &str) -> &mut Child {
        self.worker(id)
            .running
            .as_mut()
            .expect("a running worker")
            .child()
    }

    pub fn signal_worker(&mut self, id: &str, signal: i32) {
        let pid = self.worker_mut(id).id() as i32;
        // kill(2) on the pid of a child this harness spawned and has not reaped: no memory is involved.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal})");
    }

    /// SIGKILLs the (first) scheduler.
    pub fn kill_scheduler(&mut self) {
        self.kill_scheduler_at(0);
    }

    /// SIGKILLs the scheduler in `slot`, if one runs there, and reaps it.
    pub fn kill_scheduler_at(&mut self, slot: usize) {
        if let Some(running) = self.schedulers[slot].running.take() {
            running.kill();
        }
    }

    /// The whole log of one process.
    pub fn full_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.path().join(name)).unwrap_or_default()
    }

    /// The tail of one process's log, for failure messages.
    pub fn log(&self, name: &str) -> String {
        if self.servers == Servers::InProcess {
            return format!("--- {name}: in-process, logged in the test's output ---");
        }
        let text = std::fs::read_to_string(self.logs.path().join(name)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        format!(
            "--- {name} (last lines) ---\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    pub async fn get_json(&self, path: &str) -> anyhow::Result<Value> {
        let r = self.http.get(self.url(path)).send().await?;
        let status = r.status();
        let body: Value = r.json().await?;
        if !status.is_success() {
            bail!("GET {path}: {status}: {body}");
        }
        Ok(body)
    }

    /// POSTs a submission; returns the status and the answer: the job, or the error body.
    pub async fn submit(&self, body: &Value) -> anyhow::Result<(reqwest::StatusCode, Reply)> {
        let r = self
            .http
            .post(self.url("/v1/jobs"))
            .json(body)
            .send()
            .await?;
        let status = r.status();
        let bytes = r.bytes().await?;
        let reply = if status.is_success() {
            Ok(serde_json::from_slice(&bytes)
                .with_context(|| format!("{status}: {}", String::from_utf8_lossy(&bytes)))?)
        } else {
            Err(serde_json::from_slice(&bytes)
                .with_context(|| format!("{status}: {}", String::from_utf8_lossy(&bytes)))?)
        };
        Ok((status, reply))
    }

    /// POSTs a submission that must make a new job (201); returns its id.
    pub async fn submit_new(&self, body: &Value) -> anyhow::Result<JobId> {
        match self.submit(body).await? {
            (reqwest::StatusCode::CREATED, Ok(submitted)) => Ok(submitted.job_id),
            (status, reply) => bail!("submitting {body}: {status} {reply:?}"),
        }
    }

    /// Asks the scheduler to cancel a job; fails unless the request is accepted.
    pub async fn cancel(&self, id: impl Display) -> anyhow::Result<()> {
        let r = self
            .http
            .post(self.url(&format!("/v1/jobs/{id}/cancel")))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "cancel {id}: {}", r.status());
        Ok(())
    }

    /// The (first) scheduler's `/metrics` text.
    pub async fn scheduler_metrics(&self) -> anyhow::Result<String> {
        Ok(self
            .http
            .get(self.url("/metrics"))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// Submits a job that must be new and waits until it is in a final state (whichever).
    pub async fn run(&self, body: &Value, timeout: Duration) -> anyhow::Result<JobView> {
        let id = self.submit_new(body).await?;
        self.wait_finished(id, timeout).await
    }

    /// The bytes of each of a job's outputs, in order, from storage.
    pub async fn outputs(&self, job: &JobView) -> anyhow::Result<Vec<bytes::Bytes>> {
        let mut outputs = Vec::with_capacity(job.outputs.len());
        for key in &job.outputs {
            outputs.push(self.storage.get(key).await?);
        }
        Ok(outputs)
    }

    /// A job the registry holds, as the API's view.
    pub async fn job(&self, id: impl Display) -> anyhow::Result<JobView> {
        let job = self.get_json(&format!("/v1/jobs/{id}")).await?;
        serde_json::from_value(job.clone()).with_context(|| format!("job {id} as a view: {job}"))
    }

    /// `GET /v1/jobs` with `query` (`all=true&limit=1000`), as views.
    pub async fn jobs(&self, query: &str) -> anyhow::Result<Vec<JobView>> {
        let mut list = self.get_json(&format!("/v1/jobs?{query}")).await?;
        Ok(serde_json::from_value(list["jobs"].take())?)
    }

    /// A job as `GET /v1/jobs/{id}` answers it: the registry's view, or an archived job's.
    pub async fn job_answer(&self, id: impl Display) -> anyhow::Result<JobAnswer> {
        Ok(serde_json::from_value(
            self.get_json(&format!("/v1/jobs/{id}")).await?,
        )?)
    }

    /// The workers the scheduler lists.
    pub async fn workers(&self) -> anyhow::Result<Vec<Worker>> {
        let fleet: Fleet = serde_json::from_value(self.get_json("/v1/workers").await?)?;
        Ok(fleet.workers)
    }

    /// Waits until the job has reported denoising step `step` (or a later one).
    pub async fn wait_step(
        &self,
        id: impl Display,
        step: u32,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        wait_for(
            &format!("job {id} to reach step {step}"),
            timeout,
            || async {
                let job = self.job(&id).await.ok()?;
                job.progress.filter(|p| p.step >= step).map(|_| ())
            },
        )
        .await
    }

    /// Waits until the job is in a final state and returns it: for a job the registry holds (see
    /// [`Farm::wait_finished_or_archived`] where retention may have archived it).
    pub async fn wait_finished(
        &self,
        id: impl Display,
        timeout: Duration,
    ) -> anyhow::Result<JobView> {
        wait_for(&format!("job {id} to finish"), timeout, || async {
            let job = self.job(&id).await.ok()?;
            job.state.is_terminal().then_some(job)
        })
        .await
        .map_err(|e| {
            e.context(format!(
                "{}\n{}",
                self.log("scheduler.log"),
                self.worker_logs()
            ))
        })
    }

    /// Waits until the job is in a final state, as the registry's view or as an archived job.
    pub async fn wait_finished_or_archived(
        &self,
        id: impl Display,
        timeout: Duration,
    ) -> anyhow::Result<JobAnswer> {
        wait_for(&format!("job {id} to finish"), timeout, || async {
            let job = self.job_answer(&id).await.ok()?;
            job.state().is_terminal().then_some(job)
        })
        .await
    }

    pub fn worker_logs(&self) -> String {
        self.workers
            .iter()
            .map(|w| self.log(&format!("{}.log", w.id)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Keeps the processes' logs when the farm is dropped (to examine a failed run); returns
    /// their directory.
    pub fn keep_logs(&mut self) -> PathBuf {
        self.logs.disable_cleanup(true);
        self.logs.path().to_path_buf()
    }

    /// The tails of every scheduler slot's log.
    pub fn scheduler_logs(&self) -> String {
        self.schedulers
            .iter()
            .map(|s| self.log(&s.log))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Reads `/v1/events` (Server-Sent Events) into JSON events until `until` says so.
    pub async fn collect_events(
        &self,
        timeout: Duration,
        until: impl Fn(&[Value]) -> bool,
    ) -> anyhow::Result<Vec<Value>> {
        let response = self.http.get(self.url("/v1/events?after=0")).send().await?;
        let mut body = std::pin::pin!(sse::json(response.bytes_stream()));
        let mut events = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while !until(&events) {
            let event = tokio::time::timeout_at(deadline, body.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("event stream ended"))??;
            events.push(event);
        }
        Ok(events)
    }

    pub async fn connect_amqp(&self) -> anyhow::Result<lapin::Connection> {
        Ok(lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default()).await?)
    }

    /// Publishes `body` to the farm's intake queue as a foreign producer would: persistent, and
    /// confirmed by the broker.
    pub async fn publish_intake(
        &self,
        body: &Value,
        props: lapin::BasicProperties,
    ) -> anyhow::Result<()> {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        let conn = self.connect_amqp().await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let confirm = channel
            .basic_publish(
                "".into(),
                format!("{}.intake", self.prefix).as_str().into(),
                BasicPublishOptions::default(),
                &serde_json::to_vec(body)?,
                props.with_delivery_mode(2),
            )
            .await?
            .await?;
        anyhow::ensure!(confirm.is_ack(), "the intake publish was not confirmed");
        Ok(())
    }

    /// How many messages wait in one of the farm's queues (`dead`, `intake`, ...).
    pub async fn queue_depth(&self, queue: &str) -> anyhow::Result<u32> {
        use lapin::options::QueueDeclareOptions;
        let conn = self.connect_amqp().await?;
        let channel = conn.create_channel().await?;
        let q = channel
            .queue_declare(
                format!("{}.{queue}", self.prefix).as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await?;
        Ok(q.message_count())
    }
}

impl Drop for Farm {
    fn drop(&mut self) {
        for worker in &mut self.workers {
            if let Some(running) = worker.running.take() {
                running.kill();
            }
        }
        for slot in 0..self.schedulers.len() {
            self.kill_scheduler_at(slot);
        }
        // Remove this test's queues, stream and exchanges from the shared broker.
        let prefix = self.prefix.clone();
        let workers: Vec<vnfarm_proto::WorkerId> = self
            .workers
            .iter()
            .filter_map(|w| w.id.parse().ok())
            .collect();
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let conn =
                    lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                        .await
                        .ok()?;
                let ch = conn.create_channel().await.ok()?;
                let config = vnfarm_bus::AmqpConfig {
                    prefix,
                    ..Default::default()
                };
                vnfarm_bus::topology::delete_all(&ch, &config, &workers)
                    .await
                    .ok()
            })
        });
        let _ = cleanup.join();
    }
}

/// Mean absolute difference, in 1/255 units, of a PNG and a float reference image `[H, W, 3]` in
/// 0..1.
pub fn png_mae(png: &[u8], want: &tch::Tensor) -> f64 {
    let img = image::load_from_memory(png).expect("PNG").to_rgb8();
    let (h, w) = (i64::from(img.height()), i64::from(img.width()));
    assert_eq!(want.size(), [h, w, 3], "image size");
    let got = tch::Tensor::from_slice(img.as_raw())
        .to_kind(tch::Kind::Float)
        .view([h, w, 3]);
    (got - want * 255.0)
        .abs()
        .mean(tch::Kind::Double)
        .double_value(&[])
}

/// Stores a file that is not an image under `key` (for jobs that must fail on their input).
pub async fn put_undecodable(storage: &Storage, key: &str) -> anyhow::Result<()> {
    storage
        .put(key, b"not an image".to_vec().into(), "image/png")
        .await?;
    Ok(())
}
