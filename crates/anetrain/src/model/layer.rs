//! A decoder layer as data: its token mixer, its MLP, and where its norms
//! sit. An architecture is a description over these parts (Qwen3 and
//! Llama are two); the weights' layout, the parameter count, the engine,
//! the kernel set, the memory plan and the decoder read it, so a new
//! architecture adds a part where it differs, not a branch in each.
//!   pre-norm:  h = x + α·mixer(rmsnorm(x)·w₁),  x' = h + α·mlp(rmsnorm(h)·w₂)
//!   sandwich:  h = x + rmsnorm(mixer(rmsnorm(x)·w₁))·v₁,  x' = h + rmsnorm(mlp(rmsnorm(h)·w₂))·v₂
//!   post-norm: h = x + rmsnorm(mixer(x))·v₁,  x' = h + rmsnorm(mlp(h))·v₂
//!   mixer = attention(rope(qknorm(Wq·)), rope(qknorm(Wk·)), Wv·)·Wo,  mlp = W_down·(act(W_gate·) ⊙ W_up·)

use serde::Serialize;

/// The sizes a layer's parts are made of (from the model's configuration,
/// `ModelConfig::layer_dims`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDims {
    /// The residual stream's width `D`.
    pub hidden: usize,
    /// Queries' and keys'/values' widths (heads · head_dim).
    pub q: usize,
    pub kv: usize,
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
}

/// Indices into [`Model::params`](crate::model::Model::params) of one
/// layer's tensors, by their role in the layer's description
/// ([`LayerSpec`]).
#[derive(Clone, Copy, Debug)]
pub struct LayerIds {
    /// The RMSNorm weights before the mixer and before the MLP, where the
    /// layer has them (not [`Norms::Post`]).
    pub mixer_norm: Option<usize>,
    pub mlp_norm: Option<usize>,
    /// The RMSNorm weights on the mixer's and the MLP's outputs, where
    /// the layer has them ([`Norms::Sandwich`], [`Norms::Post`]).
    pub post_norms: [Option<usize>; 2],
    /// The weight projections, by [`Projection::index`].
    pub projections: [usize; 7],
    /// The mixer's query and key norms (QK-norm: per head, or over the
    /// whole projection, [`QkNorm`]).
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    /// The projections' biases `[out]`, by [`Projection::index`] (Qwen2's
    /// q, k and v).
    pub biases: [Option<usize>; 7],
}

/// One of a decoder layer's seven weight projections (what a LoRA adapter
/// attaches to, what a kernel multiplies by).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// The names each projection goes by, by [`Projection::index`]: Hugging
/// Face module, module path inside a decoder layer, kernel weight region,
/// kernel regions of LoRA's A and B, the weight's tensor name inside a
/// decoder layer.
#[rustfmt::skip]
const PROJECTION_NAMES: [(&str, &str, &str, &str, &str, &str); 7] = [
    ("q_proj", "self_attn.q_proj", "wq", "wq_lora_a", "wq_lora_b", "self_attn.q_proj.weight"),
    ("k_proj", "self_attn.k_proj", "wk", "wk_lora_a", "wk_lora_b", "self_attn.k_proj.weight"),
    ("v_proj", "self_attn.v_proj", "wv", "wv_lora_a", "wv_lora_b", "self_attn.v_proj.weight"),
    ("o_proj", "self_attn.o_proj", "wo", "wo_lora_a", "wo_lora_b", "self_attn.o_proj.weight"),
    ("gate_proj", "mlp.gate_proj", "w1", "w1_lora_a", "w1_lora_b", "mlp.gate_proj.weight"),
    ("up_proj", "mlp.up_proj", "w3", "w3_lora_a", "w3_lora_b", "mlp.up_proj.weight"),
    ("down_proj", "mlp.down_proj", "w2", "w2_lora_a", "w2_lora_b", "mlp.down_proj.weight"),
];

/// Each projection's bias: its tensor name in a decoder layer, its kernel
/// region (by [`Projection::index`]).
const PROJECTION_BIAS_NAMES: [&str; 7] = [
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "mlp.gate_proj.bias",
    "mlp.up_proj.bias",
    "mlp.down_proj.bias",
];
const PROJECTION_BIAS_REGIONS: [&str; 7] = ["bq", "bk", "bv", "bo", "b1", "b3", "b2"];

