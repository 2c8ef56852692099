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
mod options;
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
pub use options::{KernelOptions, LoraKernel, MAX_TILE_BYTES};
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
