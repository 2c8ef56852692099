//! The `config.json` a saved model carries: this model's configuration as
//! transformers writes it for its family (its defaults' keys, RoPE in both
//! spellings, a multimodal checkpoint's outer config around the text one).

use crate::model::config::{Arch, ModelConfig};
use crate::model::dtype::StoredDtype;

/// transformers 5's `rope_parameters`: θ and the scaling's keys (and
/// Phi's `partial_rotary_factor`).
fn rope_parameters(c: &ModelConfig) -> serde_json::Value {
    let mut p = c.rope_scaling.hf_keys();
    if let Some(o) = p.as_object_mut() {
        o.insert("rope_theta".into(), c.rope_theta.into());
        if c.partial_rotary.is_some() {
            o.insert(
                "partial_rotary_factor".into(),
                partial_rotary_factor(c).into(),
            );
        }
    }
    p
}

/// The `partial_rotary_factor` transformers turns back into the rotated
/// dimensions (`int(head_dim · factor)`): the quotient, or the next float
/// up where the product rounds below the count.
fn partial_rotary_factor(c: &ModelConfig) -> f64 {
    let (r, hd) = (c.rotary_dim() as f64, c.head_dim as f64);
    let mut f = r / hd;
    while ((hd * f) as usize) < c.rotary_dim() {
        f = f64::from_bits(f.to_bits() + 1);
    }
    f
}

/// A `config.json` `transformers` reads back to the same architecture: a
/// multimodal checkpoint's own, with this model's as its `text_config`.
pub fn hf_config_json(c: &ModelConfig, dtype: StoredDtype) -> String {
    let text = text_config_json(c, dtype);
    let Some(outer) = &c.multimodal else {
        return text;
    };
    let mut o = outer.clone();
    if let (Some(o), Ok(mut t)) = (
        o.as_object_mut(),
        serde_json::from_str::<serde_json::Value>(&text),
    ) {
        if let Some(t) = t.as_object_mut() {
            t.remove("architectures");
            t.remove("torch_dtype");
        }
        o.insert("text_config".into(), t);
        // Written as floats: the checkpoint's quantization is not this file's.
        o.remove("quantization");
        o.remove("quantization_config");
        o.insert("torch_dtype".into(), dtype_name(dtype).into());
    }
    serde_json::to_string_pretty(&o).unwrap_or_default()
}

/// transformers' name of a stored dtype.
fn dtype_name(dtype: StoredDtype) -> &'static str {
    match dtype {
        StoredDtype::F32 => "float32",
        StoredDtype::F16 => "float16",
        StoredDtype::BF16 => "bfloat16",
    }
}

/// The text model's `config.json`.
fn text_config_json(c: &ModelConfig, dtype: StoredDtype) -> String {
    let (arch, model_type) = (c.arch.class(), c.arch.model_type());
    let mut v = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope_parameters(c),
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "torch_dtype": dtype_name(dtype),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "use_cache": true,
    });
    let layer_types: Vec<&str> = (0..c.num_hidden_layers)
        .map(|i| match c.layer_class(i).window {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    let family = match c.arch {
        Arch::Granite => serde_json::json!({
            "embedding_multiplier": c.scales.embedding,
            "residual_multiplier": c.scales.residual,
            "attention_multiplier": c.score_scale(),
            "logits_scaling": c.scales.logits,
        }),
        Arch::Mistral => serde_json::json!({ "sliding_window": c.sliding_window }),
        Arch::Ministral => serde_json::json!({
            "sliding_window": c.sliding_window,
            "layer_types": layer_types,
        }),
        Arch::SmolLM3 => serde_json::json!({
            "no_rope_layers": (0..c.num_hidden_layers)
                .map(|i| u8::from(c.layer_class(i).rope))
                .collect::<Vec<u8>>(),
            "use_sliding_window": false,
        }),
        Arch::Gemma2 | Arch::Gemma3 => {
            let scalar = c.score_scale().powi(-2);
            let mut f = serde_json::json!({
                "sliding_window": c.sliding_window,
                "layer_types": layer_types,
                // An integer where it is one (Gemma's configs type it int).
                "query_pre_attn_scalar": match (scalar - scalar.round()).abs() < 1e-9 {
                    true => serde_json::json!(scalar.round() as i64),
                    false => serde_json::json!(scalar),
                },
                "hidden_activation": "gelu_pytorch_tanh",
                "hidden_act": "gelu_pytorch_tanh",
                "attn_logit_softcapping": c.scales.attention_cap,
                "final_logit_softcapping": c.scales.logits_cap,
            });
            if c.arch == Arch::Gemma3 {
                f["rope_local_base_freq"] = c.local_rope_theta.into();
                f["rope_parameters"] = serde_json::json!({
                    "full_attention": rope_parameters(c),
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": c.local_rope_theta,
                    },
                });
            }
            f
        }
        Arch::Phi3 => {
            let mut f = serde_json::json!({
                "sliding_window": c.sliding_window,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "partial_rotary_factor": partial_rotary_factor(c),
            });
            if let crate::model::config::RopeScaling::Longrope {
                original_max_position_embeddings,
                ..
            } = c.rope_scaling
            {
                f["original_max_position_embeddings"] = original_max_position_embeddings.into();
            }
            f
        }
        Arch::Llama | Arch::Qwen3 | Arch::Qwen2 | Arch::Olmo2 => serde_json::json!({}),
    };
    if let (Some(v), serde_json::Value::Object(f)) = (v.as_object_mut(), family) {
        v.extend(f);
    }
    if !c.rope_scaling.is_default() {
        // transformers 4's key, which mlx-lm and llama.cpp's converter read.
        if let Some(v) = v.as_object_mut() {
            v.insert("rope_scaling".into(), c.rope_scaling.hf_keys());
        }
    }
    serde_json::to_string_pretty(&v).unwrap_or_default()
}
