//! Runtime CPU dispatch for elementwise loops. The crate is built for the
//! baseline x86-64 (SSE2), so a plain loop is compiled 4 lanes wide at
//! best; [`vectorized!`] compiles one loop body three times — for
//! AVX-512, for AVX2 + FMA, and for the baseline — and picks the widest the
//! CPU has at run time. The arithmetic is the same IEEE operations in the
//! same order in every version (Rust never fuses a multiply and an add on
//! its own), so results are identical bit for bit whichever runs.

/// Defines `fn NAME(args) -> RET` whose body is compiled per instruction
/// set as described in the module comment.
macro_rules! vectorized {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the instructions `avx512` uses.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the instructions `avx2` uses.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use vectorized;
