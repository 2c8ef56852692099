//! Timing probes: what `anetrain doctor` measures on a Neural Engine so the
//! cost model ([`crate::cost`]) can use this machine's numbers instead of
//! the published ones. Three programs, within [`TIMING_COMPILES`]:
//!
//!   dispatch  = median evaluation of a minimal program (≥ 50 runs)
//!   matmul    = a dynamic-weight product y = Wᵀ·x, W read from the input
//!               surface beside x, at two of Qwen3-0.6B's projection shapes
//!   write     = host writes into an input surface (GB/s of fp16)
//!   compile   = the mean compile of the three programs
//!
//! On the simulator these run too (that is how they are tested), but their
//! numbers describe the host, not a chip: `doctor` neither saves nor uses
//! them there.

use std::time::Instant;

use mil::builder::Value;
use mil::{DType, Ty};

use crate::cost::Measured;
use crate::Device;

/// Programs [`measure`] compiles.
pub const TIMING_COMPILES: usize = 3;

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
/// `W [K, N]` in the next `N`, as the kernels pack dynamic weights.
fn dynamic_matmul(k: usize, n: usize, s: usize) -> String {
    text([1, k, 1, s + n], |b, x| {
        let (k, n, s) = (k as i64, n as i64, s as i64);
        let cut = |b: &mut mil::builder::FunctionBuilder, name: &str, at: i64, w: i64| {
            let bv = b.ints(&format!("{name}_begin"), &[0, 0, 0, at])?;
            let sv = b.ints(&format!("{name}_size"), &[1, k, 1, w])?;
            b.slice_by_size(name, x, &bv, &sv)
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
/// [`MATMUL_SHAPES`]; median of 10 each), the host's surface-write
/// bandwidth (median of 5 writes of 16 MB) and the mean compile time on
/// `dev`.
pub fn measure<D: Device>(
    dev: &mut D,
    dispatch_runs: usize,
    shapes: &[(usize, usize, usize)],
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
        let m = measure(&mut dev, 50, &[(k, n, s), (k, n, s)]).unwrap();
        assert_eq!(dev.compiles(), TIMING_COMPILES);
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
}
