//! Links this crate's programs to libtorch so that they find the GPU backend and start without
//! `LD_LIBRARY_PATH` (see `vnfarm-build-support`), and records the commit the build came from
//! (`VNFARM_GIT_COMMIT`, empty outside a git checkout) for the settings files' fingerprint.

use std::path::Path;
use std::process::Command;

fn main() {
    vnfarm_build_support::link_libtorch();
    let git = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.git");
    if git.join("HEAD").exists() {
        println!("cargo:rerun-if-changed={}", git.join("HEAD").display());
        if let Ok(head) = std::fs::read_to_string(git.join("HEAD"))
            && let Some(reference) = head.trim().strip_prefix("ref: ")
        {
            println!("cargo:rerun-if-changed={}", git.join(reference).display());
        }
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short=10", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    println!("cargo:rustc-env=VNFARM_GIT_COMMIT={commit}");
}
