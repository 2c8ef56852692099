//! The dynamic-weight kernel set. Each kernel is one module implementing
//! [`Kernel`]: a [`KernelLayout`] saying where its inputs and outputs live,
//! a MIL program (built with the typed builder through [`Gen`]) and a
//! native f32 CPU twin, side by side; tests hold program and twin equal.
//! Its activations and results are typed structs ([`Activations`],
//! [`Outputs`]) keyed by [`Port`]s.
//!
//! Conventions (see `docs/kernels.md`):
//! * activations are channel-first `[C, S]`; weights are Hugging Face
//!   `[out, in]`;
//! * RoPE is Hugging Face's half-split `rotate_half` with θ from the config
//!   (the seed's interleaved pairs survive only in seed-compatible mode);
//! * grouped-query attention folds the `ratio` query heads that share a KV
//!   head along the sequence axis (`[1, KV, ratio·S, HD]`), so query head h
//!   reads KV head `h / ratio` exactly as `repeat_kv` does, K and V are never
//!   duplicated, and the backward kernels produce dK and dV already summed
//!   over the group.

pub mod check;
pub mod io;
pub mod layout;
pub mod maths;
mod positions;
mod program;
mod projections_backward;
pub mod tiling;

/// What every kernel module writes with.
mod prelude {
    pub(crate) use super::io::{activations, outputs, LayerWeights, Port};
    pub(crate) use super::Encoding::*;
    pub(crate) use super::{Gen, Kernel, KernelKind, KernelOptions, LayoutBuilder, Product, Shape};
    pub(crate) use crate::model::Projection;
    pub(crate) use mil::builder::Value;
}

pub mod ffn_backward_w13;
pub mod ffn_backward_w2;
pub mod ffn_forward;
pub mod head_backward;
pub mod head_forward;
pub mod kv_backward;
pub mod q_backward;
pub mod sdpa_backward;
pub mod sdpa_backward1;
pub mod sdpa_backward2;
pub mod sdpa_forward;
pub mod wo_backward;
pub mod wo_forward;

use serde::Serialize;

use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::layer::{LayerClass, LayerSpec, Mixer, Mlp};
use crate::model::lora::LoraConfig;
use crate::model::Projection;
pub use ffn_backward_w13::FfnBackwardW13;
pub use ffn_backward_w2::FfnBackwardW2;
pub use ffn_forward::FfnForward;
pub use head_backward::HeadBackward;
pub use head_forward::HeadForward;
pub use io::{Activations, LayerWeights, Outputs, Port, Tensors};
pub use kv_backward::KvBackward;
pub use layout::{Encoding, KernelLayout, LayoutBuilder};
#[cfg(test)]
pub(crate) use positions::MASKED;
pub use positions::{
    causal_mask, inv_freqs, mask_row, rope_rotation, rope_row, rope_tables, visible_keys,
};
pub use program::Gen;
pub use q_backward::QBackward;
pub use sdpa_backward::SdpaBackward;
pub use sdpa_backward1::SdpaBackward1;
pub use sdpa_backward2::SdpaBackward2;
pub use sdpa_forward::SdpaForward;
pub use wo_backward::WoBackward;
pub use wo_forward::WoForward;

