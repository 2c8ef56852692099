//! `wo_forward`: attention's output projection, `o = Wo·attn` (+ LoRA).

use super::prelude::*;

use super::maths::{add_adapter, w_x};

pub struct WoForward;

activations! {
    /// Attention output `[heads·HD, S]`.
    Acts { attn: Port::Attn }
}

outputs! {
    /// `o [D, S]`.
    Out { o: Port::O }
}

impl Kernel for WoForward {
    const KIND: KernelKind = KernelKind::WoForward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[(Projection::O, Product::Forward)];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Attn, s.q_dim(), s.seq, Activation)
            .columns(Port::Weight(Projection::O), s.q_dim(), s.dim, Transposed)
            .output(Port::O, s.dim);
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let at = g.act_rows(Port::Attn)?;
        // o feeds the residual stream: its product is pre-scaled past the
        // matmul output cliff (KernelOptions::cliff_prescale).
        let (at, undo) = g.prescale("attn_scaled", &at, o)?;
        let y = g.project("o_mm", &at, Port::Weight(Projection::O))?;
        let y = g.with_adapter(y, &at, Projection::O, Product::Forward, o)?;
        let y = g.unscale("o_unscaled", y, undo)?;
        Ok(vec![g.rows_to_channels("o", &y)?])
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        let x = a.attn;
        let mut y = w_x(w.projection(Projection::O), x, s.dim, s.q_dim(), s.seq);
        add_adapter(&mut y, w, o, s, Projection::O, x, Product::Forward);
        Out { o: y }
    }
}
