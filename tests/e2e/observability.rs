//! The metrics, dashboards and alerts (DESIGN §8) against a real Prometheus scraping a real farm.
//!
//! A Prometheus of the test's own (the Debian package's binary, on a free port, its data in a
//! temporary directory, `deploy/prometheus/alerts.yml` loaded) scrapes the scheduler and two
//! test-pattern workers every second through a workload that completes, fails, dead-letters (on
//! the scheduler and on a worker), hits and misses the encode cache, dispatches by affinity and
//! lives through an S3 outage. Then:
//!
//! - every family DESIGN §8 names has been fed (a value above zero where the workload makes one);
//! - every PromQL expression of `dashboards/*.json` (template variables substituted as Grafana
//!   would) and of the alert rules parses and returns series, and so does every metric selector
//!   inside them. An alert's threshold comparisons get the `bool` modifier, so an alert that does
//!   not fire still returns its series while a selector that matches nothing returns none;
//! - Prometheus evaluated every rule without error;
//! - `promtool check rules`, `promtool test rules` and `promtool check config` pass;
//! - the dashboards have the structure Grafana needs (see [`check_dashboard`]): no Grafana can be
//!   installed here, and no registry offers a dashboard validator (`@grafana/schema` ships
//!   TypeScript types, no JSON Schema).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use serde_json::{Value, json};
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, free_port, wait_for};

use crate::FINISH;

