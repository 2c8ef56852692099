//! `wo_backward`: attention's output projection backward.

use super::prelude::*;
use super::projections_backward::projections_backward;

projections_backward! {
    /// `da [heads·HD, S] = Woᵀ·dy` (+ LoRA), `dy [D, S]`.
    WoBackward applies [O] to Acts { dy: Port::Dy } giving Out { da: Port::Da }
}