/// The one table of kernels: each row a kernel's kind (and the type of
/// its module), its name, the seed's name for it, whether it belongs to
/// the forward pass, the axes its tiles may split (preferred first; see
/// [`KernelKind::tile_axes`]), and what it computes. [`KernelKind`], its
/// names, [`KernelKind::ALL`] and [`KernelKind::with`] are generated from
/// it.
macro_rules! kernel_table {
    ($($(#[doc = $doc:literal])* $kind:ident: $name:literal, $seed:expr, $forward:literal, [$($axis:ident),*];)*) => {
        /// The kernels: ten per layer, in the order a training step uses
        /// them, and the LM head's two, run per vocabulary chunk.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
        pub enum KernelKind {
            $($(#[doc = $doc])* $kind,)*
        }

        impl KernelKind {
            pub const ALL: [KernelKind; [$(KernelKind::$kind),*].len()] = [$(KernelKind::$kind),*];

            /// File-friendly name (`sdpa_forward`).
            pub fn name(self) -> &'static str {
                match self {
                    $(KernelKind::$kind => $name,)*
                }
            }

            /// The seed's name for the same kernel (`sdpaFwd`); the seed
            /// runs the LM head on the host, so its kernels have none.
            pub fn seed_name(self) -> Option<&'static str> {
                match self {
                    $(KernelKind::$kind => $seed,)*
                }
            }

            /// Whether the kernel belongs to the forward pass (which walks
            /// the layers upwards; the backward walks them down).
            pub fn is_forward(self) -> bool {
                match self {
                    $(KernelKind::$kind => $forward,)*
                }
            }

            /// The axes this kernel's tiles may split, preferred first. A
            /// kernel with a nonlinearity across an axis (softmax over
            /// heads' scores, SiLU of a product summed over the model
            /// dimension) cannot split it. Kernels that treat every
            /// position alone may also split the sequence, last: a block
            /// re-sends the weights, so weight axes go first. The head's
            /// vocabulary is cut into chunks the host walks
            /// ([`tiling::HeadChunks`]); a chunk's product treats positions
            /// alone.
            pub fn tile_axes(self) -> &'static [tiling::Axis] {
                match self {
                    $(KernelKind::$kind => &[$(tiling::Axis::$axis),*],)*
                }
            }

            /// Calls `f` with this kernel's type: the one place a kernel's
            /// name turns into its definition.
            pub fn with<F: KernelFn>(self, f: F) -> F::Output {
                match self {
                    $(KernelKind::$kind => f.call::<$kind>(),)*
                }
            }
        }
    };
}

kernel_table! {
    /// xnorm, Wq, Wk, Wv (+ QK-norm weights) → attention output, roped q/k, v.
    SdpaForward: "sdpa_forward", Some("sdpaFwd"), true, [KvGroups, Seq];
    /// attn, Wo → o.
    WoForward: "wo_forward", Some("woFwd"), true, [KvGroups, Dim, Seq];
    /// x2norm, x2, W1, W3, W2 → x_next = x2 + α·W2(silu(W1 x)·W3 x), h1, h3, gate.
    FfnForward: "ffn_forward", Some("ffnFused"), true, [Hidden, Seq];
    /// dffn, W2 → dgate = W2ᵀ dffn.
    FfnBackwardW2: "ffn_backward_w2", Some("ffnBwdW2t"), false, [Hidden, Dim, Seq];
    /// dh1, dh3, W1, W3 → dx = W1ᵀ dh1 + W3ᵀ dh3.
    FfnBackwardW13: "ffn_backward_w13", Some("ffnBwdW13t"), false, [Hidden, Dim, Seq];
    /// dy, Wo → da = Woᵀ dy.
    WoBackward: "wo_backward", Some("wotBwd"), false, [KvGroups, Dim, Seq];
    /// q, k, v, da → dv, probs, dp (attention recomputed).
    SdpaBackward1: "sdpa_backward1", Some("sdpaBwd1"), false, [KvGroups, Seq];
    /// probs, dp, q, k → dq, dk (softmax backward on the device).
    SdpaBackward2: "sdpa_backward2", Some("sdpaBwd2"), false, [KvGroups, Seq];
    /// q, k, v, da (a block of queries) → dv, dq, dk: the pair above in one
    /// program, P and dP kept inside.
    SdpaBackward: "sdpa_backward", None, false, [KvGroups, Seq];
    /// dq, Wq → dx = Wqᵀ dq.
    QBackward: "q_backward", Some("qBwd"), false, [KvGroups, Dim, Seq];
    /// dk, dv, Wk, Wv → dx = Wkᵀ dk + Wvᵀ dv.
    KvBackward: "kv_backward", Some("kvBwd"), false, [KvGroups, Dim, Seq];
    /// xf, a vocabulary chunk of the LM head E_c → logits z_c = E_c·xf.
    HeadForward: "head_forward", None, true, [Seq];
    /// dz_c, E_c → dxf_c = E_cᵀ·dz_c (summed over chunks by the host).
    HeadBackward: "head_backward", None, false, [Seq];
}

impl KernelKind {
    /// Whether the kernel computes part of a layer of this description:
    /// the attention's programs for an attention mixer, the SwiGLU's for
    /// a SwiGLU MLP (the LM head's serve no layer). A layer runs these,
    /// in [`KernelKind::ALL`]'s order.
    pub fn serves(self, layer: &LayerSpec) -> bool {
        use KernelKind::*;
        match self {
            SdpaForward | WoForward | WoBackward | SdpaBackward1 | SdpaBackward2 | SdpaBackward
            | QBackward | KvBackward => {
                matches!(layer.mixer, Mixer::Attention { .. })
            }
            FfnForward | FfnBackwardW2 | FfnBackwardW13 => {
                matches!(layer.mlp, Mlp::SwiGlu | Mlp::GeGlu)
            }
            HeadForward | HeadBackward => false,
        }
    }

    pub fn from_name(s: &str) -> Option<KernelKind> {
        KernelKind::ALL
            .into_iter()
            .find(|k| k.name() == s || k.seed_name() == Some(s))
    }

    /// Whether the kernel computes the LM head (its units are vocabulary
    /// chunks, not layers).
    pub fn is_head(self) -> bool {
        matches!(self, KernelKind::HeadForward | KernelKind::HeadBackward)
    }
}

/// RoPE pairing convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Rope {
    /// Hugging Face `rotate_half` over a head's first `rotary` dimensions
    /// (all of them but with Phi's `partial_rotary_factor`): dimension
    /// i < rotary/2 pairs with i + rotary/2, the rest pass through.
    HalfSplit { rotary: usize },
    /// The seed's (and llama2.c's) adjacent pairs (2i, 2i+1).
    Interleaved,
}

impl Rope {
    /// Hugging Face's half-split RoPE over whole heads of `hd`.
    pub fn whole(hd: usize) -> Rope {
        Rope::HalfSplit { rotary: hd }
    }

    /// The dimensions of a head of `hd` that rotate (the first ones).
    pub fn rotated(self, hd: usize) -> usize {
        match self {
            Rope::HalfSplit { rotary } => rotary.min(hd),
            Rope::Interleaved => hd,
        }
    }

    /// Dimension `d`'s partner in `rotate(x)` and the sign its term takes:
    /// `rotate(x)[d] = sign·x[partner]`. Half-split:
    /// `rotate(x) = concat(−x[r/2..r], x[..r/2])` over the `r` rotated
    /// dimensions; interleaved, pairs `(x₂ᵢ, x₂ᵢ₊₁) → (−x₂ᵢ₊₁, x₂ᵢ)`; a
    /// dimension passed through is its own partner with sign 0.
    pub fn partner(self, d: usize, hd: usize) -> (usize, f32) {
        let half = self.rotated(hd) / 2;
        match self {
            Rope::HalfSplit { .. } if d < half => (d + half, -1.0),
            Rope::HalfSplit { .. } if d < 2 * half => (d - half, 1.0),
            Rope::HalfSplit { .. } => (d, 0.0),
            Rope::Interleaved if d.is_multiple_of(2) => (d + 1, -1.0),
            Rope::Interleaved => (d - 1, 1.0),
        }
    }
}

