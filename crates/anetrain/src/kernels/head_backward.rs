//! `head_backward`: one vocabulary chunk's part of the LM head's input
//! gradient,
//!
//!   dxf_c = E_cᵀ·dz_c      (E_c [Vc, D], dz_c [Vc, S]; dxf = Σ_c dxf_c)
//!
//! The host forms dz_c from the softmax statistics, pre-scaled by a power
//! of two so that small probabilities survive fp16 and the product stays
//! under the matmul output cliff (`engine::head_grad_scale`); the weight
//! gradient dE_c = dz_c·xfᵀ stays on the host.

use super::maths::wt_x;
use super::prelude::*;

pub struct HeadBackward;

activations! {
    /// The chunk's logit gradients `[Vc, S]`.
    Acts { dlogits: Port::Dlogits }
}

outputs! {
    /// The chunk's part of the hidden state's gradient `[D, S]`.
    Out { dxf: Port::Dxf }
}

impl Kernel for HeadBackward {
    const KIND: KernelKind = KernelKind::HeadBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dlogits, s.vocab, s.seq, Activation)
            .columns(Port::Head, s.vocab, s.dim, AsIs)
            .output(Port::Dxf, s.dim);
    }

    fn mil(g: &mut Gen, _: &Shape, _: &KernelOptions) -> mil::Result<Vec<Value>> {
        // [S, Vc] · [Vc, D], contracting over the chunk's rows.
        let dzt = g.act_rows(Port::Dlogits)?;
        let dx = g.project("dxf_mm", &dzt, Port::Head)?;
        Ok(vec![g.rows_to_channels("dxf", &dx)?])
    }

    fn cpu(s: &Shape, _: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            dxf: wt_x(w.head, a.dlogits, s.vocab, s.dim, s.seq),
        }
    }
}
