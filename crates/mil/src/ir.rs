//! The program representation shared by the builder, printer, parser,
//! validator and interpreter. Plain data: every statement keeps what the text
//! says (argument order, the `name=string(...)` attribute, literal values), so
//! `parse(print(p)) == p`.

use crate::types::{DType, Ty};

/// A whole `program(1.3)` with its `buildInfo` dictionary.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub version: String,
    pub build_info: Vec<(String, String)>,
    pub functions: Vec<Function>,
}

/// The `buildInfo` the ANE compiler expects (the values coremltools 9 writes).
pub fn default_build_info() -> Vec<(String, String)> {
    [
        ("coremlc-component-MIL", "3510.2.1"),
        ("coremlc-version", "3505.4.1"),
        ("coremltools-component-milinternal", ""),
        ("coremltools-version", "9.0"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

impl Program {
    /// A `program(1.3)` with the default build info holding `functions`.
    pub fn new(functions: Vec<Function>) -> Program {
        Program {
            version: "1.3".into(),
            build_info: default_build_info(),
            functions,
        }
    }

    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// The function named `main`, or the only function.
    pub fn main(&self) -> Option<&Function> {
        self.function("main").or(if self.functions.len() == 1 {
            self.functions.first()
        } else {
            None
        })
    }
}

/// A named, typed SSA value.
#[derive(Clone, Debug, PartialEq)]
pub struct Var {
    pub name: String,
    pub ty: Ty,
}

/// `func NAME<OPSET>(inputs) { ops } -> (outputs);`
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub opset: String,
    pub inputs: Vec<Var>,
    pub ops: Vec<Operation>,
    pub outputs: Vec<String>,
}

impl Function {
    /// The type of a variable visible in this function (an input or the
    /// result of an operation).
    pub fn var_type(&self, name: &str) -> Option<&Ty> {
        self.inputs
            .iter()
            .find(|v| v.name == name)
            .map(|v| &v.ty)
            .or_else(|| {
                self.ops
                    .iter()
                    .find(|o| o.output.name == name)
                    .map(|o| &o.output.ty)
            })
    }

    /// FLOPs of the function's matrix products, `2·M·N·K` per output
    /// (batched `matmul`s; elementwise work is not counted). `K` is the
    /// dimension of `x` that is not the output's `M` (either, when equal).
    pub fn matmul_flops(&self) -> f64 {
        self.ops
            .iter()
            .filter(|o| o.op == "matmul")
            .filter_map(|o| {
                let out = o.output.ty.dims();
                let Some(Arg::Var(x)) = o.arg("x") else {
                    return None;
                };
                let xd = self.var_type(x)?.dims();
                let (m, r) = (out[out.len().checked_sub(2)?], xd.len());
                let k = if xd[r.checked_sub(2)?] == m {
                    xd[r - 1]
                } else {
                    xd[r - 2]
                };
                Some(2.0 * out.iter().product::<usize>() as f64 * k as f64)
            })
            .sum()
    }

    pub fn output_types(&self) -> Vec<Ty> {
        self.outputs
            .iter()
            .filter_map(|n| self.var_type(n).cloned())
            .collect()
    }
}

/// An operation argument: a variable, or a tuple of variables (`values=(a,b)`).
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    Var(String),
    Tuple(Vec<String>),
}

/// Source position of a statement (1-based). Positions never take part in
/// equality: a printed-then-parsed program equals the original.
#[derive(Clone, Copy, Debug, Default)]
pub struct Span {
    pub line: usize,
    pub col: usize,
}

impl PartialEq for Span {
    fn eq(&self, _: &Span) -> bool {
        true
    }
}

/// `TYPE OUT = OP(arg=value, ...)[name=string("..."), val=...];`
#[derive(Clone, Debug, PartialEq)]
pub struct Operation {
    pub op: String,
    pub output: Var,
    pub args: Vec<(String, Arg)>,
    /// The `name=string(...)` attribute; may differ from the variable name.
    pub name: String,
    /// The `val=...` attribute of a `const`.
    pub val: Option<ConstVal>,
    pub span: Span,
}

impl Operation {
    pub fn arg(&self, name: &str) -> Option<&Arg> {
        self.args.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    /// Where this statement is, for error messages: `line 12:2 (op 'mm1')`.
    pub fn locate(&self) -> String {
        if self.span.line > 0 {
            format!(
                "line {}:{}: {} '{}'",
                self.span.line, self.span.col, self.op, self.output.name
            )
        } else {
            format!("{} '{}'", self.op, self.output.name)
        }
    }
}

/// A constant: its written type and its payload.
#[derive(Clone, Debug, PartialEq)]
pub struct ConstVal {
    pub ty: Ty,
    pub data: ConstData,
}

/// Literal payloads. Floats keep the written value in f64 (rounded to the
/// dtype only when evaluated), so the text round-trips exactly.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstData {
    Floats(Vec<f64>),
    Ints(Vec<i64>),
    Bools(Vec<bool>),
    Str(String),
    /// `BLOBFILE(path=string("@model_path/weights/x.bin"), offset=uint64(64))`
    Blob {
        path: String,
        offset: u64,
    },
}

impl ConstVal {
    pub fn ints(values: &[i64]) -> ConstVal {
        ConstVal {
            ty: Ty::tensor(DType::Int32, [values.len()]),
            data: ConstData::Ints(values.to_vec()),
        }
    }

    /// Number of elements a non-blob literal holds.
    pub fn literal_len(&self) -> Option<usize> {
        match &self.data {
            ConstData::Floats(v) => Some(v.len()),
            ConstData::Ints(v) => Some(v.len()),
            ConstData::Bools(v) => Some(v.len()),
            ConstData::Str(_) => Some(1),
            ConstData::Blob { .. } => None,
        }
    }

    /// Integer contents, if this is an integer literal.
    pub fn as_ints(&self) -> Option<&[i64]> {
        match &self.data {
            ConstData::Ints(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match &self.data {
            ConstData::Bools(v) if v.len() == 1 => Some(v[0]),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match &self.data {
            ConstData::Str(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn matmul_flops_count_every_product_and_its_transposes() {
        // [2, 3, 4]·[2, 4, 5] and xᵀ·y with x [2, 4, 3]: 2·(2·3·5)·4 each.
        let text = "program(1.3)\n{\n func main<ios18>(tensor<fp16, [2, 3, 4]> a, tensor<fp16, [2, 4, 5]> b, tensor<fp16, [2, 4, 3]> c) {\n \
             bool f = const()[name=string(\"f\"), val=bool(false)];\n \
             bool t = const()[name=string(\"t\"), val=bool(true)];\n \
             tensor<fp16, [2, 3, 5]> y = matmul(x=a, y=b, transpose_x=f, transpose_y=f)[name=string(\"y\")];\n \
             tensor<fp16, [2, 3, 5]> z = matmul(x=c, y=b, transpose_x=t, transpose_y=f)[name=string(\"z\")];\n \
             } -> (y, z);\n}\n";
        let p = crate::parse_and_validate(text).unwrap();
        assert_eq!(p.functions[0].matmul_flops(), 2.0 * 240.0);
    }
}
