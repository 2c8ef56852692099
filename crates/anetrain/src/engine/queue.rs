//! Where a layer's weight gradients run while its kernels do: inline (the
//! CPU engine, whose kernels use every core) or on one worker thread beside
//! a device's kernels, in order, joined when the layer ends.

use anyhow::Result;

use crate::engine::grads::Grads;
use crate::model::{Model, Projection};

/// Runs `job` (weight gradients) on a worker thread beside `kernel` (device
/// work) when `overlap` is set, else one after the other; both have
/// finished when this returns.
pub(super) fn overlapped<T>(
    overlap: bool,
    job: impl FnOnce() + Send,
    kernel: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if !overlap {
        job();
        return kernel();
    }
    std::thread::scope(|s| {
        let worker = s.spawn(job);
        let out = kernel();
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
        out
    })
}

/// A group of weight gradients of one layer's backward.
pub(super) type GradJob<'q> = Box<dyn FnOnce(&mut Grads) + Send + 'q>;

/// Where a layer's weight gradients run: at once, on this thread (the
/// CPU engine, whose kernels use every core), or queued for the worker
/// thread that computes them beside a device's kernels, in order.
pub(super) enum GradQueue<'q> {
    Inline,
    Worker(std::sync::mpsc::Sender<GradJob<'q>>),
}

impl<'q> GradQueue<'q> {
    /// Runs `job` on `grads` now, or queues it for the worker (which
    /// holds the layer's projection gradients, see [`Grads::take`]).
    pub(super) fn push(&self, grads: &mut Grads, job: impl FnOnce(&mut Grads) + Send + 'q) {
        match self {
            GradQueue::Inline => job(grads),
            GradQueue::Worker(tx) => {
                // The worker only stops when the queue is dropped or a
                // job panics; the panic is resumed where it is joined.
                let _ = tx.send(Box::new(job));
            }
        }
    }
}

/// The gradients a layer's weight-gradient jobs write: every projection's
/// weight, or with LoRA its adapters.
pub(super) fn projection_grad_ids(model: &Model, layer: usize) -> Vec<usize> {
    match &model.lora {
        None => Projection::ALL
            .iter()
            .map(|t| t.base(&model.layers[layer]))
            .collect(),
        Some(l) => {
            // A fused module's parts share A and B: each id once.
            let mut ids: Vec<usize> = l.slots[layer]
                .iter()
                .flatten()
                .flat_map(|ids| [ids.a, ids.b])
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::bail;

    #[test]
    fn overlapped_runs_the_job_on_a_worker_and_joins_it() {
        let main = std::thread::current().id();
        let mut job_thread = None;
        let out = overlapped(
            true,
            || job_thread = Some(std::thread::current().id()),
            || Ok(std::thread::current().id()),
        )
        .unwrap();
        assert_eq!(out, main, "the kernel runs on the calling thread");
        assert!(
            job_thread.is_some_and(|t| t != main),
            "the job ran on a worker"
        );
        let mut ran = false;
        overlapped(false, || ran = true, || Ok(())).unwrap();
        assert!(ran);
        let e = overlapped(true, || (), || -> Result<()> { bail!("device failed") });
        assert_eq!(e.unwrap_err().to_string(), "device failed");
    }
}
