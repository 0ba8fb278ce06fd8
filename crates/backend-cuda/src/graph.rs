//! Recorded steps: the ops of a step captured from the backend's stream into a CUDA graph,
//! replayed with one launch ([`kapitsa_backend::Backend::begin_recording`] and the methods
//! after it). No CPU twin: the CPU backend runs every step op by op.
//!
//! Kernels are launched with programmatic dependent launch allowed (src/launch.rs), and a
//! capture keeps that attribute: inside the graph consecutive kernels get programmatic edges.
//!
//! # Memory
//! Tensors allocated and dropped while recording become the graph's own allocation and free
//! nodes (stream-ordered allocations are legal in a capture); the graph is instantiated with
//! auto-free-on-launch so a leaked one cannot block a relaunch. Capture runs in thread-local
//! mode: a synchronising call from the recording thread (a read-back) invalidates the
//! capture and `end_recording` reports it.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use kapitsa_backend::{BackendError, Recording, Result};

use crate::device::dev_err;
use crate::CudaBackend;

/// An instantiated graph of one recorded step.
pub(crate) struct StepGraph {
    /// Id of the backend that recorded it.
    owner: u64,
    ctx: Arc<CudaContext>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// The kernels launched while recording, in order (`KAPITSA_CUDA_PROF=1` only).
    names: Vec<String>,
}

// SAFETY: the graph and its executable instance are plain driver handles; the driver allows
// using them from any thread as long as calls on one graph are serialised, which `&self`
// access through the model's step lock (and `Drop`'s `&mut self`) guarantees. Nothing in
// the struct is tied to the creating thread.
unsafe impl Send for StepGraph {}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // Errors here cannot be reported; the context records them for the next check.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `exec` and `graph` were created by `end_recording_impl`, are destroyed
        // only here, once, and no launch of `exec` can be queued after `self` is gone.
        unsafe {
            self.ctx.record_err(result::graph::exec_destroy(self.exec));
            self.ctx.record_err(result::graph::destroy(self.graph));
        }
    }
}

/// The function of a kernel node, `None` for other nodes.
///
/// # Safety
/// `node` must be a node of a live graph.
unsafe fn kernel_function(node: sys::CUgraphNode) -> Result<Option<usize>> {
    // SAFETY: `node` is live (the caller's contract); the out-pointers point at locals of
    // the types the driver writes; the params struct is plain data whose zeroed start is a
    // valid value, filled by the driver before `assume_init`.
    unsafe {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        sys::cuGraphNodeGetType(node, &mut ty)
            .result()
            .map_err(dev_err)?;
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            return Ok(None);
        }
        let mut p = std::mem::MaybeUninit::<sys::CUDA_KERNEL_NODE_PARAMS_v2>::zeroed();
        sys::cuGraphKernelNodeGetParams_v2(node, p.as_mut_ptr())
            .result()
            .map_err(dev_err)?;
        Ok(Some(p.assume_init().func as usize))
    }
}

/// Number of kernel nodes of `graph`.
///
/// # Safety
/// `graph` must be a live graph used by no other thread.
unsafe fn count_kernels(graph: sys::CUgraph) -> Result<usize> {
    // SAFETY: `graph` is live (the caller's contract); the node query is called twice, first
    // for the count, then with a buffer of that many elements.
    unsafe {
        let mut n_nodes = 0usize;
        sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n_nodes)
            .result()
            .map_err(dev_err)?;
        let mut nodes = vec![std::ptr::null_mut(); n_nodes];
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n_nodes)
            .result()
            .map_err(dev_err)?;
        let mut n = 0;
        for &node in &nodes[..n_nodes] {
            if kernel_function(node)?.is_some() {
                n += 1;
            }
        }
        Ok(n)
    }
}

impl CudaBackend {
    /// Graphs are on unless `KAPITSA_CUDA_GRAPHS=0` (read once: this is asked every step).
    pub(crate) fn can_record_impl(&self) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("KAPITSA_CUDA_GRAPHS").map_or(true, |v| v != "0"))
    }

    pub(crate) fn begin_recording_impl(&self) -> Result<()> {
        crate::prof::start_capture();
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(dev_err)
    }

    pub(crate) fn end_recording_impl(&self) -> Result<Recording> {
        let names = crate::prof::take_capture();
        self.ctx.bind_to_thread().map_err(dev_err)?;
        // SAFETY: the stream is this backend's and was put in capture mode by
        // `begin_recording_impl` on this thread (the driver reports an error otherwise).
        let graph =
            unsafe { result::stream::end_capture(self.stream.cu_stream()) }.map_err(dev_err)?;
        if graph.is_null() {
            return Err(BackendError::Device(
                "end_recording: the capture produced no graph".into(),
            ));
        }
        // SAFETY: `graph` is the live graph just captured, owned here.
        let counted = unsafe { count_kernels(graph) };
        let kernels = match counted {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: destroyed once, nothing else holds it.
                self.ctx
                    .record_err(unsafe { result::graph::destroy(graph) });
                return Err(e);
            }
        };
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        // SAFETY: `graph` is a complete captured graph of this context.
        let exec = match unsafe { result::graph::instantiate(graph, flags) } {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: as above.
                self.ctx
                    .record_err(unsafe { result::graph::destroy(graph) });
                return Err(dev_err(e));
            }
        };
        let g = StepGraph {
            owner: self.id,
            ctx: self.ctx.clone(),
            graph,
            exec,
            names,
        };
        Ok(Recording::from_parts(Box::new(g), kernels))
    }

    pub(crate) fn replay_impl(&self, rec: &Recording) -> Result<()> {
        let g = match rec.get::<StepGraph>() {
            Some(g) if g.owner == self.id => g,
            _ => {
                return Err(BackendError::ForeignHandle {
                    op: "replay",
                    what: "recording",
                })
            }
        };
        self.ctx.bind_to_thread().map_err(dev_err)?;
        if let Some(p) = &self.prof {
            p.before_replay(&self.stream)?;
        }
        // SAFETY: `exec` is a live executable graph of this context (owned by `g`, which the
        // caller keeps alive), launched on this backend's stream.
        unsafe { result::graph::launch(g.exec, self.stream.cu_stream()) }.map_err(dev_err)?;
        match &self.prof {
            Some(p) => p.after_replay(&self.stream, &g.names),
            None => Ok(()),
        }
    }
}
