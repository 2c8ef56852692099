//! `wo_backward`: attention's output projection backward, `da = Woᵀ·dy`
//! (+ LoRA).

use mil::builder::Value;

use super::io::{activations, outputs, LayerWeights, Port};
use super::maths::projections_backward;
use super::Encoding::*;
use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
use crate::model::Projection;

pub struct WoBackward;

activations! {
    /// The gradient of the projection's output `[D, S]`.
    Acts { dy: Port::Dy }
}

outputs! {
    /// `da [heads·HD, S]`.
    Out { da: Port::Da }
}

impl Kernel for WoBackward {
    const KIND: KernelKind = KernelKind::WoBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[(Projection::O, Product::Backward)];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dy, s.dim, s.seq, Activation)
            .columns(Port::Weight(Projection::O), s.dim, s.q_dim(), AsIs)
            .output(Port::Da, s.q_dim());
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Value> {
        g.projections_backward(Self::PROJECTIONS, &[Port::Dy], "da", o)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            da: projections_backward(s, o, w, Self::PROJECTIONS, &[a.dy]),
        }
    }
}
