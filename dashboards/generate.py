#!/usr/bin/env python3
"""Writes vnfarm's Grafana dashboards (the JSON files beside this script).

The JSON files are what Grafana loads and what the e2e test `observability` checks; this script is
how they are made, so that every panel has the same shape (datasource variable, unit,
description, grid position). Edit it and run `python3 dashboards/generate.py`; commit both (the
e2e test `observability` fails while they differ).
Standard library only.
"""

import json
import pathlib
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
HERE = pathlib.Path(__file__).resolve().parent


class Board:
    """Panels laid out left to right, 24 grid columns to a row."""

    def __init__(self):
        self.panels = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title):
        self.newline()
        self.panels.append({
            "id": len(self.panels) + 1,
            "type": "row",
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            "panels": [],
        })
        self.y += 1

    def newline(self):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def panel(self, kind, title, description, unit, targets, w=8, h=8, options=None, field=None,
              instant=False):
        if self.x + w > 24:
            self.newline()
        defaults = {"unit": unit}
        if field:
            defaults.update(field)
        if kind == "timeseries":
            defaults.setdefault("custom", {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                           "showPoints": "never", "spanNulls": True})
        panel = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options or default_options(kind),
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": not instant,
                    "instant": instant,
                    **({"format": "table"} if kind == "table" else {}),
                }
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def default_options(kind):
    if kind == "timeseries":
        return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    if kind == "table":
        return {"showHeader": True}
    return {}


def datasource_variable():
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
        "includeAll": False,
        "multi": False,
    }


def instance_variable(metric, label="instance", title="Worker"):
    return {
        "name": label,
        "label": title,
        "type": "query",
        "datasource": DS,
        "query": {"query": f"label_values({metric}, {label})", "refId": "vars"},
        "definition": f"label_values({metric}, {label})",
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "sort": 1,
        "hide": 0,
    }


def dashboard(uid, title, description, board, variables=()):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["vnfarm"],
        "editable": False,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["vnfarm"], "asDropdown": True,
                   "title": "vnfarm", "includeVars": False, "keepTime": True}],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": board.panels,
    }


def quantiles(metric, by, selector=""):
    """p50 and p95 of a histogram, summed over everything but `by`."""
    keep = ", ".join(["le", *by])
    legend = " ".join("{{" + b + "}}" for b in by)
    return [
        (f"histogram_quantile({q}, sum by ({keep}) (rate({metric}_bucket{selector}[{RATE}])))",
         f"p{int(q * 100)} {legend}".strip())
        for q in (0.5, 0.95)
    ]


# Several schedulers (active and standbys) export the same registry-derived series: take the
# largest, never the sum. Counters fed by applied events are counted by every scheduler too.
def per_scheduler_rate(metric, by, selector=""):
    inner = ", ".join(["instance", *by])
    outer = ", ".join(by)
    return f"max by ({outer}) (sum by ({inner}) (rate({metric}{selector}[{RATE}])))"


