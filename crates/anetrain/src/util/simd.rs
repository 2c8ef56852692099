//! Runtime CPU dispatch for elementwise loops. The crate is built for the
//! baseline x86-64 (SSE2), so a plain loop is compiled 4 lanes wide at
//! best; [`vectorized!`] compiles one loop body three times — for
//! AVX-512, for AVX2 + FMA, and for the baseline — and picks the widest the
//! CPU has at run time. The arithmetic is the same IEEE operations in the
//! same order in every version (Rust never fuses a multiply and an add on
//! its own), so results are identical bit for bit whichever runs. On
//! aarch64 (Apple Silicon) only the plain loop exists: NEON is that
//! target's baseline, so it is already compiled 4 lanes wide.

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
                /// # Safety
                /// The CPU has AVX-512 (checked before the call).
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                /// # Safety
                /// The CPU has AVX2 and FMA (checked before the call).
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

/// `eˣ` in single precision from plain IEEE operations, so loops calling it
/// inside [`vectorized!`] compile to vector code (libm's `expf` is a call
/// per element) and give the same bits on every instruction set.
///
/// Cody–Waite reduction `x = n·ln2 + r`, |r| ≤ ln2/2, with `ln2` split in
/// two so `n·ln2_hi` is exact; `eʳ = 1 + r + r²·P(r)` with Cephes' degree-5
/// minimax `P`; then `2ⁿ` is built in the exponent bits. Below
/// ln(f32::MIN_POSITIVE) ≈ −87.34 the result is 0 (so a masked −∞ gives
/// exactly 0), above ln(f32::MAX) it is +∞, NaN stays NaN. Measured against
/// f64 `exp`: within 1 ulp over the whole normal range (test below).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it rounds to an integer (to nearest even) and leaves
    // that integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.722_84;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + ROUND;
    let nf = t - ROUND;
    let r = (xc - nf * LN2_HI) - nf * LN2_LO;
    let p = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = p * (r * r) + r + 1.0;
    // n ∈ [−126, 128] is applied as 2^h·2^(n−h), h = ⌊n/2⌋, both factors
    // normal: the product then underflows or overflows only where eˣ does.
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let h = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let y = er * pow2(h) * pow2(n - h);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// Σx in f32 over sixteen interleaved accumulators (independent add
/// chains, so it vectorises), then in order: the same bits on every
/// instruction set.
#[inline(always)]
fn sum16(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut blocks = x.chunks_exact(16);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a += v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(blocks.remainder()) {
        *a += v;
    }
    acc.iter().sum()
}

/// The largest element (NaN ignored, as `f32::max` does), over sixteen
/// lanes like [`sum16`].
#[inline(always)]
fn max16(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut blocks = x.chunks_exact(16);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a = a.max(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(blocks.remainder()) {
        *a = a.max(v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

vectorized! {
    /// `row ← softmax(scale·row)` in place:
    ///   z = scale·x;  yᵢ = exp(zᵢ − max z) / Σⱼ exp(zⱼ − max z)
    pub fn softmax_scaled(row: &mut [f32], scale: f32) {
        row.iter_mut().for_each(|v| *v *= scale);
        let max = max16(row);
        row.iter_mut().for_each(|v| *v = exp(*v - max));
        let sum = sum16(row);
        row.iter_mut().for_each(|v| *v /= sum);
    }
}

vectorized! {
    /// One vocabulary row of a cross-entropy over columns:
    /// `z[s] ← exp(z[s] − max[s])`, `sum[s] += z[s]` (in f64).
    pub fn exp_shifted_accumulate(z: &mut [f32], max: &[f32], sum: &mut [f64]) {
        let n = z.len();
        let (max, sum) = (&max[..n], &mut sum[..n]);
        for s in 0..n {
            let e = exp(z[s] - max[s]);
            z[s] = e;
            sum[s] += e as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `y` and the f64 value `want`.
    fn ulps(y: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
        (y as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_is_within_one_ulp_of_f64() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 {
                worst = worst.max(ulps(exp(x), want));
            }
            x += 1.37e-4;
        }
        for x in [-1e-6f32, 0.0, 1e-6, 0.3465, -0.3466, 1.0, -1.0, 88.0, -87.0] {
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        assert!(worst <= 1.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(88.7).is_finite());
    }

    #[test]
    fn vector_loops_match_the_scalar_formulas() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.0173).collect();
        let mut row = xs.clone();
        softmax_scaled(&mut row, 0.5);
        let max = xs.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * 0.5));
        let total: f64 = xs.iter().map(|&x| ((x * 0.5 - max) as f64).exp()).sum();
        for (x, y) in xs.iter().zip(&row) {
            let want = ((x * 0.5 - max) as f64).exp() / total;
            assert!((*y as f64 - want).abs() <= 1e-6 * want, "{y} vs {want}");
        }
        let mut z = xs.clone();
        let shift: Vec<f32> = (0..1000).map(|i| i as f32 * 0.01).collect();
        let mut acc = vec![1.0f64; 1000];
        exp_shifted_accumulate(&mut z, &shift, &mut acc);
        for s in 0..1000 {
            assert_eq!(z[s].to_bits(), exp(xs[s] - shift[s]).to_bits());
            assert_eq!(acc[s], 1.0 + z[s] as f64);
        }
        let mut masked = vec![f32::NEG_INFINITY; 20];
        masked[3] = 2.0;
        softmax_scaled(&mut masked, 1.0);
        assert_eq!(masked.iter().filter(|&&v| v == 0.0).count(), 19);
        assert_eq!(masked[3], 1.0);
    }
}
