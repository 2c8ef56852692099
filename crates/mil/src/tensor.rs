//! Runtime values of the interpreter: a dtype, a shape and shared storage.
//! fp16 values are held in f32 storage; in fp16 mode the interpreter rounds
//! every fp16 result to the nearest representable half.

use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::types::{shape_str, DType, Ty};

#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Arc<Vec<f32>>),
    I32(Arc<Vec<i32>>),
    Bool(Arc<Vec<bool>>),
    Str(String),
}

/// A dense row-major tensor (scalars have an empty shape).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    /// A float tensor of dtype `dtype` (fp16 or fp32) from f32 values.
    pub fn float(dtype: DType, shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            dtype,
            shape,
            data: Data::F32(Arc::new(data)),
        }
    }

    pub fn int(shape: Vec<usize>, data: Vec<i32>) -> Tensor {
        Tensor {
            dtype: DType::Int32,
            shape,
            data: Data::I32(Arc::new(data)),
        }
    }

    pub fn bool(shape: Vec<usize>, data: Vec<bool>) -> Tensor {
        Tensor {
            dtype: DType::Bool,
            shape,
            data: Data::Bool(Arc::new(data)),
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ty(&self) -> Ty {
        Ty::tensor(self.dtype, self.shape.clone())
    }

    /// Float contents (fp16/fp32 tensors).
    pub fn f32s(&self) -> Result<&[f32], String> {
        match &self.data {
            Data::F32(v) => Ok(v),
            _ => Err(format!("expected a float tensor, got {}", self.dtype)),
        }
    }

    pub fn i32s(&self) -> Result<&[i32], String> {
        match &self.data {
            Data::I32(v) => Ok(v),
            _ => Err(format!("expected an int32 tensor, got {}", self.dtype)),
        }
    }

    pub fn bools(&self) -> Result<&[bool], String> {
        match &self.data {
            Data::Bool(v) => Ok(v),
            _ => Err(format!("expected a bool tensor, got {}", self.dtype)),
        }
    }

    /// Integer contents widened to i64 (for shape-like arguments).
    pub fn ints(&self) -> Result<Vec<i64>, String> {
        Ok(self.i32s()?.iter().map(|&v| v as i64).collect())
    }

    pub fn scalar_bool(&self) -> Result<bool, String> {
        match self.bools()? {
            [b] => Ok(*b),
            _ => Err("expected a single bool".into()),
        }
    }

    pub fn as_str(&self) -> Result<&str, String> {
        match &self.data {
            Data::Str(s) => Ok(s),
            _ => Err(format!("expected a string, got {}", self.dtype)),
        }
    }

    /// The same storage viewed with another shape of the same element count.
    pub fn reshaped(&self, shape: Vec<usize>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), self.len());
        Tensor {
            dtype: self.dtype,
            shape,
            data: self.data.clone(),
        }
    }

    /// Rounds fp16 contents to representable halves (no-op for other dtypes).
    pub fn round_fp16(self) -> Tensor {
        if self.dtype != DType::Fp16 {
            return self;
        }
        match self.data {
            Data::F32(v) => {
                let mut v = Arc::try_unwrap(v).unwrap_or_else(|a| (*a).clone());
                round_to_f16_in_place(&mut v);
                Tensor {
                    data: Data::F32(Arc::new(v)),
                    ..self
                }
            }
            _ => self,
        }
    }

    /// Flushes fp16 values below 2⁻¹⁴ in magnitude to a zero of their sign
    /// (no-op for other dtypes).
    pub fn flush_fp16_subnormals(self) -> Tensor {
        const MIN_NORMAL: f32 = 6.103_515_6e-5;
        if self.dtype != DType::Fp16 {
            return self;
        }
        match self.data {
            Data::F32(v) if v.iter().any(|x| *x != 0.0 && x.abs() < MIN_NORMAL) => {
                let mut v = Arc::try_unwrap(v).unwrap_or_else(|a| (*a).clone());
                for x in v.iter_mut().filter(|x| x.abs() < MIN_NORMAL) {
                    *x = 0.0f32.copysign(*x);
                }
                Tensor {
                    data: Data::F32(Arc::new(v)),
                    ..self
                }
            }
            _ => self,
        }
    }

    /// Checks that this value has type `ty` (dtype and dims).
    pub fn check_type(&self, ty: &Ty, what: &str) -> Result<(), String> {
        if self.dtype != ty.dtype || self.shape != ty.dims() {
            return Err(format!(
                "{what}: expected {} {}, got {} {}",
                ty.dtype,
                shape_str(ty.dims()),
                self.dtype,
                shape_str(&self.shape)
            ));
        }
        Ok(())
    }
}

/// Rounds every value to the nearest fp16 (ties to even; overflow to ±inf).
pub fn round_to_f16_in_place(v: &mut [f32]) {
    const CHUNK: usize = 4096;
    let mut tmp = [f16::ZERO; CHUNK];
    for chunk in v.chunks_mut(CHUNK) {
        let t = &mut tmp[..chunk.len()];
        t.convert_from_f32_slice(chunk);
        t.convert_to_f32_slice(chunk);
    }
}

/// Rounds one value to the nearest fp16.
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}
