//! Neural Engine devices. (The `Device` trait and its implementations are
//! built on the `mil` crate; see the project README for status.)

pub use mil;
