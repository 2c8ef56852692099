//! `ffn_backward_w13`: the FFN's gate and up projections backward.

use super::prelude::*;
use super::projections_backward::projections_backward;

projections_backward! {
    /// `dx [D, S] = W1ᵀ·dh1 + W3ᵀ·dh3` (+ LoRA), `dh1, dh3 [H, S]`.
    FfnBackwardW13 applies [Gate, Up]
        to Acts { dh1: Port::Dh1, dh3: Port::Dh3 } giving Out { dx: Port::Dx }
}
