//! Commands built on the library that nothing in it depends on: speed
//! benchmarks, the device doctor, llama2.c conversion, GGUF export and
//! MLX quantization.

pub mod bench;
pub mod convert;
pub mod doctor;
pub mod gguf;
pub mod quantize;
