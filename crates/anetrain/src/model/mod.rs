//! The model as data: its configuration, parameters in Hugging Face names
//! and shapes, LoRA adapters, and Hugging Face directories on disk.

pub mod adapter_base;
pub mod config;
pub mod dtype;
pub mod generation;
pub mod hf_config;
pub mod hub;
pub mod layer;
pub mod lora;
pub mod params;
pub mod quant;
pub mod source;
pub mod tensor_file;
mod weights;

pub use hf_config::hf_config_json;
pub use weights::*;
