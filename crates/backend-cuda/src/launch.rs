//! Kernel launches of the backend: a builder like cudarc's `launch_builder` that launches
//! through `cuLaunchKernelEx` with programmatic dependent launch (PDL, sm_90) allowed.
//!
//! With the PDL attribute a kernel may be launched while the kernel before it on the stream is
//! still running, and it waits in its first instruction (`griddepcontrol.wait`, kernels/pdl.cuh
//! `pdl_enter`) until that kernel has finished and its writes are visible. So the launch
//! latency between the hundreds of small kernels of a decode step overlaps the work before
//! it, op by op and inside a recorded step (CUDA graph) alike. Every kernel of kernels/*.cu
//! starts with `pdl_enter()`; that is what makes the attribute safe on all of them.
//! `KAPITSA_CUDA_PDL=0` launches without it (for measurements).
//!
//! Arguments are pushed as cudarc's are: a device buffer (`CudaSlice`, `CudaView`,
//! `CudaViewMut`) as its device pointer, a scalar (`u32`, `i32`, `u64`, `f32`) by reference,
//! in the order of the kernel's parameters.

use std::ffi::c_void;

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig,
};

env_switch! {
    /// Whether kernels are launched with the PDL attribute (`KAPITSA_CUDA_PDL=0`: no).
    fn pdl_on = "KAPITSA_CUDA_PDL"
}

/// One argument slot: a device pointer (kept in the builder) or a host value's address.
enum Slot {
    Dev(usize),
    Host(*const c_void),
}

/// A kernel launch being built: `stream.kernel(&f).arg(..).arg(..)`, then `launch(cfg)`.
/// Borrows every scalar argument until the launch.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    /// Device pointers of the buffer arguments (the parameter array points at them).
    dev: Vec<u64>,
    slots: Vec<Slot>,
}

/// `stream.kernel(&f)`: start a launch of `f` on the stream.
pub(crate) trait KernelLaunch {
    /// A launch builder for `func` on this stream.
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a>;
}

impl KernelLaunch for CudaStream {
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch {
            stream: self,
            func,
            dev: Vec::with_capacity(16),
            slots: Vec::with_capacity(24),
        }
    }
}

/// A value that can be a kernel argument.
pub(crate) trait KernelArg<'a> {
    /// Append `self` to `l`'s arguments.
    fn push_to(self, l: &mut Launch<'a>);
}

/// `KernelArg` for values passed by value (copied at launch): scalars, and the `#[repr(C)]`
/// argument structs of the GEMV kernels (the kernels' `__grid_constant__` structs).
macro_rules! host_arg {
    ($($t:ty),*) => {$(
        impl<'a> $crate::launch::KernelArg<'a> for &'a $t {
            fn push_to(self, l: &mut $crate::launch::Launch<'a>) {
                l.push_host((self as *const $t).cast());
            }
        }
    )*};
}
pub(crate) use host_arg;

host_arg!(u32, i32, u64, f32);

impl<'a, T> KernelArg<'a> for &'a CudaSlice<T> {
    fn push_to(self, l: &mut Launch<'a>) {
        let (p, _sync) = self.device_ptr(l.stream);
        l.push_dev(p);
    }
}

impl<'a, T> KernelArg<'a> for &'a mut CudaSlice<T> {
    fn push_to(self, l: &mut Launch<'a>) {
        let (p, _sync) = self.device_ptr_mut(l.stream);
        l.push_dev(p);
    }
}

impl<'a, 'b, T> KernelArg<'a> for &'a CudaView<'b, T> {
    fn push_to(self, l: &mut Launch<'a>) {
        let (p, _sync) = self.device_ptr(l.stream);
        l.push_dev(p);
    }
}

impl<'a, 'b, T> KernelArg<'a> for &'a mut CudaViewMut<'b, T> {
    fn push_to(self, l: &mut Launch<'a>) {
        let (p, _sync) = self.device_ptr_mut(l.stream);
        l.push_dev(p);
    }
}

/// An optional buffer: its device pointer, or a null pointer (0) for `None` (the kernels'
/// "absent" value for optional inputs such as a bias).
impl<'a, A: KernelArg<'a>> KernelArg<'a> for Option<A> {
    fn push_to(self, l: &mut Launch<'a>) {
        match self {
            Some(a) => a.push_to(l),
            None => l.push_dev(0),
        }
    }
}

impl<'a> Launch<'a> {
    fn push_dev(&mut self, p: sys::CUdeviceptr) {
        self.slots.push(Slot::Dev(self.dev.len()));
        self.dev.push(p);
    }

    /// Append a host value's address (a by-value parameter of any type; the caller's
    /// `KernelArg` impl borrows the value for 'a).
    pub(crate) fn push_host(&mut self, p: *const c_void) {
        self.slots.push(Slot::Host(p));
    }

    /// Append an argument.
    pub(crate) fn arg(&mut self, a: impl KernelArg<'a>) -> &mut Self {
        a.push_to(self);
        self
    }

    /// Queue the launch on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// buffer must be large enough for what the kernel reads and writes with this `cfg`.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        crate::prof::note_launch(self.func);
        let mut params: Vec<*mut c_void> = self
            .slots
            .iter()
            .map(|s| match *s {
                Slot::Dev(i) => (&self.dev[i] as *const u64).cast_mut().cast(),
                Slot::Host(p) => p.cast_mut(),
            })
            .collect();
        // SAFETY: the attribute is plain data; the union member written is the one the id
        // names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = pdl_on();
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `params` holds one pointer per kernel parameter (the caller's contract),
        // each pointing at a live value (`self.dev` is not touched until the call returns;
        // scalars are borrowed for 'a); the driver copies the values before returning.
        // `config` and `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
