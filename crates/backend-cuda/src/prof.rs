//! In-graph kernel timing for measurements (`KAPITSA_CUDA_PROF=1`; no CPU twin: a
//! measurement tool). Nsight Compute times kernels one by one, outside the graphs and the
//! programmatic launches decode actually runs with, which misstates small kernels; this
//! times them where they run.
//!
//! Every kernel's `pdl_enter` (kernels/pdl.cuh) appends the global timer to a device buffer
//! once the kernels it depends on have finished, when its module's `kap_prof` constant points
//! at one. With profiling on, the backend points every module it loaded at one buffer
//! ([`Prof::new`]), the launches of a recording are listed in launch order
//! ([`note_launch`] between [`start_capture`] and [`take_capture`]), and each replay of a
//! recorded step reads the timestamps back (one synchronisation per step): entry `i + 1`
//! minus entry `i` is the time from kernel `i` being able to start to kernel `i + 1` being
//! able to start, i.e. kernel `i`'s duration in the step including the gap after it. The
//! step's last kernel has no end mark and is not counted; non-kernel nodes (memsets) and
//! kernels that do not call `pdl_enter` (cuBLAS) fold into the kernel before them. The
//! table (per kernel name: launches, total and mean microseconds) goes to stderr when the
//! backend is dropped. The timer's resolution is the GPU's (about 32 ns to 1 us), so means
//! over many steps are what to read. Backends created concurrently on several threads with
//! profiling on may attach each other's modules.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use kapitsa_backend::{BackendError, Result};

use crate::device::dev_err;

/// Timestamps one replay may record.
const CAP: u32 = 16_384;

/// Whether `KAPITSA_CUDA_PROF=1` (read once).
pub(crate) fn prof_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KAPITSA_CUDA_PROF").is_ok_and(|v| v == "1"))
}

/// Modules loaded while profiling is on and not yet attached to a [`Prof`].
static LOADED: Mutex<Vec<Arc<CudaModule>>> = Mutex::new(Vec::new());

/// Remember `m` for the next [`Prof::new`] (a no-op with profiling off).
pub(crate) fn note_module(m: &Arc<CudaModule>) {
    if prof_on() {
        LOADED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(m.clone());
    }
}

thread_local! {
    /// The kernels launched on this thread since [`start_capture`] (`None`: not recording).
    static CAPTURE: RefCell<Option<Vec<sys::CUfunction>>> = const { RefCell::new(None) };
}

/// Start listing this thread's launches (a recording begins).
pub(crate) fn start_capture() {
    if prof_on() {
        CAPTURE.with(|c| *c.borrow_mut() = Some(Vec::new()));
    }
}

/// List `f` if a recording is being listed on this thread.
pub(crate) fn note_launch(f: &CudaFunction) {
    if prof_on() {
        CAPTURE.with(|c| {
            if let Some(v) = c.borrow_mut().as_mut() {
                v.push(f.cu_function());
            }
        });
    }
}

/// The names of the kernels launched since [`start_capture`], in launch order (empty when
/// profiling is off); stops listing.
pub(crate) fn take_capture() -> Vec<String> {
    let funcs = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    funcs.into_iter().map(kernel_name).collect()
}

