//! Helpers shared by the fixture-based tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `testdata/fixtures/<kind>` (written by `scripts/make_fixtures.py`).
pub fn fixture(kind: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(kind)
}

/// The fixture's token rows (`tokens.npy`, `[batch, n+1]`).
pub fn tokens(dir: &Path) -> Vec<Vec<u32>> {
    let a = npy::read(&dir.join("tokens.npy")).unwrap();
    let npy::NpyData::Int(v) = a.data else {
        panic!("tokens not int")
    };
    v.chunks(a.shape[1])
        .map(|r| r.iter().map(|&t| t as u32).collect())
        .collect()
}

/// A float `.npy` file's values.
pub fn floats(p: &Path) -> Vec<f32> {
    let npy::NpyData::Float(v) = npy::read(p).unwrap().data else {
        panic!("{} not float", p.display())
    };
    v
}

pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Largest difference relative to `b`'s largest magnitude.
pub fn rel(a: &[f32], b: &[f32]) -> f32 {
    max_diff(a, b) / max_abs(b)
}

/// The trainer's loss over whole token rows (every target counted) and,
/// with `grads`, its gradient: the first half of the training step
/// (`anetrain::train::step::batch_loss`, SFT), as `train` runs it. Returns
/// the mean loss and the number of targets. The step may swap a
/// reference's adapters into the model it trains, so it takes the model
/// mutably: it runs on a copy here (SFT changes nothing in it).
pub fn batch_loss<R: anetrain::device::KernelRunner>(
    eng: &mut anetrain::engine::Engine<R>,
    model: &anetrain::model::Model,
    rows: &[Vec<u32>],
    grads: Option<&mut anetrain::engine::Grads>,
) -> anyhow::Result<(f64, usize)> {
    use anetrain::train::step::{batch_loss, Backward, Batch, Loss};
    let batch = Batch::Examples(
        rows.iter()
            .map(|r| anetrain::data::records::Example {
                tokens: r.clone(),
                offset: 0,
            })
            .collect(),
    );
    let never = || false;
    let mut model = model.clone();
    let sft = &mut Loss::sft();
    let b = batch_loss(
        eng,
        &mut model,
        sft,
        &batch,
        grads.map(Backward::plain),
        &never,
    )?
    .expect("never stopped");
    Ok((b.loss, b.targets))
}

/// Every transformers fixture (`scripts/make_fixtures.py`): one per family,
/// Llama with Llama 3.1's RoPE scaling and Qwen3 with YaRN's.
#[allow(dead_code)]
pub const FAMILIES: [&str; 14] = [
    "qwen3",
    "llama",
    "mistral",
    "granite",
    "qwen2",
    "llama3",
    "yarn",
    "smollm3",
    "ministral",
    "gemma3",
    "phi3",
    "gemma3mm",
    "gemma2",
    "olmo2",
];

/// Per-parameter values (in `model.params` order) from tensors in Hugging
/// Face's layout: a fused matrix (Phi-3's `qkv_proj`) split by rows into
/// its parts.
pub fn per_param(
    model: &anetrain::model::Model,
    hf: &std::collections::BTreeMap<String, anetrain::model::tensor_file::Tensor>,
) -> Vec<Vec<f32>> {
    let mut out = vec![vec![]; model.params.len()];
    for t in model.hf_tensors().into_iter().filter(|t| t.extra.is_none()) {
        let data = &hf[&t.name].data;
        let mut at = 0;
        for &id in &t.parts {
            let n = model.params[id]
                .data
                .len()
                .max(model.params[id].shape.iter().product());
            out[id] = data[at..at + n].to_vec();
            at += n;
        }
    }
    out
}

/// Per-parameter values (`model.params` order) in Hugging Face's layout:
/// `(name, values)`, a fused matrix's parts stacked (a multimodal
/// checkpoint's other tensors left out).
pub fn hf_layout(model: &anetrain::model::Model, values: &[Vec<f32>]) -> Vec<(String, Vec<f32>)> {
    model
        .hf_tensors()
        .into_iter()
        .filter(|t| t.extra.is_none())
        .map(|t| {
            let v = t
                .parts
                .iter()
                .flat_map(|&id| values[id].iter().copied())
                .collect();
            (t.name, v)
        })
        .collect()
}

/// Each position's next-token logits as a full forward over the tokens up
/// to it computes them (what a KV-cache decoder must equal): one forward
/// over the whole row, but where RoPE's frequencies follow the length
/// (LongRoPE) a forward over the prefix for the positions short of the
/// switch.
pub fn prefix_logits<R: anetrain::device::KernelRunner>(
    eng: &mut anetrain::engine::Engine<R>,
    model: &anetrain::model::Model,
    row: &[u32],
) -> Vec<Vec<f32>> {
    let v = model.cfg.vocab_size;
    let fwd = eng.forward(model, row, None).unwrap();
    let full = eng.logits(model, &fwd.xf).unwrap();
    (0..row.len())
        .map(|p| match model.cfg.rope_scaling.switches_after() {
            Some(n) if p < n => {
                let fwd = eng.forward(model, &row[..=p], None).unwrap();
                eng.logits(model, &fwd.xf).unwrap()[p * v..].to_vec()
            }
            _ => full[p * v..(p + 1) * v].to_vec(),
        })
        .collect()
}
