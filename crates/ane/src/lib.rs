//! Neural Engine devices behind one trait.
//!
//! A [`Device`] compiles MIL text (plus its BLOBFILE contents) into a
//! program, allocates fp16 buffers in the ANE's `[1, C, 1, S]` layout, and
//! evaluates a program from one buffer into another. [`SimDevice`] does all
//! of this with the `mil` reference interpreter in fp16 mode, parsing the
//! exact text a real device would compile, so the whole ANE pipeline runs
//! and is tested on any machine.

use std::fmt;

pub mod apple;
pub mod cost;
mod error;
pub mod family;
pub mod probes;
pub mod rules;
pub mod timing;

pub use apple::AneDevice;
pub use error::Error;

use family::{Family, Limits};
use half::f16;
use half::slice::HalfFloatSliceExt;
use mil::{DType, Executable, Precision, Tensor};
use rules::RuleSet;

/// Device errors: one line saying what failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

/// A setting the device cannot be opened with, as its error.
impl From<error::Error> for DeviceError {
    fn from(e: error::Error) -> DeviceError {
        DeviceError(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, DeviceError>;

/// What every Neural Engine back end provides.
pub trait Device {
    /// A compiled program.
    type Program;
    /// An fp16 buffer (an IOSurface on macOS, host memory in the simulator).
    type Buffer;

    /// Short name for messages (`ane-sim`, `ane`).
    fn name(&self) -> &'static str;
    /// Compiles MIL text; `blobs` are `(path as written in the text, file bytes)`.
    fn compile(&mut self, mil: &str, blobs: &[(String, Vec<u8>)]) -> Result<Self::Program>;
    /// Number of fp16 elements of the program's input and output.
    fn io_elems(&self, p: &Self::Program) -> (usize, usize);
    /// A zeroed buffer of `elems` fp16 values.
    fn buffer(&mut self, elems: usize) -> Result<Self::Buffer>;
    /// Stores f32 values (rounded to fp16) at `offset` elements into `buf`.
    fn write(&mut self, buf: &mut Self::Buffer, offset: usize, data: &[f32]) -> Result<()>;
    /// Stores `data` (row-major, rows of `width` values) as rows starting
    /// `stride` elements apart from `offset`: one region of a packed
    /// `[1, C, 1, S]` input. A device that must lock its buffer to write
    /// locks it once for all rows (the references lock once per buffer:
    /// maderix/ANE training/training_dynamic/io.h:79-88 writes every
    /// channel of a dynamic-weight input between one IOSurfaceLock and
    /// IOSurfaceUnlock).
    fn write_rows(
        &mut self,
        buf: &mut Self::Buffer,
        offset: usize,
        stride: usize,
        width: usize,
        data: &[f32],
    ) -> Result<()> {
        for (r, row) in data.chunks(width.max(1)).enumerate() {
            self.write(buf, offset + r * stride, row)?;
        }
        Ok(())
    }
    /// Loads fp16 values starting at `offset` elements into `out` as f32.
    fn read(&self, buf: &Self::Buffer, offset: usize, out: &mut [f32]) -> Result<()>;
    /// Evaluates `p` from `input` into `output`.
    fn eval(
        &mut self,
        p: &Self::Program,
        input: &Self::Buffer,
        output: &mut Self::Buffer,
    ) -> Result<()>;
    /// Programs compiled so far in this process (failed compiles included).
    fn compiles(&self) -> usize;
    /// The limits programs for this device are built to: its chip
    /// family's (see [`family`]).
    fn limits(&self) -> Limits;
}

/// What every device checks before compiling: the text parses and
/// type-checks, breaks none of the enabled ANE rules, and its `main` takes
/// exactly one fp16 input and produces one or more fp16 outputs (the rules
/// `single-input`/`fp16-io` may be switched off, but a device still binds
/// one fp16 input buffer). Several outputs land one after another, in the
/// program's (name) order, in one output buffer.
pub fn check_program(text: &str, rules: &RuleSet) -> Result<mil::Program> {
    let p = mil::parse_and_validate(text).map_err(|e| DeviceError(format!("MIL rejected: {e}")))?;
    let broken = rules::check(&p, rules);
    if let Some(b) = broken.first() {
        return Err(DeviceError(format!(
            "MIL breaks ANE rule {b} ({} finding(s) in all)",
            broken.len()
        )));
    }
    let f = p
        .main()
        .ok_or_else(|| DeviceError("the program has no main function".into()))?;
    let outs: Vec<&mil::Ty> = f.outputs.iter().filter_map(|o| f.var_type(o)).collect();
    if f.inputs.len() != 1
        || outs.is_empty()
        || f.inputs[0].ty.dtype != DType::Fp16
        || outs.iter().any(|o| o.dtype != DType::Fp16)
    {
        return Err(DeviceError(
            "a device program needs exactly one fp16 input and fp16 outputs".into(),
        ));
    }
    Ok(p)
}

/// Refuses a compile beyond the per-process budget.
pub fn check_budget(compiles: usize, budget: usize) -> Result<()> {
    if compiles >= budget {
        return Err(DeviceError(format!(
            "compile budget exhausted: {compiles} programs compiled (the ANE compiler fails after about {budget} per process); \
             reuse compiled kernels instead of recompiling"
        )));
    }
    Ok(())
}

/// Elements of `main`'s input and of all its outputs together, of a
/// program [`check_program`] accepted.
pub fn io_elems(p: &mil::Program) -> (usize, usize) {
    let (input, outputs) = io_parts(p);
    (input, outputs.iter().sum())
}

/// Elements of `main`'s input and of each output, in order.
pub fn io_parts(p: &mil::Program) -> (usize, Vec<usize>) {
    let f = p.main().expect("checked programs have main");
    let outs = f
        .outputs
        .iter()
        .map(|o| f.var_type(o).expect("checked outputs have types").elems())
        .collect();
    (f.inputs[0].ty.elems(), outs)
}

/// The real compiler reportedly stops working after about 119 in-process
/// compiles; the simulator enforces the same budget by default so code that
/// would exhaust it fails here first.
pub const DEFAULT_COMPILE_BUDGET: usize = 119;

/// The Neural Engine simulated by the `mil` interpreter in fp16 mode.
pub struct SimDevice {
    rules: RuleSet,
    budget: usize,
    compiles: usize,
    precision: Precision,
    faults: ChipFaults,
    family: Option<Family>,
    limits: Limits,
}

/// The numeric faults of a chip, as published measurements describe them
/// (see [`family::Limits`] for the sources), applied by the simulator to
/// every op's result before fp16 rounding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChipFaults {
    /// A `slice_by_size` whose last-axis begin is nonzero turns every
    /// value above this magnitude into ±inf (M1–M3).
    pub width_slice_clamp: Option<f32>,
    /// A matmul result above this magnitude becomes ±inf (every measured chip).
    pub matmul_cliff: Option<f32>,
}

impl ChipFaults {
    /// The faults of a family's limits.
    pub fn of(l: &Limits) -> ChipFaults {
        ChipFaults {
            width_slice_clamp: l.width_slice_clamp,
            matmul_cliff: l.matmul_cliff,
        }
    }
}

fn saturate(t: &mut Tensor, bound: f32) {
    if let mil::tensor::Data::F32(v) = &mut t.data {
        if v.iter().any(|x| x.abs() > bound) {
            for x in std::sync::Arc::make_mut(v) {
                if x.abs() > bound {
                    *x = f32::INFINITY.copysign(*x);
                }
            }
        }
    }
}

impl mil::interp::Faults for ChipFaults {
    fn after(&self, op: &str, args: &[(&'static str, Vec<&Tensor>)], result: &mut Tensor) {
        match op {
            "matmul" => {
                if let Some(c) = self.matmul_cliff {
                    saturate(result, c);
                }
            }
            "slice_by_size" => {
                let Some(c) = self.width_slice_clamp else {
                    return;
                };
                let begin = args
                    .iter()
                    .find(|(n, _)| *n == "begin")
                    .and_then(|(_, t)| t.first())
                    .and_then(|t| t.ints().ok());
                if begin.is_some_and(|b| b.last().is_some_and(|&w| w != 0)) {
                    saturate(result, c);
                }
            }
            _ => {}
        }
    }
}

/// A program compiled by [`SimDevice`].
pub struct SimProgram {
    exe: Executable,
    input_shape: Vec<usize>,
    input_elems: usize,
    output_elems: usize,
}

/// Host memory holding fp16 values.
pub struct SimBuffer(Vec<f16>);

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice::new()
    }
}

impl SimDevice {
    /// A simulator with the default ANE rules and compile budget, playing
    /// the matmul output cliff every measured chip has (see [`ChipFaults`])
    /// and no family's other faults.
    pub fn new() -> SimDevice {
        SimDevice {
            rules: RuleSet::default(),
            budget: DEFAULT_COMPILE_BUDGET,
            compiles: 0,
            precision: Precision::Fp16,
            faults: ChipFaults {
                width_slice_clamp: None,
                matmul_cliff: Some(family::MATMUL_CLIFF),
            },
            family: None,
            limits: Limits::default(),
        }
    }

    /// A simulator playing `family`: its rules and caps refuse programs at
    /// compile time as the chip is reported to, and its numeric faults
    /// ([`ChipFaults`]) apply at evaluation.
    pub fn for_family(family: Family) -> SimDevice {
        let mut l = family.limits();
        if let Ok(Some(n)) = family::max_dim_from_env() {
            l = l.with_max_dim(n);
        }
        SimDevice {
            family: Some(family),
            ..SimDevice::new()
        }
        .with_limits(l)
    }

    /// Plays a chip of limits `l`: its rules refuse programs at compile
    /// (`concat` too, where `l` says the compiler rejects it), its faults
    /// apply at evaluation, and kernels are built to `l`.
    pub fn with_limits(mut self, l: Limits) -> SimDevice {
        // The chip compiles a width-offset slice and computes it wrong:
        // the simulator plays the fault rather than refusing the program.
        let mut rules = RuleSet::for_limits(l);
        rules
            .set("width-offset-slice", false)
            .expect("a known rule");
        self.rules = rules;
        self.faults = ChipFaults::of(&l);
        self.limits = l;
        self
    }

    /// [`SimDevice::for_family`] for `ANETRAIN_SIM_FAMILY` when it is set;
    /// else [`SimDevice::new`] building kernels to the limits in force
    /// ([`family::Profile::in_force`]: `ANETRAIN_ANE_FAMILY`, a profile
    /// `doctor` saved, or the conservative row). An unusable variable is an
    /// error naming it.
    pub fn from_env() -> Result<SimDevice> {
        Ok(match family::sim_family_from_env()? {
            Some(f) => SimDevice::for_family(f),
            None => SimDevice {
                limits: family::Profile::in_force()?.limits,
                ..SimDevice::new()
            },
        })
    }

    /// The family this simulator plays, if any.
    pub fn family(&self) -> Option<Family> {
        self.family
    }

    /// Sets the numeric faults applied at evaluation.
    pub fn with_faults(mut self, faults: ChipFaults) -> SimDevice {
        self.faults = faults;
        self
    }

    /// Flushes fp16 subnormals to zero in every evaluation (inputs,
    /// constants, results), as a device without subnormal support would.
    pub fn with_flush_subnormals(mut self, flush: bool) -> SimDevice {
        self.precision = if flush {
            Precision::Fp16FlushSubnormals
        } else {
            Precision::Fp16
        };
        self
    }

    /// Sets which ANE constraint rules `compile` enforces.
    pub fn with_rules(mut self, rules: RuleSet) -> SimDevice {
        self.rules = rules;
        self
    }

    /// Sets the number of compiles allowed per process.
    pub fn with_compile_budget(mut self, budget: usize) -> SimDevice {
        self.budget = budget;
        self
    }
}

impl Device for SimDevice {
    type Program = SimProgram;
    type Buffer = SimBuffer;

    fn name(&self) -> &'static str {
        "ane-sim"
    }

    fn compile(&mut self, text: &str, blobs: &[(String, Vec<u8>)]) -> Result<SimProgram> {
        check_budget(self.compiles, self.budget)?;
        // A failed compile counts too: the budget is of calls to the
        // compiler (Orion docs/ane_constraints.md §5 counts ANECCompile()).
        self.compiles += 1;
        let p = check_program(text, &self.rules)?;
        let f = p
            .main()
            .ok_or_else(|| DeviceError("the program has no main function".into()))?;
        let exe = Executable::with_blobs(f, blobs).map_err(|e| DeviceError(e.to_string()))?;
        let ins = exe.input_types();
        let outs = exe.output_types();
        let output_elems = outs.iter().map(|(_, t)| t.elems()).sum();
        Ok(SimProgram {
            input_shape: ins[0].1.dims().to_vec(),
            input_elems: ins[0].1.elems(),
            output_elems,
            exe,
        })
    }

    fn io_elems(&self, p: &SimProgram) -> (usize, usize) {
        (p.input_elems, p.output_elems)
    }

    fn buffer(&mut self, elems: usize) -> Result<SimBuffer> {
        Ok(SimBuffer(vec![f16::ZERO; elems]))
    }

    fn write(&mut self, buf: &mut SimBuffer, offset: usize, data: &[f32]) -> Result<()> {
        let len = buf.0.len();
        let dst = offset
            .checked_add(data.len())
            .and_then(|end| buf.0.get_mut(offset..end))
            .ok_or_else(|| {
                DeviceError(format!(
                    "write of {} values at {offset} overruns a buffer of {len}",
                    data.len()
                ))
            })?;
        dst.convert_from_f32_slice(data);
        Ok(())
    }

    fn read(&self, buf: &SimBuffer, offset: usize, out: &mut [f32]) -> Result<()> {
        let src = offset
            .checked_add(out.len())
            .and_then(|end| buf.0.get(offset..end))
            .ok_or_else(|| {
                DeviceError(format!(
                    "read of {} values at {offset} overruns a buffer of {}",
                    out.len(),
                    buf.0.len()
                ))
            })?;
        src.convert_to_f32_slice(out);
        Ok(())
    }

    fn eval(&mut self, p: &SimProgram, input: &SimBuffer, output: &mut SimBuffer) -> Result<()> {
        if input.0.len() != p.input_elems || output.0.len() != p.output_elems {
            return Err(DeviceError(format!(
                "buffers of {} and {} elements given to a program taking {} and producing {}",
                input.0.len(),
                output.0.len(),
                p.input_elems,
                p.output_elems
            )));
        }
        let mut xs = vec![0f32; input.0.len()];
        input.0.convert_to_f32_slice(&mut xs);
        let x = Tensor::float(DType::Fp16, p.input_shape.clone(), xs);
        let out = p
            .exe
            .run_with_faults(vec![x], self.precision, Some(&self.faults))
            .map_err(|e| DeviceError(format!("evaluation failed: {e}")))?;
        // Several outputs one after another, in the program's order.
        let mut at = 0;
        for t in &out {
            let y = t.f32s().map_err(DeviceError)?;
            output.0[at..at + y.len()].convert_from_f32_slice(y);
            at += y.len();
        }
        Ok(())
    }

    fn compiles(&self) -> usize {
        self.compiles
    }

    /// The family's limits when the simulator plays one, else those it
    /// was made with ([`SimDevice::from_env`]).
    fn limits(&self) -> Limits {
        self.limits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOUBLE: &str = "program(1.3)\n{\n func main<ios18>(tensor<fp16, [1, 2, 1, 4]> x) {\n tensor<fp16, [1,2,1,4]> y = add(x=x,y=x)[name=string(\"y\")];\n } -> (y);\n}\n";

    /// The default rules without `min-surface` and `min-width`, for
    /// programs small enough to read.
    fn small_programs() -> RuleSet {
        let mut r = RuleSet::default();
        r.set("min-surface", false).unwrap();
        r.set("min-width", false).unwrap();
        r
    }

    fn compile_err(d: &mut SimDevice, text: &str) -> DeviceError {
        match d.compile(text, &[]) {
            Ok(_) => panic!("compile should fail"),
            Err(e) => e,
        }
    }

    #[test]
    fn rows_land_a_stride_apart() {
        let mut d = SimDevice::new();
        let mut b = d.buffer(12).unwrap();
        d.write_rows(&mut b, 1, 4, 2, &[1., 2., 3., 4., 5., 6.])
            .unwrap();
        let mut out = vec![0f32; 12];
        d.read(&b, 0, &mut out).unwrap();
        assert_eq!(out, [0., 1., 2., 0., 0., 3., 4., 0., 0., 5., 6., 0.]);
        assert!(d.write_rows(&mut b, 1, 4, 2, &[0.; 8]).is_err());
    }

    #[test]
    fn compiles_evaluates_and_counts() {
        let mut d = SimDevice::new()
            .with_rules(small_programs())
            .with_compile_budget(2);
        let p = d.compile(DOUBLE, &[]).unwrap();
        assert_eq!(d.io_elems(&p), (8, 8));
        let mut x = d.buffer(8).unwrap();
        let mut y = d.buffer(8).unwrap();
        d.write(&mut x, 0, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.1])
            .unwrap();
        d.eval(&p, &x, &mut y).unwrap();
        let mut out = [0f32; 8];
        d.read(&y, 0, &mut out).unwrap();
        assert_eq!(out[..7], [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]);
        assert!((out[7] - 0.2).abs() < 1e-3);
        d.compile(DOUBLE, &[]).unwrap();
        let e = compile_err(&mut d, DOUBLE);
        assert!(e.0.contains("compile budget"), "{e}");
        assert!(d.write(&mut x, 7, &[1.0, 2.0]).is_err());
        let mut small = d.buffer(4).unwrap();
        assert!(d.eval(&p, &x, &mut small).is_err());
    }

    #[test]
    fn enforces_enabled_rules() {
        let two_inputs = DOUBLE.replace(
            "(tensor<fp16, [1, 2, 1, 4]> x)",
            "(tensor<fp16, [1, 2, 1, 4]> x, tensor<fp16, [1, 2, 1, 4]> z)",
        );
        let e = compile_err(
            &mut SimDevice::new().with_rules(small_programs()),
            &two_inputs,
        );
        assert!(e.0.contains("single-input"), "{e}");
        let e = compile_err(&mut SimDevice::new(), DOUBLE);
        assert!(e.0.contains("min-width"), "{e}");
        let mut r = small_programs();
        r.set("min-surface", true).unwrap();
        let e = compile_err(&mut SimDevice::new().with_rules(r), DOUBLE);
        assert!(e.0.contains("min-surface"), "{e}");
    }
}
