//! The thread-pool abstraction kernels run on.
//!
//! Kernels split work into `n_tasks` independent tasks and call [`ThreadPool::run`]; the pool
//! decides how tasks map to threads. A 1-thread pool runs everything inline (tests), the rayon
//! pool uses a dedicated rayon pool of a fixed size, and the spin pool (the default of the CLI
//! and the server, see [`cpu_pool`]) keeps its workers spinning briefly between ops, which
//! suits decode's many small ops.

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

/// The compute pool the CLI and the server run on: a [`SpinPool`] of `n_threads` threads (0 = one
/// per core), or a [`RayonPool`] when the environment variable `KAPITSA_POOL` is `rayon` (an A/B
/// switch for benchmarks; `spin` or unset gives the default).
pub fn cpu_pool(n_threads: usize) -> std::io::Result<Box<dyn ThreadPool + Send>> {
    match std::env::var("KAPITSA_POOL").ok().as_deref() {
        None | Some("") | Some("spin") => Ok(Box::new(SpinPool::new(n_threads)?)),
        Some("rayon") => Ok(Box::new(
            RayonPool::new(n_threads).map_err(std::io::Error::other)?,
        )),
        Some(other) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("KAPITSA_POOL must be 'spin' or 'rayon', not '{other}'"),
        )),
    }
}

/// A persistent pool for fine-grained ops: `n - 1` worker threads plus the calling thread, which
/// takes tasks too. Workers spin for a short while after each job (a decode step issues a few
/// hundred ops a few microseconds apart, so the next job usually arrives while they spin) and
/// then sleep on a condition variable, so an idle pool costs no CPU.
///
/// Tasks are claimed one at a time from a shared counter, so a descheduled thread delays only
/// the task it holds. A job submitted while another is running on the same pool (a nested
/// `run` from inside a task, or a second thread sharing the pool) runs inline on its caller.
pub struct SpinPool {
    n: usize,
    shared: std::sync::Arc<spin::Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// Held while a job runs on the workers.
    busy: std::sync::Mutex<()>,
}

impl SpinPool {
    /// A pool of `n_threads` threads in all, the caller included (0 means one per available
    /// core). Errors if a worker thread cannot be started.
    pub fn new(n_threads: usize) -> std::io::Result<SpinPool> {
        let n = if n_threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            n_threads
        };
        let shared = std::sync::Arc::new(spin::Shared::default());
        let mut pool = SpinPool {
            n,
            shared: shared.clone(),
            workers: Vec::with_capacity(n.saturating_sub(1)),
            busy: std::sync::Mutex::new(()),
        };
        for i in 1..n {
            let sh = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("kapitsa-pool-{i}"))
                .spawn(move || spin::worker(&sh))?;
            pool.workers.push(h);
        }
        Ok(pool)
    }
}

impl ThreadPool for SpinPool {
    fn n_threads(&self) -> usize {
        self.n
    }

    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks <= 1 || self.n == 1 || n_tasks > spin::MAX_TASKS {
            (0..n_tasks).for_each(f);
            return;
        }
        // Nested or concurrent use: run inline rather than wait (never deadlocks). A poisoned
        // lock only means an earlier job's task panicked; the protocol state is still valid.
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                (0..n_tasks).for_each(f);
                return;
            }
        };
        spin::run(&self.shared, n_tasks, f);
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.shutdown();
        for h in self.workers.drain(..) {
            // A worker only ends by returning from its loop; a join error would mean it
            // panicked outside a task, which `catch_unwind` around tasks rules out.
            let _ = h.join();
        }
    }
}

/// The job protocol of [`SpinPool`].
///
/// `counter` packs the job's epoch (high 32 bits) and the next unclaimed task index (low 32
/// bits). A job's closure and task count live in slot `epoch % 2`. Claiming task `i` of job `e`
/// is a compare-exchange from `(e, i)` to `(e, i + 1)` with `i < n_tasks(e)`, so it succeeds only
/// while job `e` is current and unfinished; the caller returns from `run` only after every
/// claimed task has finished (`done == n_tasks`), and publishes job `e + 1` only after that. So
/// a successful claim always runs a live closure of the right job, and slot `e % 2` is not
/// rewritten (by job `e + 2`) while job `e` can still be claimed. (A worker would have to stall
/// across 2^32 jobs, between reading the counter and its compare-exchange, for the epoch to
/// wrap onto a stale value.)
mod spin {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
    use std::sync::{Condvar, Mutex};

    /// Tasks per job must fit the counter's low 32 bits.
    pub(super) const MAX_TASKS: usize = u32::MAX as usize;
    /// Polls of the counter before a worker sleeps (tens of microseconds).
    const SPIN: u32 = 1 << 14;