/// What the test substitutes for Grafana's interval variables: at least four scrape intervals.
const RATE_INTERVAL: &str = "20s";
const INTERVAL: &str = "5s";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// A Prometheus server of this test's own; killed when dropped.
struct Prometheus {
    url: String,
    child: Child,
    dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Prometheus {
    /// Starts Prometheus scraping `scheduler` and `workers` (host:port) every second with the
    /// shipped alert rules, and waits until it is ready.
    async fn start(scheduler: &str, workers: &[String]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let rules = repo("deploy/prometheus/alerts.yml").canonicalize()?;
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n\
             \x20 - job_name: vnfarm-scheduler\n    static_configs:\n      - targets: [\"{scheduler}\"]\n\
             \x20 - job_name: vnfarm-worker\n    static_configs:\n      - targets: [{workers}]\n",
            rules = rules.display(),
            workers = workers
                .iter()
                .map(|w| format!("\"{w}\""))
                .collect::<Vec<_>>()
                .join(", "),
        );
        std::fs::write(dir.path().join("prometheus.yml"), config)?;
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        // Our own instance on our own port and storage: the Debian package may run a system
        // Prometheus on :9090, which this test neither uses nor disturbs.
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus (`./farm setup` installs the Debian package)")?;
        let prometheus = Self {
            url: format!("http://127.0.0.1:{port}"),
            child,
            dir,
            http: reqwest::Client::new(),
        };
        let ready = format!("{}/-/ready", prometheus.url);
        wait_for(
            "Prometheus to be ready",
            Duration::from_secs(60),
            || async {
                let r = prometheus.http.get(&ready).send().await.ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await
        .map_err(|e| e.context(prometheus.log()))?;
        Ok(prometheus)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query: the result vector, or the error Prometheus gives (a parse error, ...).
    async fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let body: Value = self
            .http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", expr)])
            .send()
            .await?
            .json()
            .await?;
        if body["status"] != "success" {
            bail!("{}: {}", body["errorType"], body["error"]);
        }
        match body["data"]["resultType"].as_str() {
            Some("vector" | "matrix") => Ok(body["data"]["result"]
                .as_array()
                .cloned()
                .unwrap_or_default()),
            // A scalar is one value: count it as one series.
            Some("scalar") => Ok(vec![body["data"]["result"].clone()]),
            other => bail!("unexpected result type {other:?}"),
        }
    }

    /// The alerting rules Prometheus loaded: (name, query, health, last error).
    async fn rules(&self) -> anyhow::Result<Vec<(String, String, String, String)>> {
        let body: Value = self
            .http
            .get(format!("{}/api/v1/rules", self.url))
            .send()
            .await?
            .json()
            .await?;
        let mut rules = Vec::new();
        for group in body["data"]["groups"].as_array().into_iter().flatten() {
            for rule in group["rules"].as_array().into_iter().flatten() {
                let text = |k: &str| rule[k].as_str().unwrap_or_default().to_owned();
                rules.push((
                    text("name"),
                    text("query"),
                    text("health"),
                    text("lastError"),
                ));
            }
        }
        Ok(rules)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `expr` with every comparison operator given the `bool` modifier (`a > 0` → `a > bool 0`), so
/// it returns its series whatever their values: outside label matchers (`{...}`) and strings.
fn with_bool(expr: &str) -> String {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = String::new();
    let mut braces = 0usize;
    let mut quote: Option<char> = None;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if let Some(q) = quote {
            out.push(c);
            if c == '\\' && q != '`' {
                if let Some(&next) = chars.get(i + 1) {
                    out.push(next);
                    i += 1;
                }
            } else if c == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            _ => {}
        }
        let next = chars.get(i + 1).copied();
        let operator = match (c, next) {
            _ if braces > 0 => None,
            ('=', Some('=')) | ('!', Some('=')) | ('>', Some('=')) | ('<', Some('=')) => Some(2),
            ('>', _) | ('<', _) => Some(1),
            _ => None,
        };
        match operator {
            Some(len) => {
                out.extend(&chars[i..i + len]);
                i += len;
                let rest: String = chars[i..].iter().collect();
                if !rest.trim_start().starts_with("bool") {
                    out.push_str(" bool");
                }
            }
            None => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// The metric selectors in `expr` (`vnfarm_*` and `up`, with their label matchers), outside
/// strings.
fn selectors(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = BTreeSet::new();
    let mut i = 0;
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            // Skip the string (label values and legends are not selectors).
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if ident(c) && (i == 0 || !ident(chars[i - 1])) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let name: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j] == ' ' {
                j += 1;
            }
            let matchers = if chars.get(j) == Some(&'{') {
                let end = chars[j..]
                    .iter()
                    .position(|&c| c == '}')
                    .map_or(chars.len(), |p| j + p + 1);
                let m: String = chars[j..end].iter().collect();
                i = end;
                m
            } else {
                String::new()
            };
            let is_function = chars.get(j) == Some(&'(');
            if (name.starts_with("vnfarm_") || (name == "up" && !matchers.is_empty()))
                && !is_function
            {
                found.insert(format!("{name}{matchers}"));
            }
            continue;
        }
        i += 1;
    }
    found
}

#[test]
fn comparisons_get_bool_and_selectors_are_found() {
    assert_eq!(
        with_bool(r#"max by (model) (x{state="ready", a!="b"}) == 0"#),
        r#"max by (model) (x{state="ready", a!="b"}) == bool 0"#
    );
    assert_eq!(
        with_bool("a > 0 and on (m) b <= 1 or c != bool 2"),
        "a > bool 0 and on (m) b <= bool 1 or c != bool 2"
    );
    assert_eq!(
        with_bool(r#"x{l=~"a|>"} < 0.05"#),
        r#"x{l=~"a|>"} < bool 0.05"#
    );
    assert_eq!(
        selectors(
            r#"sum(rate(vnfarm_a_total{outcome="failed"}[5m])) / ignoring (kind) vnfarm_b and up{job="w"} > 0"#
        ),
        BTreeSet::from([
            r#"up{job="w"}"#.to_owned(),
            "vnfarm_a_total{outcome=\"failed\"}".to_owned(),
            "vnfarm_b".to_owned()
        ])
    );
}

/// A dashboard's PromQL expressions with the template variables substituted, each with where it
/// is (for messages): panel targets and query variables' metrics.
fn dashboard_exprs(file: &str, dashboard: &Value) -> Vec<(String, String)> {
    let mut substitutions = vec![
        ("$__rate_interval".to_owned(), RATE_INTERVAL.to_owned()),
        ("${__rate_interval}".to_owned(), RATE_INTERVAL.to_owned()),
        ("$__interval".to_owned(), INTERVAL.to_owned()),
        ("${__interval}".to_owned(), INTERVAL.to_owned()),
    ];
    let variables = dashboard["templating"]["list"].as_array().cloned();
    let mut exprs = Vec::new();
    for var in variables.iter().flatten() {
        let name = var["name"].as_str().unwrap_or_default();
        if var["type"] == "query" {
            let all = var["allValue"].as_str().unwrap_or(".*").to_owned();
            substitutions.push((format!("${{{name}}}"), all.clone()));
            substitutions.push((format!("${name}"), all));
            // `label_values(metric, label)`: the metric must exist.
            if let Some(def) = var["definition"].as_str()
                && let Some(metric) = def
                    .strip_prefix("label_values(")
                    .and_then(|rest| rest.split(',').next())
            {
                exprs.push((format!("{file}: variable {name}"), metric.trim().to_owned()));
            }
        }
    }
    let substitute = |expr: &str| {
        substitutions
            .iter()
            .fold(expr.to_owned(), |e, (from, to)| e.replace(from, to))
    };
    let mut panels: Vec<Value> = dashboard["panels"].as_array().cloned().unwrap_or_default();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().cloned().unwrap_or_default());
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                exprs.push((
                    format!("{file}: panel {:?} {}", panel["title"], target["refId"]),
                    substitute(expr),
                ));
            }
        }
    }
    exprs
}

/// The structure Grafana needs of a provisioned dashboard, and this project's rules for one: a
/// `datasource` variable of type `datasource` and no other datasource reference; every panel with
/// an id, type, title and grid position inside 24 columns, overlapping no other; every panel but a
/// row with a description, a unit and targets, each target with a refId and an expression.
fn check_dashboard(file: &str, d: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let mut problem = |p: String| problems.push(format!("{file}: {p}"));
    if d["schemaVersion"].as_u64().is_none_or(|v| v < 36) {
        problem(format!(
            "schemaVersion {} (want a number >= 36)",
            d["schemaVersion"]
        ));
    }
    for key in ["uid", "title", "description"] {
        if d[key].as_str().is_none_or(str::is_empty) {
            problem(format!("no {key}"));
        }
    }
    let variables = d["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !variables.iter().any(|v| {
        v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
    }) {
        problem("templating has no `datasource` variable of type datasource (prometheus)".into());
    }
    // Every datasource reference anywhere is the variable, never a fixed uid.
    let mut stack = vec![d.clone()];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(map) => {
                if let Some(ds) = map.get("datasource")
                    && (ds["uid"] != "${datasource}" || ds["type"] != "prometheus")
                {
                    problem(format!(
                        "datasource {ds} is not {{prometheus, ${{datasource}}}}"
                    ));
                }
                stack.extend(map.into_iter().map(|(_, v)| v));
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    let mut panels: Vec<Value> = d["panels"].as_array().cloned().unwrap_or_default();
    if panels.is_empty() {
        problem("no panels".into());
    }
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(String, [u64; 4])> = Vec::new();
    while let Some(p) = panels.pop() {
        panels.extend(p["panels"].as_array().cloned().unwrap_or_default());
        let title = p["title"].as_str().unwrap_or_default().to_owned();
        if title.is_empty() {
            problem(format!("panel {} has no title", p["id"]));
        }
        match p["id"].as_u64() {
            Some(id) if ids.insert(id) => {}
            _ => problem(format!(
                "panel {title:?}: missing or repeated id {}",
                p["id"]
            )),
        }
        let g = &p["gridPos"];
        let pos = ["x", "y", "w", "h"].map(|k| g[k].as_u64());
        let [Some(x), Some(y), Some(w), Some(h)] = pos else {
            problem(format!("panel {title:?}: gridPos {g} lacks x, y, w or h"));
            continue;
        };
        if w == 0 || h == 0 || x + w > 24 {
            problem(format!("panel {title:?}: gridPos {g} outside 24 columns"));
        }
        for (other, [ox, oy, ow, oh]) in &boxes {
            if x < ox + ow && *ox < x + w && y < oy + oh && *oy < y + h {
                problem(format!("panels {title:?} and {other:?} overlap"));
            }
        }
        boxes.push((title.clone(), [x, y, w, h]));
        let kind = p["type"].as_str().unwrap_or_default();
        if kind == "row" {
            continue;
        }
        if !matches!(
            kind,
            "timeseries" | "stat" | "table" | "gauge" | "bargauge" | "heatmap" | "text"
        ) {
            problem(format!("panel {title:?}: unexpected type {kind:?}"));
        }
        if p["description"].as_str().is_none_or(str::is_empty) {
            problem(format!("panel {title:?} has no description"));
        }
        if p["fieldConfig"]["defaults"]["unit"]
            .as_str()
            .is_none_or(str::is_empty)
        {
            problem(format!("panel {title:?} has no unit"));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            problem(format!("panel {title:?} has no targets"));
        }
        let mut refs = BTreeSet::new();
        for t in targets {
            if !t["refId"]
                .as_str()
                .is_some_and(|r| refs.insert(r.to_owned()))
            {
                problem(format!("panel {title:?}: missing or repeated refId"));
            }
            if t["expr"].as_str().is_none_or(str::is_empty) {
                problem(format!("panel {title:?}: a target has no expr"));
            }
        }
    }
    problems
}

/// Runs a command to completion; its output, or an error with it.
fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} (`./farm setup` installs prometheus)"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "{program} {args:?} failed:\n{text}");
    Ok(text)
}

