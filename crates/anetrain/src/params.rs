//! A model's parameters as plain data: the tensors, the table of one
//! decoder layer's tensor indices, and the seven weight projections (what
//! kernels multiply by and LoRA adapters attach to).

use crate::config::ModelConfig;

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Hugging Face tensor name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    /// Weight decay applies (matrices and embeddings, never norm weights).
    pub decay: bool,
}

/// Indices into [`Model::params`](crate::model::Model::params) of one layer's tensors.
#[derive(Clone, Copy, Debug)]
pub struct LayerIds {
    pub attn_norm: usize,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub ffn_norm: usize,
    pub w1: usize,
    pub w3: usize,
    pub w2: usize,
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
/// kernel regions of LoRA's A and B.
#[rustfmt::skip]
const PROJECTION_NAMES: [(&str, &str, &str, &str, &str); 7] = [
    ("q_proj", "self_attn.q_proj", "wq", "wq_lora_a", "wq_lora_b"),
    ("k_proj", "self_attn.k_proj", "wk", "wk_lora_a", "wk_lora_b"),
    ("v_proj", "self_attn.v_proj", "wv", "wv_lora_a", "wv_lora_b"),
    ("o_proj", "self_attn.o_proj", "wo", "wo_lora_a", "wo_lora_b"),
    ("gate_proj", "mlp.gate_proj", "w1", "w1_lora_a", "w1_lora_b"),
    ("up_proj", "mlp.up_proj", "w3", "w3_lora_a", "w3_lora_b"),
    ("down_proj", "mlp.down_proj", "w2", "w2_lora_a", "w2_lora_b"),
];

impl Projection {
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
        match self {
            Projection::Q => l.wq,
            Projection::K => l.wk,
            Projection::V => l.wv,
            Projection::O => l.wo,
            Projection::Gate => l.w1,
            Projection::Up => l.w3,
            Projection::Down => l.w2,
        }
    }
}

impl crate::choice::Choice for Projection {
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

impl Projection {
    /// `[out, in]` of this projection in a model of configuration `cfg`.
    pub fn shape(self, cfg: &ModelConfig) -> (usize, usize) {
        let d = cfg.hidden_size;
        let (q, kv) = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        );
        match self {
            Projection::Q => (q, d),
            Projection::K | Projection::V => (kv, d),
            Projection::O => (d, q),
            Projection::Gate | Projection::Up => (cfg.intermediate_size, d),
            Projection::Down => (d, cfg.intermediate_size),
        }
    }
}
