//! Timing probes: what `anetrain doctor` measures on a Neural Engine so the
//! cost model ([`crate::cost`]) can use this machine's numbers instead of
//! the published ones. Four programs, within [`TIMING_COMPILES`]:
//!
//!   dispatch  = median evaluation of a minimal program (≥ 50 runs)
//!   matmul    = a dynamic-weight product y = Wᵀ·x, W read from the input
//!               surface beside x, at two of Qwen3-0.6B's projection shapes
//!   scratch   = o = k·softmax(qᵀ·k)ᵀ, whose two [n, n] intermediates are
//!               twenty times its surfaces: whether a program's
//!               intermediates slow it as surfaces of that size would
//!               (the fused attention backward keeps P, dP and dS inside)
//!   write     = host writes into an input surface (GB/s of fp16)
//!   compile   = the mean compile of the four programs
//!
//! On the simulator these run too (that is how they are tested), but their
//! numbers describe the host, not a chip: `doctor` neither saves nor uses
//! them there.

use std::time::Instant;

use mil::builder::Value;
use mil::{DType, Ty};

use crate::family::{Measured, ScratchTiming};
use crate::Device;

/// Programs [`measure`] compiles.
pub const TIMING_COMPILES: usize = 4;

/// The scratch probe's `(d, n)`: q and k of `[d, n]`, scores and
/// probabilities of `[n, n]` — 3 MB of surfaces, 64 MB of intermediates
/// (a fused attention-backward tile of Qwen3-0.6B at 4096 tokens keeps
/// 100 MB), 8.6 GFLOP. With all of it counted the M4's table predicts
/// the program 2.4× slower than with none (`cost` tests), so one median
/// tells the cases apart.
pub const SCRATCH_SHAPE: (usize, usize) = (128, 4096);

/// Dynamic-weight products measured, `(contraction K, outputs N, positions
/// S)`: Qwen3-0.6B's o-projection and up-projection at 256 tokens, the
/// shapes its step spends most of its device time in.
pub const MATMUL_SHAPES: [(usize, usize, usize); 2] = [(2048, 1024, 256), (1024, 3072, 256)];

fn text(
    input: [usize; 4],
    body: impl FnOnce(&mut mil::builder::FunctionBuilder, &Value) -> mil::Result<Value>,
) -> String {
    let mut b = mil::builder::FunctionBuilder::new("main", "ios18");
    let x = b.input("x", Ty::tensor(DType::Fp16, input));
    let out = body(&mut b, &x).expect("timing programs are well typed");
    b.output(&out);
    let f = b.finish().expect("timing programs are well typed");
    mil::print(&mil::Program::new(vec![f]))
}

/// `y [N, S] = Wᵀ·x` with `x [K, S]` in the input's first `S` columns and
/// `W [K, N]` in the next `N`, as the kernels pack dynamic weights: the
/// input viewed as `[1, K, (S+N)/32, 32]` and cut along axis 2, so no
/// slice begins at a width offset (M1–M3 compute those through a crop
/// that saturates |v| > 4094: ANEForge `docs/numeric-cliffs.md`; the
/// kernels' `Gen::region` does the same). `S` and `N` are multiples of 32.
fn dynamic_matmul(k: usize, n: usize, s: usize) -> String {
    text([1, k, 1, s + n], |b, x| {
        let (k, n, s) = (k as i64, n as i64, s as i64);
        let sh = b.ints("groups_shape", &[1, k, (s + n) / 32, 32])?;
        let groups = b.reshape("groups", x, &sh)?;
        let cut = |b: &mut mil::builder::FunctionBuilder, name: &str, at: i64, w: i64| {
            let bv = b.ints(&format!("{name}_begin"), &[0, 0, at / 32, 0])?;
            let sv = b.ints(&format!("{name}_size"), &[1, k, w / 32, 32])?;
            let v = b.slice_by_size(&format!("{name}_groups"), &groups, &bv, &sv)?;
            let sh = b.ints(&format!("{name}_shape"), &[1, k, 1, w])?;
            b.reshape(name, &v, &sh)
        };
        let xa = cut(b, "xa", 0, s)?;
        let w = cut(b, "w", s, n)?;
        let shape = |b: &mut mil::builder::FunctionBuilder, name: &str, v: &Value, d: [i64; 4]| {
            let sh = b.ints(&format!("{name}_shape"), &d)?;
            b.reshape(name, v, &sh)
        };
        let w2 = shape(b, "w2", &w, [1, 1, k, n])?;
        let x2 = shape(b, "x2", &xa, [1, 1, k, s])?;
        let (t, f) = (b.bool("bT", true)?, b.bool("bF", false)?);
        let y = b.matmul("y", &w2, &x2, &t, &f)?;
        shape(b, "out", &y, [1, n, 1, s])
    })
}

