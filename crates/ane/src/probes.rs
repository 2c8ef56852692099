//! Small programs that measure a device's limits and numeric cliffs, so
//! `anetrain doctor` can check the family table ([`crate::family`]) on the
//! machine at hand: the width-offset slice clamp, the matmul output cliff,
//! the largest spatial and channel extents, width 16 against 32, a
//! contraction of 16, and `concat`. They never use `tile` (it poisons the
//! device for the rest of the process: apple-neural-engine-field-guide
//! README.md, "The tile Poison") and compile at most [`COMPILE_BUDGET`]
//! programs. Every surface is at least 48 KiB, so the 0x1d failure of small
//! surfaces (Orion docs/ane_constraints.md §4) does not hide what is
//! measured.

use mil::builder::{FunctionBuilder, Value};
use mil::{DType, Ty};
use serde::Serialize;

use crate::family::Limits;
use crate::rules::RuleSet;
use crate::Device;

/// At most this many programs are compiled by [`run`].
pub const COMPILE_BUDGET: usize = 16;

/// One probe's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeResult {
    pub probe: &'static str,
    /// What it asks.
    pub question: &'static str,
    /// What the family table says.
    pub expected: String,
    /// What the device did.
    pub measured: String,
    /// Whether the two agree.
    pub agrees: bool,
}

/// Every probe's outcome and the limits they measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeReport {
    pub results: Vec<ProbeResult>,
    /// Programs compiled (at most [`COMPILE_BUDGET`]).
    pub compiles: usize,
    /// The table's limits with every measured one put in.
    pub limits: Limits,
}

/// The rules a real device gets while probing: only what any device binds
/// (one fp16 `[1, C, 1, S]` input and output), so the device's own
/// compiler, not our rules, answers each question.
pub fn probe_rules() -> RuleSet {
    let mut r = RuleSet::none();
    for id in ["single-input", "fp16-io", "io-layout"] {
        r.set(id, true).expect("known rule");
    }
    r
}

struct Program {
    text: String,
    blobs: Vec<(String, Vec<u8>)>,
}

const F16: DType = DType::Fp16;

fn program(
    input: [usize; 4],
    body: impl FnOnce(&mut FunctionBuilder, &Value) -> mil::Result<Value>,
) -> Program {
    let mut b = FunctionBuilder::new("main", "ios18");
    let x = b.input("x", Ty::tensor(F16, input));
    let out = body(&mut b, &x).expect("probe programs are well typed");
    b.output(&out);
    let f = b.finish().expect("probe programs are well typed");
    Program {
        text: mil::print(&mil::Program::new(vec![f])),
        blobs: vec![],
    }
}

/// `x[:, c0..c0+c, :, w0..w0+w]`.
fn cut(
    b: &mut FunctionBuilder,
    name: &str,
    x: &Value,
    at: [i64; 4],
    size: [i64; 4],
) -> mil::Result<Value> {
    let bv = b.ints(&format!("{name}_begin"), &at)?;
    let sv = b.ints(&format!("{name}_size"), &size)?;
    b.slice_by_size(name, x, &bv, &sv)
}

fn shape(b: &mut FunctionBuilder, name: &str, x: &Value, dims: [i64; 4]) -> mil::Result<Value> {
    let s = b.ints(&format!("{name}_shape"), &dims)?;
    b.reshape(name, x, &s)
}

/// `aᵀ·b` for two channel blocks `[k, n]` of the input (`k` channels each).
fn channel_product(k: usize, n: usize) -> Program {
    program([1, 2 * k, 1, n], |b, x| {
        let (k, n) = (k as i64, n as i64);
        let a = cut(b, "a", x, [0, 0, 0, 0], [1, k, 1, n])?;
        let c = cut(b, "b", x, [0, k, 0, 0], [1, k, 1, n])?;
        let a2 = shape(b, "a2", &a, [1, 1, k, n])?;
        let c2 = shape(b, "b2", &c, [1, 1, k, n])?;
        let (t, f) = (b.bool("bT", true)?, b.bool("bF", false)?);
        let y = b.matmul("y", &a2, &c2, &t, &f)?;
        shape(b, "out", &y, [1, n, 1, n])
    })
}

fn doubled(input: [usize; 4]) -> Program {
    program(input, |b, x| b.add("out", x, x))
}

