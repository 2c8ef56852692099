//! anetrain: training Llama and Qwen3 models on the Apple Neural Engine.
//!
//! Data flows one way: [`config`] → [`kernels`] (MIL + layout + CPU twin)
//! → [`engine`] → trainer. [`model`] holds parameters and Hugging Face I/O.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod choice;
pub mod config;
pub mod convert;
pub mod corpus;
pub mod data;
pub mod engine;
pub mod fsutil;
pub mod generate;
pub mod grads;
pub mod kernels;
pub mod lora;
pub mod mem;
pub mod model;
pub mod optim;
pub mod params;
pub mod rng;
pub mod runner;
mod simd;
pub mod tensor_file;
pub mod tokenizer;
pub mod train;
