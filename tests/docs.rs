//! Every repository path that `docs/DESIGN.md` and `README.md` name in backticks exists, so a file
//! moved or renamed takes its mentions along.
//!
//! A backticked span counts as a path when it is made of path characters only and either starts
//! with a top-level entry of the repository (`scheduler/src/lib.rs`, `deploy/`, `farm`) or contains
//! a `/` and ends in a source extension (`registry/plan.rs`, named relative to its crate: it must
//! end some file's path). Storage keys (`inputs/`, `results/<job>/0.png`), media types, routes and
//! Rust paths (`a::b`) are none of these. Fenced code blocks are left out: they show commands. Paths
//! under `shared/` name the steering folder beside the checkout (the design's first copy and the
//! references it cites), which is not part of the repository.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Extensions of the files a relative path may name.
const SOURCE_EXTENSIONS: &[&str] = &[
    "rs", "md", "toml", "json", "py", "sh", "cu", "cpp", "h", "js", "css", "html", "yml", "yaml",
];

/// Build outputs and local state, which are not the repository's.
const NOT_TRACKED: &[&str] = &[".git", "target", ".venv", ".demo", "node_modules"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies in the workspace")
        .to_path_buf()
}

/// Every file and folder under `dir`, relative to `root`, `/`-separated.
fn entries(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    let listing = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in listing {
        let entry = entry.expect("a readable folder entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        if NOT_TRACKED.contains(&name.as_str()) {
            continue;
        }
        let path = entry.path();
        let relative = path
            .strip_prefix(root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        if path.is_dir() {
            out.insert(format!("{relative}/"));
            entries(root, &path, out);
        } else {
            out.insert(relative);
        }
    }
}

/// The backticked spans of `text` outside fenced code blocks.
fn spans(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        out.extend(line.split('`').skip(1).step_by(2).map(str::to_owned));
    }
    out
}

/// Why `span` is a path that does not exist, or `None` (it exists, or it is no path).
fn dead(span: &str, entries: &BTreeSet<String>, top: &BTreeSet<&str>) -> Option<&'static str> {
    let path_chars = |c: char| c.is_ascii_alphanumeric() || "_-./".contains(c);
    if span.is_empty()
        || !span.chars().all(path_chars)
        || span.starts_with('/')
        || span.starts_with("shared/")
    {
        return None;
    }
    let first = span.split('/').next().unwrap_or_default();
    if top.contains(first) {
        let found = if span.ends_with('/') {
            entries.contains(span)
        } else {
            entries.contains(span) || entries.contains(&format!("{span}/"))
        };
        return (!found).then_some("no such file or folder");
    }
    let extension = span.rsplit_once('.').map(|(_, e)| e);
    if span.contains('/') && extension.is_some_and(|e| SOURCE_EXTENSIONS.contains(&e)) {
        let suffix = format!("/{span}");
        return (!entries.iter().any(|e| e.ends_with(&suffix))).then_some("no file's path ends so");
    }
    None
}

#[test]
fn every_path_the_design_and_the_readme_name_exists() {
    let root = root();
    let mut all = BTreeSet::new();
    entries(&root, &root, &mut all);
    let top: BTreeSet<&str> = all
        .iter()
        .filter_map(|e| e.strip_suffix('/').unwrap_or(e).split('/').next())
        .collect();
    let mut missing = Vec::new();
    for doc in ["docs/DESIGN.md", "README.md"] {
        let text = std::fs::read_to_string(root.join(doc)).expect("the document");
        for span in spans(&text) {
            if let Some(why) = dead(&span, &all, &top) {
                missing.push(format!("{doc}: `{span}`: {why}"));
            }
        }
    }
    assert!(missing.is_empty(), "dead paths:\n{}", missing.join("\n"));
}

#[test]
fn the_check_tells_paths_from_other_spans() {
    let all: BTreeSet<String> = [
        "scheduler/",
        "scheduler/src/",
        "scheduler/src/lib.rs",
        "farm",
    ]
    .map(str::to_owned)
    .into();
    let top: BTreeSet<&str> = ["scheduler", "farm"].into();
    for alive in [
        "scheduler/src/lib.rs",
        "scheduler/src",
        "scheduler/",
        "farm",
        "src/lib.rs",
        "inputs/",
        "results/<job>/0.png",
        "image/png",
        "/v1/jobs",
        "vnfarm_models::qwen_image",
        "lib.rs",
        "shared/reference/fleet.md",
    ] {
        assert_eq!(dead(alive, &all, &top), None, "{alive}");
    }
    for gone in [
        "scheduler/src/dispatch.rs",
        "scheduler/web/",
        "registry/plan.rs",
    ] {
        assert!(dead(gone, &all, &top).is_some(), "{gone}");
    }
}
