//! Small helpers that know nothing of models: named choices, atomic
//! files, memory figures, the seeded generator and vectorised loops.

pub mod choice;
pub mod fsutil;
pub mod mem;
pub mod rng;
pub(crate) mod simd;
