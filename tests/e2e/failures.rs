//! Bad input: invalid specs over HTTP, malformed and oversized messages over AMQP. Each gets a clear
//! error, nothing is lost, and the binaries keep serving.

use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::AMQPValue;
use serde_json::json;
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_over_http_get_4xx_naming_the_field() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("invalid").await?;
    farm.start_scheduler().await?;
    let cases = [
        (
            json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "width": 1001}}),
            "job.width",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "steps": 500}}),
            "job.steps",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "count": 0}}),
            "job.count",
        ),
        (
            json!({"schema_version": 9, "job": {"kind": "generate", "prompt": "x"}}),
            "schema_version",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "guidance": 3}}),
            "job",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/a.png"}, "scale": 3}}),
            "job.scale",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "edit", "input": {"inline": "bm90IGFuIGltYWdl"}, "instruction": "x"}}),
            "job.input.inline",
        ),
        // A bad inline image is named where it is.
        (
            json!({"schema_version": 1, "job": {"kind": "edit", "inputs": [{"stored": "inputs/a.png"}, {"inline": "bm90IGFuIGltYWdl"}], "instruction": "x"}}),
            "job.inputs[1].inline",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"}, "edits": [{"instruction": "a"}, {"instruction": "b", "references": [{"inline": "bm90IGFuIGltYWdl"}]}]}}),
            "job.edits[1].references[0].inline",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"}, "upscales": [{"of": {"edit": 2}}]}}),
            "job.upscales[0].of",
        ),
        // Stored inputs that are not there are refused at once, naming the input.
        (
            json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/missing.png"}}}),
            "job.input",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "edit", "inputs": [{"job_output": {"job": "01a23176-ac29-7059-960f-9bbf47f968ef", "index": 0}}, {"stored": "inputs/missing.png"}], "instruction": "x"}}),
            "job.inputs[1]",
        ),
        (
            json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"}, "edits": [{"instruction": "a"}, {"instruction": "b", "references": [{"stored": "inputs/missing.png"}]}]}}),
            "job.edits[1].references[0]",
        ),
    ];
    for (body, field) in cases {
        let (status, reply) = farm.submit(&body).await?;
        assert_eq!(status, 422, "{body} -> {reply:?}");
        let refused = reply.expect_err("a refusal");
        assert_eq!(refused.error.field, field, "{body} -> {refused:?}");
        assert!(!refused.error.message.is_empty());
    }
    let r = farm
        .http
        .post(farm.url("/v1/jobs"))
        .body("{not json")
        .send()
        .await?;
    assert_eq!(r.status(), 422);
    // Nothing was queued by any of them.
    assert_eq!(
        farm.get_json("/v1/jobs?all=true").await?["jobs"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    Ok(())
}

fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_messages_are_dead_lettered_with_a_failed_event()
-> anyhow::Result<()> {
    let mut farm = Farm::in_process("malformed").await?;
    farm.start_scheduler().await?;
    farm.start_worker("w1", WorkerOptions::default()).await?;
    let conn = farm.connect_amqp().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let publish = |queue: String, body: Vec<u8>, id: String| {
        let channel = channel.clone();
        async move {
            let props = BasicProperties::default().with_message_id(id.into());
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                )
                .await?
                .await
        }
    };
    let intake = format!("{}.intake", farm.prefix);
    let garbage = uuid::Uuid::now_v7().to_string();
    let oversized = uuid::Uuid::now_v7().to_string();
    let invalid = uuid::Uuid::now_v7().to_string();
    let to_worker = uuid::Uuid::now_v7().to_string();
    publish(
        intake.clone(),
        b"\x00\xffnot json at all".to_vec(),
        garbage.clone(),
    )
    .await?;
    publish(
        intake.clone(),
        vec![b' '; 13 * 1024 * 1024],
        oversized.clone(),
    )
    .await?;
    let bad_spec =
        json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "width": 100}});
    publish(
        intake.clone(),
        serde_json::to_vec(&bad_spec)?,
        invalid.clone(),
    )
    .await?;
    // Straight onto a worker's queue, bypassing the scheduler.
    publish(
        format!("{}.worker.w1", farm.prefix),
        b"{\"schema_version\": 1}".to_vec(),
        to_worker.clone(),
    )
    .await?;

    for (id, failure) in [
        (&garbage, "malformed"),
        (&oversized, "malformed"),
        (&invalid, "invalid_spec"),
        (&to_worker, "malformed"),
    ] {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job.state, JobState::Failed, "{job:?}");
        let kind = job.failure.as_ref().map(|f| f.kind.as_str());
        assert_eq!(kind, Some(failure), "{job:?}");
    }
    let job = farm.job(&invalid).await?;
    assert!(
        job.failure
            .as_ref()
            .is_some_and(|f| f.message.contains("job.width")),
        "{job:?}"
    );

    // All four wait in the dead-letter queue with their reasons.
    let mut dead = Vec::new();
    while let Some(msg) = channel
        .basic_get(
            format!("{}.dead", farm.prefix).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        dead.push((
            header_text(&msg.delivery.properties, "x-vnfarm-job-id"),
            header_text(&msg.delivery.properties, "x-vnfarm-reason"),
            msg.delivery.data.len(),
        ));
    }
    assert_eq!(dead.len(), 4, "{dead:?}");
    for id in [&garbage, &oversized, &invalid, &to_worker] {
        let (_, reason, _) = dead
            .iter()
            .find(|(j, _, _)| j.as_deref() == Some(id.as_str()))
            .expect("dead letter per message");
        assert!(!reason.as_deref().unwrap_or("").is_empty());
    }
    assert!(
        dead.iter().any(|(_, _, len)| *len == 13 * 1024 * 1024),
        "the oversized message is kept whole"
    );

    // Both binaries still serve.
    let id = farm.submit_new(&json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "still alive", "width": 256, "height": 256, "steps": 2}})).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");

    // An input that is not an image is a permanent failure of that job only.
    vnfarm_tests::put_undecodable(&farm.storage, "inputs/garbage.png").await?;
    let id = farm.submit_new(&json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/garbage.png"}}})).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(
        (job.state, job.failure.as_ref().map(|f| f.kind.as_str())),
        (JobState::Failed, Some("bad_input")),
        "{job:?}"
    );
    Ok(())
}