#[test]
fn the_alert_rules_check_and_their_unit_tests_pass() -> anyhow::Result<()> {
    let dir = repo("deploy/prometheus");
    let path = |f: &str| dir.join(f).display().to_string();
    let checked = run("promtool", &["check", "rules", &path("alerts.yml")])?;
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = run("promtool", &["test", "rules", &path("alerts.test.yml")])?;
    assert!(tested.contains("SUCCESS"), "{tested}");
    run(
        "promtool",
        &["check", "config", "--syntax-only", &path("prometheus.yml")],
    )?;
    Ok(())
}

#[test]
fn the_dashboards_have_the_structure_grafana_needs() -> anyhow::Result<()> {
    let mut problems = Vec::new();
    let mut uids = BTreeSet::new();
    let mut files = 0;
    for entry in std::fs::read_dir(repo("dashboards"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        files += 1;
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let dashboard: Value = serde_json::from_slice(&std::fs::read(&path)?)
            .with_context(|| format!("{file} is not JSON"))?;
        problems.extend(check_dashboard(&file, &dashboard));
        if !uids.insert(dashboard["uid"].to_string()) {
            problems.push(format!("{file}: uid {} used twice", dashboard["uid"]));
        }
    }
    assert_eq!(files, 4, "overview, jobs, workers, scheduling");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The committed files are what their generator writes (nobody edited one by hand).
    let generated = tempfile::tempdir()?;
    let out = generated.path().display().to_string();
    let script = repo("dashboards/generate.py").display().to_string();
    run("python3", &[&script, "--out", &out])?;
    for entry in std::fs::read_dir(generated.path())? {
        let path = entry?.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            std::fs::read(&path)? == std::fs::read(repo("dashboards").join(&name))?,
            "dashboards/{name} differs from what dashboards/generate.py writes: run it and commit"
        );
    }
    // The check itself catches what it is for.
    let broken = json!({"schemaVersion": 39, "uid": "u", "title": "t", "description": "d",
        "templating": {"list": []},
        "panels": [{"id": 1, "type": "timeseries", "title": "p",
            "datasource": {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"},
            "gridPos": {"x": 20, "y": 0, "w": 8, "h": 8}, "fieldConfig": {"defaults": {}},
            "targets": [{"refId": "A", "expr": "up"}]}]});
    let found = check_dashboard("broken.json", &broken).join("\n");
    for expected in [
        "datasource` variable",
        "P1809F7CD0C75ACF3",
        "24 columns",
        "no unit",
        "no description",
    ] {
        assert!(
            found.contains(expected),
            "{expected:?} not reported:\n{found}"
        );
    }
    Ok(())
}

/// Every family DESIGN §8 asks for, fed by the workload: each query must return a series (they are
/// written to return nothing while the family is zero or missing).
const FED: &[&str] = &[
    r#"vnfarm_jobs_submitted_total > 0"#,
    r#"vnfarm_jobs_finished_total{outcome="completed"} > 0"#,
    r#"vnfarm_jobs_finished_total{outcome="failed"} > 0"#,
    r#"vnfarm_queue_wait_seconds_count{kind="edit"} > 0"#,
    r#"vnfarm_job_run_seconds_count{kind="generate"} > 0"#,
    r#"vnfarm_worker_stage_seconds_count{kind="edit",stage="denoise"} > 0"#,
    r#"vnfarm_worker_stage_seconds_count{stage="upload"} > 0"#,
    r#"vnfarm_worker_job_seconds_count > 0"#,
    r#"vnfarm_worker_denoise_step_seconds_count{model="sdxl",resolution="0.25mp"} > 0"#,
    r#"vnfarm_worker_denoise_step_seconds_count{model="qwen-edit"} > 0"#,
    r#"vnfarm_worker_model_load_seconds_count > 0"#,
    r#"vnfarm_worker_encode_cache_total{result="hit"} > 0"#,
    r#"vnfarm_worker_encode_cache_total{result="miss"} > 0"#,
    r#"vnfarm_worker_batch_jobs_count > 0"#,
    r#"vnfarm_dispatch_batch_jobs_count > 0"#,
    r#"vnfarm_dispatches_total{decision="affinity_hit"} > 0"#,
    r#"vnfarm_worker_busy_seconds_total > 0"#,
    r#"vnfarm_worker_gpu_memory_bytes{kind="total"} > 0"#,
    r#"vnfarm_worker_gpu_memory_bytes{kind="free"} > 0"#,
    r#"count(vnfarm_worker_state{state="ready"} == 1) == 2"#,
    r#"vnfarm_worker_info == 1"#,
    r#"vnfarm_workers{state="ready"} == 2"#,
    r#"vnfarm_model_workers{model="qwen-edit",state="ready"} == 2"#,
    r#"vnfarm_backlog_jobs{model="sdxl",priority="batch"} >= 0"#,
    r#"vnfarm_jobs{state="queued"} >= 0"#,
    r#"vnfarm_dead_letters_total{job="vnfarm-scheduler",failure="malformed"} > 0"#,
    r#"vnfarm_dead_letters_total{job="vnfarm-worker",failure="bad_input"} > 0"#,
    r#"vnfarm_queue_messages{queue="dead"} >= 2"#,
    r#"vnfarm_malformed_messages_total{job="vnfarm-scheduler"} > 0"#,
    r#"vnfarm_storage_errors_total{job="vnfarm-worker"} > 0"#,
    r#"vnfarm_storage_errors_total{job="vnfarm-scheduler",op="get"} > 0"#,
    r#"vnfarm_requeues_total >= 0"#,
    r#"vnfarm_amqp_reconnects_total >= 0"#,
    r#"count(vnfarm_amqp_connected == 1) == 3"#,
    r#"vnfarm_scheduler_active == 1"#,
    r#"vnfarm_events_applied_total > 0"#,
    r#"vnfarm_registry_jobs > 0"#,
];

/// The farm's workload: see the module's note.
async fn workload(farm: &mut Farm, worker_metrics: &[String]) -> anyhow::Result<()> {
    // A pipeline: a generate, three edits of its base (one encode, then the cache), an upscale.
    let pipeline = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "pipeline",
            "base": {"prompt": "a lighthouse at dusk", "width": 256, "height": 256, "steps": 4},
            "edits": [{"instruction": "make it snow"}, {"instruction": "make it rain"},
                      {"instruction": "add a moon"}],
            "upscales": [{"of": {"edit": 0}, "scale": 2}]}}))
        .await?;
    let done = farm.wait_finished(pipeline, FINISH).await?;
    ensure!(done.state == JobState::Completed, "{done:?}");
    let base = *done.children.first().context("the pipeline's base")?;

    // More edits of the base, one at a time: the worker holding its encodings takes each
    // (affinity_hit) and finds them in its cache.
    for instruction in ["make it foggy", "make it night"] {
        let id = farm
            .submit_new(&json!({"schema_version": 1, "job": {"kind": "edit",
                "input": {"job_output": {"job": base, "index": 0}},
                "instruction": instruction, "steps": 2}}))
            .await?;
        let job = farm.wait_finished(id, FINISH).await?;
        ensure!(job.state == JobState::Completed, "{job:?}");
    }

    // A job that fails for good: its input is not an image. The worker dead-letters it.
    vnfarm_tests::put_undecodable(&farm.storage, "inputs/garbage.png").await?;
    let id = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "upscale",
            "input": {"stored": "inputs/garbage.png"}}}))
        .await?;
    let job = farm.wait_finished(id, FINISH).await?;
    ensure!(job.state == JobState::Failed, "{job:?}");

    // Garbage on the intake queue: the scheduler dead-letters it.
    let conn = farm.connect_amqp().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let garbage = uuid::Uuid::now_v7().to_string();
    channel
        .basic_publish(
            "".into(),
            format!("{}.intake", farm.prefix).as_str().into(),
            BasicPublishOptions::default(),
            b"\x00not json",
            BasicProperties::default().with_message_id(garbage.as_str().into()),
        )
        .await?
        .await?;
    let job = farm.wait_finished(&garbage, FINISH).await?;
    ensure!(job.state == JobState::Failed, "{job:?}");
    drop(channel);
    drop(conn);

    // S3 down: a worker's storage operations fail (and are retried), so does the scheduler's
    // fetch of an output; the job completes once S3 is back.
    farm.own_s3.as_mut().expect("the farm's own S3").stop();
    let during = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "generate",
            "prompt": "during an outage", "width": 256, "height": 256, "steps": 2}}))
        .await?;
    let output = farm
        .http
        .get(farm.url(&format!("/v1/jobs/{base}/outputs/0")))
        .send()
        .await?;
    ensure!(output.status() == 503, "{}", output.status());
    // Whichever worker took the job counts the errors.
    wait_for("a worker to count a storage error", FINISH, || async {
        for url in worker_metrics {
            let text = farm.http.get(url).send().await.ok()?.text().await.ok()?;
            let counted = text
                .lines()
                .filter(|l| l.starts_with("vnfarm_storage_errors_total{"))
                .any(|l| l.rsplit(' ').next().is_some_and(|v| v != "0"));
            if counted {
                return Some(());
            }
        }
        None
    })
    .await?;
    farm.own_s3.as_mut().expect("the farm's own S3").restart()?;
    let job = farm.wait_finished(during, FINISH).await?;
    ensure!(job.state == JobState::Completed, "{job:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_expression_returns_series_from_a_real_farm() -> anyhow::Result<()>
{
    let mut farm = Farm::with_own_s3("observability").await?;
    farm.scheduler_env
        .push(("VNFARM_DISPATCH__POLICY".into(), "affinity".into()));
    farm.start_scheduler().await?;
    let mut targets = Vec::new();
    // Simulated 24 GiB devices; the second nearly full, as GPU boxes often are.
    for (id, used_mib) in [("w1", "8192"), ("w2", "23552")] {
        let listen = format!("127.0.0.1:{}", free_port());
        let options = WorkerOptions {
            extra_env: vec![
                ("VNFARM_LISTEN".into(), listen.clone()),
                ("VNFARM_STORAGE_ATTEMPTS".into(), "2".into()),
                (
                    "VNFARM_ENGINE__TEST_PATTERN__GPU_MEMORY_MIB".into(),
                    "24576".into(),
                ),
                (
                    "VNFARM_ENGINE__TEST_PATTERN__GPU_MEMORY_USED_MIB".into(),
                    used_mib.into(),
                ),
            ],
            ..WorkerOptions::default()
        };
        farm.start_worker(id, options).await?;
        targets.push(listen);
    }
    let scheduler = format!("127.0.0.1:{}", farm.scheduler_port);
    let prometheus = Prometheus::start(&scheduler, &targets).await?;
    wait_for("Prometheus to scrape all three targets", FINISH, || async {
        let up = prometheus.query("up == 1").await.ok()?;
        (up.len() == 3).then_some(())
    })
    .await
    .map_err(|e| e.context(prometheus.log()))?;

    let worker_metrics: Vec<String> = targets
        .iter()
        .map(|t| format!("http://{t}/metrics"))
        .collect();
    if let Err(e) = workload(&mut farm, &worker_metrics).await {
        let logs = farm.keep_logs();
        return Err(e.context(format!(
            "workload failed; process logs kept in {}\n{}\n{}",
            logs.display(),
            farm.scheduler_logs(),
            farm.worker_logs()
        )));
    }

    // Fed: each family has the value the workload gave it, once Prometheus has scraped it.
    for expr in FED {
        wait_for(
            &format!("{expr} in Prometheus"),
            Duration::from_secs(30),
            || async {
                let result = prometheus.query(expr).await.ok()?;
                (!result.is_empty()).then_some(())
            },
        )
        .await?;
    }

    let mut exprs = Vec::new();
    let mut files = 0;
    for entry in std::fs::read_dir(repo("dashboards"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            files += 1;
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let dashboard: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
            exprs.extend(dashboard_exprs(&file, &dashboard));
        }
    }
    ensure!(
        files == 4 && exprs.len() > 40,
        "{files} dashboards, {} expressions",
        exprs.len()
    );

    // The rules as Prometheus loaded them: each evaluated without error (Prometheus evaluates
    // every second; wait for a second round after the workload).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rules = prometheus.rules().await?;
    let expected = [
        "VnfarmWorkerDown",
        "VnfarmSchedulerDown",
        "VnfarmNoActiveScheduler",
        "VnfarmNoWorkerForModel",
        "VnfarmBacklogGrowing",
        "VnfarmDeadLettersRising",
        "VnfarmJobFailureRatio",
        "VnfarmAmqpDisconnected",
        "VnfarmStorageErrors",
        "VnfarmGpuMemoryNearFull",
    ];
    let names: Vec<&str> = rules.iter().map(|(n, ..)| n.as_str()).collect();
    assert_eq!(names, expected, "the rules Prometheus loaded");
    let mut problems = Vec::new();
    for (name, query, health, error) in &rules {
        if health != "ok" || !error.is_empty() {
            problems.push(format!("rule {name}: health {health:?}, error {error:?}"));
        }
        exprs.push((
            format!("alert {name} (comparisons as bool)"),
            with_bool(query),
        ));
    }

    let mut all_selectors = BTreeSet::new();
    for (at, expr) in &exprs {
        all_selectors.extend(selectors(expr));
        match prometheus.query(expr).await {
            Ok(result) if result.is_empty() => problems.push(format!("{at}: no series: {expr}")),
            Ok(_) => {}
            Err(e) => problems.push(format!("{at}: invalid: {expr}: {e}")),
        }
    }
    for selector in &all_selectors {
        match prometheus.query(selector).await {
            Ok(result) if result.is_empty() => {
                problems.push(format!("selector matches nothing: {selector}"))
            }
            Ok(_) => {}
            Err(e) => problems.push(format!("selector {selector}: {e}")),
        }
    }
    println!(
        "evaluated {} expressions and {} selectors on Prometheus",
        exprs.len(),
        all_selectors.len()
    );
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    drop(prometheus);
    Ok(())
}
