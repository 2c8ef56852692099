//! `sdpa_backward`: `sdpa_backward1` and `sdpa_backward2` in one program,
//! for a block of queries against every key,
//!
//!   P = softmax(qᵀk/√HD + mask),  dV_g = Σ_h P_hᵀ·dA_h,  dP = dAᵀ·V,
//!   dS = P ⊙ (dP − Σ_j P⊙dP)/√HD,  dQ_h = dS_h·K_g,  dK_g = Σ_h dS_hᵀ·Q_h
//!
//! P and dP stay inside the program: the pair's tile hand-off (P and dP
//! read from one surface, written to the next, a dispatch between) is
//! gone. A tile returns its queries' dq and partial dV and dK that the
//! tiles sum, as the pair's tiles do. Used where the attention backward
//! is cut into query blocks; whole layers keep the pair.

use super::prelude::*;

use super::{sdpa_backward1, sdpa_backward2, SdpaBackward1, SdpaBackward2};

pub struct SdpaBackward;

/// The same activations as `sdpa_backward1`.
pub type Acts<'a> = sdpa_backward1::Acts<'a>;

outputs! {
    /// dV `[KV·HD, S]`, dq `[heads·HD, S]` (the block's queries), dK `[KV·HD, S]`.
    Out { dv: Port::Dv, dq: Port::Dq, dk: Port::Dk }
}

impl Kernel for SdpaBackward {
    const KIND: KernelKind = KernelKind::SdpaBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        sdpa_backward1::inputs(b, s);
        b.output(Port::Dv, s.kv_dim())
            .output(Port::Dq, s.query_rows(s.q_dim()))
            .output(Port::Dk, s.kv_dim());
    }

    /// `sdpa_backward1`'s maths, then `sdpa_backward2`'s on its P and dP.
    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let a = sdpa_backward1::recompute(g, s, o)?;
        let dvc = g.heads_rows_to_channels("dv", &a.dv)?;
        let (dqc, dkc) =
            sdpa_backward2::softmax_backward(g, s, o, &a.probs, &a.dp, &a.q_fold, &a.k, a.tanh)?;
        Ok(vec![dvc, dqc, dkc])
    }

    /// The pair's twins, one after the other.
    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        let b1 = SdpaBackward1::cpu(s, o, w, a);
        let a2 = sdpa_backward2::Acts {
            probs: &b1.probs,
            dp: &b1.dp,
            q_rope: a.q_rope,
            k_rope: a.k_rope,
        };
        let b2 = SdpaBackward2::cpu(s, o, w, &a2);
        Out {
            dv: b1.dv,
            dq: b2.dq,
            dk: b2.dk,
        }
    }
}
