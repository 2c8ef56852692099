//! `ffn_backward_w13`: the FFN's gate and up projections backward,
//! `dx = W1ᵀ·dh1 + W3ᵀ·dh3` (+ LoRA).

use mil::builder::Value;

use super::io::{activations, outputs, LayerWeights, Port};
use super::maths::projections_backward;
use super::Encoding::*;
use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
use crate::model::Projection;

pub struct FfnBackwardW13;

activations! {
    /// Gradients of h1 and h3, each `[H, S]`.
    Acts { dh1: Port::Dh1, dh3: Port::Dh3 }
}

outputs! {
    /// `dx [D, S]` (of the normed FFN input).
    Out { dx: Port::Dx }
}

impl Kernel for FfnBackwardW13 {
    const KIND: KernelKind = KernelKind::FfnBackwardW13;
    const PROJECTIONS: &'static [(Projection, Product)] = &[
        (Projection::Gate, Product::Backward),
        (Projection::Up, Product::Backward),
    ];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dh1, s.hidden, s.seq, Activation)
            .columns(Port::Dh3, s.hidden, s.seq, Activation)
            .columns(Port::Weight(Projection::Gate), s.hidden, s.dim, AsIs)
            .columns(Port::Weight(Projection::Up), s.hidden, s.dim, AsIs)
            .output(Port::Dx, s.dim);
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Value> {
        g.projections_backward(Self::PROJECTIONS, &[Port::Dh1, Port::Dh3], "dx", o)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            dx: projections_backward(s, o, w, Self::PROJECTIONS, &[a.dh1, a.dh3]),
        }
    }
}