/// Compiles and runs `p` on `input`; an error is the device's, in one line.
fn run_one<D: Device>(
    dev: &mut D,
    compiles: &mut usize,
    p: &Program,
    input: &[f32],
) -> Result<Vec<f32>, String> {
    if *compiles >= COMPILE_BUDGET {
        return Err(format!("probe compile budget of {COMPILE_BUDGET} spent"));
    }
    *compiles += 1;
    let prog = dev.compile(&p.text, &p.blobs).map_err(|e| e.to_string())?;
    let (ni, no) = dev.io_elems(&prog);
    let mut x = dev.buffer(ni).map_err(|e| e.to_string())?;
    let mut y = dev.buffer(no).map_err(|e| e.to_string())?;
    dev.write(&mut x, 0, input).map_err(|e| e.to_string())?;
    dev.eval(&prog, &x, &mut y).map_err(|e| e.to_string())?;
    let mut out = vec![0f32; no];
    dev.read(&y, 0, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

fn short(e: &str) -> String {
    let e = e.lines().next().unwrap_or("");
    if e.len() > 120 {
        format!("{}…", &e[..e.floor_char_boundary(120)])
    } else {
        e.to_string()
    }
}

fn cliff_text(v: Option<f32>) -> String {
    v.map_or("exact".into(), |c| format!("magnitudes above {c} → ±inf"))
}

/// Runs every probe on `dev` and compares it with `expected` (the family
/// table's row, or the conservative one).
pub fn run<D: Device>(dev: &mut D, expected: &Limits) -> ProbeReport {
    let mut compiles = 0;
    let mut results = vec![];
    let mut limits = *expected;
    let mut push = |probe, question, expected: String, measured: String| {
        let agrees = expected == measured;
        results.push(ProbeResult {
            probe,
            question,
            expected,
            measured,
            agrees,
        });
    };

    // 1. Width-offset slice: columns 32..64 of [768, 64] hold ±5000 and
    //    ±1000; a clamping route turns the ±5000 into ±inf.
    let p = program([1, 768, 1, 64], |b, x| {
        cut(b, "out", x, [0, 0, 0, 32], [1, 768, 1, 32])
    });
    let input: Vec<f32> = (0..768 * 64)
        .map(|i| {
            let (c, w) = (i / 64, i % 64);
            let v = if c % 2 == 0 { 5000.0 } else { 1000.0 };
            if w % 3 == 0 {
                -v
            } else {
                v
            }
        })
        .collect();
    let want: Vec<f32> = (0..768)
        .flat_map(|c| input[c * 64 + 32..c * 64 + 64].to_vec())
        .collect();
    let measured = match run_one(dev, &mut compiles, &p, &input) {
        Ok(got) if got == want => {
            limits.width_slice_clamp = None;
            cliff_text(None)
        }
        Ok(got) => {
            let clamped = got.iter().zip(&want).all(|(g, w)| {
                if w.abs() > 4094.0 {
                    g.is_infinite() && g.signum() == w.signum()
                } else {
                    g == w
                }
            });
            limits.width_slice_clamp = Some(crate::family::WIDTH_SLICE_CLAMP);
            if clamped {
                cliff_text(limits.width_slice_clamp)
            } else {
                "wrong values".into()
            }
        }
        Err(e) => {
            limits.width_slice_clamp = Some(crate::family::WIDTH_SLICE_CLAMP);
            format!("failed: {}", short(&e))
        }
    };
    push(
        "width-slice",
        "does a slice at width offset 32 keep values of 5000?",
        cliff_text(expected.width_slice_clamp),
        measured,
    );

    // 2. Matmul output cliff: aᵀ·b with a's first row ones and b's first
    //    row 32000, 33024, -33024, 1, …: output columns carry those values.
    let (k, n) = (32, 384);
    let p = channel_product(k, n);
    let mut input = vec![0f32; 2 * k * n];
    input[..n].fill(1.0);
    let b0 = &mut input[k * n..k * n + n];
    b0.fill(1.0);
    b0[..3].copy_from_slice(&[32000.0, 33024.0, -33024.0]);
    let measured = match run_one(dev, &mut compiles, &p, &input) {
        Ok(got) => {
            let col = |j: usize| got[j];
            let (below, above, neg) = (col(0), col(1), col(2));
            if below == 32000.0 && above == 33024.0 && neg == -33024.0 {
                limits.matmul_cliff = None;
                cliff_text(None)
            } else if below == 32000.0 && above == f32::INFINITY && neg == f32::NEG_INFINITY {
                limits.matmul_cliff = Some(crate::family::MATMUL_CLIFF);
                cliff_text(limits.matmul_cliff)
            } else {
                limits.matmul_cliff = Some(crate::family::MATMUL_CLIFF);
                format!("wrong values ({below}, {above}, {neg})")
            }
        }
        Err(e) => format!("failed: {}", short(&e)),
    };
    push(
        "matmul-cliff",
        "does a matmul output of 33024 stay finite (32000 below the reported cliff)?",
        cliff_text(expected.matmul_cliff),
        measured,
    );

    // 3. The largest spatial extent: 65536 (A16), else 16384 (A13–A15).
    let accepts = |dev: &mut D, compiles: &mut usize, dims: [usize; 4]| {
        let p = doubled(dims);
        let n: usize = dims.iter().product();
        let input: Vec<f32> = (0..n).map(|i| (i % 251) as f32 / 8.0).collect();
        match run_one(dev, compiles, &p, &input) {
            Ok(got) => got.iter().zip(&input).all(|(g, x)| *g == 2.0 * x),
            Err(_) => false,
        }
    };
    let spatial = if accepts(dev, &mut compiles, [1, 32, 1, 65_536]) {
        65_536
    } else if accepts(dev, &mut compiles, [1, 32, 1, 16_384]) {
        16_384
    } else {
        0
    };
    if spatial > 0 {
        limits.max_spatial = spatial;
    }
    push(
        "spatial-extent",
        "the widest input (65536, else 16384) that compiles and computes",
        expected.max_spatial.to_string(),
        if spatial > 0 {
            spatial.to_string()
        } else {
            "neither".into()
        },
    );

    // 4. The channel axis at 65536.
    let channel = accepts(dev, &mut compiles, [1, 65_536, 1, 32]);
    if !channel {
        limits.max_channel = limits.max_channel.min(16_384);
    }
    push(
        "channel-extent",
        "do 65536 channels compile and compute?",
        (expected.max_channel >= 65_536).to_string(),
        channel.to_string(),
    );

    // 5. Width 16 (the field guide says 32 is the least that works).
    let w16 = accepts(dev, &mut compiles, [1, 1536, 1, 16]);
    limits.min_width = if w16 { 16 } else { 32 };
    push(
        "width-16",
        "does a 16-wide surface compile and compute?",
        (expected.min_width <= 16).to_string(),
        w16.to_string(),
    );

    // 6. A contraction of 16 (maderix/ANE PR #47: silent zeros).
    let (k, n) = (16, 768);
    let p = channel_product(k, n);
    let input: Vec<f32> = (0..2 * k * n)
        .map(|i| ((i * 7919) % 17) as f32 / 16.0 - 0.5)
        .collect();
    let inner16 = match run_one(dev, &mut compiles, &p, &input) {
        Ok(got) => (0..n).step_by(37).all(|i| {
            (0..n).step_by(41).all(|j| {
                let want: f32 = (0..k)
                    .map(|r| input[r * n + i] * input[(k + r) * n + j])
                    .sum();
                (got[i * n + j] - want).abs() <= 1e-2
            })
        }),
        Err(_) => false,
    };
    limits.inner_multiple = if inner16 { 16 } else { 32 };
    push(
        "contraction-16",
        "does a matmul contracting over 16 compute?",
        (expected.inner_multiple <= 16).to_string(),
        inner16.to_string(),
    );

    // 7. concat of the input with constant zeros along channels.
    let mut p = program([1, 768, 1, 32], |b, x| {
        let z = b.blob("zeros", Ty::tensor(F16, [1, 768, 1, 32]), "zeros.bin")?;
        let ax = b.int("axis", 1)?;
        let il = b.bool("bF", false)?;
        b.concat("out", &[x, &z], &ax, &il)
    });
    p.blobs = vec![(
        format!("{}zeros.bin", mil::blob::PATH_PREFIX),
        mil::blob::encode(&vec![0f32; 768 * 32]),
    )];
    let input: Vec<f32> = (0..768 * 32).map(|i| (i % 97) as f32).collect();
    let concat = match run_one(dev, &mut compiles, &p, &input) {
        Ok(got) => got[..input.len()] == input[..] && got[input.len()..].iter().all(|v| *v == 0.0),
        Err(_) => false,
    };
    limits.concat = concat;
    push(
        "concat",
        "does concat with a constant compile and compute?",
        expected.concat.to_string(),
        concat.to_string(),
    );

    ProbeReport {
        results,
        compiles,
        limits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::Family;
    use crate::SimDevice;

    #[test]
    fn the_simulated_families_measure_as_their_rows() {
        for f in [Family::M1, Family::M5] {
            let mut dev = SimDevice::for_family(f);
            let r = run(&mut dev, &f.limits());
            assert!(r.compiles <= COMPILE_BUDGET);
            for p in &r.results {
                assert!(p.agrees, "{f:?}: {p:?}");
            }
            assert_eq!(
                r.limits.width_slice_clamp,
                f.limits().width_slice_clamp,
                "{f:?}"
            );
            assert_eq!(r.limits.matmul_cliff, f.limits().matmul_cliff, "{f:?}");
            assert_eq!(r.limits.max_spatial, f.limits().max_spatial, "{f:?}");
        }
    }
}
