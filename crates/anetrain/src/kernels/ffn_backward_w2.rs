//! `ffn_backward_w2`: the FFN's down projection backward,
//! `dgate = W2ᵀ·dffn` (+ LoRA).

use mil::builder::Value;

use super::io::{activations, outputs, LayerWeights, Port};
use super::maths::projections_backward;
use super::Encoding::*;
use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
use crate::model::Projection;

pub struct FfnBackwardW2;

activations! {
    /// The gradient of the FFN branch `[D, S]`.
    Acts { dffn: Port::Dffn }
}

outputs! {
    /// `dgate [H, S]`.
    Out { dgate: Port::Dgate }
}

impl Kernel for FfnBackwardW2 {
    const KIND: KernelKind = KernelKind::FfnBackwardW2;
    const PROJECTIONS: &'static [(Projection, Product)] = &[(Projection::Down, Product::Backward)];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dffn, s.dim, s.seq, Activation)
            .columns(Port::Weight(Projection::Down), s.dim, s.hidden, AsIs)
            .output(Port::Dgate, s.hidden);
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Value> {
        g.projections_backward(Self::PROJECTIONS, &[Port::Dffn], "dgate", o)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            dgate: projections_backward(s, o, w, Self::PROJECTIONS, &[a.dffn]),
        }
    }
}