    /// The task closure of a job: a thin pointer to the caller's `&dyn Fn`, valid while the job
    /// can be claimed (see the module docs).
    type TaskRef<'a> = &'a (dyn Fn(usize) + Sync);

    #[derive(Default)]
    pub(super) struct Shared {
        counter: AtomicU64,
        /// Per epoch parity: the address of the caller's `TaskRef` and the task count.
        job: [AtomicUsize; 2],
        n_tasks: [AtomicUsize; 2],
        /// Tasks of the current job finished (panicked ones included).
        done: AtomicUsize,
        panicked: AtomicBool,
        shutdown: AtomicBool,
        sleeping: AtomicUsize,
        lock: Mutex<()>,
        wake: Condvar,
    }

    impl Shared {
        pub(super) fn shutdown(&self) {
            self.shutdown.store(true, SeqCst);
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }

        /// Claims and runs tasks of job `epoch` until none is left.
        fn work(&self, epoch: u64) {
            let slot = (epoch % 2) as usize;
            let n = self.n_tasks[slot].load(Acquire) as u64;
            let job = self.job[slot].load(Acquire);
            let mut c = self.counter.load(Acquire);
            loop {
                if c >> 32 != epoch & 0xffff_ffff || c & 0xffff_ffff >= n {
                    return;
                }
                match self
                    .counter
                    .compare_exchange_weak(c, c + 1, AcqRel, Acquire)
                {
                    Ok(_) => {
                        // SAFETY: the claim succeeded, so job `epoch` is live: `job` is the
                        // address of its caller's `TaskRef`, which outlives every claimed task
                        // (the caller waits for `done == n` before returning).
                        let f: TaskRef<'_> = unsafe { *(job as *const TaskRef<'_>) };
                        let i = (c & 0xffff_ffff) as usize;
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err()
                        {
                            self.panicked.store(true, Release);
                        }
                        self.done.fetch_add(1, Release);
                        c = self.counter.load(Acquire);
                    }
                    Err(now) => c = now,
                }
            }
        }
    }

    /// Runs one job on the caller and the workers; returns when all `n_tasks` are done.
    pub(super) fn run(sh: &Shared, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let fref: TaskRef<'_> = f;
        let epoch = (sh.counter.load(Acquire) >> 32) + 1;
        let slot = (epoch % 2) as usize;
        sh.job[slot].store(&fref as *const TaskRef<'_> as usize, Release);
        sh.n_tasks[slot].store(n_tasks, Release);
        sh.done.store(0, Release);
        sh.panicked.store(false, Release);
        sh.counter.store((epoch & 0xffff_ffff) << 32, SeqCst);
        if sh.sleeping.load(SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        sh.work(epoch & 0xffff_ffff);
        let mut spins = 0u32;
        while sh.done.load(Acquire) < n_tasks {
            spins += 1;
            if spins < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if sh.panicked.load(Acquire) {
            panic!("a SpinPool task panicked");
        }
    }

    /// A worker: wait for a new epoch (spinning, then sleeping), work on it, repeat.
    pub(super) fn worker(sh: &Shared) {
        let mut seen = sh.counter.load(Acquire) >> 32;
        loop {
            let mut spins = 0u32;
            let epoch = loop {
                let e = sh.counter.load(Acquire) >> 32;
                if e != seen {
                    break e;
                }
                if sh.shutdown.load(Acquire) {
                    return;
                }
                spins += 1;
                if spins < SPIN {
                    std::hint::spin_loop();
                    continue;
                }
                let mut g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleeping.fetch_add(1, SeqCst);
                while sh.counter.load(SeqCst) >> 32 == seen && !sh.shutdown.load(SeqCst) {
                    g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleeping.fetch_sub(1, SeqCst);
                spins = 0;
            };
            seen = epoch;
            sh.work(epoch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn spin_pool_runs_every_task_once_across_many_jobs() {
        let pool = SpinPool::new(3).expect("pool");
        assert_eq!(pool.n_threads(), 3);
        for job in 0..20_000usize {
            let n = 1 + job % 37;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "job {job}"
            );
            if job % 5000 == 0 {
                // let the workers fall asleep, then wake them with the next job
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }

    #[test]
    fn spin_pool_nested_and_concurrent_runs_complete() {
        let pool = SpinPool::new(2).expect("pool");
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            // nested: runs inline on this thread
            pool.run(3, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..2000 {
                        pool.run(5, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 2000 * 5);
    }

    #[test]
    fn spin_pool_propagates_task_panics_and_stays_usable() {
        let pool = SpinPool::new(2).expect("pool");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task 5 fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
