//! Typed construction of MIL functions. Every op added is type-checked at
//! once through the op table, so a generator bug surfaces as an error naming
//! the op, the argument and the shapes — before any text is printed.
//!
//! ```
//! use mil::{builder::FunctionBuilder, DType, Ty};
//! let mut b = FunctionBuilder::new("main", "ios18");
//! let x = b.input("x", Ty::tensor(DType::Fp16, [1, 4, 1, 8]));
//! let y = b.sigmoid("y", &x).unwrap();
//! b.output(&y);
//! let f = b.finish().unwrap();
//! assert_eq!(f.ops.len(), 1);
//! ```

use std::collections::HashMap;

use crate::error::{MilError, Result};
use crate::ir::{Arg, ConstData, ConstVal, Function, Operation, Span, Var};
use crate::types::{DType, Ty};
use crate::validate::{check_const_val, infer_op, VarInfo};

/// Handle to a value in the function being built.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub name: String,
    pub ty: Ty,
}

impl Value {
    pub fn dims(&self) -> &[usize] {
        self.ty.dims()
    }
}

/// An argument: one value or a tuple of values.
pub enum ArgRef<'a> {
    One(&'a Value),
    Many(Vec<&'a Value>),
}

impl<'a> From<&'a Value> for ArgRef<'a> {
    fn from(v: &'a Value) -> Self {
        ArgRef::One(v)
    }
}

pub struct FunctionBuilder {
    f: Function,
    /// name -> index of the defining op (None for inputs)
    defs: HashMap<String, Option<usize>>,
}

impl FunctionBuilder {
    pub fn new(name: &str, opset: &str) -> FunctionBuilder {
        FunctionBuilder {
            f: Function {
                name: name.into(),
                opset: opset.into(),
                inputs: vec![],
                ops: vec![],
                outputs: vec![],
            },
            defs: HashMap::new(),
        }
    }

    pub fn input(&mut self, name: &str, ty: Ty) -> Value {
        self.f.inputs.push(Var {
            name: name.into(),
            ty: ty.clone(),
        });
        self.defs.insert(name.into(), None);
        Value {
            name: name.into(),
            ty,
        }
    }

