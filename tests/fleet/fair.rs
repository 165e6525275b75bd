//! Fair share on the fleet (issue 24, DESIGN §7a): one person's long batch backlog, then another
//! person's few jobs, on a saturated farm of test-pattern workers with the profile's delays. What
//! is measured, from the event stream: for each of the second person's jobs, how long after it
//! was submitted it started, and how long after the worker it started on had freed (its previous
//! job there ended), both also in job durations (the median time from `started` to `completed`
//! of the first person's jobs).

use std::time::Duration;

use anyhow::{Context, ensure};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use vnfarm_proto::{EventKind, JobId};

use super::{RunConfig, scaled};
use crate::{Farm, WorkerOptions, wait_for};

const ADMIN_TOKEN: &str = "fleet-fair-share-admin-token";

#[derive(Clone, Debug)]
pub struct FairConfig {
    pub run: RunConfig,
    /// The first person's batch jobs, queued at once.
    pub backlog: usize,
    /// The second person's jobs, submitted once every worker is busy.
    pub others: usize,
}

/// One of the second person's jobs.
#[derive(Clone, Debug)]
pub struct OtherJob {
    pub waited_s: f64,
    /// From the end of the previous job on the worker it took to its own start.
    pub after_free_s: f64,
    /// The first person's jobs that started between its submission and its start.
    pub overtaken_by: usize,
}

#[derive(Clone, Debug)]
pub struct FairReport {
    pub workers: usize,
    pub backlog: usize,
    /// Median `started` → `completed` of the first person's jobs, seconds.
    pub job_s: f64,
    pub others: Vec<OtherJob>,
    /// How many of the first person's jobs were still waiting when the last of the others
    /// started.
    pub backlog_left: usize,
}

impl FairReport {
    pub fn render(&self) -> String {
        let mut out = format!(
            "fair share: {} workers; one person's {} batch generates queued, then another's {} \
             (job duration {:.3} s)\n\n| job | waited (s) | waited (job durations) | start after its \
             worker freed (s) | the first person's starts before it |\n| --- | ---: | ---: | ---: | ---: |\n",
            self.workers,
            self.backlog,
            self.others.len(),
            self.job_s
        );
        for (n, o) in self.others.iter().enumerate() {
            out += &format!(
                "| {} | {:.3} | {:.2} | {:.3} | {} |\n",
                n + 1,
                o.waited_s,
                o.waited_s / self.job_s,
                o.after_free_s,
                o.overtaken_by
            );
        }
        let worst = self
            .others
            .iter()
            .map(|o| o.after_free_s)
            .fold(0.0, f64::max);
        out += &format!(
            "\nevery one of the other person's jobs started within {:.3} s ({:.3} job durations) of \
             the worker it took freeing; {} of the first person's jobs still waited when the last \
             started (first come, first served would have run them all first)\n",
            worst,
            worst / self.job_s,
            self.backlog_left
        );
        out
    }
}

/// A client that sends `token`.
fn client(token: &str) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse()?,
    );
    Ok(reqwest::Client::builder()
        .default_headers(headers)
        .build()?)
}

async fn post(http: &reqwest::Client, url: String, body: &Value) -> anyhow::Result<Value> {
    let response = http.post(url).json(body).send().await?;
    let status = response.status();
    let body: Value = response.json().await?;
    ensure!(status.is_success(), "{status}: {body}");
    Ok(body)
}

