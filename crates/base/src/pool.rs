//! The thread-pool abstraction kernels run on.
//!
//! Kernels split work into `n_tasks` independent tasks and call [`ThreadPool::run`]; the pool
//! decides how tasks map to threads. A 1-thread pool runs everything inline (tests), the rayon
//! pool uses a dedicated rayon pool of a fixed size.

/// Runs `n_tasks` independent closures `f(0) .. f(n_tasks - 1)` and returns when all are done.
pub trait ThreadPool: Sync {
    /// Number of worker threads (>= 1); kernels use it to choose a task granularity.
    fn n_threads(&self) -> usize;
    /// Run `f(i)` for every `i in 0..n_tasks`, in any order, possibly concurrently.
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync));
}

/// Runs every task inline on the calling thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct SerialPool;

impl ThreadPool for SerialPool {
    fn n_threads(&self) -> usize {
        1
    }
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        for i in 0..n_tasks {
            f(i);
        }
    }
}

/// A fixed-size rayon pool.
pub struct RayonPool {
    pool: rayon::ThreadPool,
    n: usize,
}

impl RayonPool {
    /// A pool of `n_threads` threads (0 means one per available core).
    pub fn new(n_threads: usize) -> Result<RayonPool, rayon::ThreadPoolBuildError> {
        let n = if n_threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            n_threads
        };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build()?;
        Ok(RayonPool { pool, n })
    }
}

impl ThreadPool for RayonPool {
    fn n_threads(&self) -> usize {
        self.n
    }
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 1 || self.n == 1 {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        self.pool.install(|| {
            rayon::scope(|s| {
                for i in 0..n_tasks {
                    s.spawn(move |_| f(i));
                }
            })
        });
    }
}