/// Everything besides the shapes that changes what a kernel computes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelOptions {
    pub rope: Rope,
    pub rope_theta: f64,
    /// RoPE's frequency scaling (the checkpoint's `rope_type`).
    pub rope_scaling: RopeScaling,
    /// The base of a [`LayerClass::local_rope`] layer's RoPE (Gemma's
    /// `rope_local_base_freq`), unscaled.
    pub local_rope_theta: Option<f64>,
    /// The layer the kernels compute parts of: which kernels a layer runs
    /// ([`KernelKind::serves`]) and what they compute (QK-norm inside
    /// sdpa_forward).
    pub layer: LayerSpec,
    /// RMSNorm epsilon (QK-norm inside sdpa_forward).
    pub eps: f64,
    /// Scale α of each residual branch: 1 for most Hugging Face models
    /// (Granite's `residual_multiplier`), 1/sqrt(2·layers) in the seed
    /// (DeepNet).
    pub residual_scale: f64,
    /// The attention scores' scale: 1/√head_dim, or the model's own
    /// (Granite's `attention_multiplier`, `ModelConfig::score_scale`).
    pub score_scale: f64,
    /// The scores' tanh soft cap c (Gemma 2's `attn_logit_softcapping`):
    /// scores ← c·tanh(scores/c) after the scale, before the mask.
    pub score_cap: Option<f64>,
    /// The class of the layer the kernels run for (its RoPE and attention
    /// window: [`LayerClass`]); [`KernelOptions::for_layer`] sets it. A
    /// model-wide use (a plan, a cost) reads the first layer's.
    pub class: LayerClass,
    /// Reproduce the seed's layouts (sdpa_forward also passes xnorm through).
    pub seed_compat: bool,
    /// CPU twin only: compute with the constants exactly as the MIL program
    /// stores them (fp16 RoPE tables, score scale, eps, residual scale), so
    /// the interpreter's fp32 mode can be compared bit for bit with the
    /// maths. The CPU engine leaves this off and uses exact constants.
    pub fp16_constants: bool,
    /// LoRA adapters as extra dynamic-weight regions, if any.
    pub lora: Option<LoraKernel>,
    /// Smallest input and output surface in bytes: the layout pads the
    /// input with unused columns and the output with zero channels up to
    /// it (the device rejects smaller surfaces; see
    /// [`ane::rules::MIN_SURFACE_BYTES`]). 0 in seed-compatible mode.
    pub min_surface_bytes: usize,
    /// The device's limits (its chip family's, see [`ane::family`]):
    /// padding never widens an input past the spatial cap, and [`tiling`]
    /// splits kernels whose programs would break a limit.
    pub limits: ane::family::Limits,
    /// Tile every kernel at least this many times where its axis allows
    /// (`ANETRAIN_ANE_MIN_TILES`; 1 unless set): exercises tiled execution
    /// on models too small to need it.
    pub min_tiles: usize,
    /// Split the sequence of every kernel that may split it into at least
    /// this many blocks, where the length allows (`ANETRAIN_ANE_SEQ_TILES`;
    /// 1 unless set): exercises sequence tiling at short lengths.
    pub min_seq_tiles: usize,
    /// Tile a kernel further, where an axis allows, until one tile's input
    /// and output surfaces are at most this many bytes each (`None`: only as far as the
    /// device's limits need; Hugging Face models: [`MAX_TILE_BYTES`]).
    pub max_tile_bytes: Option<usize>,
    /// The chip family whose cost model ([`ane::cost::Rates`]) chooses
    /// among the tilings that pass the rules within the cap: the family
    /// in force, else the M1 (the slowest measured row).
    pub cost_family: ane::family::Family,
    /// What `anetrain doctor` measured on this machine's engine (its
    /// profile's family and timing): used in place of the table's rates
    /// when `cost_family` is that family ([`KernelOptions::cost_rates`]).
    pub cost_measured: Option<(ane::family::Family, ane::family::Measured)>,
    /// Run a tiled attention backward as the fused `sdpa_backward` (P and
    /// dP kept on the device) where the cost model predicts it faster
    /// than the pair; off, `sdpa_backward1`/`sdpa_backward2` always run
    /// (tests of the pair's tile hand-off). Whole layers keep the pair.
    pub fuse_attention_backward: bool,
}

/// The largest tile surface (input or output) the device kernels are built for (where an axis
/// allows cutting further): what a device buffer holds at most, so it
/// bounds streamed buffers, the host's staging copy and the simulator's
/// working set to a few tens of megabytes per kernel whatever the model's
/// size (see `device::DeviceBuffers`). Tiles share a program, so this
/// adds device evaluations, not compiles. Both buffer modes run the same
/// tiles, which is what makes them give the same bits.
pub const MAX_TILE_BYTES: usize = 16 << 20;