/// Projections a family stores (and PEFT adapts) as one matrix, their
/// rows stacked in order: Phi-3's `qkv_proj` and `gate_up_proj`. Training
/// holds the parts apart; loading splits the stored matrix by rows and
/// saving stacks the parts again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fused {
    /// The Hugging Face module name (`qkv_proj`).
    pub module: &'static str,
    /// The module path inside a decoder layer (`self_attn.qkv_proj`).
    pub path: &'static str,
    pub parts: &'static [Projection],
}

/// Phi-3's fused projections (transformers `Phi3Attention.qkv_proj`,
/// `Phi3MLP.gate_up_proj`: gate's rows before up's).
pub const PHI3_FUSED: [Fused; 2] = [
    Fused {
        module: "qkv_proj",
        path: "self_attn.qkv_proj",
        parts: &[Projection::Q, Projection::K, Projection::V],
    },
    Fused {
        module: "gate_up_proj",
        path: "mlp.gate_up_proj",
        parts: &[Projection::Gate, Projection::Up],
    },
];

impl Projection {
    /// `(out, in)` of the projection's weight for a model dimension `dim`,
    /// an FFN of `hidden`, and query and key/value widths `q` and `kv`: the
    /// one place projection shapes are written.
    pub fn dims(self, dim: usize, hidden: usize, q: usize, kv: usize) -> (usize, usize) {
        match self {
            Projection::Q => (q, dim),
            Projection::K | Projection::V => (kv, dim),
            Projection::O => (dim, q),
            Projection::Gate | Projection::Up => (hidden, dim),
            Projection::Down => (dim, hidden),
        }
    }

    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// Position in [`Projection::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Hugging Face module name (`q_proj`).
    pub fn module(self) -> &'static str {
        PROJECTION_NAMES[self.index()].0
    }

    /// Module path inside a decoder layer (`self_attn.q_proj`).
    pub fn path(self) -> &'static str {
        PROJECTION_NAMES[self.index()].1
    }

    /// The weight's tensor name inside a decoder layer
    /// (`self_attn.q_proj.weight`).
    pub fn weight_name(self) -> &'static str {
        PROJECTION_NAMES[self.index()].5
    }

    /// The bias's tensor name inside a decoder layer
    /// (`self_attn.q_proj.bias`).
    pub fn bias_name(self) -> &'static str {
        PROJECTION_BIAS_NAMES[self.index()]
    }

    /// The kernel region of the projection's bias (`bq`).
    pub fn bias_region(self) -> &'static str {
        PROJECTION_BIAS_REGIONS[self.index()]
    }

    /// The kernel weight region of the base projection (`wq`).
    pub fn region(self) -> &'static str {
        PROJECTION_NAMES[self.index()].2
    }

    /// Kernel regions of A and B (`wq_lora_a`, `wq_lora_b`).
    pub fn adapter_regions(self) -> (&'static str, &'static str) {
        let n = PROJECTION_NAMES[self.index()];
        (n.3, n.4)
    }

    pub fn from_module(name: &str) -> Option<Projection> {
        Projection::ALL.into_iter().find(|t| t.module() == name)
    }

    /// The base weight's index in the model's parameter list.
    pub fn base(self, l: &LayerIds) -> usize {
        l.projections[self.index()]
    }
}

impl crate::util::choice::Choice for Projection {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (Projection::Q, "q", "self_attn.q_proj"),
        (Projection::K, "k", "self_attn.k_proj"),
        (Projection::V, "v", "self_attn.v_proj"),
        (Projection::O, "o", "self_attn.o_proj"),
        (Projection::Gate, "gate", "mlp.gate_proj"),
        (Projection::Up, "up", "mlp.up_proj"),
        (Projection::Down, "down", "mlp.down_proj"),
    ];
}

impl LayerDims {
    /// Projection `p`'s bias as a layer parameter (`[out]`, not decayed).
    fn bias(&self, p: Projection) -> LayerParam {
        let (out, _) = p.dims(self.hidden, self.intermediate, self.q, self.kv);
        LayerParam {
            role: Role::Bias(p),
            name: p.bias_name(),
            shape: vec![out],
            decay: false,
        }
    }

    /// Projection `p`'s weight as a layer parameter (`[out, in]`, decayed).
    fn matrix(&self, p: Projection) -> LayerParam {
        let (out, inp) = p.dims(self.hidden, self.intermediate, self.q, self.kv);
        LayerParam {
            role: Role::Projection(p),
            name: p.weight_name(),
            shape: vec![out, inp],
            decay: true,
        }
    }
}

/// One decoder layer's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    pub mixer: Mixer,
    pub mlp: Mlp,
    pub norms: Norms,
}

