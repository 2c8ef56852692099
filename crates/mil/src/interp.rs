//! Reference interpreter. An [`Executable`] is a validated function with its
//! constants (literal and BLOBFILE) materialised once; `run` evaluates it
//! in fp16 mode (inputs and every fp16 result rounded to the nearest half,
//! matmuls and reductions accumulated in f32 — what the ANE computes) or
//! fp32 mode (no rounding of inputs or results). Matrix products sum in
//! the order of their inner dimension (`linalg::matmul_in_order`), so a
//! run gives the same bits on every CPU and whatever backend the host's
//! own products use, and a row of a product does not depend on how many
//! other rows the program holds.
//!
//! In both modes a constant holds a value of its declared dtype: the literal
//! `fp16(0.176777)` *is* the half 0.17676. (This is also how the reference
//! corpus computes its unrounded outputs.)

use std::collections::HashMap;
use std::path::Path;

use crate::blob;
use crate::error::{MilError, Result};
use crate::ir::{Arg, ConstData, ConstVal, Function, Program};
use crate::ops::{self, EvalArgs, OpDef};
use crate::tensor::Tensor;
use crate::types::{shape_str, DType, Ty};

/// Numeric mode of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Every fp16-typed result (and input, and constant) rounded to fp16.
    Fp16,
    /// As `Fp16`, and every fp16 value smaller in magnitude than 2⁻¹⁴ —
    /// inputs, constants and results — flushed to a zero of its sign, as a
    /// device without fp16 subnormals would (whether the ANE keeps them is
    /// not documented: programs must be right either way).
    Fp16FlushSubnormals,
    /// fp16-typed values kept in full f32 precision.
    Fp32,
}

impl Precision {
    /// Applies this mode to a value just loaded or computed.
    fn apply(self, t: Tensor) -> Tensor {
        match self {
            Precision::Fp16 => t.round_fp16(),
            Precision::Fp16FlushSubnormals => t.round_fp16().flush_fp16_subnormals(),
            Precision::Fp32 => t,
        }
    }
}

