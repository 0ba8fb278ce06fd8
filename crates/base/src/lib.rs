//! Kapitsa base crate: element types and quantisation block layouts shared by every other crate,
//! CPU feature detection and the thread-pool abstraction the kernels run on.

pub mod cpu;
pub mod dtype;
pub mod pool;
pub mod quant;

pub use cpu::CpuFeatures;
pub use dtype::GgmlType;
pub use pool::ThreadPool;
