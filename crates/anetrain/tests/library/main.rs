//! The library's tests, one module per subject, in one test binary (one
//! link of the library and its dependencies instead of one per file; one
//! harness spreads every test over the cores). `tests/hub.rs` stays a
//! binary of its own: it sets process environment variables.

mod common;

mod chat;
mod families;
mod kernels;
mod layout;
mod lora;
mod neural;
mod parity;
mod quantized;
mod standin;
mod tiling;
