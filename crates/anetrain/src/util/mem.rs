//! Memory: the process-wide allocator policy, the machine's physical
//! memory, and byte counts as users write them.

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

/// Physical memory of this machine in bytes, if known.
pub fn physical_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
    #[cfg(target_os = "macos")]
    {
        let mut size: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: hw.memsize is a u64; the buffer and its length match.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&mut size as *mut u64).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0).then_some(size)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        None
    }
}

/// A byte count that does not parse.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SizeError {
    #[error("'{0}': not a size (e.g. 16G, 800M)")]
    NotASize(String),
    #[error("'{0}': a size must be positive")]
    NotPositive(String),
}

/// Parses a byte count: `16G`, `16GB`, `12.5G`, `800M`, `1024K` or plain
/// bytes (decimal units, as the plan prints).
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let upper = t.to_ascii_uppercase();
    let (num, unit) = match upper.trim_end_matches('B').char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c),
        _ => (upper.trim_end_matches('B'), ' '),
    };
    let not_a_size = || SizeError::NotASize(text.into());
    let scale = match unit {
        ' ' => 1.0,
        'K' => 1e3,
        'M' => 1e6,
        'G' => 1e9,
        'T' => 1e12,
        _ => return Err(not_a_size()),
    };
    let v: f64 = num.trim().parse().map_err(|_| not_a_size())?;
    if !(v.is_finite() && v > 0.0) {
        return Err(SizeError::NotPositive(text.into()));
    }
    Ok((v * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_decimal_units() {
        assert_eq!(parse_bytes("16G"), Ok(16_000_000_000));
        assert_eq!(parse_bytes("12.5GB"), Ok(12_500_000_000));
        assert_eq!(parse_bytes("800m"), Ok(800_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1G").is_err());
    }
}
