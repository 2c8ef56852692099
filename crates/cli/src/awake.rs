//! Keeps the CPUs from halting in the gaps between a step's parallel
//! sections.
//!
//! A training step is thousands of parallel regions with short serial gaps
//! between them; in each gap the pool's idle threads go to sleep, and a CPU
//! with nothing to run halts. On a virtual machine a halted virtual CPU
//! hands its physical core back to the host, and getting it back for the
//! next region can take far longer than the gap: the time shows up as
//! "steal" (`bench` reports it as `host_steal_fraction`). OpenMP runtimes
//! avoid this by spin-waiting between regions, which is why PyTorch rarely
//! shows steal where we did. [`KeepAwake`] gets the same effect without
//! touching the pool: one thread per CPU at Linux's `SCHED_IDLE` priority
//! that does nothing but `sched_yield`. It runs only when no other thread
//! wants the CPU, any waking thread preempts it at once, and because it
//! yields it never holds the CPU from a pool thread that is itself
//! yield-spinning while it waits for work (a plain busy loop there cost a
//! fine-grained `rayon::join` about 30 µs).
//!
//! Measured (stories110m, seq 256, runs alternating with and without idle
//! spinners, 2-core VM): in a noisy spell the step median went 1.71 → 1.66,
//! 3.25 → 2.05, 2.79 → 1.97 and 2.09 → 1.76 s, with steal 8–37% → 1–8%;
//! in quiet spells the two were level.
//!
//! Only on Linux; `ANETRAIN_KEEP_AWAKE=0` turns it off.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// While alive, one idle-priority thread per CPU of the pool keeps each CPU
/// runnable. Dropping it stops and joins them.
pub struct KeepAwake {
    stop: Arc<AtomicBool>,
    /// How many threads are spinning at idle priority.
    #[cfg_attr(not(test), allow(dead_code))]
    idle: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl KeepAwake {
    /// Starts the idle threads, unless `ANETRAIN_KEEP_AWAKE=0` or this is not
    /// Linux (then it holds nothing).
    pub fn start() -> KeepAwake {
        let stop = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(AtomicUsize::new(0));
        let enabled = cfg!(target_os = "linux")
            && std::env::var("ANETRAIN_KEEP_AWAKE").map_or(true, |v| v.trim() != "0");
        let count = if enabled {
            rayon::current_num_threads()
        } else {
            0
        };
        let threads = (0..count)
            .filter_map(|i| {
                let (stop, idle) = (Arc::clone(&stop), Arc::clone(&idle));
                std::thread::Builder::new()
                    .name(format!("keep-awake-{i}"))
                    .stack_size(64 << 10)
                    .spawn(move || spin_at_idle_priority(&stop, &idle))
                    .ok()
            })
            .collect();
        KeepAwake {
            stop,
            idle,
            threads,
        }
    }

    /// How many threads were started (0 when turned off).
    #[cfg(test)]
    fn threads(&self) -> usize {
        self.threads.len()
    }

    /// How many of them are spinning at idle priority so far.
    #[cfg(test)]
    fn spinning(&self) -> usize {
        self.idle.load(Ordering::Relaxed)
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Yields until `stop`, at `SCHED_IDLE` priority (counted in `idle` once
/// the kernel reports that policy); returns at once if the priority cannot
/// be lowered (spinning at normal priority would take CPU time from the
/// work itself).
fn spin_at_idle_priority(stop: &AtomicBool, idle: &AtomicUsize) {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: both act on the calling thread (pid 0); `param` is a valid
        // sched_param for SCHED_IDLE.
        let lowered = unsafe {
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0
                && libc::sched_getscheduler(0) == libc::SCHED_IDLE
        };
        if !lowered {
            return;
        }
        idle.fetch_add(1, Ordering::Relaxed);
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (stop, idle);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_threads_run_at_idle_priority_and_stop_on_drop() {
        let awake = KeepAwake::start();
        if !cfg!(target_os = "linux") || std::env::var("ANETRAIN_KEEP_AWAKE").is_ok() {
            return;
        }
        assert_eq!(awake.threads(), rayon::current_num_threads());
        let t = std::time::Instant::now();
        while awake.spinning() < awake.threads() && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(awake.spinning(), awake.threads(), "SCHED_IDLE was refused");
        drop(awake); // joins: the test hangs if the threads ignore the stop
    }
}