/// Runs the scenario on a fresh farm with the default dispatch settings.
pub async fn run_fair_share(config: &FairConfig) -> anyhow::Result<FairReport> {
    let run = &config.run;
    let mut farm = Farm::new("fleet-fair").await?;
    farm.scheduler_env
        .push(("VNFARM_API_TOKEN".into(), ADMIN_TOKEN.into()));
    farm.http = client(ADMIN_TOKEN)?;
    farm.start_scheduler().await?;
    for n in 0..run.workers {
        let options = WorkerOptions {
            step_ms: scaled(run.profile.generate_step_ms, run.scale),
            extra_env: vec![(
                "VNFARM_ENGINE__TEST_PATTERN__DECODE_MS".into(),
                scaled(run.profile.decode_ms, run.scale).to_string(),
            )],
        };
        farm.start_worker(&format!("w{n}"), options).await?;
    }
    let mut tokens = Vec::new();
    for name in ["ann", "bo"] {
        let made = post(
            &farm.http,
            farm.url("/v1/tokens"),
            &json!({"name": name, "role": "artist"}),
        )
        .await?;
        tokens.push(made["token"].as_str().context("token")?.to_owned());
    }
    let (ann, bo) = (client(&tokens[0])?, client(&tokens[1])?);
    let generate = |who: &str, n: usize| {
        json!({"schema_version": 1, "job": {"kind": "generate", "prompt": format!("{who} {n}"),
            "width": 256, "height": 256, "steps": 20}})
    };
    let mut backlog = Vec::new();
    for n in 0..config.backlog {
        let made = post(&ann, farm.url("/v1/jobs"), &generate("ann", n)).await?;
        backlog.push(
            made["job_id"]
                .as_str()
                .context("job_id")?
                .parse::<JobId>()?,
        );
    }
    // Saturated: every worker runs some of ann's work.
    wait_for(
        "every worker to be busy",
        Duration::from_secs(60),
        || async {
            let workers = farm.workers().await.ok()?;
            let busy = workers.iter().filter(|w| !w.assigned.is_empty()).count();
            (busy == run.workers).then_some(())
        },
    )
    .await?;
    let mut others = Vec::new();
    for n in 0..config.others {
        let made = post(&bo, farm.url("/v1/jobs"), &generate("bo", n)).await?;
        others.push(
            made["job_id"]
                .as_str()
                .context("job_id")?
                .parse::<JobId>()?,
        );
    }
    for id in &others {
        farm.wait_finished(id, Duration::from_secs(300)).await?;
    }
    let log = crate::stream::read_all(&farm).await?;
    let mut queued: std::collections::HashMap<JobId, DateTime<Utc>> = Default::default();
    let mut started: Vec<(DateTime<Utc>, JobId, String)> = Vec::new();
    let mut ended: Vec<(DateTime<Utc>, JobId, String)> = Vec::new();
    for ev in &log.events {
        let (id, at) = (ev.event.job_id, ev.event.at);
        match &ev.event.kind {
            EventKind::Queued { .. } => {
                queued.insert(id, at);
            }
            EventKind::Started { worker, .. } => started.push((at, id, worker.to_string())),
            EventKind::Completed {
                worker: Some(w), ..
            } => ended.push((at, id, w.to_string())),
            _ => {}
        }
    }
    let start_of = |id: &JobId| started.iter().find(|(_, j, _)| j == id).cloned();
    let mut durations: Vec<f64> = backlog
        .iter()
        .filter_map(|id| {
            let (s, _, _) = start_of(id)?;
            let (e, _, _) = ended.iter().find(|(_, j, _)| j == id)?;
            Some((*e - s).num_milliseconds() as f64 / 1000.0)
        })
        .collect();
    durations.sort_by(f64::total_cmp);
    let job_s = *durations
        .get(durations.len() / 2)
        .context("none of the backlog finished")?;
    let mut report = FairReport {
        workers: run.workers,
        backlog: config.backlog,
        job_s,
        others: Vec::new(),
        backlog_left: 0,
    };
    let mut last_start = None;
    for id in &others {
        let (at, _, worker) = start_of(id).context("a job of the second person never started")?;
        let submitted = queued[id];
        let freed = ended
            .iter()
            .filter(|(e, _, w)| *w == worker && *e <= at)
            .map(|(e, _, _)| *e)
            .max()
            .unwrap_or(submitted)
            .max(submitted);
        let overtaken_by = started
            .iter()
            .filter(|(s, j, _)| *s > submitted && *s < at && backlog.contains(j))
            .count();
        report.others.push(OtherJob {
            waited_s: (at - submitted).num_milliseconds() as f64 / 1000.0,
            after_free_s: (at - freed).num_milliseconds() as f64 / 1000.0,
            overtaken_by,
        });
        last_start = last_start.max(Some(at));
    }
    let last = last_start.context("no start")?;
    report.backlog_left = backlog
        .iter()
        .filter(|id| start_of(id).is_none_or(|(s, _, _)| s > last))
        .count();
    Ok(report)
}
