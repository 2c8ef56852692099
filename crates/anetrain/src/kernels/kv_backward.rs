//! `kv_backward`: the key and value projections backward,
//! `dx = Wkᵀ·dk + Wvᵀ·dv` (+ LoRA).

use mil::builder::Value;

use super::io::{activations, outputs, LayerWeights, Port};
use super::maths::projections_backward;
use super::Encoding::*;
use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
use crate::model::Projection;

pub struct KvBackward;

activations! {
    /// Gradients of the keys and values, each `[KV·HD, S]`.
    Acts { dk: Port::Dk, dv: Port::Dv }
}

outputs! {
    /// `dx [D, S]` (of the normed layer input).
    Out { dx: Port::Dx }
}

impl Kernel for KvBackward {
    const KIND: KernelKind = KernelKind::KvBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[
        (Projection::K, Product::Backward),
        (Projection::V, Product::Backward),
    ];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Dk, s.kv_dim(), s.seq, Activation)
            .columns(Port::Dv, s.kv_dim(), s.seq, Activation)
            .columns(Port::Weight(Projection::K), s.kv_dim(), s.dim, AsIs)
            .columns(Port::Weight(Projection::V), s.kv_dim(), s.dim, AsIs)
            .output(Port::Dx, s.dim);
    }

    fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Value> {
        g.projections_backward(Self::PROJECTIONS, &[Port::Dk, Port::Dv], "dx", o)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            dx: projections_backward(s, o, w, Self::PROJECTIONS, &[a.dk, a.dv]),
        }
    }
}