def overview():
    b = Board()
    b.row("Now")
    b.panel("stat", "Queued jobs", "Jobs waiting for a worker, all models and priorities "
            "(vnfarm_backlog_jobs, the largest value any scheduler reports).", "short",
            [("sum(max by (model, priority) (vnfarm_backlog_jobs))", "queued")], w=4, h=5)
    b.panel("stat", "Running jobs", "Jobs dispatched to or running on a worker (vnfarm_jobs).",
            "short", [('sum(max by (state) (vnfarm_jobs{state=~"dispatched|running"}))', "running")],
            w=4, h=5)
    b.panel("stat", "Ready workers", "Workers whose last heartbeat said ready, within the "
            "heartbeat timeout (vnfarm_workers).", "short",
            [('max(vnfarm_workers{state="ready"})', "ready")], w=4, h=5)
    b.panel("stat", "Active schedulers", "Schedulers holding the leader token: 1 is right, 0 "
            "means nothing is dispatched (vnfarm_scheduler_active).", "short",
            [("sum(vnfarm_scheduler_active)", "active")], w=4, h=5)
    b.panel("stat", "Fleet busy", "Share of the last interval the workers' engines spent on jobs, "
            "averaged over the workers (rate of vnfarm_worker_busy_seconds_total).", "percentunit",
            [(f"avg(rate(vnfarm_worker_busy_seconds_total[{RATE}]))", "busy")], w=4, h=5,
            field={"min": 0, "max": 1})
    b.panel("stat", "Dead letters (1h)", "Messages dead-lettered in the last hour by the "
            "scheduler and the workers (vnfarm_dead_letters_total).", "short",
            [("sum(increase(vnfarm_dead_letters_total[1h]))", "dead letters")], w=4, h=5)
    b.row("Throughput")
    b.panel("timeseries", "Jobs finished", "Jobs reaching a final state per second, by outcome "
            "(vnfarm_jobs_finished_total).", "ops",
            [(per_scheduler_rate("vnfarm_jobs_finished_total", ["outcome"]), "{{outcome}}")])
    b.panel("timeseries", "Jobs submitted", "Jobs accepted per second, by kind (a pipeline "
            "counts once; its jobs are then queued one by one).", "ops",
            [(per_scheduler_rate("vnfarm_jobs_submitted_total", ["kind"]), "{{kind}}")])
    b.panel("timeseries", "Queued jobs by model", "Jobs waiting for a worker, by model "
            "(vnfarm_backlog_jobs).", "short",
            [("sum by (model) (max by (model, priority) (vnfarm_backlog_jobs))", "{{model}}")])
    b.row("Latency")
    b.panel("timeseries", "Queue wait", "Seconds from queued to started, all kinds "
            "(vnfarm_queue_wait_seconds).", "s", quantiles("vnfarm_queue_wait_seconds", []))
    b.panel("timeseries", "Run time", "Seconds from started to completed, all kinds "
            "(vnfarm_job_run_seconds).", "s", quantiles("vnfarm_job_run_seconds", []))
    b.panel("timeseries", "Worker busy", "Share of the interval each worker's engine was busy "
            "(rate of vnfarm_worker_busy_seconds_total).", "percentunit",
            [(f"rate(vnfarm_worker_busy_seconds_total[{RATE}])", "{{instance}}")],
            field={"min": 0, "max": 1})
    b.row("Health")
    b.panel("timeseries", "Workers by state", "Known workers by state; gone: no heartbeat within "
            "the timeout (vnfarm_workers).", "short",
            [("max by (state) (vnfarm_workers)", "{{state}}")])
    b.panel("timeseries", "Broker connections", "1 while a process is connected to RabbitMQ "
            "(vnfarm_amqp_connected); reconnect attempts in the last interval.", "short",
            [("min by (job, instance) (vnfarm_amqp_connected)", "{{instance}} connected"),
             (f"sum by (job, instance) (increase(vnfarm_amqp_reconnects_total[{RATE}]))",
              "{{instance}} reconnects")])
    b.panel("timeseries", "Errors", "Per second: messages dead-lettered "
            "(vnfarm_dead_letters_total), failed storage operations "
            "(vnfarm_storage_errors_total), malformed messages.", "ops",
            [(f"sum by (job) (rate(vnfarm_dead_letters_total[{RATE}]))", "dead letters {{job}}"),
             (f"sum by (job) (rate(vnfarm_storage_errors_total[{RATE}]))", "storage {{job}}"),
             (f"sum by (job) (rate(vnfarm_malformed_messages_total[{RATE}]))",
              "malformed {{job}}")])
    return dashboard("vnfarm-overview", "vnfarm / Fleet overview",
                     "The farm at a glance: backlog, throughput, latency, workers, errors.", b)