    fn info(&self, name: &str) -> Option<VarInfo<'_>> {
        match self.defs.get(name)? {
            None => self
                .f
                .inputs
                .iter()
                .find(|v| v.name == name)
                .map(|v| VarInfo {
                    ty: &v.ty,
                    konst: None,
                }),
            Some(i) => {
                let op = &self.f.ops[*i];
                Some(VarInfo {
                    ty: &op.output.ty,
                    konst: op.val.as_ref().filter(|_| op.op == "const"),
                })
            }
        }
    }

    /// A constant. Re-declaring a name with an identical value returns the
    /// existing one, so shared constants (`perm`, `false`) are written once.
    pub fn constant(&mut self, name: &str, val: ConstVal) -> Result<Value> {
        if let Some(Some(i)) = self.defs.get(name) {
            let op = &self.f.ops[*i];
            if op.op == "const" && op.val.as_ref() == Some(&val) {
                return Ok(Value {
                    name: name.into(),
                    ty: op.output.ty.clone(),
                });
            }
        }
        if self.defs.contains_key(name) {
            return Err(MilError::new(format!(
                "const '{name}': the name is already defined"
            )));
        }
        check_const_val(&val).map_err(|e| MilError::new(format!("const '{name}': {e}")))?;
        let ty = val.ty.clone();
        self.push(Operation {
            op: "const".into(),
            output: Var {
                name: name.into(),
                ty: ty.clone(),
            },
            args: vec![],
            name: name.into(),
            val: Some(val),
            span: Span::default(),
        });
        Ok(Value {
            name: name.into(),
            ty,
        })
    }

    /// `tensor<int32, [n]>([...])`
    pub fn ints(&mut self, name: &str, v: &[i64]) -> Result<Value> {
        self.constant(name, ConstVal::ints(v))
    }

    /// `int32(v)`
    pub fn int(&mut self, name: &str, v: i64) -> Result<Value> {
        self.constant(
            name,
            ConstVal {
                ty: Ty::scalar(DType::Int32),
                data: ConstData::Ints(vec![v]),
            },
        )
    }

    /// `bool(v)`
    pub fn bool(&mut self, name: &str, v: bool) -> Result<Value> {
        self.constant(
            name,
            ConstVal {
                ty: Ty::scalar(DType::Bool),
                data: ConstData::Bools(vec![v]),
            },
        )
    }

    /// A float scalar of `dtype`, e.g. `fp16(0.5)`.
    pub fn float(&mut self, name: &str, dtype: DType, v: f64) -> Result<Value> {
        self.constant(
            name,
            ConstVal {
                ty: Ty::scalar(dtype),
                data: ConstData::Floats(vec![v]),
            },
        )
    }

    /// `string("...")`
    pub fn string(&mut self, name: &str, s: &str) -> Result<Value> {
        self.constant(
            name,
            ConstVal {
                ty: Ty::scalar(DType::Str),
                data: ConstData::Str(s.into()),
            },
        )
    }

    /// A BLOBFILE constant `@model_path/weights/{file}` at the standard offset.
    pub fn blob(&mut self, name: &str, ty: Ty, file: &str) -> Result<Value> {
        self.constant(
            name,
            ConstVal {
                ty,
                data: ConstData::Blob {
                    path: format!("{}{file}", crate::blob::PATH_PREFIX),
                    offset: crate::blob::CHUNK_OFFSET,
                },
            },
        )
    }

    fn push(&mut self, op: Operation) {
        self.defs
            .insert(op.output.name.clone(), Some(self.f.ops.len()));
        self.f.ops.push(op);
    }

    /// Adds `out = op(args)`, inferring and checking the result type.
    /// Arguments are given in print order.
    pub fn op(&mut self, op: &str, out: &str, args: &[(&str, ArgRef)]) -> Result<Value> {
        let err = |m: String| MilError::new(format!("{op} '{out}': {m}"));
        if self.defs.contains_key(out) {
            return Err(err(format!("'{out}' is already defined")));
        }
        let args: Vec<(String, Arg)> = args
            .iter()
            .map(|(k, a)| {
                let a = match a {
                    ArgRef::One(v) => Arg::Var(v.name.clone()),
                    ArgRef::Many(vs) => Arg::Tuple(vs.iter().map(|v| v.name.clone()).collect()),
                };
                (k.to_string(), a)
            })
            .collect();
        let ty = infer_op(op, &args, &|n| self.info(n)).map_err(err)?;
        self.push(Operation {
            op: op.into(),
            output: Var {
                name: out.into(),
                ty: ty.clone(),
            },
            args,
            name: out.into(),
            val: None,
            span: Span::default(),
        });
        Ok(Value {
            name: out.into(),
            ty,
        })
    }

    pub fn output(&mut self, v: &Value) {
        self.f.outputs.push(v.name.clone());
    }

    /// The finished function, validated as a whole.
    pub fn finish(self) -> Result<Function> {
        crate::validate::validate_function(&self.f)?;
        Ok(self.f)
    }

    // ----- typed helpers: one per op, arguments in the dialect's order -----

    pub fn slice_by_size(
        &mut self,
        out: &str,
        x: &Value,
        begin: &Value,
        size: &Value,
    ) -> Result<Value> {
        self.op(
            "slice_by_size",
            out,
            &[
                ("x", x.into()),
                ("begin", begin.into()),
                ("size", size.into()),
            ],
        )
    }

    pub fn reshape(&mut self, out: &str, x: &Value, shape: &Value) -> Result<Value> {
        self.op("reshape", out, &[("shape", shape.into()), ("x", x.into())])
    }

    pub fn transpose(&mut self, out: &str, x: &Value, perm: &Value) -> Result<Value> {
        self.op("transpose", out, &[("perm", perm.into()), ("x", x.into())])
    }

    pub fn matmul(
        &mut self,
        out: &str,
        x: &Value,
        y: &Value,
        tx: &Value,
        ty: &Value,
    ) -> Result<Value> {
        self.op(
            "matmul",
            out,
            &[
                ("transpose_x", tx.into()),
                ("transpose_y", ty.into()),
                ("x", x.into()),
                ("y", y.into()),
            ],
        )
    }

    /// Any elementwise binary op (`add`, `sub`, `mul`, `real_div`, `pow`).
    pub fn binary(&mut self, op: &str, out: &str, x: &Value, y: &Value) -> Result<Value> {
        self.op(op, out, &[("x", x.into()), ("y", y.into())])
    }

    pub fn add(&mut self, out: &str, x: &Value, y: &Value) -> Result<Value> {
        self.binary("add", out, x, y)
    }

    pub fn sub(&mut self, out: &str, x: &Value, y: &Value) -> Result<Value> {
        self.binary("sub", out, x, y)
    }

    pub fn mul(&mut self, out: &str, x: &Value, y: &Value) -> Result<Value> {
        self.binary("mul", out, x, y)
    }

    pub fn real_div(&mut self, out: &str, x: &Value, y: &Value) -> Result<Value> {
        self.binary("real_div", out, x, y)
    }

    /// Any elementwise unary op (`sigmoid`, `sqrt`, `exp`, `silu`, `tanh`,
    /// `rsqrt`).
    pub fn unary(&mut self, op: &str, out: &str, x: &Value) -> Result<Value> {
        self.op(op, out, &[("x", x.into())])
    }

    pub fn sigmoid(&mut self, out: &str, x: &Value) -> Result<Value> {
        self.unary("sigmoid", out, x)
    }

    pub fn softmax(&mut self, out: &str, x: &Value, axis: &Value) -> Result<Value> {
        self.op("softmax", out, &[("axis", axis.into()), ("x", x.into())])
    }

    pub fn concat(
        &mut self,
        out: &str,
        values: &[&Value],
        axis: &Value,
        interleave: &Value,
    ) -> Result<Value> {
        self.op(
            "concat",
            out,
            &[
                ("axis", axis.into()),
                ("interleave", interleave.into()),
                ("values", ArgRef::Many(values.to_vec())),
            ],
        )
    }

    /// `reduce_sum`, `reduce_mean` or `reduce_max` over `axes`.
    pub fn reduce(
        &mut self,
        op: &str,
        out: &str,
        x: &Value,
        axes: &Value,
        keep_dims: &Value,
    ) -> Result<Value> {
        self.op(
            op,
            out,
            &[
                ("x", x.into()),
                ("axes", axes.into()),
                ("keep_dims", keep_dims.into()),
            ],
        )
    }

    pub fn tile(&mut self, out: &str, x: &Value, reps: &Value) -> Result<Value> {
        self.op("tile", out, &[("x", x.into()), ("reps", reps.into())])
    }

    pub fn cast(&mut self, out: &str, x: &Value, dtype: &Value) -> Result<Value> {
        self.op("cast", out, &[("dtype", dtype.into()), ("x", x.into())])
    }
}
