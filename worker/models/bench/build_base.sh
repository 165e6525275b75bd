#!/usr/bin/env bash
# Builds the `base` binary of the pipeline benchmark: examples/bench.rs of the working tree compiled
# against the library of an older commit (default ca35d46, the library before the staged loader), with
# `set_loader` reduced to accepting `staged` (the old library has no loader option).
#
# Usage (repository root, the venv's torch first on PATH, LIBTORCH_USE_PYTORCH=1):
#   CARGO_TARGET_DIR=/var/cache/vnfarm/target-release worker/models/bench/build_base.sh [COMMIT] [OUT]
# OUT defaults to .bench/bench_base. The target dir may be the one the current binary is built in:
# cargo gives both trees' crates the same artefact names, so sources are touched to force a rebuild
# (rebuild the current binary the same way afterwards).
set -euo pipefail
commit=${1:-ca35d46}
out=${2:-.bench/bench_base}
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git -C "$root" archive "$commit" | tar -x -C "$tree"
cp "$root/worker/models/examples/bench.rs" "$tree/worker/models/examples/bench.rs"
python3 - "$tree/worker/models/examples/bench.rs" <<'EOF'
import sys
p = sys.argv[1]
s = open(p).read()
a, b = s.index("fn set_loader(name: &str) -> anyhow::Result<()> {"), s.index("fn init_cuda(")
s = s[:a] + '''fn set_loader(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(name == "staged", "the base library has one loader");
    Ok(())
}

''' + s[b:]
old = "use vnfarm_models::safetensors::{self, LoadPath, SafetensorsFile};"
assert old in s, "bench.rs imports changed: update build_base.sh"
s = s.replace(old, "use vnfarm_models::safetensors::SafetensorsFile;")
open(p, "w").write(s)
EOF
touch "$tree/worker/models/src/lib.rs" "$tree/worker/models/examples/bench.rs"
(cd "$tree" && cargo build --release -p vnfarm-models --example bench)
mkdir -p "$(dirname "$out")"
cp "${CARGO_TARGET_DIR:-$tree/target}/release/examples/bench" "$out"
echo "wrote $out (library of $commit)"