/// What the kernels need to know about LoRA adapters: every adapted
/// projection `W` gains regions `A [r, in]` and `B [out, r]` and computes
/// `W·x + scale·B·(A·x)` (forward) or `Wᵀ·dy + scale·Aᵀ·(Bᵀ·dy)` (backward).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoraKernel {
    pub rank: usize,
    pub scale: f64,
    pub targets: Vec<Projection>,
    /// The last layers adapted (`--lora-layers`), `None` every one: the
    /// programs are the same, the backward stops below them (what the
    /// plan counts).
    pub layers: Option<usize>,
}

impl LoraKernel {
    /// What the kernels need of adapters configured as `cfg`.
    pub fn of(cfg: &LoraConfig) -> LoraKernel {
        LoraKernel {
            rank: cfg.rank,
            scale: cfg.scale(),
            targets: cfg.targets.clone(),
            layers: cfg.layers,
        }
    }

    /// The layers of `n` whose backward runs: the adapted ones.
    pub fn backward_layers(&self, n: usize) -> usize {
        self.layers.map_or(n, |l| l.min(n))
    }
}

/// How a kernel uses a projection, which decides where its adapter
/// regions go and how the MIL multiplies them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// y = W·x with `W` stored transposed (`in` along channels).
    Forward,
    /// y = W·x with `W` stored as is (`out` along channels), as the FFN's
    /// down projection is.
    ForwardRows,
    /// dx = Wᵀ·dy with `W` stored as is.
    Backward,
}

impl KernelKind {
    /// The weight projections this kernel applies, and how.
    pub fn projections(self) -> &'static [(Projection, Product)] {
        struct Projections;
        impl KernelFn for Projections {
            type Output = &'static [(Projection, Product)];
            fn call<K: Kernel>(self) -> Self::Output {
                K::PROJECTIONS
            }
        }
        self.with(Projections)
    }
}

/// One kernel, everything about it in one place (its module): where its
/// inputs and outputs live, its MIL program, and its CPU twin, which tests
/// hold equal. Weights are packed from the layout's weight regions and a
/// layer's [`LayerWeights`], the same way for every kernel.
pub trait Kernel {
    const KIND: KernelKind;
    /// The weight projections the kernel applies, and how (their LoRA
    /// regions are added to the layout after the kernel's own).
    const PROJECTIONS: &'static [(Projection, Product)];
    /// Activations in.
    type Acts<'a>: Activations<'a>;
    /// Results out.
    type Out: Outputs;

    /// Declares the kernel's input regions and output blocks.
    fn layout(b: &mut LayoutBuilder, s: &Shape, o: &KernelOptions);

    /// Builds the program's body; returns its output blocks in the
    /// layout's order (joined by `concat`, or the program's several
    /// outputs where the device rejects `concat`: see [`build`]).
    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<mil::builder::Value>>;

    /// The native f32 twin.
    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Self::Acts<'_>) -> Self::Out;
}

/// Something to do with a kernel type, chosen by [`KernelKind::with`].
pub trait KernelFn {
    type Output;
    fn call<K: Kernel>(self) -> Self::Output;
}

impl KernelOptions {
    /// Hugging Face semantics for `cfg`.
    pub fn hf(cfg: &ModelConfig) -> KernelOptions {
        let profile = ane::family::Profile::in_force();
        let measured = profile
            .as_ref()
            .ok()
            .and_then(|p| p.family.zip(p.timing.clone()));
        KernelOptions {
            rope: Rope::HalfSplit {
                rotary: cfg.rotary_dim(),
            },
            rope_theta: cfg.rope_theta,
            rope_scaling: cfg.rope_scaling.clone(),
            local_rope_theta: cfg.local_rope_theta,
            layer: cfg.layer(),
            eps: cfg.rms_norm_eps,
            residual_scale: cfg.scales.residual,
            score_scale: cfg.score_scale(),
            score_cap: cfg.scales.attention_cap,
            class: cfg.layer_class(0),
            seed_compat: false,
            fp16_constants: false,
            lora: None,
            min_surface_bytes: ane::rules::MIN_SURFACE_BYTES,
            limits: profile.as_ref().map(|p| p.limits).unwrap_or_default(),
            min_tiles: tiling::min_tiles_from_env(),
            min_seq_tiles: tiling::min_seq_tiles_from_env(),
            max_tile_bytes: Some(MAX_TILE_BYTES),
            cost_family: profile
                .ok()
                .and_then(|p| p.family)
                .unwrap_or(ane::family::Family::M1),
            cost_measured: measured,
            // A bad value stops the CLI before any command (`main`).
            fuse_attention_backward: tiling::fuse_attention_backward_from_env().unwrap_or(true),
        }
    }

    /// Built for `profile`'s chip instead of the one in force: its limits,
    /// and its family's rates to choose plans by.
    pub fn for_profile(mut self, profile: &ane::family::Profile) -> KernelOptions {
        self.limits = profile.limits;
        if let Some(f) = profile.family {
            self.cost_family = f;
        }
        self
    }

    /// The rates plans are chosen by: `cost_family`'s row of the table,
    /// with what `doctor` measured on this chip in its place when the
    /// chip is of that family.
    pub fn cost_rates(&self) -> ane::cost::Rates {
        let table = ane::cost::Rates::of(self.cost_family);
        match &self.cost_measured {
            Some((f, m)) if *f == self.cost_family => table.with_measured(m),
            _ => table,
        }
    }

    /// Hugging Face semantics for a model of `cfg` with adapters of `lora`
    /// (the one place a run's kernel options are built).
    pub fn for_run(cfg: &ModelConfig, lora: Option<&LoraConfig>) -> KernelOptions {
        KernelOptions::hf(cfg).with_lora(lora)
    }