/// `o [d, n] = k·softmax(qᵀ·k)ᵀ` with `q [d, n]` in the input's first `d`
/// channels and `k [d, n]` in the next `d`: attention of n queries over n
/// keys with v = k, its scores and probabilities `[n, n]` kept inside.
fn scratch_chain(d: usize, n: usize) -> String {
    text([1, 2 * d, 1, n], |b, x| {
        let (d, n) = (d as i64, n as i64);
        let cut = |b: &mut mil::builder::FunctionBuilder, name: &str, at: i64| {
            let bv = b.ints(&format!("{name}_begin"), &[0, at, 0, 0])?;
            let sv = b.ints(&format!("{name}_size"), &[1, d, 1, n])?;
            let v = b.slice_by_size(&format!("{name}_cut"), x, &bv, &sv)?;
            let sh = b.ints(&format!("{name}_shape"), &[1, 1, d, n])?;
            b.reshape(name, &v, &sh)
        };
        let q = cut(b, "q", 0)?;
        let k = cut(b, "k", d)?;
        let (t, f) = (b.bool("bT", true)?, b.bool("bF", false)?);
        let scores = b.matmul("scores", &q, &k, &t, &f)?;
        let axis = b.int("axis", -1)?;
        let p = b.softmax("p", &scores, &axis)?;
        let o = b.matmul("o", &k, &p, &f, &t)?;
        let sh = b.ints("out_shape", &[1, d, 1, n])?;
        b.reshape("out", &o, &sh)
    })
}

