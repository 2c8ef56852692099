//! anetrain: training Llama and Qwen3 models on the Apple Neural Engine.
//!
//! Data flows one way: [`config`] → [`kernels`] (MIL + layout + CPU twin)
//! → engines → trainer.

pub mod config;
pub mod fsutil;
pub mod kernels;
pub mod rng;
