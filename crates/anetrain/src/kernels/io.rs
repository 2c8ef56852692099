//! What flows in and out of a kernel, typed: every region of a packed input
//! and every block of an output is a [`Port`]; each kernel's activations
//! and results are a struct with one field per port (`activations!`,
//! `outputs!`); weights come from one layer's [`LayerWeights`]. A kernel
//! that asks for a buffer it does not have is a compile error, not a
//! string that fails to match at run time.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::Projection;

/// A named tensor a kernel reads or writes. Its [`Port::name`] is the MIL
/// variable name and the name in `layout.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Port {
    Xnorm,
    Attn,
    X2norm,
    X2,
    QRope,
    KRope,
    V,
    Da,
    Probs,
    Dp,
    Dffn,
    Dh1,
    Dh3,
    Dy,
    Dq,
    Dk,
    Dv,
    O,
    XNext,
    H1,
    H3,
    Gate,
    Dgate,
    Dx,
    QRaw,
    KRaw,
    /// A projection's base weight `W [out, in]`.
    Weight(Projection),
    /// Per-head RMSNorm weights of QK-norm (`[HD]`).
    QNorm,
    KNorm,
    /// A projection's LoRA `A [r, in]`.
    LoraA(Projection),
    /// A projection's LoRA `B [out, r]`.
    LoraB(Projection),
}

impl Port {
    pub fn name(self) -> &'static str {
        match self {
            Port::Xnorm => "xnorm",
            Port::Attn => "attn",
            Port::X2norm => "x2norm",
            Port::X2 => "x2",
            Port::QRope => "q_rope",
            Port::KRope => "k_rope",
            Port::V => "v",
            Port::Da => "da",
            Port::Probs => "probs",
            Port::Dp => "dp",
            Port::Dffn => "dffn",
            Port::Dh1 => "dh1",
            Port::Dh3 => "dh3",
            Port::Dy => "dy",
            Port::Dq => "dq",
            Port::Dk => "dk",
            Port::Dv => "dv",
            Port::O => "o",
            Port::XNext => "x_next",
            Port::H1 => "h1",
            Port::H3 => "h3",
            Port::Gate => "gate",
            Port::Dgate => "dgate",
            Port::Dx => "dx",
            Port::QRaw => "q_raw",
            Port::KRaw => "k_raw",
            Port::Weight(p) => p.region(),
            Port::QNorm => "q_norm",
            Port::KNorm => "k_norm",
            Port::LoraA(p) => p.adapter_regions().0,
            Port::LoraB(p) => p.adapter_regions().1,
        }
    }

    /// Whether the port holds weights (staged once per optimizer step on a
    /// device) rather than activations (written per call).
    pub fn is_weight(self) -> bool {
        matches!(
            self,
            Port::Weight(_) | Port::QNorm | Port::KNorm | Port::LoraA(_) | Port::LoraB(_)
        )
    }

    /// Whether the port holds a LoRA adapter matrix.
    pub fn is_adapter(self) -> bool {
        matches!(self, Port::LoraA(_) | Port::LoraB(_))
    }

    /// Score tensors are `[heads·S, S]`: padded per head, not just per
    /// column.
    pub fn is_scores(self) -> bool {
        matches!(self, Port::Probs | Port::Dp)
    }
}

impl Port {
    /// The port named `name` (the inverse of [`Port::name`]).
    pub fn from_name(name: &str) -> Option<Port> {
        use Port::*;
        let plain = [
            Xnorm, Attn, X2norm, X2, QRope, KRope, V, Da, Probs, Dp, Dffn, Dh1, Dh3, Dy, Dq, Dk,
            Dv, O, XNext, H1, H3, Gate, Dgate, Dx, QRaw, KRaw, QNorm, KNorm,
        ];
        let per_projection = Projection::ALL
            .into_iter()
            .flat_map(|p| [Weight(p), LoraA(p), LoraB(p)]);
        plain
            .into_iter()
            .chain(per_projection)
            .find(|p| p.name() == name)
    }
}