/// Times [`scratch_chain`] at `(d, n)` (median of 10).
fn time_scratch<D: Device>(
    dev: &mut D,
    (d, n): (usize, usize),
) -> Result<(f64, ScratchTiming), String> {
    let (compile, ms) = time_program(dev, &scratch_chain(d, n), 10)?;
    let (d, n) = (d as f64, n as f64);
    let timing = ScratchTiming {
        flop: 4.0 * n * n * d,
        surface_bytes: 2.0 * 3.0 * d * n,
        scratch_bytes: 2.0 * 2.0 * n * n,
        ms,
    };
    Ok((compile, timing))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Compiles `text`, then evaluates it `runs` times on inputs of ±1:
/// (compile ms, median evaluation ms).
fn time_program<D: Device>(dev: &mut D, text: &str, runs: usize) -> Result<(f64, f64), String> {
    let t = Instant::now();
    let p = dev.compile(text, &[]).map_err(|e| e.to_string())?;
    let compile = t.elapsed().as_secs_f64() * 1e3;
    let (ni, no) = dev.io_elems(&p);
    let mut x = dev.buffer(ni).map_err(|e| e.to_string())?;
    let mut y = dev.buffer(no).map_err(|e| e.to_string())?;
    let input: Vec<f32> = (0..ni)
        .map(|i| if i % 3 == 0 { -0.5 } else { 0.25 })
        .collect();
    dev.write(&mut x, 0, &input).map_err(|e| e.to_string())?;
    // One evaluation first: the first run of a program loads it.
    dev.eval(&p, &x, &mut y).map_err(|e| e.to_string())?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        dev.eval(&p, &x, &mut y).map_err(|e| e.to_string())?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((compile, median(times)))
}

/// Measures dispatch (median of `dispatch_runs` ≥ 50 evaluations of a
/// minimal program), the dynamic-weight products of `shapes` (`doctor`:
/// [`MATMUL_SHAPES`]; median of 10 each), the scratch probe at `scratch`
/// (`doctor`: [`SCRATCH_SHAPE`]), the host's surface-write bandwidth
/// (median of 5 writes of 16 MB) and the mean compile time on `dev`.
pub fn measure<D: Device>(
    dev: &mut D,
    dispatch_runs: usize,
    shapes: &[(usize, usize, usize)],
    scratch: (usize, usize),
) -> Result<Measured, String> {
    // [1, 32, 1, 768] fp16 is 48 KiB, the smallest surface every chip
    // accepts (Orion docs/ane_constraints.md §4).
    let minimal = text([1, 32, 1, 768], |b, x| b.add("out", x, x));
    let (c0, dispatch_ms) = time_program(dev, &minimal, dispatch_runs.max(50))?;
    let mut compiles = vec![c0];
    let mut matmuls = vec![];
    for &(k, n, s) in shapes {
        let (c, ms) = time_program(dev, &dynamic_matmul(k, n, s), 10)?;
        compiles.push(c);
        matmuls.push((2.0 * (k * n * s) as f64, ms));
    }
    let (c, scratch) = time_scratch(dev, scratch)?;
    compiles.push(c);
    let elems = 8 << 20;
    let mut buf = dev.buffer(elems).map_err(|e| e.to_string())?;
    let data = vec![0.5f32; elems];
    let mut writes = vec![];
    for _ in 0..5 {
        let t = Instant::now();
        dev.write(&mut buf, 0, &data).map_err(|e| e.to_string())?;
        writes.push(t.elapsed().as_secs_f64());
    }
    let write_gbs = 2.0 * elems as f64 / median(writes) / 1e9;
    Ok(Measured {
        dispatch_ms,
        matmuls,
        write_gbs,
        compile_ms: compiles.iter().sum::<f64>() / compiles.len() as f64,
        scratch: Some(scratch),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimDevice;

    /// The probes run end to end (on the simulator, whose numbers describe
    /// the host) within their compile budget, and the product they time
    /// computes Wᵀ·x.
    #[test]
    fn the_timing_probes_run_and_the_product_is_right() {
        // Small products (the simulator's plain loops are slow), every
        // surface at least the 48 KiB the rules ask.
        let (k, n, s) = (192, 128, 192);
        let mut dev = SimDevice::new();
        let m = measure(&mut dev, 50, &[(k, n, s), (k, n, s)], (64, 384)).unwrap();
        assert_eq!(dev.compiles(), TIMING_COMPILES);
        let sc = m.scratch.unwrap();
        assert_eq!(
            (sc.flop, sc.scratch_bytes),
            (4.0 * 384.0 * 384.0 * 64.0, 4.0 * 384.0 * 384.0)
        );
        assert!(m.dispatch_ms > 0.0 && m.write_gbs > 0.0 && m.compile_ms > 0.0);
        assert_eq!(m.matmuls.len(), 2);
        assert_eq!(m.matmuls[0].0, 2.0 * (k * n * s) as f64);
        // The timed program is the product it claims to be.
        let p = dev.compile(&dynamic_matmul(k, n, s), &[]).unwrap();
        let mut x = dev.buffer(k * (s + n)).unwrap();
        let mut y = dev.buffer(n * s).unwrap();
        let v: Vec<f32> = (0..k * (s + n))
            .map(|i| ((i * 7) % 5) as f32 - 2.0)
            .collect();
        dev.write(&mut x, 0, &v).unwrap();
        dev.eval(&p, &x, &mut y).unwrap();
        let mut got = vec![0f32; n * s];
        dev.read(&y, 0, &mut got).unwrap();
        for j in 0..n {
            for t in 0..s {
                let want: f32 = (0..k)
                    .map(|c| v[c * (s + n) + s + j] * v[c * (s + n) + t])
                    .sum();
                assert_eq!(got[j * s + t], want, "y[{j}, {t}]");
            }
        }
    }

    /// The scratch probe computes attention of its q over its k (v = k),
    /// within fp16 rounding of the maths in f64; at doctor's shapes it
    /// and the matmul probes pass every family's rules (no width-offset
    /// slice, which M1–M3 crop), the scratch probe's input within the
    /// 16 MiB tile cap.
    #[test]
    fn the_scratch_probe_is_attention_and_every_chip_accepts_it() {
        let (d, n) = (64, 384);
        let mut dev = SimDevice::new();
        let p = dev.compile(&scratch_chain(d, n), &[]).unwrap();
        let mut x = dev.buffer(2 * d * n).unwrap();
        let mut y = dev.buffer(d * n).unwrap();
        let v: Vec<f32> = (0..2 * d * n)
            .map(|i| half::f16::from_f32(((i * 37 % 101) as f32 - 50.0) / 400.0).to_f32())
            .collect();
        dev.write(&mut x, 0, &v).unwrap();
        dev.eval(&p, &x, &mut y).unwrap();
        let mut got = vec![0f32; d * n];
        dev.read(&y, 0, &mut got).unwrap();
        let q = |c: usize, i: usize| v[c * n + i] as f64;
        let k = |c: usize, j: usize| v[(d + c) * n + j] as f64;
        let mut worst = 0f64;
        for i in 0..n {
            let s: Vec<f64> = (0..n)
                .map(|j| (0..d).map(|c| q(c, i) * k(c, j)).sum())
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..d {
                let want: f64 = (0..n).map(|j| k(c, j) * e[j] / z).sum();
                worst = worst.max((got[c * n + i] as f64 - want).abs());
            }
        }
        let scale = v.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        assert!(worst <= 1e-2 * scale, "worst error {worst} of {scale}");
        let (d, n) = SCRATCH_SHAPE;
        let mut programs = vec![scratch_chain(d, n)];
        programs.extend(
            MATMUL_SHAPES
                .iter()
                .map(|&(k, n, s)| dynamic_matmul(k, n, s)),
        );
        for text in programs {
            let program = mil::parse(&text).unwrap();
            for family in crate::family::Family::ALL {
                let rules = crate::rules::RuleSet::for_limits(family.limits());
                let broken = crate::rules::check(&program, &rules);
                assert!(broken.is_empty(), "{family:?}: {broken:?}");
            }
        }
        assert!(2 * 2 * d * n <= 16 << 20);
    }
}