/// A device's departures from exact fp16 arithmetic, applied to each op's
/// result before it is rounded: the simulator plays a chip's documented
/// numeric faults through this (the `ane` crate says which).
pub trait Faults: Sync {
    /// May change `result`, the value op `op` computed from `args`
    /// (argument name, its tensors).
    fn after(&self, op: &str, args: &[(&'static str, Vec<&Tensor>)], result: &mut Tensor);
}

struct Step {
    def: &'static dyn OpDef,
    args: Vec<(&'static str, Vec<usize>)>,
    out: usize,
    ty: Ty,
    /// Slots whose last reader is this step.
    free: Vec<usize>,
    locate: String,
}

/// A function ready to run many times.
pub struct Executable {
    inputs: Vec<(String, Ty)>,
    outputs: Vec<(usize, Ty)>,
    output_names: Vec<String>,
    n_slots: usize,
    /// (slot, value at its declared dtype)
    consts: Vec<(usize, Tensor)>,
    steps: Vec<Step>,
}

/// Turns a constant into a tensor, reading BLOBFILE data from `weights`.
pub fn const_tensor(val: &ConstVal, weights: Option<&Path>, what: &str) -> Result<Tensor> {
    let shape = val.ty.dims().to_vec();
    Ok(match &val.data {
        ConstData::Floats(v) => {
            Tensor::float(val.ty.dtype, shape, v.iter().map(|&x| x as f32).collect())
        }
        ConstData::Ints(v) => Tensor::int(shape, v.iter().map(|&x| x as i32).collect()),
        ConstData::Bools(v) => Tensor::bool(shape, v.clone()),
        ConstData::Str(s) => Tensor {
            dtype: DType::Str,
            shape,
            data: crate::tensor::Data::Str(s.clone()),
        },
        ConstData::Blob { path, offset } => {
            let dir = weights.ok_or_else(|| {
                MilError::new(format!(
                    "{what} reads {path} but no weights directory was given (--weights DIR)"
                ))
            })?;
            let file = blob::resolve(dir, path)
                .map_err(|e| MilError::new(format!("{what}: {}", e.msg)))?;
            let bytes = std::fs::read(&file).map_err(|e| {
                MilError::new(format!("{what}: cannot read '{}': {e}", file.display()))
            })?;
            let data = blob::decode(
                &bytes,
                *offset,
                val.ty.elems(),
                &format!("{what}: '{}'", file.display()),
            )?;
            Tensor::float(val.ty.dtype, shape, data)
        }
    })
}

impl Executable {
    /// Validates `f` and loads its constants. `weights` is the directory
    /// `@model_path/weights/` refers to.
    pub fn new(f: &Function, weights: Option<&Path>) -> Result<Executable> {
        crate::validate::validate_function(f)?;
        let blobs = |val: &ConstVal, what: &str| const_tensor(val, weights, what);
        Self::build(f, &blobs)
    }

    /// Like [`Executable::new`], with BLOBFILE contents supplied in memory
    /// (`(path, file bytes)` pairs, paths as written in the program).
    pub fn with_blobs(f: &Function, files: &[(String, Vec<u8>)]) -> Result<Executable> {
        crate::validate::validate_function(f)?;
        let blobs = |val: &ConstVal, what: &str| match &val.data {
            ConstData::Blob { path, offset } => {
                let bytes = files
                    .iter()
                    .find(|(p, _)| p == path)
                    .map(|(_, b)| b)
                    .ok_or_else(|| MilError::new(format!("{what}: no blob supplied for {path}")))?;
                let data =
                    blob::decode(bytes, *offset, val.ty.elems(), &format!("{what}: {path}"))?;
                Ok(Tensor::float(val.ty.dtype, val.ty.dims().to_vec(), data))
            }
            _ => const_tensor(val, None, what),
        };
        Self::build(f, &blobs)
    }

    /// The `main` (or only) function of a program.
    pub fn from_program(p: &Program, weights: Option<&Path>) -> Result<Executable> {
        let f = p.main().ok_or_else(|| {
            MilError::new("the program has no 'main' function (and more than one function)")
        })?;
        Executable::new(f, weights)
    }

    fn build(
        f: &Function,
        blobs: &dyn Fn(&ConstVal, &str) -> Result<Tensor>,
    ) -> Result<Executable> {
        let mut slot_of: HashMap<&str, usize> = HashMap::new();
        for (i, v) in f.inputs.iter().enumerate() {
            slot_of.insert(&v.name, i);
        }
        let mut consts = Vec::new();
        let mut steps = Vec::new();
        let mut next = f.inputs.len();
        for op in &f.ops {
            let slot = next;
            next += 1;
            if op.op == "const" {
                let val = op
                    .val
                    .as_ref()
                    .ok_or_else(|| MilError::new("const without val"))?;
                let t = blobs(val, &op.locate())?;
                consts.push((slot, t.round_fp16()));
            } else {
                let def = ops::lookup(&op.op)
                    .ok_or_else(|| MilError::new(format!("unknown op {}", op.op)))?;
                let mut args = Vec::new();
                for spec in def.inputs() {
                    let slots = match op.arg(spec.name) {
                        None => vec![],
                        Some(Arg::Var(v)) => vec![slot_of[v.as_str()]],
                        Some(Arg::Tuple(vs)) => vs.iter().map(|v| slot_of[v.as_str()]).collect(),
                    };
                    args.push((spec.name, slots));
                }
                steps.push(Step {
                    def,
                    args,
                    out: slot,
                    ty: op.output.ty.clone(),
                    free: vec![],
                    locate: op.locate(),
                });
            }
            slot_of.insert(&op.output.name, slot);
        }
        let outputs: Vec<(usize, Ty)> = f
            .outputs
            .iter()
            .map(|o| {
                let ty = f
                    .var_type(o)
                    .cloned()
                    .unwrap_or_else(|| Ty::scalar(DType::Fp32));
                (slot_of[o.as_str()], ty)
            })
            .collect();
        // Free each computed value after its last reader (never outputs or consts).
        let mut last_use: HashMap<usize, usize> = HashMap::new();
        for (i, s) in steps.iter().enumerate() {
            for (_, slots) in &s.args {
                for &sl in slots {
                    last_use.insert(sl, i);
                }
            }
        }
        let keep: Vec<usize> = outputs
            .iter()
            .map(|(s, _)| *s)
            .chain(consts.iter().map(|c| c.0))
            .collect();
        for (sl, i) in last_use {
            if !keep.contains(&sl) {
                steps[i].free.push(sl);
            }
        }
        Ok(Executable {
            inputs: f
                .inputs
                .iter()
                .map(|v| (v.name.clone(), v.ty.clone()))
                .collect(),
            outputs,
            output_names: f.outputs.clone(),
            n_slots: next,
            consts,
            steps,
        })
    }

    pub fn input_types(&self) -> Vec<(String, Ty)> {
        self.inputs.clone()
    }

    pub fn output_types(&self) -> Vec<(String, Ty)> {
        self.output_names
            .iter()
            .cloned()
            .zip(self.outputs.iter().map(|(_, t)| t.clone()))
            .collect()
    }

    /// Evaluates the function. Float inputs may be given as fp16 or fp32
    /// tensors for an fp16 input; their shapes must match exactly.
    pub fn run(&self, inputs: Vec<Tensor>, precision: Precision) -> Result<Vec<Tensor>> {
        self.run_with_faults(inputs, precision, None)
    }

    /// [`Executable::run`] with `faults` applied to every op's result.
    pub fn run_with_faults(
        &self,
        inputs: Vec<Tensor>,
        precision: Precision,
        faults: Option<&dyn Faults>,
    ) -> Result<Vec<Tensor>> {
        if inputs.len() != self.inputs.len() {
            return Err(MilError::new(format!(
                "the function takes {} input(s), {} given",
                self.inputs.len(),
                inputs.len()
            )));
        }
        let mut slots: Vec<Option<Tensor>> = vec![None; self.n_slots];
        for (i, (t, (name, ty))) in inputs.into_iter().zip(&self.inputs).enumerate() {
            if t.shape != ty.dims() {
                return Err(MilError::new(format!(
                    "input '{name}' must have shape {}, got {}",
                    shape_str(ty.dims()),
                    shape_str(&t.shape)
                )));
            }
            let compatible = t.dtype == ty.dtype || (t.dtype.is_float() && ty.dtype.is_float());
            if !compatible {
                return Err(MilError::new(format!(
                    "input '{name}' must be {}, got {}",
                    ty.dtype, t.dtype
                )));
            }
            let t = Tensor {
                dtype: ty.dtype,
                ..t
            };
            slots[i] = Some(precision.apply(t));
        }
        for (slot, value) in &self.consts {
            slots[*slot] = Some(match precision {
                Precision::Fp16FlushSubnormals => value.clone().flush_fp16_subnormals(),
                _ => value.clone(),
            });
        }
        for step in &self.steps {
            let result = {
                let args: Vec<(&'static str, Vec<&Tensor>)> = step
                    .args
                    .iter()
                    .map(|(n, ss)| (*n, ss.iter().filter_map(|&s| slots[s].as_ref()).collect()))
                    .collect();
                let mut r = step
                    .def
                    .eval(&EvalArgs {
                        args: args.clone(),
                        out: &step.ty,
                    })
                    .map_err(|e| MilError::new(format!("{}: {e}", step.locate)))?;
                if let Some(f) = faults {
                    f.after(step.def.name(), &args, &mut r);
                }
                r
            };
            result
                .check_type(&step.ty, &step.locate)
                .map_err(MilError::new)?;
            slots[step.out] = Some(precision.apply(result));
            for &f in &step.free {
                slots[f] = None;
            }
        }
        self.outputs
            .iter()
            .map(|(s, _)| {
                slots[*s]
                    .clone()
                    .ok_or_else(|| MilError::new("an output was never computed"))
            })
            .collect()
    }
}
