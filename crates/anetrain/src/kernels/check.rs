//! Kernel verification: every kernel's MIL program, run by the interpreter
//! on packed random inputs, against its CPU twin (what `anetrain kernels
//! check` and the tests run).

use mil::{DType, Executable, Precision, Tensor};

use super::layout::Encoding;
use super::{build, run_cpu, KernelKind, KernelOptions, KernelProgram, Port, Shape, Tensors};
use crate::util::rng::Rng;

/// Worst relative error (max |mil − cpu| / max |cpu|, per output block).
/// fp32 mode is compared with the twin computing with the program's own
/// fp16 constants (the same maths exactly); fp16 mode with the exact twin
/// (the whole device error).
#[derive(Clone, Debug)]
pub struct CheckResult {
    pub kind: KernelKind,
    pub fp32_max_abs: f32,
    pub fp32_rel: f32,
    pub fp16_max_abs: f32,
    pub fp16_rel: f32,
}

/// Tolerances: fp32 differs from the twin only in summation order; fp16
/// rounds every op result (about 5e-4 relative each) through chains of up
/// to ~20 ops and fp16 softmax.
pub const FP32_TOL: f32 = 1e-5;
pub const FP16_TOL: f32 = 2e-2;

impl CheckResult {
    pub fn passed(&self) -> bool {
        self.fp32_rel <= FP32_TOL && self.fp16_rel <= FP16_TOL
    }
}

/// Random inputs shaped by the kernel's layout: activations N(0, 1),
/// weights N(0, 1/in), norm weights around 1, score inputs valid softmax
/// rows (probs) and N(0, 1) gradients (dp).
pub fn random_inputs(k: &KernelProgram, rng: &mut Rng) -> Tensors {
    let mut t = Tensors::new();
    for r in &k.layout.inputs {
        let [rows, cols] = r.tensor_shape();
        let n = rows * cols;
        let v = match (r.encoding, r.port) {
            (_, Port::QNorm | Port::KNorm) => rng.normals(n, 0.3).iter().map(|x| 1.0 + x).collect(),
            (_, Port::Probs) => {
                // each row a distribution over a random support
                let mut v: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
                for row in v.chunks_mut(cols) {
                    let s: f32 = row.iter().sum();
                    row.iter_mut().for_each(|x| *x /= s);
                }
                v
            }
            (Encoding::Activation, _) => rng.normals(n, 1.0),
            (Encoding::Transposed, _) => rng.normals(n, 1.0 / (cols as f64).sqrt()),
            (Encoding::AsIs, _) => rng.normals(n, 1.0 / (rows as f64).sqrt()),
        };
        t.insert(r.port, v);
    }
    t
}

/// Packs named tensors into the kernel's input buffer.
pub fn pack_all(k: &KernelProgram, t: &Tensors) -> Vec<f32> {
    let mut buf = vec![0f32; k.layout.input_elems()];
    for r in &k.layout.inputs {
        k.layout.pack(r.port, &t[&r.port], &mut buf);
    }
    buf
}

/// Runs the kernel's MIL text (printed, re-parsed) through the interpreter.
pub fn run_mil(k: &KernelProgram, input: Vec<f32>, precision: Precision) -> mil::Result<Vec<f32>> {
    let p = mil::parse_and_validate(&k.text())?;
    let exe = Executable::with_blobs(&p.functions[0], &k.blob_paths())?;
    let shape = vec![1, k.layout.in_channels, 1, k.layout.in_spatial];
    let out = exe.run(vec![Tensor::float(DType::Fp16, shape, input)], precision)?;
    Ok(out[0].f32s().map_err(mil::MilError::new)?.to_vec())
}

fn compare(k: &KernelProgram, got: &[f32], want: &Tensors) -> (f32, f32) {
    let mut worst = (0f32, 0f32);
    for b in &k.layout.outputs {
        let g = k.layout.unpack(b.port, got);
        let w = &want[&b.port];
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let abs = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        worst.0 = worst.0.max(abs);
        worst.1 = worst.1.max(abs / scale);
    }
    worst
}

/// Checks one kernel on random inputs from `seed`.
pub fn check_kernel(
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
    seed: u64,
) -> mil::Result<CheckResult> {
    let k = build(kind, s, o)?;
    let mut rng = Rng::new(seed);
    let mut t = random_inputs(&k, &mut rng);
    // Both sides see the same (fp16-representable) values.
    for v in t.values_mut() {
        mil::tensor::round_to_f16_in_place(v);
    }
    let exact = KernelOptions {
        fp16_constants: false,
        ..o.clone()
    };
    let stored = KernelOptions {
        fp16_constants: true,
        ..o.clone()
    };
    let input = pack_all(&k, &t);
    let y32 = run_mil(&k, input.clone(), Precision::Fp32)?;
    let y16 = run_mil(&k, input, Precision::Fp16)?;
    let (a32, r32) = compare(&k, &y32, &run_cpu(kind, s, &stored, &t));
    let (a16, r16) = compare(&k, &y16, &run_cpu(kind, s, &exact, &t));
    Ok(CheckResult {
        kind,
        fp32_max_abs: a32,
        fp32_rel: r32,
        fp16_max_abs: a16,
        fp16_rel: r16,
    })
}

/// Runs kernel `kind` on `dev` (compiled there, evaluated on random inputs
/// from `seed`) and returns the worst relative error against the exact
/// CPU twin, as [`check_kernel`] measures fp16 mode. With `outlier`, one
/// channel of the residual stream (`x2`, where a model's massive
/// activations ride) holds ±`outlier`, as Qwen-family models' do.
pub fn check_on_device<D: ane::Device>(
    dev: &mut D,
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
    seed: u64,
    outlier: Option<f32>,
) -> anyhow::Result<f32> {
    let k = build(kind, s, o)?;
    let mut rng = Rng::new(seed);
    let mut t = random_inputs(&k, &mut rng);
    if let (Some(v), Some(x2)) = (outlier, t.get_mut(&Port::X2)) {
        let seq = s.seq;
        for (j, x) in x2[3 * seq..4 * seq].iter_mut().enumerate() {
            *x = if j % 2 == 0 { v } else { -v };
        }
    }
    for v in t.values_mut() {
        mil::tensor::round_to_f16_in_place(v);
    }
    let input = pack_all(&k, &t);
    let p = dev.compile(&k.text(), &k.blob_paths())?;
    let (ni, no) = dev.io_elems(&p);
    let mut x = dev.buffer(ni)?;
    let mut y = dev.buffer(no)?;
    dev.write(&mut x, 0, &input)?;
    dev.eval(&p, &x, &mut y)?;
    let mut got = vec![0f32; no];
    dev.read(&y, 0, &mut got)?;
    let exact = KernelOptions {
        fp16_constants: false,
        ..o.clone()
    };
    let (_, rel) = compare(&k, &got, &run_cpu(kind, s, &exact, &t));
    Ok(if got.iter().any(|v| !v.is_finite()) {
        f32::INFINITY
    } else {
        rel
    })
}
