//! `ffn_backward_w2`: the FFN's down projection backward.

use super::prelude::*;
use super::projections_backward::projections_backward;

projections_backward! {
    /// `dgate [H, S] = W2ᵀ·dffn` (+ LoRA), `dffn [D, S]`.
    FfnBackwardW2 applies [Down] to Acts { dffn: Port::Dffn } giving Out { dgate: Port::Dgate }
}
