//! # mil
//!
//! The MIL dialect the Apple Neural Engine compiler is fed (`program(1.3)`,
//! `func main<ios18>`), as plain data:
//!
//! * [`types`] and [`ir`]: dtypes, static tensor types, SSA statements;
//! * [`ops`]: one definition per op — inputs, type inference, evaluation;
//! * [`builder`]: typed construction, every op checked as it is added;
//! * [`printer`] / [`parser`]: the exact text form, `parse(print(p)) == p`;
//! * [`validate`]: whole-program type checking with line:column errors;
//! * [`blob`]: BLOBFILE weight files and safe path resolution;
//! * [`interp`]: a reference interpreter in fp16 or fp32 mode;
//!
//! Matrix products go through the `linalg` crate.
//!
//! This crate knows nothing about models or training.

pub mod blob;
pub mod builder;
pub mod error;
pub mod interp;
pub mod ir;
pub mod ops;
pub mod parser;
pub mod printer;
pub mod tensor;
pub mod types;
pub mod validate;

pub use error::{MilError, Result};
pub use interp::{Executable, Precision};
pub use ir::{Function, Program};
pub use parser::{parse, parse_and_validate};
pub use printer::print;
pub use tensor::Tensor;
pub use types::{DType, Ty};
