//! `head_forward`: one vocabulary chunk of the LM head,
//!
//!   z_c = E_c·xf      (E_c [Vc, D] the head's rows of chunk c, xf [D, S])
//!
//! The host folds each chunk's logits into running softmax statistics (max
//! and sum of exponentials per position, in f32), so the whole `[V, S]`
//! logits never exist at once; see `engine::head_loss`.

use super::maths::w_x;
use super::prelude::*;

pub struct HeadForward;

activations! {
    /// The final-normed hidden state `[D, S]`.
    Acts { xf: Port::Xf }
}

outputs! {
    /// The chunk's logits `[Vc, S]`.
    Out { logits: Port::Logits }
}

impl Kernel for HeadForward {
    const KIND: KernelKind = KernelKind::HeadForward;
    // The head is never adapted: LoRA runs leave it frozen.
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.columns(Port::Xf, s.dim, s.seq, Activation)
            .columns(Port::Head, s.dim, s.vocab, Transposed)
            .output(Port::Logits, s.vocab);
    }

    fn mil(g: &mut Gen, _: &Shape, _: &KernelOptions) -> mil::Result<Vec<Value>> {
        // [S, D] · [D, Vc]: logits stay far below the matmul output cliff
        // (|z| ≤ ‖E_v‖·‖xf_s‖, tens for trained models).
        let xt = g.act_rows(Port::Xf)?;
        let z = g.project("logits_mm", &xt, Port::Head)?;
        Ok(vec![g.rows_to_channels("logits", &z)?])
    }

    fn cpu(s: &Shape, _: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        Out {
            logits: w_x(w.head, a.xf, s.vocab, s.dim, s.seq),
        }
    }
}
