//! Process-wide memory policy.

/// Asks glibc's allocator to keep freed memory for reuse instead of handing
/// it back to the kernel. A training step allocates and frees the same
/// large activation buffers every layer and every step; returned pages must
/// be faulted in and zeroed again on the next touch, which on virtual
/// machines costs a noticeable share of a step (measured on Qwen3-0.6B,
/// seq 256: about 0.7 s of an 11.6 s step). Buffers up to 32 MiB (glibc's
/// ceiling for this setting) then come from the heap, and the heap is not
/// trimmed. Elsewhere this does nothing.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called at start-up
    // before other threads exist.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// A zeroed vector of `n` floats whose pages the kernel may back with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)` before first touch).
/// Optimizer moments and gradients of a large model are gigabytes that are
/// touched for the first time in the first step; with 4 KiB pages that
/// first touch costs a fault per page (measured: the first Qwen3-0.6B step
/// took 32 s against 6 s for the next ones).
pub fn zeroed_huge(n: usize) -> Vec<f32> {
    let v = vec![0f32; n];
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = n * std::mem::size_of::<f32>();
        let start = v.as_ptr() as usize;
        let aligned = start.div_ceil(HUGE) * HUGE;
        let end = (start + bytes) / HUGE * HUGE;
        if end > aligned {
            // SAFETY: advice on whole pages inside the vector's own
            // allocation; it changes how pages are backed, never contents.
            unsafe {
                libc::madvise(
                    aligned as *mut libc::c_void,
                    end - aligned,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    v
}
