//! The end-to-end tests read model fixtures with libtorch (`vnfarm-models`): give the test binaries a
//! `RUNPATH` to the libtorch torch-sys linked (`DEP_TCH_LIBTORCH_LIB`), as the worker's build script
//! does for its binary, so they start without `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