    /// These options with adapters of `lora` on the projections (none for
    /// `None`).
    pub fn with_lora(mut self, lora: Option<&LoraConfig>) -> KernelOptions {
        self.lora = lora.map(LoraKernel::of);
        self
    }

    /// [`KernelOptions::for_run`] for `model` and its adapters, if any.
    pub fn for_model(model: &crate::model::Model) -> KernelOptions {
        KernelOptions::for_run(&model.cfg, model.lora.as_ref().map(|l| &l.cfg))
    }

    /// Whether a program joins its output blocks into one output with
    /// `concat` (and pads it to the minimum surface with zero channels):
    /// unless the device rejects `concat` (Orion docs/ane_constraints.md
    /// §1), when each block is an output of its own and the device
    /// allocates the surfaces (§2). The seed's programs always join.
    pub fn joins_outputs(&self) -> bool {
        self.limits.concat || self.seed_compat
    }

    /// The power of two a residual branch's product input is scaled by
    /// before the product and its output by the inverse after, on devices
    /// whose matmul outputs turn to ±inf past 32752 (every measured chip:
    /// ANEForge docs/numeric-cliffs.md, "Matmul output saturation": "Scale
    /// activations or weights before the matmul and undo the scale
    /// afterwards"). With ½ every output fp16 can hold (up to 65504) stays
    /// under the cliff inside the product; scaling by a power of two is
    /// exact for fp16 normal values. `None`: no cliff, or seed programs.
    pub fn cliff_prescale(&self) -> Option<f64> {
        (self.limits.matmul_cliff.is_some() && !self.seed_compat).then_some(0.5)
    }

    /// Whether the attention normalises queries and keys per head.
    pub fn qk_norm(&self) -> bool {
        self.layer.qk_norm()
    }

    /// The adapter (rank, scale) of projection `t`, if it has one.
    pub fn adapter(&self, t: Projection) -> Option<(usize, f64)> {
        let l = self.lora.as_ref()?;
        l.targets.contains(&t).then_some((l.rank, l.scale))
    }

    /// The seed's conventions: interleaved RoPE with θ = 10000, no QK-norm,
    /// DeepNet residual scaling, seed layouts.
    pub fn seed(cfg: &ModelConfig) -> KernelOptions {
        KernelOptions {
            rope: Rope::Interleaved,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            local_rope_theta: None,
            layer: LayerSpec {
                mixer: Mixer::Attention {
                    qk_norm: crate::model::layer::QkNorm::None,
                    qkv_bias: false,
                },
                ..cfg.layer()
            },
            eps: cfg.rms_norm_eps,
            residual_scale: 1.0 / (2.0 * cfg.num_hidden_layers as f64).sqrt(),
            score_scale: 1.0 / (cfg.head_dim as f64).sqrt(),
            score_cap: None,
            class: LayerClass::default(),
            seed_compat: true,
            fp16_constants: false,
            lora: None,
            min_surface_bytes: 0,
            limits: ane::rules::Limits::default().with_max_dim(ane::rules::MAX_DIM),
            min_tiles: 1,
            min_seq_tiles: 1,
            max_tile_bytes: None,
            // Untiled: nothing to choose.
            cost_family: ane::family::Family::M4,
            cost_measured: None,
            // The seed's six programs per multi-head layer, its ten otherwise.
            fuse_attention_backward: false,
        }
    }
}

/// The sizes a kernel is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    pub dim: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions: keys, and for every kernel but the attention kernels'
    /// query blocks, the positions computed.
    pub seq: usize,
    /// Query positions an attention kernel computes: `seq`, or one block of
    /// them at `seq / queries` query blocks (see [`tiling::Axis::Seq`]).
    pub queries: usize,
    /// Rows of the LM head the head kernels compute: the vocabulary, or
    /// one chunk of it (see [`tiling::HeadChunks`]).
    pub vocab: usize,
}

impl Shape {
    pub fn new(cfg: &ModelConfig, seq: usize) -> Shape {
        Shape {
            dim: cfg.hidden_size,
            hidden: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            seq,
            queries: seq,
            vocab: cfg.vocab_size,
        }
    }

