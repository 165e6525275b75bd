//! Golden messages: `proto/golden/v<N>/` holds one message of every kind as protocol version N
//! writes it (docs/DESIGN.md §4, "Versions and rolling upgrades"). This build must decode every
//! version it claims to read, and the current version's files must be exactly what it writes, so
//! that the next version's tests prove it still reads today's messages. A version's directory is
//! never rewritten once released; `VNFARM_BLESS=1 cargo test -p vnfarm-proto --test golden`
//! rewrites only the current version's files from what this build writes.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use vnfarm_proto::{
    CancelRequest, Event, Heartbeat, MIN_PROTOCOL_VERSION, Manifest, PROTOCOL_VERSION, PersonEvent,
    Submission, WorkMessage, YieldRequest, decode_json,
};

fn version_dir(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("golden/v{version}"))
}

/// The message kinds, by file-name prefix. Every version directory has at least one of each.
const KINDS: [&str; 8] = [
    "submission-",
    "work-",
    "heartbeat",
    "event-",
    "cancel",
    "yield",
    "manifest",
    "people-",
];

/// The version each kind first appeared in, where not 1 (people's token events: version 2, added
/// beside it as the envelope rule of DESIGN §4 allows, since an older reader skips them).
fn since(kind: &str) -> u32 {
    if kind == "people-" { 2 } else { 1 }
}

/// Decodes `bytes` as the kind its file name says, and encodes it again as this build writes it
/// (pretty-printed, fields in declaration order).
fn reencode(name: &str, bytes: &[u8]) -> Result<String, String> {
    fn via<T: DeserializeOwned + Serialize>(bytes: &[u8]) -> Result<String, String> {
        let value: T = decode_json(bytes).map_err(|e| e.to_string())?;
        Ok(serde_json::to_string_pretty(&value).expect("wire types serialize") + "\n")
    }
    let kind = KINDS
        .iter()
        .find(|k| name.starts_with(*k))
        .ok_or_else(|| format!("{name}: no message kind has this prefix"))?;
    match *kind {
        "submission-" => via::<Submission>(bytes),
        "work-" => via::<WorkMessage>(bytes),
        "heartbeat" => via::<Heartbeat>(bytes),
        "event-" => via::<Event>(bytes),
        "cancel" => via::<CancelRequest>(bytes),
        "yield" => via::<YieldRequest>(bytes),
        "manifest" => via::<Manifest>(bytes),
        "people-" => via::<PersonEvent>(bytes),
        _ => unreachable!("every prefix of KINDS is matched"),
    }
}

fn files(version: u32) -> Vec<(String, Vec<u8>)> {
    let dir = version_dir(version);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("a directory entry").path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).expect("a golden file"))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn this_build_reads_every_version_it_claims() {
    for version in MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION {
        let files = files(version);
        for kind in KINDS.into_iter().filter(|k| since(k) <= version) {
            assert!(
                files.iter().any(|(name, _)| name.starts_with(kind)),
                "golden/v{version} has no `{kind}` message"
            );
        }
        for (name, bytes) in &files {
            if let Err(e) = reencode(name, bytes) {
                panic!("golden/v{version}/{name}.json does not decode: {e}");
            }
        }
    }
}

#[test]
fn the_current_version_files_are_what_this_build_writes() {
    let bless = std::env::var_os("VNFARM_BLESS").is_some();
    for (name, bytes) in files(PROTOCOL_VERSION) {
        let written = reencode(&name, &bytes).expect("decodes");
        if bless {
            std::fs::write(
                version_dir(PROTOCOL_VERSION).join(format!("{name}.json")),
                written,
            )
            .unwrap();
            continue;
        }
        let committed: Value = serde_json::from_slice(&bytes).unwrap();
        let written: Value = serde_json::from_str(&written).unwrap();
        assert_eq!(
            committed, written,
            "golden/v{PROTOCOL_VERSION}/{name}.json is not what this build writes (VNFARM_BLESS=1 rewrites it)"
        );
    }
}

/// Version 1 work messages name version 1, and version 1 wrote no field that version 2 added:
/// so a message this build writes for a version-1 worker decodes there.
#[test]
fn a_message_for_a_version_1_worker_is_written_as_version_1_wrote_it() {
    for (name, bytes) in files(PROTOCOL_VERSION) {
        if !name.starts_with("work-") {
            continue;
        }
        let mut msg: WorkMessage = decode_json(&bytes).unwrap();
        let version = msg
            .version_for(&[1])
            .expect("every message is expressible in version 1");
        msg.schema_version = version;
        let written: Value = serde_json::from_str(&serde_json::to_string(&msg).unwrap()).unwrap();
        let old: Value = serde_json::from_slice(
            &std::fs::read(version_dir(1).join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(written, old, "{name}");
    }
}

/// What version 2 promises the next version: extra fields in a message's envelope are ignored;
/// extra fields in a job's spec are refused (they would change what the job makes).
#[test]
fn unknown_envelope_fields_are_ignored_and_unknown_spec_fields_refused() {
    let mut beat: Value =
        serde_json::from_slice(&std::fs::read(version_dir(2).join("heartbeat.json")).unwrap())
            .unwrap();
    beat["a_field_of_version_3"] = serde_json::json!({"nested": true});
    decode_json::<Heartbeat>(&serde_json::to_vec(&beat).unwrap()).expect("ignored");

    let work = std::fs::read(version_dir(2).join("work-edit.json")).unwrap();
    let mut msg: Value = serde_json::from_slice(&work).unwrap();
    msg["trace"] = "00-abc-01".into();
    decode_json::<WorkMessage>(&serde_json::to_vec(&msg).unwrap()).expect("ignored");
    msg["task"]["strength"] = 0.5.into();
    let err = decode_json::<WorkMessage>(&serde_json::to_vec(&msg).unwrap()).unwrap_err();
    assert!(err.to_string().contains("strength"), "{err}");
}

#[test]
fn a_worker_gets_the_newest_version_both_speak() {
    let msg: WorkMessage =
        decode_json(&std::fs::read(version_dir(2).join("work-edit.json")).unwrap()).unwrap();
    assert_eq!(msg.version_for(&[1]), Some(1));
    assert_eq!(msg.version_for(&[1, 2]), Some(2));
    assert_eq!(msg.version_for(&[1, 2, 3]), Some(PROTOCOL_VERSION));
    assert_eq!(msg.version_for(&[9]), None);
}

/// Control messages reach every worker, version 1 ones too, so this build writes them exactly as
/// version 1 did.
#[test]
fn control_messages_are_written_as_version_1_wrote_them() {
    for name in ["cancel", "yield"] {
        let read = |version| -> Value {
            serde_json::from_slice(
                &std::fs::read(version_dir(version).join(format!("{name}.json"))).unwrap(),
            )
            .unwrap()
        };
        assert_eq!(read(PROTOCOL_VERSION), read(1), "{name}");
    }
}