def jobs():
    b = Board()
    b.row("Flow")
    b.panel("timeseries", "Submitted by kind", "Jobs accepted per second, by kind "
            "(vnfarm_jobs_submitted_total).", "ops",
            [(per_scheduler_rate("vnfarm_jobs_submitted_total", ["kind"]), "{{kind}}")])
    b.panel("timeseries", "Finished by kind and outcome", "Jobs reaching a final state per "
            "second (vnfarm_jobs_finished_total).", "ops",
            [(per_scheduler_rate("vnfarm_jobs_finished_total", ["kind", "outcome"]),
              "{{kind}} {{outcome}}")])
    b.panel("timeseries", "Failure ratio", "Failed over finished jobs (the VnfarmJobFailureRatio "
            "alert fires above 10 % over 15 minutes).", "percentunit",
            [(f'sum(rate(vnfarm_jobs_finished_total{{outcome="failed"}}[{RATE}])) '
              f"/ sum(rate(vnfarm_jobs_finished_total[{RATE}]))", "failed")],
            field={"min": 0, "max": 1})
    b.panel("timeseries", "Active jobs by state", "Jobs not yet final, by state (vnfarm_jobs).",
            "short", [("max by (state) (vnfarm_jobs)", "{{state}}")])
    b.panel("timeseries", "Requeues by reason", "Jobs that came back from a worker queue per "
            "second: expired (worker gone), given back (shutdown, part of a batch), delivery "
            "limit (vnfarm_requeues_total).", "ops",
            [(f"sum by (reason) (rate(vnfarm_requeues_total[{RATE}]))", "{{reason}}")])
    b.panel("timeseries", "Worker outcomes", "Jobs settled by workers per second, by outcome "
            "(vnfarm_worker_jobs_total; requeued: given back or retried).", "ops",
            [(f"sum by (outcome) (rate(vnfarm_worker_jobs_total[{RATE}]))", "{{outcome}}")])
    b.row("Latency")
    b.panel("timeseries", "Queue wait by kind", "Seconds from queued to started, p50 and p95 "
            "(vnfarm_queue_wait_seconds).", "s", quantiles("vnfarm_queue_wait_seconds", ["kind"]))
    b.panel("timeseries", "Run time by kind", "Seconds from started to completed, p50 and p95 "
            "(vnfarm_job_run_seconds).", "s", quantiles("vnfarm_job_run_seconds", ["kind"]))
    b.panel("timeseries", "Worker time per job", "Seconds from delivery to ack on the worker, "
            "p50 and p95 (vnfarm_worker_job_seconds).", "s",
            quantiles("vnfarm_worker_job_seconds", ["kind"]))
    b.row("Stages")
    b.panel("timeseries", "Mean seconds per stage", "Mean seconds a job spends in each stage "
            "(download, encode, encode_prompt, denoise, decode, upscale, encode_png, upload), by "
            "kind (vnfarm_worker_stage_seconds).", "s",
            [(f"sum by (kind, stage) (rate(vnfarm_worker_stage_seconds_sum[{RATE}])) "
              f"/ sum by (kind, stage) (rate(vnfarm_worker_stage_seconds_count[{RATE}]))",
              "{{kind}} {{stage}}")], w=12)
    b.panel("timeseries", "Stage p95", "95th percentile seconds per stage and kind "
            "(vnfarm_worker_stage_seconds).", "s",
            [(f"histogram_quantile(0.95, sum by (le, kind, stage) "
              f"(rate(vnfarm_worker_stage_seconds_bucket[{RATE}])))", "{{kind}} {{stage}}")],
            w=12)
    return dashboard("vnfarm-jobs", "vnfarm / Jobs",
                     "Jobs by kind: submissions, outcomes, queue wait, run time and stages.", b)


