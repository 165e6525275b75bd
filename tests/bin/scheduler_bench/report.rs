//! The benchmark's tables (Markdown, as `docs/performance.md` takes them) and the description of
//! the machine they were measured on.

use std::fmt::Write as _;
use std::process::Command;

use crate::backlog::DepthReport;
use crate::process::mib;
use crate::replay::{self, Start};

/// The first line of a command's output, or "unknown".
fn first_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn machine() -> String {
    let bins = vnfarm_tests::bin_dir();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let mut out = String::new();
    let _ = writeln!(out, "scheduler-bench");
    let _ = writeln!(out, "  binaries: {}", bins.display());
    let _ = writeln!(
        out,
        "  commit: {}",
        first_line("git", &["rev-parse", "--short", "HEAD"])
    );
    let _ = writeln!(
        out,
        "  machine: {} CPUs (nproc), {cpu}; {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        first_line("uname", &["-sr"])
    );
    let _ = writeln!(
        out,
        "  RabbitMQ: {}",
        first_line("rabbitmqctl", &["version"])
    );
    let _ = writeln!(out, "  {}", load());
    out
}

/// The load averages (1, 5, 15 minutes): other work on the machine shows here.
pub fn load() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let averages: Vec<&str> = text.split_whitespace().take(3).collect();
    format!("load average: {}", averages.join(" "))
}

fn secs(value: Option<f64>) -> String {
    value.map_or_else(|| "—".into(), |s| format!("{s:.2}"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

pub fn replay(report: &replay::Report) -> String {
    let live = &report.live;
    let shape = report.options.shape;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## History of {} jobs, {} events ({} per job: queued, dispatched, started, {} progress, completed; {} workers)\n",
        shape.jobs,
        live.written.events,
        shape.events_per_job(),
        shape.steps,
        shape.workers
    );
    let _ = writeln!(
        out,
        "written straight to the event stream in {:.1} s ({:.0} events/s); the live scheduler had applied the last event {:.2} s after the last write",
        live.written.elapsed.as_secs_f64(),
        live.written.events as f64 / live.written.elapsed.as_secs_f64(),
        live.lag.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "live scheduler: {} snapshots written (last {:.1} MiB), CPU {:.1} s = {:.3} ms per job, {:.1} µs per event\n",
        live.snapshots,
        live.snapshot_bytes as f64 / 1048576.0,
        live.cpu.as_secs_f64(),
        live.cpu.as_secs_f64() * 1e3 / shape.jobs as f64,
        live.cpu.as_secs_f64() * 1e6 / live.written.events as f64
    );
    let _ = writeln!(
        out,
        "| scheduler | jobs held | ready (s) | active (s) | RSS serving (MiB) | RSS +5 s (MiB) | VmHWM (MiB) | CPU to serve (s) | snapshot load (s) | stream messages replayed | replay (s) |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let _ = writeln!(
        out,
        "| empty stream, before the history | 0 | | | {:.1} | | {:.1} | | | | |",
        mib(live.empty.rss_kib),
        mib(live.empty.hwm_kib)
    );
    let _ = writeln!(
        out,
        "| live, after applying the history | {} | | | {:.1} | | {:.1} | | | | |",
        live.registry_jobs,
        mib(live.memory.rss_kib),
        mib(live.memory.hwm_kib)
    );
    for start in &report.starts {
        let _ = writeln!(out, "{}", start_row(start));
    }
    for snapshot in [true, false] {
        let starts: Vec<&Start> = report
            .starts
            .iter()
            .filter(|s| s.snapshot == snapshot)
            .collect();
        if starts.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "\nrestart {}: active after {:.2} s (median of {}), RSS +5 s {:.1} MiB (median)",
            if snapshot {
                "with a snapshot"
            } else {
                "without a snapshot"
            },
            median(
                starts
                    .iter()
                    .map(|s| s.times.active.as_secs_f64())
                    .collect()
            ),
            starts.len(),
            median(starts.iter().map(|s| mib(s.settled.rss_kib)).collect())
        );
    }
    out.push('\n');
    out
}

fn start_row(start: &Start) -> String {
    format!(
        "| restarted, {} | {} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {} | {} |",
        if start.snapshot {
            "with a snapshot"
        } else {
            "without a snapshot"
        },
        start.registry_jobs,
        start.times.ready.as_secs_f64(),
        start.times.active.as_secs_f64(),
        mib(start.serving.rss_kib),
        mib(start.settled.rss_kib),
        mib(start.settled.hwm_kib),
        start.cpu_to_serve.as_secs_f64(),
        secs(start.snapshot_seconds),
        start
            .replayed_events
            .map_or_else(|| "—".into(), |n| n.to_string()),
        secs(start.replay_seconds),
    )
}

pub fn backlog(reports: &[DepthReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## Submit and drain rates by backlog depth\n");
    let _ = writeln!(
        out,
        "| depth | round | submit (jobs/s) | backlog | p50 (ms) | p99 (ms) | scheduler CPU (ms/job) | drain (jobs/s) | backlog | scheduler CPU (ms/job) |"
    );
    let _ = writeln!(
        out,
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"
    );
    for report in reports {
        for (n, round) in report.rounds.iter().enumerate() {
            let (s, d) = (&round.submit, &round.drain);
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {} → {} | {:.1} | {:.1} | {:.2} | {:.1} | {} → {} | {:.2} |",
                report.depth,
                n + 1,
                s.rate(),
                s.from,
                s.to,
                round.submit_latency.quantile(0.5).as_secs_f64() * 1e3,
                round.submit_latency.quantile(0.99).as_secs_f64() * 1e3,
                s.cpu_ms_per_job(),
                d.rate(),
                d.from,
                d.to,
                d.cpu_ms_per_job()
            );
        }
    }
    // A depth may have been measured on several farms (the default alternates them, so that drift
    // of the machine's speed during the run falls on both alike): one summary row per depth.
    let mut depths: Vec<usize> = reports.iter().map(|r| r.depth).collect();
    depths.dedup();
    depths.sort_unstable();
    depths.dedup();
    let _ = writeln!(
        out,
        "\n| depth | farms | rounds | submit, median (jobs/s) | drain, median (jobs/s) | scheduler CPU per drained job, median (ms) | scheduler RSS at the end (MiB) |"
    );
    let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    let mut medians = Vec::new();
    for depth in depths {
        let farms: Vec<&DepthReport> = reports.iter().filter(|r| r.depth == depth).collect();
        let rounds: Vec<_> = farms.iter().flat_map(|r| &r.rounds).collect();
        let submit = median(rounds.iter().map(|x| x.submit.rate()).collect());
        let drain = median(rounds.iter().map(|x| x.drain.rate()).collect());
        let cpu = median(rounds.iter().map(|x| x.drain.cpu_ms_per_job()).collect());
        let rss: Vec<String> = farms
            .iter()
            .map(|r| format!("{:.1}", mib(r.memory.rss_kib)))
            .collect();
        let _ = writeln!(
            out,
            "| {depth} | {} | {} | {submit:.1} | {drain:.1} | {cpu:.2} | {} |",
            farms.len(),
            rounds.len(),
            rss.join(", ")
        );
        medians.push((submit, drain));
    }
    if let (Some(first), Some(last)) = (medians.first(), medians.last())
        && medians.len() > 1
    {
        let _ = writeln!(
            out,
            "\ndeepest ÷ shallowest backlog (medians): submit {:.2}, drain {:.2}",
            last.0 / first.0,
            last.1 / first.1
        );
    }
    out.push('\n');
    out
}
