//! The five backward kernels that are nothing but projections,
//!
//!   dx = Σᵢ Wᵢᵀ·dyᵢ   (+ each projection's LoRA branch, s·Aᵀ·(Bᵀ·dyᵢ)),
//!
//! differ only in which projections they apply and what their ports are
//! called, so everything else about them — layout, MIL program, CPU twin —
//! is written once here, and each kernel's module is one
//! [`projections_backward!`] line of data.

use super::prelude::*;

/// The layout: each projection's output gradient `dyᵢ [outᵢ, S]`, then
/// each weight `Wᵢ [outᵢ, in]` as is; out: `dx [in, S]`.
pub fn layout(
    b: &mut LayoutBuilder,
    s: &Shape,
    projections: &[(Projection, Product)],
    acts: &[Port],
    out: Port,
) {
    for (&(p, _), &act) in projections.iter().zip(acts) {
        b.columns(act, s.projection(p).0, s.seq, Activation);
    }
    for &(p, _) in projections {
        let (rows, cols) = s.projection(p);
        b.columns(Port::Weight(p), rows, cols, AsIs);
    }
    let inp = projections.first().map_or(0, |&(p, _)| s.projection(p).1);
    b.output(out, inp);
}

/// Declares one such kernel: its type (named as its [`KernelKind`]), its
/// `Acts` (one field per projection, in order) and `Out` (one field), and
/// its [`Kernel`] impl.
macro_rules! projections_backward {
    (
        $(#[$doc:meta])*
        $kernel:ident applies [$($p:ident),+]
        to Acts { $($act:ident: $act_port:expr),+ } giving Out { $out:ident: $out_port:expr }
    ) => {
        $(#[$doc])*
        pub struct $kernel;

        activations! {
            /// The output gradient of each projection, in order.
            Acts { $($act: $act_port),+ }
        }

        outputs! {
            /// The gradient of the projections' shared input.
            Out { $out: $out_port }
        }

        impl Kernel for $kernel {
            const KIND: KernelKind = KernelKind::$kernel;
            const PROJECTIONS: &'static [(Projection, Product)] =
                &[$((Projection::$p, Product::Backward)),+];
            type Acts<'a> = Acts<'a>;
            type Out = Out;

            fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
                let acts = [$($act_port),+];
                super::projections_backward::layout(b, s, Self::PROJECTIONS, &acts, $out_port);
            }

            fn mil(g: &mut Gen, _: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
                let acts = [$($act_port),+];
                Ok(vec![g.projections_backward(Self::PROJECTIONS, &acts, $out_port.name(), o)?])
            }

            fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
                let dys = [$(a.$act),+];
                let dx = super::maths::projections_backward(s, o, w, Self::PROJECTIONS, &dys);
                Out { $out: dx }
            }
        }
    };
}

pub(crate) use projections_backward;
