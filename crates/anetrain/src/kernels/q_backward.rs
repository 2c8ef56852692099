//! `q_backward`: the query projection backward, `dx = Wqᵀ·dq` (+ LoRA).

use mil::builder::Value;

use super::io::{activations, outputs, LayerWeights, Port};
use super::maths::projections_backward;
use super::Encoding::*;
use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
use crate::model::Projection;

pub struct QBackward;

activations! {
    /// The gradient of the (pre-RoPE, pre-norm) queries `[heads·HD, S]`.
    Acts { dq: Port::Dq }
}

outputs! {
    /// `dx [D, S]` (of the normed layer input).
    Out { dx: Port::Dx }
}

impl Kernel for QBackward {
    const KIND: KernelKind = KernelKind::QBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[(Projection::Q, Product::Backward)];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dq, s.q_dim(), s.seq, Activation)
            .columns(Port::Weight(Projection::Q), s.q_dim(), s.dim, AsIs)
            .output(Port::Dx, s.dim);
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Value> {
        g.projections_backward(Self::PROJECTIONS, &[Port::Dq], "dx", o)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            dx: projections_backward(s, o, w, Self::PROJECTIONS, &[a.dq]),
        }
    }
}