    /// The shape of one LM-head chunk of `rows` vocabulary rows.
    pub fn head_chunk(self, rows: usize) -> Shape {
        Shape {
            vocab: rows,
            ..self
        }
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// `[out, in]` of projection `t`.
    pub fn projection(&self, t: Projection) -> (usize, usize) {
        t.dims(self.dim, self.hidden, self.q_dim(), self.kv_dim())
    }

    pub fn ratio(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Channels of a flattened score matrix (`heads·queries`).
    pub fn score_channels(&self) -> usize {
        self.heads * self.queries
    }

    /// Whether attention runs on a block of the queries (against every key).
    pub fn query_block(&self) -> bool {
        self.queries < self.seq
    }

    /// Channels a `[channels, queries]` tensor fills in a region `seq`
    /// wide: a query block's activations are laid out row-major, whole
    /// rows of the surface, so every region keeps the sequence's width.
    pub fn query_rows(&self, channels: usize) -> usize {
        channels * self.queries / self.seq
    }

    /// Whether a query block's `[q_dim, queries]` fills whole rows of the
    /// surface (so [`Shape::query_rows`] is exact).
    pub fn query_rows_whole(&self) -> bool {
        (self.q_dim() * self.queries).is_multiple_of(self.seq)
    }
}

impl KernelOptions {
    /// A constant as the twin should use it (rounded to fp16 when
    /// `fp16_constants` is set).
    pub fn constant(&self, v: f64) -> f32 {
        if self.fp16_constants {
            mil::tensor::round_f16(v as f32)
        } else {
            v as f32
        }
    }

    /// The epsilon QK-norm adds on the device: the config's, raised to
    /// fp16's smallest normal value (2⁻¹⁴ ≈ 6.1e-5) when smaller. Qwen3's
    /// 1e-6 is an fp16 *subnormal*: a device that flushes subnormals would
    /// read it as 0, and a zero-padded position would then normalise as
    /// 0·(0)^(−1/2) = 0·∞ = NaN, which attention spreads into real rows.
    /// For a row whose mean square is above 0.12 the change is below fp16's
    /// rounding (2⁻¹¹ relative); the CPU engine keeps the config's value.
    /// As `(k·ε, k)` with k = 1 ([`Gen::head_rms_norm`]).
    pub fn device_eps(&self) -> (f64, f64) {
        (self.eps.max(F16_MIN_NORMAL), 1.0)
    }

    /// The epsilon of a norm over a whole projection (OLMo 2's QK-norm) on
    /// the device, as `(k·ε, k)`: k the smallest power of 4 that makes
    /// k·ε an fp16 normal value, and the program computes
    /// (k·mean(x²) + k·ε)^(−1/2)·√k — the config's ε, not a raised one
    /// (OLMo 2's layers read the residual stream unnormed, so a mean square
    /// of 1e-4 is ordinary and a raised ε would move it by a tenth). k·mean(x²)
    /// stays in fp16 up to a mean square of 65504/k (1023 for ε = 1e-6, an
    /// RMS of 32): [`KernelOptions::whole_norm_bound`].
    pub fn whole_norm_eps(&self) -> (f64, f64) {
        let mut k = 1.0;
        while self.eps * k < F16_MIN_NORMAL {
            k *= 4.0;
        }
        (self.eps * k, k)
    }

    /// The largest mean square of a projection the device's whole-projection
    /// norm holds ([`KernelOptions::whole_norm_eps`]).
    pub fn whole_norm_bound(&self) -> f64 {
        F16_MAX / self.whole_norm_eps().1
    }

    /// The QK-norm epsilon as the twin should use it: the device's (as
    /// the program's fp16 constant, k·ε, over k) when computing with the
    /// program's constants, else the config's (Hugging Face parity).
    pub fn norm_eps(&self) -> f32 {
        if !self.fp16_constants {
            return self.eps as f32;
        }
        let (eps, k) = match self.layer.qk_norm_kind() {
            crate::model::layer::QkNorm::Whole => self.whole_norm_eps(),
            _ => self.device_eps(),
        };
        self.constant(eps) / k as f32
    }

    /// These options for layer `layer` of a model of `cfg`: its class's
    /// RoPE and window.
    pub fn for_layer(&self, cfg: &ModelConfig, layer: usize) -> KernelOptions {
        KernelOptions {
            class: cfg.layer_class(layer),
            ..self.clone()
        }
    }

    /// [`KernelOptions::for_layer`], borrowing these options when the
    /// layer's class is theirs.
    pub fn of_layer(&self, cfg: &ModelConfig, layer: usize) -> std::borrow::Cow<'_, KernelOptions> {
        match cfg.layer_class(layer) == self.class {
            true => std::borrow::Cow::Borrowed(self),
            false => std::borrow::Cow::Owned(self.for_layer(cfg, layer)),
        }
    }

    /// RoPE tables of the model's θ and scaling (what a program's
    /// constants hold before fp16); a layer without RoPE's are cos = 1,
    /// sin = 0 (see [`LayerClass::rope`]).
    pub fn exact_rope_tables(&self, seq: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        match self.class.rope {
            true => {
                let (theta, scaling) = self.class_rope();
                rope_tables(seq, hd, theta, &scaling, self.rope)
            }
            false => (vec![1.0; seq * hd], vec![0.0; seq * hd]),
        }
    }

    /// The RoPE base and scaling of the class in force.
    fn class_rope(&self) -> (f64, RopeScaling) {
        match (self.class.local_rope, self.local_rope_theta) {
            (true, Some(local)) => (local, RopeScaling::Default),
            _ => (self.rope_theta, self.rope_scaling.clone()),
        }
    }

    /// One position's RoPE row (`cos, sin [HD]`) of
    /// [`KernelOptions::exact_rope_tables`] of `len` positions.
    pub fn rope_row(&self, pos: usize, len: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        match self.class.rope {
            true => {
                let (theta, scaling) = self.class_rope();
                rope_row(pos, len, hd, theta, &scaling, self.rope)
            }
            false => (vec![1.0; hd], vec![0.0; hd]),
        }
    }

    /// RoPE tables as the twin should use them.
    pub fn rope_tables(&self, seq: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut c, mut s) = self.exact_rope_tables(seq, hd);
        if self.fp16_constants {
            mil::tensor::round_to_f16_in_place(&mut c);
            mil::tensor::round_to_f16_in_place(&mut s);
        }
        (c, s)
    }
}

/// Where each kernel's inputs and outputs live (the single source of offsets).
pub fn layout(kind: KernelKind, s: &Shape, o: &KernelOptions) -> KernelLayout {
    struct Layout<'a>(&'a Shape, &'a KernelOptions);
    impl KernelFn for Layout<'_> {
        type Output = KernelLayout;
        fn call<K: Kernel>(self) -> KernelLayout {
            layout_of::<K>(self.0, self.1)
        }
    }
    kind.with(Layout(s, o))
}