/// What mixes information across positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mixer {
    /// Causal grouped-query attention with rotary positions (Hugging
    /// Face's `rotate_half`) on queries and keys; `qk_norm`: an RMSNorm on
    /// each before RoPE ([`QkNorm`]); `qkv_bias`: biases on the q, k and v
    /// projections (Qwen2).
    Attention { qk_norm: QkNorm, qkv_bias: bool },
}

/// Where the attention normalises its queries and keys before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// Each head's vector over its `head_dim`, one weight `[HD]` shared by
    /// the heads (Qwen3, Gemma 3).
    PerHead,
    /// The whole projection of a position, every head at once, a weight
    /// `[heads·HD]` (OLMo 2's `q_norm`, `k_norm`).
    Whole,
}

/// The position-wise MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    /// `down(silu(gate·x) ⊙ up·x)` (Llama's, Qwen's).
    SwiGlu,
    /// `down(gelu(gate·x) ⊙ up·x)` with GELU's tanh form (Gemma's
    /// `gelu_pytorch_tanh`).
    GeGlu,
}

/// Where the layer's RMSNorms sit around its two sublayers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Norms {
    /// One before each sublayer; the residual adds the sublayer's output
    /// (`input_layernorm`, `post_attention_layernorm`).
    Pre,
    /// One before and one after each sublayer; the residual adds the
    /// normed output (Gemma's `input_layernorm`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    Sandwich,
    /// One after each sublayer only: the sublayer reads the residual
    /// stream as it is (OLMo 2's `post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    Post,
}

impl Norms {
    /// Whether a norm follows each sublayer's output.
    pub fn after(self) -> bool {
        matches!(self, Norms::Sandwich | Norms::Post)
    }

    /// Whether a norm precedes each sublayer.
    pub fn before(self) -> bool {
        matches!(self, Norms::Pre | Norms::Sandwich)
    }
}

/// The two sublayers, in the order a layer runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sublayer {
    Mixer,
    Mlp,
}

/// What a layer parameter is to the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The RMSNorm weight before a sublayer (`[D]`).
    Norm(Sublayer),
    /// The RMSNorm weight on a sublayer's output (`[D]`).
    PostNorm(Sublayer),
    /// A weight projection (what LoRA adapts, what kernels multiply by).
    Projection(Projection),
    /// The per-head RMSNorm weights of queries and keys (`[HD]`).
    QNorm,
    KNorm,
    /// A projection's bias (`[out]`).
    Bias(Projection),
}

/// One parameter of a layer: its role, its Hugging Face name under
/// `model.layers.{i}.`, its shape, and whether weight decay applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerParam {
    pub role: Role,
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub decay: bool,
}

impl LayerSpec {
    /// Whether the mixer normalises queries and keys (per head or whole).
    pub fn qk_norm(&self) -> bool {
        self.qk_norm_kind() != QkNorm::None
    }

    /// How the mixer normalises queries and keys.
    pub fn qk_norm_kind(&self) -> QkNorm {
        match self.mixer {
            Mixer::Attention { qk_norm, .. } => qk_norm,
        }
    }

    /// The widths the query and key norms' weights hold (`[HD]` each per
    /// head, the projections' widths over the whole), given the head
    /// dimension and the q and kv widths.
    pub fn qk_norm_widths(&self, hd: usize, q: usize, kv: usize) -> (usize, usize) {
        match self.qk_norm_kind() {
            QkNorm::Whole => (q, kv),
            QkNorm::PerHead | QkNorm::None => (hd, hd),
        }
    }

