//! How long the engine computes: each engine run (one forward batch of a message, from its inputs
//! on the host to its images on the host; an upscale's resampling to the job's scale comes after,
//! on the worker's blocking pool, and is not in it) timed on the device's own clock, by a pair of runtime
//! events (`cudaEventRecord` on the default stream before and after the run, `cudaEventElapsedTime`
//! between them; HIP's functions on ROCm builds), and on the host's clock beside it. The sums are
//! what `vnfarm-worker bench` divides by its wall time for the GPU's busy fraction.
//!
//! The event after a run is recorded once the run's images are on the host, so every kernel of the
//! run has finished before it: the device time covers the run's whole span on the device (gaps the
//! engine itself leaves between kernels included), not the host's view of a queue of launches.
//! Where no GPU runtime is loaded (a CPU-only libtorch, the test-pattern engine) only the host's
//! clock is kept.

use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::gpu_runtime;

type Event = *mut c_void;
type EventCreate = unsafe extern "C" fn(*mut Event) -> c_int;
type EventRecord = unsafe extern "C" fn(Event, *mut c_void) -> c_int;
type EventSynchronize = unsafe extern "C" fn(Event) -> c_int;
type EventElapsedTime = unsafe extern "C" fn(*mut f32, Event, Event) -> c_int;
type EventDestroy = unsafe extern "C" fn(Event) -> c_int;

#[derive(Clone, Copy)]
struct Runtime {
    create: EventCreate,
    record: EventRecord,
    synchronize: EventSynchronize,
    elapsed: EventElapsedTime,
    destroy: EventDestroy,
}

/// The engine's compute time so far, summed over its runs. Cheap to clone.
#[derive(Clone, Default)]
pub struct EngineBusy(Arc<Totals>);

#[derive(Default)]
struct Totals {
    runs: AtomicU64,
    host_ns: AtomicU64,
    device_ns: AtomicU64,
    /// Runs whose device time could not be read (no runtime, or an event call failed).
    untimed_runs: AtomicU64,
}

/// A snapshot of [`EngineBusy`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BusyTotals {
    pub runs: u64,
    /// Summed on the host's clock, around each run.
    pub host: Duration,
    /// Summed on the device's clock; `None` when some run had no device reading.
    pub device: Option<Duration>,
}

impl EngineBusy {
    pub fn totals(&self) -> BusyTotals {
        let t = &self.0;
        let runs = t.runs.load(Ordering::Relaxed);
        BusyTotals {
            runs,
            host: Duration::from_nanos(t.host_ns.load(Ordering::Relaxed)),
            device: (runs > 0 && t.untimed_runs.load(Ordering::Relaxed) == 0)
                .then(|| Duration::from_nanos(t.device_ns.load(Ordering::Relaxed))),
        }
    }

