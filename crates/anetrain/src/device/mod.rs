//! Who runs the kernels: [`KernelRunner`], with the CPU twins
//! ([`CpuKernels`]) or the MIL programs on a Neural Engine device
//! ([`NeuralKernels`]), and the choice between them ([`backend`]).

pub mod backend;
mod runner;

pub use runner::*;
