//! Links this crate's programs to libtorch so that they find the GPU backend and start without
//! `LD_LIBRARY_PATH` (see `vnfarm-build-support`).

fn main() {
    vnfarm_build_support::link_libtorch();
}