def workers():
    b = Board()
    sel = '{instance=~"$instance"}'
    b.row("Workers")
    b.panel("table", "Workers", "Each scraped worker: its id, engine and version "
            "(vnfarm_worker_info).", "none",
            [(f"vnfarm_worker_info{sel}", "{{worker}}")], w=12, h=7, instant=True)
    b.panel("table", "Engine settings", "The kernel and layout settings each worker runs: "
            "measured on its box by `vnfarm-worker check` (source measured, with the settings "
            "file's id) or the configured presets (vnfarm_worker_settings_info; `vnfarm workers` "
            "and the web page's fleet list show the same from heartbeats).", "none",
            [(f"vnfarm_worker_settings_info{sel}", "{{instance}}")], w=12, h=7, instant=True)
    b.panel("timeseries", "State", "1 for the state each worker heartbeats: warming (loading "
            "models), ready, draining (vnfarm_worker_state).", "short",
            [(f"vnfarm_worker_state{sel} == 1", "{{instance}} {{state}}")], w=12, h=7)
    b.panel("timeseries", "Busy", "Share of the interval each engine spent on jobs (rate of "
            "vnfarm_worker_busy_seconds_total).", "percentunit",
            [(f"rate(vnfarm_worker_busy_seconds_total{sel}[{RATE}])", "{{instance}}")],
            field={"min": 0, "max": 1})
    b.panel("timeseries", "Jobs by outcome", "Jobs settled per second by each worker "
            "(vnfarm_worker_jobs_total).", "ops",
            [(f"sum by (instance, outcome) (rate(vnfarm_worker_jobs_total{sel}[{RATE}]))",
              "{{instance}} {{outcome}}")])
    b.panel("timeseries", "Jobs per message", "Mean jobs per work message a worker took: above 1 "
            "when batches arrive (vnfarm_worker_batch_jobs).", "short",
            [(f"sum by (instance) (rate(vnfarm_worker_batch_jobs_sum{sel}[{RATE}])) "
              f"/ sum by (instance) (rate(vnfarm_worker_batch_jobs_count{sel}[{RATE}]))",
              "{{instance}}")])
    b.row("GPU")
    b.panel("timeseries", "GPU memory used", "Device memory in use (total minus free, every "
            "process counted) as the GPU runtime reports it (vnfarm_worker_gpu_memory_bytes).",
            "bytes",
            [(f'vnfarm_worker_gpu_memory_bytes{{kind="total",instance=~"$instance"}} - ignoring '
              f'(kind) vnfarm_worker_gpu_memory_bytes{{kind="free",instance=~"$instance"}}',
              "{{instance}} used"),
             (f'vnfarm_worker_gpu_memory_bytes{{kind="total",instance=~"$instance"}}',
              "{{instance}} total")])
    b.panel("timeseries", "GPU memory free", "Free over total device memory (the "
            "VnfarmGpuMemoryNearFull alert fires under 5 % for 10 minutes).", "percentunit",
            [(f'vnfarm_worker_gpu_memory_bytes{{kind="free",instance=~"$instance"}} / ignoring '
              f'(kind) vnfarm_worker_gpu_memory_bytes{{kind="total",instance=~"$instance"}}',
              "{{instance}}")], field={"min": 0, "max": 1})
    b.panel("stat", "Model load", "Seconds each worker took to load and warm up its engine at "
            "start (vnfarm_worker_model_load_seconds).", "s",
            [(f"vnfarm_worker_model_load_seconds_sum{sel} "
              f"/ vnfarm_worker_model_load_seconds_count{sel}", "{{instance}}")])
    b.row("Denoising")
    b.panel("timeseries", "Denoise step, p50", "Median seconds per denoising step by model and "
            "output resolution class (0.25mp … 8mp; vnfarm_worker_denoise_step_seconds). In a "
            "batch, a job's share of the step.", "s",
            [(f"histogram_quantile(0.5, sum by (le, model, resolution) "
              f"(rate(vnfarm_worker_denoise_step_seconds_bucket{sel}[{RATE}])))",
              "{{model}} {{resolution}}")], w=12)
    b.panel("timeseries", "Denoise step by worker", "Mean seconds per denoising step on each "
            "worker, by model (vnfarm_worker_denoise_step_seconds).", "s",
            [(f"sum by (instance, model) (rate(vnfarm_worker_denoise_step_seconds_sum{sel}[{RATE}])) "
              f"/ sum by (instance, model) "
              f"(rate(vnfarm_worker_denoise_step_seconds_count{sel}[{RATE}]))",
              "{{instance}} {{model}}")], w=12)
    b.row("Connections and errors")
    b.panel("timeseries", "Broker", "1 while connected to RabbitMQ (vnfarm_amqp_connected), and "
            "reconnect attempts in the interval (vnfarm_amqp_reconnects_total).", "short",
            [(f"vnfarm_amqp_connected{sel}", "{{instance}} connected"),
             (f"increase(vnfarm_amqp_reconnects_total{sel}[{RATE}])", "{{instance}} reconnects")])
    b.panel("timeseries", "Storage errors", "Failed storage operations per second, by "
            "operation; each is retried with backoff (vnfarm_storage_errors_total).", "ops",
            [(f"sum by (instance, op) (rate(vnfarm_storage_errors_total{sel}[{RATE}]))",
              "{{instance}} {{op}}")])
    b.panel("timeseries", "Dead letters", "Messages a worker dead-lettered per second, by failure "
            "kind (vnfarm_dead_letters_total), and undecodable messages "
            "(vnfarm_malformed_messages_total).", "ops",
            [(f'sum by (instance, failure) (rate(vnfarm_dead_letters_total{{job="vnfarm-worker",'
              f'instance=~"$instance"}}[{RATE}]))', "{{instance}} {{failure}}"),
             (f"rate(vnfarm_malformed_messages_total{{job=\"vnfarm-worker\",instance=~\"$instance\"}}"
              f"[{RATE}])", "{{instance}} malformed")])
    return dashboard("vnfarm-workers", "vnfarm / Workers",
                     "Each worker: state, busy time, GPU memory, model load, denoising speed, "
                     "connections and errors.", b,
                     [instance_variable("vnfarm_worker_info")])