impl Serialize for Port {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Tensors by port, row-major in their logical shapes (checks and tests;
/// the engines use the typed structs).
pub type Tensors = BTreeMap<Port, Vec<f32>>;

/// One layer's weights as the kernels read them: every projection, the
/// QK-norm weights, LoRA adapters, and (host only) LoRA dropout masks.
#[derive(Clone, Copy, Default)]
pub struct LayerWeights<'a> {
    /// `W [out, in]` per projection, by [`Projection::index`].
    pub projections: [&'a [f32]; 7],
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// `(A [r, in], B [out, r])` per adapted projection.
    pub adapters: [Option<(&'a [f32], &'a [f32])>; 7],
    /// LoRA dropout masks (already scaled by 1/(1−p)) on each adapted
    /// projection's input; the device kernels have no dropout.
    pub dropout: [Option<&'a [f32]>; 7],
}

impl<'a> LayerWeights<'a> {
    /// The weight behind `port`, if this layer has it.
    pub fn get(&self, port: Port) -> Option<&'a [f32]> {
        match port {
            Port::Weight(p) => Some(self.projections[p.index()]).filter(|w| !w.is_empty()),
            Port::QNorm => self.q_norm,
            Port::KNorm => self.k_norm,
            Port::LoraA(p) => self.adapters[p.index()].map(|(a, _)| a),
            Port::LoraB(p) => self.adapters[p.index()].map(|(_, b)| b),
            _ => None,
        }
    }

    /// `W [out, in]` of projection `p`.
    pub fn projection(&self, p: Projection) -> &'a [f32] {
        self.projections[p.index()]
    }

    /// Weights taken from `t` by port (checks and tests).
    pub fn from_tensors(t: &'a Tensors) -> LayerWeights<'a> {
        let mut w = LayerWeights::default();
        for (&port, v) in t {
            match port {
                Port::Weight(p) => w.projections[p.index()] = v,
                Port::QNorm => w.q_norm = Some(v),
                Port::KNorm => w.k_norm = Some(v),
                Port::LoraA(p) | Port::LoraB(p) => {
                    if let (Some(a), Some(b)) = (t.get(&Port::LoraA(p)), t.get(&Port::LoraB(p))) {
                        w.adapters[p.index()] = Some((a, b));
                    }
                }
                _ => {}
            }
        }
        w
    }

    /// Whether any dropout mask is set.
    pub fn has_dropout(&self) -> bool {
        self.dropout.iter().any(Option::is_some)
    }
}

/// A kernel's activation inputs.
pub trait Activations<'a>: Sized {
    /// Every activation with its port.
    fn ports(&self) -> Vec<(Port, &'a [f32])>;
    /// The activations `get` gives for each port (checks and tests).
    fn from_lookup(get: &dyn Fn(Port) -> &'a [f32]) -> Self;
}

/// A kernel's results.
pub trait Outputs: Sized {
    /// Every result with its port.
    fn into_ports(self) -> Vec<(Port, Vec<f32>)>;
    /// The results `take` gives for each port; `None` when a required one
    /// is missing.
    fn from_lookup(take: &mut dyn FnMut(Port) -> Option<Vec<f32>>) -> Option<Self>;
}

/// A struct of borrowed activations, one field per port.
macro_rules! activations {
    ($(#[$m:meta])* $name:ident { $($field:ident: $port:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy)]
        pub struct $name<'a> {
            $(pub $field: &'a [f32]),+
        }

        impl<'a> $crate::kernels::io::Activations<'a> for $name<'a> {
            fn ports(&self) -> Vec<($crate::kernels::Port, &'a [f32])> {
                vec![$(($port, self.$field)),+]
            }
            fn from_lookup(get: &dyn Fn($crate::kernels::Port) -> &'a [f32]) -> Self {
                $name { $($field: get($port)),+ }
            }
        }
    };
}

/// A struct of owned results, one field per port; fields after `optional`
/// exist only for some options (`Option<Vec<f32>>`).
macro_rules! outputs {
    ($(#[$m:meta])* $name:ident {
        $($field:ident: $port:expr),+ $(,)?
        $(; optional $($ofield:ident: $oport:expr),+ $(,)?)?
    }) => {
        $(#[$m])*
        pub struct $name {
            $(pub $field: Vec<f32>,)+
            $($(pub $ofield: Option<Vec<f32>>,)+)?
        }

        impl $crate::kernels::io::Outputs for $name {
            fn into_ports(self) -> Vec<($crate::kernels::Port, Vec<f32>)> {
                #[allow(unused_mut)]
                let mut v = vec![$(($port, self.$field)),+];
                $($(if let Some(x) = self.$ofield {
                    v.push(($oport, x));
                })+)?
                v
            }
            fn from_lookup(
                take: &mut dyn FnMut($crate::kernels::Port) -> Option<Vec<f32>>,
            ) -> Option<Self> {
                Some($name {
                    $($field: take($port)?,)+
                    $($($ofield: take($oport),)+)?
                })
            }
        }
    };
}

pub(crate) use {activations, outputs};