/// [`layout()`] for a kernel type: its own regions, then its projections'
/// LoRA regions (padded so the width stays a multiple of 16).
pub fn layout_of<K: Kernel>(s: &Shape, o: &KernelOptions) -> KernelLayout {
    use Encoding::*;
    let mut b = LayoutBuilder::new(K::KIND.name(), s.seq);
    if !o.seed_compat {
        b.aligned(COLUMN_GROUP);
    }
    K::layout(&mut b, s, o);
    let mut adapted = false;
    for &(t, product) in K::PROJECTIONS {
        let Some((r, _)) = o.adapter(t) else { continue };
        let (out, inp) = s.projection(t);
        let (a, bn) = (Port::LoraA(t), Port::LoraB(t));
        // The rank padded with zeros to a multiple of 32, so the products
        // contracting over it do so over a multiple of 32 (see
        // `matmul-inner-32`); zero rows of A and columns of B add nothing.
        let rp = if o.seed_compat {
            r
        } else {
            r.div_ceil(COLUMN_GROUP) * COLUMN_GROUP
        };
        let (ha, hb) = (Some([r, inp]), Some([out, r]));
        match product {
            Product::Forward => b
                .columns_holding(a, inp, rp, Transposed, ha)
                .columns_holding(bn, rp, out, Transposed, hb),
            Product::ForwardRows | Product::Backward => b
                .columns_holding(bn, out, rp, AsIs, hb)
                .columns_holding(a, rp, inp, AsIs, ha),
        };
        adapted = true;
    }
    if adapted {
        b.pad_spatial_to(16);
    }
    // fp16 surfaces: two bytes an element.
    b.pad_to_min_elems(o.min_surface_bytes.div_ceil(2), o.limits.max_spatial);
    if !o.joins_outputs() {
        // Several outputs: the device sizes their surfaces (see `build`).
        b.unpadded_output();
    }
    b.build()
}

/// The device's column group, the one granularity of every layout and
/// length: the smallest surface width the device accepts
/// (apple-neural-engine-field-guide README.md, "The SP=32 Constraint"),
/// sequence strides multiples of 16 (Orion core/ane_runtime.m), products
/// contracting over the sequence multiples of 32 (maderix/ANE PR #47).
/// Aligned layouts ([`KernelLayout::view`]) group columns by it, LoRA ranks
/// and head chunks are padded to it, sequences are compiled at multiples
/// of it ([`compiled_length`]) and sequence tiles are blocks of it.
pub const COLUMN_GROUP: usize = 32;

/// The length a kernel set is compiled for to run `seq` positions: a
/// power-of-two multiple of [`COLUMN_GROUP`], so rows of many lengths
/// share a few sets.
pub fn compiled_length(seq: usize) -> usize {
    seq.div_ceil(COLUMN_GROUP).next_power_of_two() * COLUMN_GROUP
}

/// A generated kernel: program, the blob files it reads, its layout.
pub struct KernelProgram {
    pub kind: KernelKind,
    pub layout: KernelLayout,
    pub program: mil::Program,
    /// `(file name under weights/, blob file bytes)`
    pub blobs: Vec<(String, Vec<u8>)>,
}

impl KernelProgram {
    /// The program as MIL text.
    pub fn text(&self) -> String {
        mil::print(&self.program)
    }

    /// Blobs keyed by the path the text uses (`@model_path/weights/NAME`).
    pub fn blob_paths(&self) -> Vec<(String, Vec<u8>)> {
        self.blobs
            .iter()
            .map(|(n, b)| (format!("{}{n}", mil::blob::PATH_PREFIX), b.clone()))
            .collect()
    }
}

/// Generates `kind` for shape `s` with options `o`.
pub fn build(kind: KernelKind, s: &Shape, o: &KernelOptions) -> mil::Result<KernelProgram> {
    build_with(kind, s, o, true)
}

/// [`build`] without the constants' bytes (`blobs` empty, the program
/// naming them by role): what checking a program against the device's
/// rules needs. Planning builds many candidate tiles, and a whole
/// sequence's causal mask is `ratio·S²` values.
pub fn build_unfilled(
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
) -> mil::Result<KernelProgram> {
    build_with(kind, s, o, false)
}

fn build_with(
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
    fill: bool,
) -> mil::Result<KernelProgram> {
    struct Build<'a>(&'a Shape, &'a KernelOptions, bool);
    impl KernelFn for Build<'_> {
        type Output = mil::Result<KernelProgram>;
        fn call<K: Kernel>(self) -> Self::Output {
            build_of::<K>(self.0, self.1, self.2)
        }
    }
    kind.with(Build(s, o, fill))
}