def scheduling():
    b = Board()
    b.row("Dispatch")
    b.panel("timeseries", "Dispatches by decision", "Work messages sent per second, by the "
            "policy's decision: affinity_hit (the worker holds the input's encodings), "
            "affinity_miss, affinity_spill, affinity_wait_expired, affinity_imbalance, "
            "least_loaded, round_robin (vnfarm_dispatches_total).", "ops",
            [(f"sum by (decision) (rate(vnfarm_dispatches_total[{RATE}]))", "{{decision}}")])
    b.panel("timeseries", "Affinity hit ratio", "Share of affinity decisions that found a worker "
            "holding the input's encodings (vnfarm_dispatches_total).", "percentunit",
            [(f'sum(rate(vnfarm_dispatches_total{{decision="affinity_hit"}}[{RATE}])) '
              f'/ sum(rate(vnfarm_dispatches_total{{decision=~"affinity_.*"}}[{RATE}]))', "hits")],
            field={"min": 0, "max": 1})
    b.panel("timeseries", "Jobs per message", "Jobs per dispatched message, p50 and p95, and "
            "mean: above 1 when compatible jobs travel as a batch "
            "(vnfarm_dispatch_batch_jobs).", "short",
            [*quantiles("vnfarm_dispatch_batch_jobs", []),
             (f"sum(rate(vnfarm_dispatch_batch_jobs_sum[{RATE}])) "
              f"/ sum(rate(vnfarm_dispatch_batch_jobs_count[{RATE}]))", "mean")])
    b.row("Encode cache")
    b.panel("timeseries", "Encode cache hit ratio", "Edits whose input encodings were already in "
            "the worker's encode cache, over all edits (vnfarm_worker_encode_cache_total).",
            "percentunit",
            [(f'sum(rate(vnfarm_worker_encode_cache_total{{result="hit"}}[{RATE}])) '
              f"/ sum(rate(vnfarm_worker_encode_cache_total[{RATE}]))", "hit ratio")],
            field={"min": 0, "max": 1})
    b.panel("timeseries", "Encode cache lookups", "Hits, misses (encoded here) and fetches "
            "(another worker's encodings, read from storage) per second, by worker "
            "(vnfarm_worker_encode_cache_total).", "ops",
            [(f"sum by (instance, result) (rate(vnfarm_worker_encode_cache_total[{RATE}]))",
              "{{instance}} {{result}}")])
    b.panel("timeseries", "Shared encodings", "Encodings read from and published to storage per "
            "second, by result: a fetch found, missing, error, timeout or invalid (the worker "
            "encodes then), a publish ok or error (vnfarm_worker_shared_encodings_total).", "ops",
            [(f"sum by (op, result) (rate(vnfarm_worker_shared_encodings_total[{RATE}]))",
              "{{op}} {{result}}")])
    b.panel("timeseries", "Messages per worker", "Mean jobs per message as workers received "
            "them (vnfarm_worker_batch_jobs).", "short",
            [(f"sum by (instance) (rate(vnfarm_worker_batch_jobs_sum[{RATE}])) "
              f"/ sum by (instance) (rate(vnfarm_worker_batch_jobs_count[{RATE}]))",
              "{{instance}}")])
    b.row("Backlog")
    b.panel("timeseries", "Backlog by model and priority", "Jobs waiting for a worker "
            "(vnfarm_backlog_jobs).", "short",
            [("max by (model, priority) (vnfarm_backlog_jobs)", "{{model}} {{priority}}")])
    b.panel("timeseries", "Ready workers by model", "Workers advertising each model in a ready "
            "heartbeat (vnfarm_model_workers); with jobs queued and none ready, "
            "VnfarmNoWorkerForModel fires.", "short",
            [('max by (model) (vnfarm_model_workers{state="ready"})', "{{model}}")])
    b.panel("timeseries", "Shared queues", "Messages in the intake, redispatch and dead-letter "
            "queues as the broker counts them (vnfarm_queue_messages).", "short",
            [("max by (queue) (vnfarm_queue_messages)", "{{queue}}")])
    b.row("Dead letters")
    b.panel("timeseries", "Dead letters by failure", "Messages dead-lettered per second by the "
            "scheduler and the workers, by failure kind (vnfarm_dead_letters_total).", "ops",
            [(f"sum by (job, failure) (rate(vnfarm_dead_letters_total[{RATE}]))",
              "{{job}} {{failure}}")], w=12)
    b.panel("timeseries", "Dead-letter queue", "Messages waiting in the dead-letter queue, "
            "including those the broker dead-lettered on its own (vnfarm_queue_messages).",
            "short", [('max(vnfarm_queue_messages{queue="dead"})', "dead")], w=12)
    b.row("Scheduler")
    b.panel("timeseries", "Events applied", "Job events read from the event stream per second, "
            "by scheduler (vnfarm_events_applied_total).", "ops",
            [(f"rate(vnfarm_events_applied_total[{RATE}])", "{{instance}}")], w=6)
    b.panel("timeseries", "Jobs in memory", "Jobs held by each scheduler, active and retained "
            "finished ones (vnfarm_registry_jobs).", "short",
            [("vnfarm_registry_jobs", "{{instance}}")], w=6)
    b.panel("timeseries", "Snapshots", "Registry snapshots per interval by outcome: written, "
            "failed, too_large (vnfarm_snapshots_total).", "short",
            [(f"sum by (outcome) (increase(vnfarm_snapshots_total[{RATE}]))", "{{outcome}}")],
            w=6)
    b.panel("timeseries", "Snapshot size", "Size of the last registry snapshot each scheduler "
            "wrote (vnfarm_snapshot_bytes); a restart replays only the events after it.",
            "bytes", [("vnfarm_snapshot_bytes", "{{instance}}")], w=6)
    b.panel("timeseries", "Leadership and clients", "1 for the scheduler holding the leader "
            "token (vnfarm_scheduler_active); connected Server-Sent Events clients "
            "(vnfarm_sse_clients).", "short",
            [("vnfarm_scheduler_active", "{{instance}} active"),
             ("vnfarm_sse_clients", "{{instance}} SSE clients")], w=6)
    return dashboard("vnfarm-scheduling", "vnfarm / Scheduling",
                     "Dispatch decisions, batching, the encode cache, backlog and dead letters.",
                     b)


def main():
    # `--out DIR` writes elsewhere (the e2e test compares that with the committed files).
    out = pathlib.Path(sys.argv[2]) if sys.argv[1:2] == ["--out"] else HERE
    for name, board in [("overview", overview()), ("jobs", jobs()), ("workers", workers()),
                        ("scheduling", scheduling())]:
        path = out / f"vnfarm-{name}.json"
        path.write_text(json.dumps(board, indent=2, ensure_ascii=False) + "\n")
        print(path)


if __name__ == "__main__":
    main()
