//! anetrain: training Llama and Qwen3 models on the Apple Neural Engine.
//!
//! Data flows one way: [`config`] → [`kernels`] (one module per kernel:
//! layout + MIL + CPU twin) → [`runner`] (CPU twins, or the programs on a
//! Neural Engine device) → [`engine`] → [`train`], which reports
//! [`train::Event`]s and prints nothing. [`params`] and [`model`] hold the
//! parameters and their Hugging Face I/O, [`lora`] the adapters. The
//! command line is the `anetrain-cli` crate.

pub mod backend;
pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod choice;
pub mod config;
pub mod convert;
pub mod corpus;
pub mod data;
pub mod doctor;
pub mod engine;
pub mod fsutil;
pub mod generate;
pub mod gguf;
pub mod grads;
pub mod kernels;
pub mod lora;
pub mod mem;
pub mod memplan;
pub mod model;
pub mod optim;
pub mod params;
pub mod records;
pub mod rng;
pub mod runner;
mod simd;
pub mod tensor_file;
pub mod tokenizer;
pub mod train;
pub mod work;
