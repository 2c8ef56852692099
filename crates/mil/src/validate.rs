//! Type checking of whole functions: every argument resolves, matches its
//! op's declared input (domain, const-ness, tuple-ness), and every
//! statement's declared type equals the inferred one.

use std::collections::HashMap;

use crate::error::{MilError, Result};
use crate::ir::{Arg, ConstData, ConstVal, Function, Operation, Program};
use crate::ops::{self, InferArg, InferArgs};
use crate::types::{DType, Ty};

/// What the checker knows about a visible variable.
#[derive(Clone, Copy)]
pub struct VarInfo<'a> {
    pub ty: &'a Ty,
    pub konst: Option<&'a ConstVal>,
}

/// Infers the result type of `op_name(args)` given the visible variables.
/// Errors name the argument and the mismatch (the caller adds the op).
pub fn infer_op<'a>(
    op_name: &str,
    args: &[(String, Arg)],
    lookup: &dyn Fn(&str) -> Option<VarInfo<'a>>,
) -> std::result::Result<Ty, String> {
    let def = ops::lookup(op_name).ok_or_else(|| {
        format!(
            "unknown op '{op_name}' (supported: {})",
            ops::op_names().join(", ")
        )
    })?;
    let specs = def.inputs();
    for (name, _) in args {
        if !specs.iter().any(|s| s.name == name) {
            let names: Vec<&str> = specs.iter().map(|s| s.name).collect();
            return Err(format!(
                "unknown argument '{name}' ({op_name} takes {})",
                names.join(", ")
            ));
        }
        if args.iter().filter(|(n, _)| n == name).count() > 1 {
            return Err(format!("argument '{name}' is given twice"));
        }
    }
    let mut resolved = Vec::with_capacity(specs.len());
    for spec in specs {
        let arg = args.iter().find(|(n, _)| n == spec.name).map(|(_, a)| a);
        let Some(arg) = arg else {
            if spec.optional {
                resolved.push((spec.name, None));
                continue;
            }
            return Err(format!("argument '{}' is missing", spec.name));
        };
        let names: Vec<&String> = match (arg, spec.tuple) {
            (Arg::Var(v), false) => vec![v],
            (Arg::Tuple(vs), true) => vs.iter().collect(),
            (Arg::Var(_), true) => {
                return Err(format!(
                    "argument '{}' must be a tuple, e.g. {}=(a,b)",
                    spec.name, spec.name
                ))
            }
            (Arg::Tuple(_), false) => {
                return Err(format!(
                    "argument '{}' must be a single variable, not a tuple",
                    spec.name
                ))
            }
        };
        let mut tys = Vec::with_capacity(names.len());
        let mut konst = None;
        for n in names {
            let info = lookup(n).ok_or_else(|| {
                format!(
                    "argument '{}' refers to undefined variable '{n}'",
                    spec.name
                )
            })?;
            if !spec.domain.accepts(info.ty.dtype) {
                return Err(format!(
                    "argument '{}' ('{n}') must be {}, got {}",
                    spec.name,
                    spec.domain.describe(),
                    info.ty.dtype
                ));
            }
            if spec.konst && info.konst.is_none() {
                return Err(format!(
                    "argument '{}' ('{n}') must be a const, but '{n}' is computed",
                    spec.name
                ));
            }
            konst = info.konst;
            tys.push(info.ty);
        }
        resolved.push((spec.name, Some(InferArg { tys, konst })));
    }
    def.infer(&InferArgs { args: resolved })
}

/// Checks a `const` statement: its value's type equals the declared type and
/// holds the right number of elements of the right kind.
pub fn check_const(op: &Operation) -> std::result::Result<(), String> {
    if !op.args.is_empty() {
        return Err("const takes no arguments".into());
    }
    let val = op.val.as_ref().ok_or("const has no val=... attribute")?;
    if !val.ty.same_as(&op.output.ty) || val.ty.shape.is_some() != op.output.ty.shape.is_some() {
        return Err(format!(
            "declared type {} differs from val's type {}",
            op.output.ty, val.ty
        ));
    }
    check_const_val(val)
}

pub fn check_const_val(val: &ConstVal) -> std::result::Result<(), String> {
    let d = val.ty.dtype;
    let kind_ok = match &val.data {
        ConstData::Floats(_) => d.is_float(),
        ConstData::Ints(_) => d == DType::Int32,
        ConstData::Bools(_) => d == DType::Bool,
        ConstData::Str(_) => d == DType::Str && val.ty.shape.is_none(),
        ConstData::Blob { .. } => d.is_float() && val.ty.shape.is_some(),
    };
    if !kind_ok {
        return Err(format!("val does not hold {} data", val.ty));
    }
    if let Some(n) = val.literal_len() {
        if n != val.ty.elems() {
            return Err(format!(
                "val {} needs {} values, got {n}",
                val.ty,
                val.ty.elems()
            ));
        }
    }
    Ok(())
}

/// Type-checks every function of a program.
pub fn validate(p: &Program) -> Result<()> {
    if p.functions.is_empty() {
        return Err(MilError::new("program has no functions"));
    }
    for f in &p.functions {
        validate_function(f)?;
    }
    Ok(())
}

/// Type-checks one function; the first error is returned with its position.
pub fn validate_function(f: &Function) -> Result<()> {
    let mut env: HashMap<&str, VarInfo> = HashMap::new();
    for v in &f.inputs {
        if v.ty.dtype == DType::Str {
            return Err(MilError::new(format!(
                "function '{}': input '{}' cannot be a string",
                f.name, v.name
            )));
        }
        if env
            .insert(
                &v.name,
                VarInfo {
                    ty: &v.ty,
                    konst: None,
                },
            )
            .is_some()
        {
            return Err(MilError::new(format!(
                "function '{}': input '{}' is declared twice",
                f.name, v.name
            )));
        }
    }
    for op in &f.ops {
        let err = |m: String| {
            MilError::at(
                op.span.line,
                op.span.col,
                format!("{} '{}': {m}", op.op, op.output.name),
            )
        };
        if env.contains_key(op.output.name.as_str()) {
            return Err(err(format!("'{}' is already defined", op.output.name)));
        }
        if op.op == "const" {
            check_const(op).map_err(err)?;
        } else {
            if op.val.is_some() {
                return Err(err("only const takes a val=... attribute".into()));
            }
            let lookup = |n: &str| env.get(n).copied();
            let ty = infer_op(&op.op, &op.args, &lookup).map_err(err)?;
            if !ty.same_as(&op.output.ty) {
                return Err(err(format!(
                    "declared type {} but the op produces {ty}",
                    op.output.ty
                )));
            }
        }
        env.insert(
            &op.output.name,
            VarInfo {
                ty: &op.output.ty,
                konst: if op.op == "const" {
                    op.val.as_ref()
                } else {
                    None
                },
            },
        );
    }
    if f.outputs.is_empty() {
        return Err(MilError::new(format!(
            "function '{}' returns nothing",
            f.name
        )));
    }
    for o in &f.outputs {
        if !env.contains_key(o.as_str()) {
            return Err(MilError::new(format!(
                "function '{}' returns undefined variable '{o}'",
                f.name
            )));
        }
    }
    Ok(())
}