/// The name of kernel `f` (`?` where the driver does not say).
fn kernel_name(f: sys::CUfunction) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `f` is a live function handle of a loaded module (listed at its launch; the
    // modules outlive the backend's recordings); the driver writes a pointer to a string it
    // owns for the module's lifetime, copied out at once.
    unsafe {
        if sys::cuFuncGetName(&mut p, f).result().is_err() || p.is_null() {
            return "?".into();
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// The device side of `kernels/pdl.cuh` `KapProf` (24 bytes, little-endian): buf, count,
/// cap, unused.
fn kap_prof_bytes(buf: u64, count: u64, cap: u32) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(&buf.to_le_bytes());
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b[16..20].copy_from_slice(&cap.to_le_bytes());
    b
}

/// The timing buffer and what the replays measured (module docs).
pub(crate) struct Prof {
    /// The timestamps and the entry count, on the device.
    dev: Mutex<(CudaSlice<u64>, CudaSlice<u32>)>,
    /// Per kernel name: launches timed, total nanoseconds.
    stats: Mutex<HashMap<String, (u64, u64)>>,
}

impl Prof {
    /// A buffer on `stream`'s device, and every module noted since the last call pointed at
    /// it.
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Prof> {
        let buf = stream.alloc_zeros::<u64>(CAP as usize).map_err(dev_err)?;
        let count = stream.alloc_zeros::<u32>(1).map_err(dev_err)?;
        let bytes = kap_prof_bytes(buf.device_ptr(stream).0, count.device_ptr(stream).0, CAP);
        let modules = std::mem::take(&mut *LOADED.lock().unwrap_or_else(|p| p.into_inner()));
        for m in &modules {
            let mut g = m.get_global("kap_prof", stream).map_err(|e| {
                BackendError::Unavailable(format!(
                    "KAPITSA_CUDA_PROF: no kap_prof in a module: {e}"
                ))
            })?;
            if g.len() != bytes.len() {
                return Err(BackendError::Unavailable(format!(
                    "KAPITSA_CUDA_PROF: kap_prof is {} bytes, expected {}",
                    g.len(),
                    bytes.len()
                )));
            }
            stream.memcpy_htod(&bytes[..], &mut g).map_err(dev_err)?;
        }
        stream.synchronize().map_err(dev_err)?;
        Ok(Prof {
            dev: Mutex::new((buf, count)),
            stats: Mutex::new(HashMap::new()),
        })
    }

    /// Before a replay: no entries yet.
    pub(crate) fn before_replay(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut dev = self.dev.lock().unwrap_or_else(|p| p.into_inner());
        stream.memset_zeros(&mut dev.1).map_err(dev_err)
    }

    /// After a replay of the step whose kernels are `names`: wait for it, read the
    /// timestamps and add each kernel's interval to its name.
    pub(crate) fn after_replay(&self, stream: &Arc<CudaStream>, names: &[String]) -> Result<()> {
        let (n, ts) = {
            let dev = self.dev.lock().unwrap_or_else(|p| p.into_inner());
            let n = stream.clone_dtoh(&dev.1).map_err(dev_err)?;
            let ts = stream.clone_dtoh(&dev.0).map_err(dev_err)?;
            (n.first().copied().unwrap_or(0).min(CAP) as usize, ts)
        };
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let n = n.min(names.len());
        for (i, name) in names.iter().enumerate().take(n.saturating_sub(1)) {
            let e = stats.entry(name.clone()).or_insert((0, 0));
            e.0 += 1;
            e.1 += ts[i + 1].saturating_sub(ts[i]);
        }
        Ok(())
    }

    /// The table of what was measured (empty when nothing was).
    pub(crate) fn report(&self) -> String {
        let stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<(&String, &(u64, u64))> = stats.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        let total: u64 = rows.iter().map(|r| r.1 .1).sum();
        if total == 0 {
            return String::new();
        }
        let mut s = format!(
            "KAPITSA_CUDA_PROF: kernel time in replayed steps (from one kernel's start to the \
             next's), {:.1} ms in all\n{:<36} {:>9} {:>11} {:>6} {:>9}\n",
            total as f64 / 1e6,
            "kernel",
            "launches",
            "total us",
            "%",
            "us/launch"
        );
        for (name, &(n, ns)) in rows {
            s.push_str(&format!(
                "{:<36} {:>9} {:>11.1} {:>6.1} {:>9.2}\n",
                name,
                n,
                ns as f64 / 1e3,
                100.0 * ns as f64 / total as f64,
                ns as f64 / 1e3 / n.max(1) as f64
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::kap_prof_bytes;

    #[test]
    fn the_descriptor_is_laid_out_as_the_kernels_read_it() {
        let b = kap_prof_bytes(0x1122_3344_5566_7788, 0x99aa_bbcc_ddee_ff00, 16_384);
        assert_eq!(b[0], 0x88);
        assert_eq!(b[7], 0x11);
        assert_eq!(b[8], 0x00);
        assert_eq!(b[15], 0x99);
        assert_eq!(u32::from_le_bytes([b[16], b[17], b[18], b[19]]), 16_384);
        assert_eq!(&b[20..], &[0, 0, 0, 0]);
    }
}
