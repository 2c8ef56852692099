//! Value types of the MIL dialect: element dtypes, and scalar or tensor types
//! with static shapes.

use std::fmt;

/// Element type of a MIL value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Fp16,
    Fp32,
    Int32,
    Bool,
    /// `string`: scalar only (e.g. `cast`'s `dtype` argument).
    Str,
}

impl DType {
    pub const ALL: [DType; 5] = [
        DType::Fp16,
        DType::Fp32,
        DType::Int32,
        DType::Bool,
        DType::Str,
    ];

    /// The dialect's spelling (`fp16`, `fp32`, `int32`, `bool`).
    pub fn name(self) -> &'static str {
        match self {
            DType::Fp16 => "fp16",
            DType::Fp32 => "fp32",
            DType::Int32 => "int32",
            DType::Bool => "bool",
            DType::Str => "string",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::Fp16 | DType::Fp32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Type of a value: a scalar (`fp16`) or a tensor with a static shape
/// (`tensor<fp16, [1,64,1,16]>`). A rank-0 tensor (`tensor<int32, []>`) is
/// distinct in the text but behaves like a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ty {
    pub dtype: DType,
    /// `None` for the scalar form.
    pub shape: Option<Vec<usize>>,
}

impl Ty {
    pub fn scalar(dtype: DType) -> Ty {
        Ty { dtype, shape: None }
    }

    pub fn tensor(dtype: DType, shape: impl Into<Vec<usize>>) -> Ty {
        Ty {
            dtype,
            shape: Some(shape.into()),
        }
    }

    /// The dimensions; empty for scalars.
    pub fn dims(&self) -> &[usize] {
        self.shape.as_deref().unwrap_or(&[])
    }

    pub fn rank(&self) -> usize {
        self.dims().len()
    }

    pub fn elems(&self) -> usize {
        self.dims().iter().product()
    }

    /// Same dtype and dims, ignoring scalar-versus-rank-0 spelling.
    pub fn same_as(&self, other: &Ty) -> bool {
        self.dtype == other.dtype && self.dims() == other.dims()
    }

    /// Writes the type with `sep` between dimensions (the dialect uses
    /// `", "` in function signatures and `","` in statements).
    pub fn write(&self, out: &mut String, sep: &str) {
        match &self.shape {
            None => out.push_str(self.dtype.name()),
            Some(dims) => {
                out.push_str("tensor<");
                out.push_str(self.dtype.name());
                out.push_str(", [");
                for (i, d) in dims.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    out.push_str(&d.to_string());
                }
                out.push_str("]>");
            }
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        self.write(&mut s, ",");
        f.write_str(&s)
    }
}

/// Formats a shape as `[a, b, c]` for error messages.
pub fn shape_str(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}
