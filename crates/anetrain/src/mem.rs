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
