//! Runs a parsed command line against the scheduler; the small commands (list, show, cancel,
//! workers, queue, pause, resume, front, tokens) live here, the larger ones in their own modules.

use std::process::ExitCode;

use vnfarm_proto::http::{QueueView, TokenRequest};
use vnfarm_proto::{JobId, SettingsInUse, SettingsSource, WorkerState};

use crate::args::{Cli, Command, ListArgs, SubmitCommand, TokensCommand};
use crate::client::Api;
use crate::table::print_table;
use crate::watch::{Outcome, watch};
use crate::{fetch, submission};

/// Runs one command; `Ok` carries the exit status (1 for a watched job that failed or was cancelled).
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let api = Api::new(&cli.url, cli.token)?;
    match cli.command {
        Command::Submit(cmd) => submit(&api, &cmd).await,
        Command::Watch { job_id } => Ok(exit_code(watch(&api, job_id).await?)),
        Command::List(args) => list(&api, &args).await.map(|()| ExitCode::SUCCESS),
        Command::Show { job_id } => {
            let job = api.job_json(job_id).await?;
            println!("{}", serde_json::to_string_pretty(&job)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel { job_id } => {
            api.cancel(job_id).await?;
            eprintln!("cancel requested for {job_id}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Fetch { job_id, out } => fetch::fetch(&api, job_id, &out)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Workers => workers(&api).await.map(|()| ExitCode::SUCCESS),
        Command::Queue => {
            print_queue(&api.queue().await?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Pause { person } => {
            print_queue(&api.set_paused(person.as_deref(), true).await?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { person } => {
            print_queue(&api.set_paused(person.as_deref(), false).await?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Front { job_id } => {
            let job = api.move_to_front(job_id).await?;
            eprintln!(
                "{job_id} moved to the front by {}",
                job.moved_by.as_deref().unwrap_or("?")
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Tokens(command) => tokens(&api, command).await.map(|()| ExitCode::SUCCESS),
        Command::Models { storage, command } => crate::models::run(&storage, &command)
            .await
            .map(|()| ExitCode::SUCCESS),
    }
}

fn exit_code(outcome: Outcome) -> ExitCode {
    match outcome {
        Outcome::Completed => ExitCode::SUCCESS,
        Outcome::Failed | Outcome::Cancelled => ExitCode::FAILURE,
    }
}

async fn submit(api: &Api, cmd: &SubmitCommand) -> anyhow::Result<ExitCode> {
    let submission = submission::build(cmd)?;
    let id: JobId = api.submit(&submission).await?;
    println!("{id}");
    if cmd.options().no_watch {
        return Ok(ExitCode::SUCCESS);
    }
    Ok(exit_code(watch(api, id).await?))
}

async fn list(api: &Api, args: &ListArgs) -> anyhow::Result<()> {
    let mut query = vec![("limit", args.limit.to_string())];
    if let Some(state) = &args.state {
        query.push(("state", state.clone()));
    }
    if let Some(kind) = &args.kind {
        query.push(("kind", kind.clone()));
    }
    if args.all {
        query.push(("all", "true".to_owned()));
    }
    let jobs = api.jobs(&query).await?;
    let rows = jobs.iter().map(|j| {
        vec![
            j.id.to_string(),
            j.kind.clone(),
            j.state.as_str().to_owned(),
            j.owner.clone(),
            j.created_at.format("%Y-%m-%dT%H:%M:%S").to_string(),
            j.outputs.len().to_string(),
        ]
    });
    print_table(
        &["ID", "KIND", "STATE", "OWNER", "CREATED", "OUTPUTS"],
        rows,
    );
    Ok(())
}

/// The queue: a line for a paused farm, then a row per person.
fn print_queue(queue: &QueueView) {
    if let Some(p) = &queue.farm_paused {
        println!(
            "the farm is paused (by {} at {})",
            p.by,
            p.at.format("%Y-%m-%dT%H:%M:%S")
        );
    }
    let limit = |n: Option<u32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    let rows = queue.people.iter().map(|p| {
        vec![
            p.name.clone(),
            p.waiting.to_string(),
            format!("{}/{}", p.running, limit(p.max_running)),
            format!("{:.1}/{}", p.gpu_minutes_today, limit(p.daily_gpu_minutes)),
            p.paused
                .as_ref()
                .map_or_else(|| "-".to_owned(), |p| format!("by {}", p.by)),
            p.held.clone().unwrap_or_else(|| "-".to_owned()),
        ]
    });
    print_table(
        &[
            "PERSON",
            "WAITING",
            "RUNNING/CAP",
            "GPU MIN TODAY/QUOTA",
            "PAUSED",
            "WAITS FOR",
        ],
        rows,
    );
}

/// `vnfarm tokens create|list|revoke`. A new token goes to stdout alone (for a script to keep),
/// what it is to stderr.
async fn tokens(api: &Api, command: TokensCommand) -> anyhow::Result<()> {
    match command {
        TokensCommand::Create { name, role } => {
            let made = api.create_token(&TokenRequest { name, role }).await?;
            eprintln!(
                "token for {} ({}); it is shown this once:",
                made.name, made.role
            );
            println!("{}", made.token);
        }
        TokensCommand::List => {
            let tokens = api.tokens().await?;
            let rows = tokens.iter().map(|t| {
                vec![
                    t.name.clone(),
                    t.role.to_string(),
                    t.created_at.format("%Y-%m-%dT%H:%M:%S").to_string(),
                    t.created_by.clone(),
                    t.revoked_at.map_or_else(
                        || "live".to_owned(),
                        |at| format!("revoked {}", at.format("%Y-%m-%dT%H:%M:%S")),
                    ),
                ]
            });
            print_table(&["NAME", "ROLE", "CREATED", "BY", "STATE"], rows);
        }
        TokensCommand::Revoke { name } => {
            let revoked = api.revoke_token(&name).await?;
            eprintln!("{} revoked at {}", revoked.name, revoked.revoked_at);
        }
    }
    Ok(())
}

/// A worker's engine settings: `measured <id>` (with `!` when the file warrants a warning),
/// `presets <names>`, or `-` for a worker that does not say (older versions, the test-pattern engine).
fn settings_cell(settings: Option<&SettingsInUse>) -> String {
    match settings {
        None => "-".to_owned(),
        Some(s) => {
            let source = match s.source {
                SettingsSource::Measured => "measured",
                SettingsSource::Presets => "presets",
            };
            let warn = if s.warning.is_some() { " !" } else { "" };
            format!("{source} {}{warn}", s.id)
        }
    }
}

async fn workers(api: &Api) -> anyhow::Result<()> {
    let workers = api.workers().await?;
    let rows = workers.iter().map(|w| {
        let hb = w.heartbeat.as_ref();
        let models: Vec<_> = hb
            .map(|h| h.models.iter().map(|m| m.as_str()).collect())
            .unwrap_or_default();
        vec![
            w.id.to_string(),
            if w.alive { "yes" } else { "no" }.to_owned(),
            hb.map_or("-", |h| worker_state(h.state)).to_owned(),
            if models.is_empty() {
                "-".to_owned()
            } else {
                models.join(",")
            },
            hb.map_or("-".to_owned(), |h| format!("{}/{}", h.in_flight, h.slots)),
            w.assigned.len().to_string(),
            hb.map_or("-".to_owned(), |h| settings_cell(h.settings.as_ref())),
            hb.filter(|h| !h.running.is_empty())
                .map_or("-".to_owned(), |h| {
                    h.running
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                }),
            w.seconds_since_heartbeat
                .map_or("never".to_owned(), |s| format!("{s:.0}s ago")),
        ]
    });
    print_table(
        &[
            "ID",
            "ALIVE",
            "STATE",
            "MODELS",
            "IN FLIGHT",
            "ASSIGNED",
            "SETTINGS",
            "RUNNING",
            "HEARD",
        ],
        rows,
    );
    Ok(())
}

fn worker_state(state: WorkerState) -> &'static str {
    match state {
        WorkerState::Warming => "warming",
        WorkerState::Ready => "ready",
        WorkerState::Draining => "draining",
    }
}