    /// The projections with a bias (none, or Qwen2's q, k and v).
    pub fn biased(&self) -> &'static [Projection] {
        match self.mixer {
            Mixer::Attention { qkv_bias: true, .. } => {
                &[Projection::Q, Projection::K, Projection::V]
            }
            Mixer::Attention { .. } => &[],
        }
    }

    /// The layer's parameters in the order the layer meets them (the
    /// order of Hugging Face's checkpoints and of ours): each sublayer's
    /// norm (pre-norm), then the sublayer's own.
    pub fn params(&self, dims: &LayerDims) -> Vec<LayerParam> {
        let mut out = Vec::new();
        for sub in [Sublayer::Mixer, Sublayer::Mlp] {
            if self.norms.before() {
                out.push(self.norm(dims, Role::Norm(sub)));
            }
            match sub {
                Sublayer::Mixer => out.extend(self.mixer_params(dims)),
                Sublayer::Mlp => out.extend(self.mlp_params(dims)),
            }
            if self.norms.after() {
                out.push(self.norm(dims, Role::PostNorm(sub)));
            }
        }
        out
    }

    fn norm(&self, dims: &LayerDims, role: Role) -> LayerParam {
        use Sublayer::*;
        let name = match (self.norms, role) {
            (_, Role::Norm(Mixer)) => "input_layernorm.weight",
            (Norms::Pre, Role::Norm(Mlp)) => "post_attention_layernorm.weight",
            (Norms::Sandwich, Role::Norm(Mlp)) => "pre_feedforward_layernorm.weight",
            (_, Role::PostNorm(Mixer)) => "post_attention_layernorm.weight",
            (_, _) => "post_feedforward_layernorm.weight",
        };
        LayerParam {
            role,
            name,
            shape: vec![dims.hidden],
            decay: false,
        }
    }

    fn mixer_params(&self, dims: &LayerDims) -> Vec<LayerParam> {
        let (qw, kw) = self.qk_norm_widths(dims.head_dim, dims.q, dims.kv);
        let matrix = |p: Projection| dims.matrix(p);
        let norm = |role, name, width| LayerParam {
            role,
            name,
            shape: vec![width],
            decay: false,
        };
        match self.mixer {
            Mixer::Attention { .. } => {
                let mut out = vec![];
                for p in [Projection::Q, Projection::K, Projection::V, Projection::O] {
                    out.push(matrix(p));
                    if self.biased().contains(&p) {
                        out.push(dims.bias(p));
                    }
                }
                if self.qk_norm() {
                    out.push(norm(Role::QNorm, "self_attn.q_norm.weight", qw));
                    out.push(norm(Role::KNorm, "self_attn.k_norm.weight", kw));
                }
                out
            }
        }
    }

    fn mlp_params(&self, dims: &LayerDims) -> Vec<LayerParam> {
        match self.mlp {
            Mlp::SwiGlu | Mlp::GeGlu => [Projection::Gate, Projection::Up, Projection::Down]
                .map(|p| dims.matrix(p))
                .to_vec(),
        }
    }

    /// Values one layer's forward keeps for its backward, per position:
    /// `(host, kernels)` — the host's (the residual stream and the norms'
    /// outputs, in f32) and the kernels' outputs (in f16 when a device
    /// made them). The engine's `LayerActs` holds exactly these.
    pub fn kept_per_position(&self, dims: &LayerDims) -> (usize, usize) {
        let (d, q, kv, h) = (dims.hidden, dims.q, dims.kv, dims.intermediate);
        // Each sublayer's input and its normed input (and, normed
        // after, its output).
        // (Post-norm layers keep their inputs twice: the sublayer's input
        // is its "normed" input.)
        let host = match self.norms {
            Norms::Pre => 4 * d,
            Norms::Sandwich | Norms::Post => 6 * d,
        };
        let mixer = match self.mixer {
            // attn, q_rope, k_rope, v (+ q and k before RoPE, for QK-norm's backward)
            Mixer::Attention { .. } => {
                let raw = usize::from(self.qk_norm());
                (2 + raw) * q + (2 + raw) * kv
            }
        };
        let mlp = match self.mlp {
            // h1 = gate·x, h3 = up·x, act(h1)·h3
            Mlp::SwiGlu | Mlp::GeGlu => 3 * h,
        };
        (host, mixer + mlp)
    }
}

/// What may differ between one model's layers besides their weights: the
/// attention's positions and reach (SmolLM3 leaves RoPE out of every
/// fourth layer, `no_rope_layers`; Mistral's layers see a window of keys).
/// Layers of one class run the same programs with the same constants
/// (`ModelConfig::layer_class`, `KernelOptions::for_layer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerClass {
    /// Rotary positions on queries and keys; `false`: none (NoPE). A NoPE
    /// layer's RoPE tables are cos = 1, sin = 0, which makes the rotation
    /// exactly the identity (x·1 + r·0 = x in f32 and fp16), so its
    /// programs are its siblings' with other tables.
    pub rope: bool,
    /// A query sees itself and the `W − 1` keys before it
    /// (`kernels::visible_keys`); `None`, every earlier key.
    pub window: Option<usize>,
    /// RoPE of the model's local base, unscaled (Gemma's windowed layers:
    /// `ModelConfig::local_rope_theta`), not of `rope_theta`.
    pub local_rope: bool,
}

impl Default for LayerClass {
    fn default() -> LayerClass {
        LayerClass {
            rope: true,
            window: None,
            local_rope: false,
        }
    }
}