    /// Runs `run` on this thread (the engine's, whose current device is the engine's), timing it.
    pub(crate) fn time<T>(&self, run: impl FnOnce() -> T) -> T {
        let events = runtime().and_then(EventPair::new);
        if let Some(events) = &events {
            events.record_start();
        }
        let started = Instant::now();
        let out = run();
        let host = started.elapsed();
        let device = events.and_then(|e| e.elapsed());
        let t = &self.0;
        t.runs.fetch_add(1, Ordering::Relaxed);
        t.host_ns.fetch_add(nanos(host), Ordering::Relaxed);
        match device {
            Some(d) => t.device_ns.fetch_add(nanos(d), Ordering::Relaxed),
            None => t.untimed_runs.fetch_add(1, Ordering::Relaxed),
        };
        out
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Two events of the runtime, destroyed on drop.
struct EventPair {
    runtime: Runtime,
    start: Event,
    end: Event,
    /// Whether recording `start` succeeded.
    started: std::cell::Cell<bool>,
}

#[allow(unsafe_code)]
impl EventPair {
    fn new(runtime: Runtime) -> Option<Self> {
        let (mut start, mut end): (Event, Event) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `cudaEventCreate(cudaEvent_t *)` writes one event handle through a valid
        // pointer; a failure leaves it null, and a null handle is never destroyed below.
        let ok = unsafe { (runtime.create)(&mut start) == 0 && (runtime.create)(&mut end) == 0 };
        let pair = Self {
            runtime,
            start,
            end,
            started: std::cell::Cell::new(false),
        };
        ok.then_some(pair)
    }

    fn record_start(&self) {
        // SAFETY: a live event of this runtime; stream null is the default stream, which the
        // engines' work runs on.
        let ok = unsafe { (self.runtime.record)(self.start, std::ptr::null_mut()) == 0 };
        self.started.set(ok);
    }

    /// Records the end, waits for it, and reads the time between the two.
    fn elapsed(&self) -> Option<Duration> {
        if !self.started.get() {
            return None;
        }
        let mut ms = 0f32;
        // SAFETY: live events of this runtime, `start` recorded; the float pointer is valid for
        // the call. Synchronising on `end` waits only for work already queued before it.
        let ok = unsafe {
            (self.runtime.record)(self.end, std::ptr::null_mut()) == 0
                && (self.runtime.synchronize)(self.end) == 0
                && (self.runtime.elapsed)(&mut ms, self.start, self.end) == 0
        };
        (ok && ms.is_finite() && ms >= 0.0).then(|| Duration::from_secs_f64(f64::from(ms) / 1e3))
    }
}

#[allow(unsafe_code)]
impl Drop for EventPair {
    fn drop(&mut self) {
        for event in [self.start, self.end] {
            if !event.is_null() {
                // SAFETY: created by this runtime's `cudaEventCreate` and not destroyed before.
                unsafe { (self.runtime.destroy)(event) };
            }
        }
    }
}

/// The CUDA runtime's event functions, else HIP's, looked up once.
fn runtime() -> Option<Runtime> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    *RUNTIME.get_or_init(|| {
        lookup([
            c"cudaEventCreate",
            c"cudaEventRecord",
            c"cudaEventSynchronize",
            c"cudaEventElapsedTime",
            c"cudaEventDestroy",
        ])
        .or_else(|| {
            lookup([
                c"hipEventCreate",
                c"hipEventRecord",
                c"hipEventSynchronize",
                c"hipEventElapsedTime",
                c"hipEventDestroy",
            ])
        })
    })
}

#[allow(unsafe_code)]
fn lookup(names: [&CStr; 5]) -> Option<Runtime> {
    // SAFETY: the runtime's functions under their documented C names, of the signatures above
    // (`cudaError_t cudaEventCreate(cudaEvent_t *)`, `cudaEventRecord(cudaEvent_t, cudaStream_t)`,
    // `cudaEventSynchronize(cudaEvent_t)`, `cudaEventElapsedTime(float *, cudaEvent_t,
    // cudaEvent_t)`, `cudaEventDestroy(cudaEvent_t)`; HIP's identical).
    unsafe {
        Some(Runtime {
            create: gpu_runtime::function::<EventCreate>(names[0])?,
            record: gpu_runtime::function::<EventRecord>(names[1])?,
            synchronize: gpu_runtime::function::<EventSynchronize>(names[2])?,
            elapsed: gpu_runtime::function::<EventElapsedTime>(names[3])?,
            destroy: gpu_runtime::function::<EventDestroy>(names[4])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_is_counted_on_the_host_clock_and_without_a_gpu_has_no_device_time() {
        let busy = EngineBusy::default();
        assert_eq!(busy.totals().runs, 0);
        let answer = busy.time(|| {
            std::thread::sleep(Duration::from_millis(20));
            7
        });
        assert_eq!(answer, 7);
        busy.time(|| std::thread::sleep(Duration::from_millis(5)));
        let totals = busy.totals();
        assert_eq!(totals.runs, 2);
        assert!(totals.host >= Duration::from_millis(25), "{totals:?}");
        if runtime().is_none() {
            assert_eq!(totals.device, None);
        }
    }
}
