//! `q_backward`: the query projection backward.

use super::prelude::*;
use super::projections_backward::projections_backward;

projections_backward! {
    /// `dx [D, S] = Wqᵀ·dq` (+ LoRA), `dq [heads·HD, S]` the gradient of
    /// the pre-RoPE, pre-norm queries.
    QBackward applies [Q] to Acts { dq: Port::Dq } giving Out { dx: Port::Dx }
}