fn build_of<K: Kernel>(s: &Shape, o: &KernelOptions, fill: bool) -> mil::Result<KernelProgram> {
    let layout = layout_of::<K>(s, o);
    // Seed-compatible programs stay the seed's; without `concat` there is
    // no way to pad.
    let multiple = match o.seed_compat || !o.limits.concat {
        true => 1,
        false => o.limits.inner_multiple,
    };
    let mut g = Gen::new(&layout).with_contraction_multiple(multiple);
    let blocks = K::mil(&mut g, s, o)?;
    let outputs = if o.joins_outputs() {
        let mut out = match blocks.as_slice() {
            [one] => one.clone(),
            _ => g.concat("out", &blocks.iter().collect::<Vec<_>>(), 1)?,
        };
        let pad = layout.out_padding();
        if pad > 0 {
            // Zero channels below the results, so the output surface reaches
            // the minimum size (concat along channels as the seed's outputs are).
            let file = format!("{BLOB_ZEROS}{pad}x{}.bin", s.seq);
            let zeros = g.blob("out_pad", [1, pad, 1, s.seq], &file)?;
            out = g.concat("out_padded", &[&out, &zeros], 1)?;
        }
        vec![out]
    } else {
        // One output per block, named so that name order (the order the
        // runtime binds output surfaces in: Orion docs/ane_constraints.md
        // §3) is the layout's; a reshape to the same shape moves nothing.
        blocks
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let name = format!("out{i:02}_{}", v.name);
                g.reshape(&name, v, v.dims())
            })
            .collect::<mil::Result<Vec<_>>>()?
    };
    let (mut function, blob_names) = g.finish(&outputs)?;
    if !fill {
        return Ok(KernelProgram {
            kind: K::KIND,
            layout,
            program: mil::Program::new(vec![function]),
            blobs: vec![],
        });
    }
    let blobs: Vec<(String, Vec<u8>)> = blob_names
        .into_iter()
        .map(|name| {
            let data = match name.as_str() {
                BLOB_MASK => causal_mask(s.seq, s.ratio(), o.class.window),
                BLOB_COS => o.exact_rope_tables(s.seq, s.head_dim).0,
                n if n.starts_with(BLOB_ROT) => {
                    let heads = n[BLOB_ROT.len()..n.len() - 4].parse().unwrap_or(1);
                    rope_rotation(heads, s.head_dim, o.rope)
                }
                // `zeros_{d0}x{d1}….bin`: as many zeros as the dims hold.
                n if n.starts_with(BLOB_ZEROS) => {
                    let count = n[BLOB_ZEROS.len()..n.len() - 4]
                        .split('x')
                        .map(|d| d.parse::<usize>().unwrap_or(0))
                        .product();
                    vec![0.0; count]
                }
                _ => o.exact_rope_tables(s.seq, s.head_dim).1,
            };
            (name, mil::blob::encode(&data))
        })
        .collect();
    let blobs = if o.seed_compat {
        blobs
    } else {
        name_by_content(&mut function, blobs)
    };
    Ok(KernelProgram {
        kind: K::KIND,
        layout,
        program: mil::Program::new(vec![function]),
        blobs,
    })
}

/// Renames every blob file after its content (`rope_cos.bin` →
/// `rope_cos.3f2a….bin`) in the file list and in the program's BLOBFILE
/// paths, so a program's text changes whenever a constant's bytes do. The
/// runtime keys compiled programs on the MIL text and the weight keys, not
/// the bytes (Orion core/ane_runtime.m: "Same hexId as donor (same
/// MIL text + weight dict keys)"): RoPE tables that differ only by
/// `rope_theta` would otherwise share one compiled program.
fn name_by_content(f: &mut mil::Function, blobs: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    use sha2::Digest;
    let renamed: Vec<(String, String, Vec<u8>)> = blobs
        .into_iter()
        .map(|(name, bytes)| {
            let digest = sha2::Sha256::digest(&bytes);
            let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
            let stem = name.strip_suffix(".bin").unwrap_or(&name);
            (name.clone(), format!("{stem}.{hex}.bin"), bytes)
        })
        .collect();
    for op in &mut f.ops {
        let Some(val) = op.val.as_mut() else { continue };
        if let mil::ir::ConstData::Blob { path, .. } = &mut val.data {
            if let Some((_, new, _)) = renamed
                .iter()
                .find(|(old, _, _)| path.strip_prefix(mil::blob::PATH_PREFIX) == Some(old))
            {
                *path = format!("{}{new}", mil::blob::PATH_PREFIX);
            }
        }
    }
    renamed.into_iter().map(|(_, new, b)| (new, b)).collect()
}

/// Runs kernel `kind`'s CPU twin on tensors by port (weights and
/// activations alike), returning its results by port: for checks and
/// tests, which build inputs from a layout. Panics if an activation is
/// missing (a test bug).
pub fn run_cpu(kind: KernelKind, s: &Shape, o: &KernelOptions, t: &Tensors) -> Tensors {
    struct Run<'a>(&'a Shape, &'a KernelOptions, &'a Tensors);
    impl KernelFn for Run<'_> {
        type Output = Tensors;
        fn call<K: Kernel>(self) -> Tensors {
            let Run(s, o, t) = self;
            let w = LayerWeights::from_tensors(t);
            let get = |p: Port| -> Option<&[f32]> { t.get(&p).map(|v| v.as_slice()) };
            let acts = K::Acts::from_lookup(&get);
            K::cpu(s, o, &w, &acts).into_ports().into_iter().collect()
        }
    }
    kind.with(Run(s, o, t))
}

/// fp16's smallest normal value, 2⁻¹⁴.
pub const F16_MIN_NORMAL: f64 = 6.103_515_625e-5;
/// fp16's largest finite value.
pub const F16_MAX: f64 = 65504.0;

pub(crate) const BLOB_MASK: &str = "mask.bin";
pub(crate) const BLOB_COS: &str = "rope_cos.bin";
pub(crate) const BLOB_SIN: &str = "rope_sin.bin";
/// RoPE's rotation as a matrix per head, `rope_rot_{heads}.bin`.
pub(crate) const BLOB_ROT: &str = "rope_rot_";
/// Zero channels padding an output, `zeros_{channels}x{seq}.bin`.
pub(crate) const BLOB_ZEROS: &str = "zeros_";
