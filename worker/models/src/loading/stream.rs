//! Loads on a side stream of their own ([`on_load_stream`]): a model's copies, dtype conversions
//! and LoRA fusion are queued on a stream from libtorch's pool instead of the device's default
//! stream. Then they neither wait for nor hold up the compute other threads queue meanwhile (the
//! worker warms one engine while the others load), and a staging buffer is reused once its own
//! copies are done ([`super::safetensors`]), not once the whole device is idle. The threads a load
//! spawns ([`spawn`]) take the same stream. The load ends with the host waiting for that stream, so
//! whoever gets the loaded model next (another thread, on another stream) finds its weights
//! complete.
//!
//! Blocks the caching allocator hands out while a load's stream is current belong to that stream:
//! a model's weights, which live as long as the model, and the temporaries it frees while loading,
//! which later work on the default stream does not reuse until libtorch empties its cache (it does
//! before giving up on an allocation). A freed weight's block may go to the next allocation on the
//! same stream at once, whatever other streams still have queued: so a model's weights are to be
//! freed only once the work that reads them is done (the worker frees weights between jobs, each of
//! which has waited for its device work).

use std::cell::Cell;
use std::thread::{Scope, ScopedJoinHandle};

use tch::Device;

use crate::nn::stream::{OnStream, Stream};

thread_local! {
    /// The stream this thread loads on, set by [`on_load_stream`] and by [`spawn`] for its threads.
    static LOAD_STREAM: Cell<Option<Stream>> = const { Cell::new(None) };
}

/// Makes `stream` this thread's current stream and load stream until dropped.
struct Loading {
    _on: OnStream,
    before: Option<Stream>,
}

impl Loading {
    fn enter(stream: Stream) -> Option<Loading> {
        let on = OnStream::enter(stream)?;
        let before = LOAD_STREAM.replace(Some(stream));
        Some(Loading { _on: on, before })
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        LOAD_STREAM.set(self.before);
    }
}

/// Runs `load` with this thread's work on `device` on a side stream, then waits for that stream.
/// Off the GPU, or where the binary has no stream support, `load` just runs.
pub fn on_load_stream<T>(device: Device, load: impl FnOnce() -> T) -> T {
    let Some(side) = Stream::from_pool(device) else {
        return load();
    };
    let Some(loading) = Loading::enter(side) else {
        return load();
    };
    let out = load();
    drop(loading);
    side.synchronize();
    out
}

/// Spawns `f` on `scope` on the stream this thread loads on (none: the thread's default).
pub fn spawn<'scope, 'env, T: Send + 'scope>(
    scope: &'scope Scope<'scope, 'env>,
    f: impl FnOnce() -> T + Send + 'scope,
) -> ScopedJoinHandle<'scope, T> {
    let stream = LOAD_STREAM.get();
    scope.spawn(move || {
        let _loading = stream.and_then(Loading::enter);
        f()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU a load runs as it is, and the threads it spawns too.
    #[test]
    fn a_cpu_load_runs_on_its_thread_as_before() {
        let out = on_load_stream(Device::Cpu, || {
            assert_eq!(LOAD_STREAM.get(), None);
            std::thread::scope(|scope| spawn(scope, || LOAD_STREAM.get()).join().expect("joins"))
        });
        assert_eq!(out, None);
    }

    /// Tensors loaded by four threads on a load's side stream, through staging buffers that fill
    /// and start over, while another thread keeps the default stream busy, are the file's values;
    /// the load ran on a stream other than the default one. Needs a GPU (`--ignored` on a GPU
    /// machine: `worker/models/bench/run_worker_bench.sh` runs it).
    #[test]
    #[ignore = "needs a GPU: cargo test -p vnfarm-models --lib -- --ignored, on a GPU machine"]
    fn loads_on_side_streams_are_the_files_values() {
        use crate::loading::safetensors::SafetensorsFile;
        use tch::{Kind, Tensor};
        assert!(tch::Cuda::is_available(), "this test needs a GPU");
        let gpu = Device::Cuda(0);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("weights.safetensors");
        tch::manual_seed(7);
        // 6 × 48 MB and 300 × 256 kB of bf16 (the staging buffer is 128 MB), and fp16 read as fp32.
        let mut named: Vec<(String, Tensor)> = (0..6)
            .map(|i| {
                (
                    format!("big.{i}"),
                    Tensor::randn([24 << 20], (Kind::BFloat16, Device::Cpu)),
                )
            })
            .chain((0..300).map(|i| {
                (
                    format!("small.{i}"),
                    Tensor::randn([128 << 10], (Kind::BFloat16, Device::Cpu)),
                )
            }))
            .collect();
        named.push((
            "half".into(),
            Tensor::randn([1 << 20], (Kind::Half, Device::Cpu)),
        ));
        Tensor::write_safetensors(&named, &path).expect("written");
        let file = SafetensorsFile::open(&path).expect("opens");
        let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        let kind_of = |name: &str| {
            if name == "half" {
                Kind::Float
            } else {
                Kind::BFloat16
            }
        };

        let default = Stream::current(gpu).expect("streams are built in");
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (side, loaded) = std::thread::scope(|scope| {
            let busy = scope.spawn(|| {
                let _guard = tch::no_grad_guard();
                let a = Tensor::randn([4096, 4096], (Kind::Float, gpu));
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = a.matmul(&a).sum(Kind::Float).double_value(&[]);
                }
            });
            let out = on_load_stream(gpu, || {
                let side = LOAD_STREAM.get();
                let loaded: Vec<(usize, Tensor)> = std::thread::scope(|scope| {
                    let threads: Vec<_> = (0..4)
                        .map(|t| {
                            let (file, names) = (&file, &names);
                            spawn(scope, move || {
                                assert_eq!(LOAD_STREAM.get(), side, "spawned threads load on it");
                                (t..names.len())
                                    .step_by(4)
                                    .map(|i| {
                                        let name = names[i];
                                        (i, file.load(name, gpu, kind_of(name)).expect("loads"))
                                    })
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    threads
                        .into_iter()
                        .flat_map(|t| t.join().expect("joins"))
                        .collect()
                });
                (side, loaded)
            });
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            busy.join().expect("the busy thread ends");
            out
        });
        assert!(
            side.is_some_and(|s| s != default),
            "the load ran on a side stream"
        );
        assert_eq!(
            Stream::current(gpu),
            Some(default),
            "the default stream is current again"
        );
        assert_eq!(loaded.len(), names.len());
        for (i, t) in loaded {
            let (name, expected) = &named[i];
            let expected = expected.to_kind(kind_of(name));
            assert!(t.to_device(Device::Cpu).equal(&expected), "{name} differs");
        }
    }
}
