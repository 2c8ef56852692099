//! `anetrain export gguf`: a minimal GGUF reader (written from llama.cpp's
//! `docs/gguf.md`, independent of the writer) finds every tensor, shape,
//! type and metadata key the export wrote; f16 tensors are the model's
//! values rounded, q8_0 blocks dequantise to within half a block scale,
//! llama q/k rows are in adjacent-pair RoPE order; and the one-line errors.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{bin, fails, one_line_error, tmp};

#[derive(Debug, Clone, PartialEq)]
enum Meta {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
    Other,
}

struct Tensor {
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

struct Gguf {
    meta: HashMap<String, Meta>,
    tensors: HashMap<String, Tensor>,
    data_start: usize,
    bytes: Vec<u8>,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
    fn value(&mut self, ty: u32) -> Meta {
        match ty {
            0 | 1 => {
                self.take(1);
                Meta::Other
            }
            2 | 3 => {
                self.take(2);
                Meta::Other
            }
            4 => Meta::U32(self.u32()),
            5 => Meta::I32(self.u32() as i32),
            6 => Meta::F32(f32::from_bits(self.u32())),
            7 => Meta::Bool(self.take(1)[0] != 0),
            8 => Meta::Str(self.string()),
            9 => {
                let elem = self.u32();
                let n = self.u64();
                Meta::Array((0..n).map(|_| self.value(elem)).collect())
            }
            10..=12 => {
                self.take(8);
                Meta::Other
            }
            t => panic!("unknown metadata type {t}"),
        }
    }
}

fn read_gguf(path: &Path) -> Gguf {
    let bytes = std::fs::read(path).unwrap();
    let mut c = Cursor { b: &bytes, at: 0 };
    assert_eq!(c.take(4), b"GGUF");
    assert_eq!(c.u32(), 3, "version");
    let n_tensors = c.u64();
    let n_meta = c.u64();
    let mut meta = HashMap::new();
    for _ in 0..n_meta {
        let key = c.string();
        let ty = c.u32();
        let v = c.value(ty);
        assert!(meta.insert(key.clone(), v).is_none(), "{key} twice");
    }
    let mut tensors = HashMap::new();
    for _ in 0..n_tensors {
        let name = c.string();
        let nd = c.u32();
        let dims = (0..nd).map(|_| c.u64()).collect();
        let ty = c.u32();
        let offset = c.u64();
        assert_eq!(offset % 32, 0, "{name} offset");
        tensors.insert(name, Tensor { dims, ty, offset });
    }
    let data_start = c.at.next_multiple_of(32);
    Gguf {
        meta,
        tensors,
        data_start,
        bytes,
    }
}

impl Gguf {
    /// The tensor's values as f32 (F32, F16 or Q8_0), and the Q8_0 scale
    /// of each value's block (0 for the others).
    fn values(&self, name: &str) -> (Vec<f32>, Vec<f32>) {
        let t = &self.tensors[name];
        let n: u64 = t.dims.iter().product();
        let n = n as usize;
        let at = self.data_start + t.offset as usize;
        let b = &self.bytes[at..];
        match t.ty {
            0 => (
                (0..n)
                    .map(|i| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()))
                    .collect(),
                vec![0.0; n],
            ),
            1 => (
                (0..n)
                    .map(|i| half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32())
                    .collect(),
                vec![0.0; n],
            ),
            8 => {
                let (mut v, mut s) = (vec![], vec![]);
                for blk in b[..n / 32 * 34].chunks(34) {
                    let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    v.extend(blk[2..].iter().map(|&q| q as i8 as f32 * d));
                    s.extend([d; 32]);
                }
                (v, s)
            }
            t => panic!("{name}: type {t}"),
        }
    }

    fn str(&self, key: &str) -> &str {
        match &self.meta[key] {
            Meta::Str(s) => s,
            m => panic!("{key}: {m:?}"),
        }
    }

    fn u32(&self, key: &str) -> u32 {
        match &self.meta[key] {
            Meta::U32(v) => *v,
            m => panic!("{key}: {m:?}"),
        }
    }
}

/// A model directory's tensors by Hugging Face name: shape and f32 values.
fn safetensors(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = HashMap::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(t["dtype"], "F32", "{name}");
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let off = t["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let v = data[a..b]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), (shape, v));
    }
    out
}

fn gguf_name(hf: &str) -> String {
    let map = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.").unwrap();
            let (l, s) = rest.split_once('.').unwrap();
            let s = s.strip_suffix(".weight").unwrap();
            let g = map.iter().find(|(h, _)| *h == s).unwrap().1;
            format!("blk.{l}.{g}.weight")
        }
    }
}

fn chat_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat/model")
}

/// A LoRA adapter of the chat model, trained for `steps` steps into
/// `dir/adapter`.
fn chat_adapter(dir: &Path, rank: &str, steps: &str) -> PathBuf {
    let adapter = dir.join("adapter");
    let (model, data) = (chat_model(), chat_model().join("../data/chat"));
    let args = [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    let rest = [
        "--lora-rank",
        rank,
        "--steps",
        steps,
        "--lr",
        "1e-2",
        "--seq",
        "64",
    ];
    let run = [
        &args[..],
        &rest[..],
        &["--eval-every", "0", "--backend", "cpu"],
    ]
    .concat();
    common::run(&run, &adapter);
    adapter
}

fn export(args: &[&str]) -> String {
    let o = bin().args(["export", "gguf"]).args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Every tensor of the Qwen3 chat model, with a LoRA adapter merged in,
/// in f16 and q8_0: names, shapes (innermost first), types, values; the
/// metadata llama.cpp reads, the tokenizer and the chat template.
#[test]
fn a_qwen3_model_with_an_adapter_round_trips() {
    let t = tmp();
    let adapter = chat_adapter(t.path(), "8", "3");
    // The reference: the merged model as `merge` writes it.
    let merged = t.path().join("merged");
    let o = bin()
        .args([
            "merge",
            "--model",
            chat_model().to_str().unwrap(),
            "--adapter",
        ])
        .arg(&adapter)
        .arg("--out")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = safetensors(&merged);
    let base = safetensors(&chat_model());
    assert!(
        want["model.layers.0.self_attn.q_proj.weight"].1
            != base["model.layers.0.self_attn.q_proj.weight"].1,
        "the adapter changes the weights"
    );

    for ty in ["f16", "q8_0"] {
        let out = t.path().join(format!("chat-{ty}.gguf"));
        let printed = export(&[
            "--model",
            chat_model().to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--type",
            ty,
        ]);
        assert!(printed.contains("llama-cli -m"), "{printed}");
        let g = read_gguf(&out);
        assert_eq!(g.str("general.architecture"), "qwen3");
        assert_eq!(g.u32("qwen3.block_count"), 2);
        assert_eq!(g.u32("qwen3.embedding_length"), 64);
        assert_eq!(g.u32("qwen3.feed_forward_length"), 96);
        assert_eq!(g.u32("qwen3.attention.head_count"), 4);
        assert_eq!(g.u32("qwen3.attention.head_count_kv"), 2);
        assert_eq!(g.u32("qwen3.attention.key_length"), 16);
        assert_eq!(g.u32("qwen3.context_length"), 1024);
        assert_eq!(g.meta["qwen3.rope.freq_base"], Meta::F32(1e6));
        assert_eq!(
            g.meta["qwen3.attention.layer_norm_rms_epsilon"],
            Meta::F32(1e-6)
        );
        assert_eq!(g.u32("general.file_type"), if ty == "f16" { 1 } else { 7 });
        assert_eq!(g.str("tokenizer.ggml.model"), "gpt2");
        assert_eq!(g.str("tokenizer.ggml.pre"), "gpt-2");
        let Meta::Array(tokens) = &g.meta["tokenizer.ggml.tokens"] else {
            panic!()
        };
        assert_eq!(tokens.len(), 360);
        assert_eq!(tokens[2], Meta::Str("<|im_end|>".into()));
        let Meta::Array(types) = &g.meta["tokenizer.ggml.token_type"] else {
            panic!()
        };
        assert_eq!(types[2], Meta::I32(3), "special tokens are CONTROL");
        assert!(matches!(&g.meta["tokenizer.ggml.merges"], Meta::Array(m) if !m.is_empty()));
        assert_eq!(g.u32("tokenizer.ggml.eos_token_id"), 2);
        assert_eq!(
            g.str("tokenizer.chat_template"),
            std::fs::read_to_string(chat_model().join("chat_template.jinja")).unwrap()
        );

        // Tied embeddings: no output.weight; every other tensor is there.
        assert_eq!(g.tensors.len(), want.len());
        assert!(!g.tensors.contains_key("output.weight"));
        for (hf, (shape, values)) in &want {
            let name = gguf_name(hf);
            let tensor = &g.tensors[&name];
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            assert_eq!(tensor.dims, dims, "{name}");
            let (got, scale) = g.values(&name);
            let expect_ty = match (shape.len(), ty) {
                (1, _) => 0,
                (_, "f16") => 1,
                _ => 8,
            };
            assert_eq!(tensor.ty, expect_ty, "{name}");
            for (i, (&a, &b)) in got.iter().zip(values).enumerate() {
                let ok = match expect_ty {
                    0 => a == b,
                    1 => a == half::f16::from_f32(b).to_f32(),
                    // Within half a step of the block's scale (plus the
                    // scale's own fp16 rounding).
                    _ => (a - b).abs() <= 0.5 * scale[i] + 127.0 * scale[i] * 1e-3,
                };
                assert!(ok, "{name}[{i}]: {a} for {b}");
            }
        }
    }
}

/// A byte-fallback BPE tokenizer (SentencePiece's form, as Llama 2 and the
/// Stories models have it) for the llama fixture's 96-token vocabulary.
fn write_llama_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    let pieces = ["<unk>", "<s>", "</s>", "▁", "a", "b", "ab", "▁ab", "<0x0A>"];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert(p.to_string(), i.into());
    }
    let special = |id: usize, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
            "merges": ["a b", "▁ ab"]}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": true}"#,
    )
    .unwrap();
}

/// A copy of the `kind` fixture's model in `dir/name`, with the small
/// SentencePiece-style tokenizer of [`write_llama_tokenizer`].
fn fixture_with_tokenizer(dir: &Path, kind: &str, name: &str) -> PathBuf {
    let model = dir.join(name);
    std::fs::create_dir(&model).unwrap();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(kind)
        .join("model");
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture.join(f), model.join(f)).unwrap();
    }
    write_llama_tokenizer(&model);
    model
}

/// The llama fixture (untied head, 4 heads of 12): an `output.weight`,
/// q and k rows permuted to adjacent RoPE pairs, the `llama` tokenizer
/// model with merge-rank scores and byte tokens, bf16 values rounded.
#[test]
fn a_llama_model_has_adjacent_pair_rope_rows_and_a_sentencepiece_vocabulary() {
    let t = tmp();
    let model = fixture_with_tokenizer(t.path(), "llama", "llama");
    let out = t.path().join("llama.gguf");
    export(&[
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let g = read_gguf(&out);
    assert_eq!(g.str("general.architecture"), "llama");
    assert_eq!(g.u32("llama.rope.dimension_count"), 12);
    assert_eq!(g.str("tokenizer.ggml.model"), "llama");
    let Meta::Array(types) = &g.meta["tokenizer.ggml.token_type"] else {
        panic!()
    };
    assert_eq!(types.len(), 96);
    assert_eq!(types[8], Meta::I32(6), "<0x0A> is a BYTE token");
    assert_eq!(types[1], Meta::I32(3), "<s> is CONTROL");
    assert_eq!(
        types[50],
        Meta::I32(5),
        "ids the tokenizer lacks are UNUSED"
    );
    let Meta::Array(scores) = &g.meta["tokenizer.ggml.scores"] else {
        panic!()
    };
    // "ab" is made by merge 0, "▁ab" by merge 1: earlier merges score higher.
    assert_eq!(scores[6], Meta::F32(-1.0));
    assert_eq!(scores[7], Meta::F32(-2.0));
    assert_eq!(g.meta["tokenizer.ggml.add_bos_token"], Meta::Bool(true));
    assert_eq!(g.u32("tokenizer.ggml.bos_token_id"), 1);

    let want = safetensors(&model);
    assert!(g.tensors.contains_key("output.weight"));
    let (q, _) = g.values("blk.0.attn_q.weight");
    let (hq, hv) = &want["model.layers.0.self_attn.q_proj.weight"];
    let (cols, d) = (hq[1], 12);
    for h in 0..4 {
        for j in 0..d / 2 {
            for s in 0..2 {
                let to = (h * d + 2 * j + s) * cols;
                let from = (h * d + s * d / 2 + j) * cols;
                for c in 0..cols {
                    assert_eq!(q[to + c], half::f16::from_f32(hv[from + c]).to_f32());
                }
            }
        }
    }
    let (v, _) = g.values("blk.1.attn_v.weight");
    let vw = &want["model.layers.1.self_attn.v_proj.weight"].1;
    assert!(v
        .iter()
        .zip(vw)
        .all(|(a, &b)| *a == half::f16::from_f32(b).to_f32()));
}

/// A Phi-3 (the fixture, its window taken out: llama.cpp's phi3 has
/// none, and a windowed one is refused): q, k, v written as the one
/// `attn_qkv` and gate, up as `ffn_up`, as Hugging Face stores them; RoPE
/// on 12 of 16 dimensions; LongRoPE's factors as tensors beside its
/// attention factor and original context.
#[test]
fn a_phi3_model_keeps_its_fused_matrices_and_longrope_factors() {
    let t = tmp();
    let model = fixture_with_tokenizer(t.path(), "phi3", "small-p3");
    let out = t.path().join("p3.gguf");
    let o = bin()
        .args(["export", "gguf", "--model", model.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("window") && !out.exists(),
        "{err}"
    );
    let config = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["sliding_window"] = serde_json::Value::Null;
    std::fs::write(&config, c.to_string()).unwrap();
    export(&[
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let g = read_gguf(&out);
    assert_eq!(g.str("general.architecture"), "phi3");
    assert_eq!(g.u32("phi3.rope.dimension_count"), 12);
    assert_eq!(g.u32("phi3.rope.scaling.original_context_length"), 8);
    assert_eq!(
        g.meta["phi3.rope.scaling.attn_factor"],
        Meta::F32(2f32.sqrt())
    );
    let want = safetensors(&model);
    for (hf, gguf) in [
        (
            "model.layers.1.self_attn.qkv_proj.weight",
            "blk.1.attn_qkv.weight",
        ),
        (
            "model.layers.0.mlp.gate_up_proj.weight",
            "blk.0.ffn_up.weight",
        ),
    ] {
        let (shape, values) = &want[hf];
        let (got, _) = g.values(gguf);
        assert_eq!(got.len(), shape[0] * shape[1], "{gguf}");
        assert!(
            got.iter()
                .zip(values)
                .all(|(a, &b)| *a == half::f16::from_f32(b).to_f32()),
            "{gguf} is {hf} as stored"
        );
    }
    for (name, key) in [
        ("rope_factors_short.weight", "short_factor"),
        ("rope_factors_long.weight", "long_factor"),
    ] {
        let want: Vec<f32> = c["rope_parameters"][key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(g.values(name).0, want, "{name}");
    }
}

/// An existing output without --force, a model without a tokenizer, an
/// adapter of another base: one line each, and nothing written.
#[test]
fn export_errors_are_one_line_and_leave_no_file() {
    let t = tmp();
    let out = t.path().join("x.gguf");
    std::fs::write(&out, b"keep").unwrap();
    fails(
        &[
            "export",
            "gguf",
            "--model",
            chat_model().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &["already exists", "--force"],
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");

    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/qwen3/model");
    let out2 = t.path().join("y.gguf");
    fails(
        &[
            "export",
            "gguf",
            "--model",
            fixture.to_str().unwrap(),
            "--out",
            out2.to_str().unwrap(),
        ],
        &["no tokenizer.json"],
    );
    // An adapter trained on the chat model, applied to another base.
    let adapter = chat_adapter(t.path(), "4", "1");
    let other = t.path().join("other");
    std::fs::create_dir(&other).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), other.join(f)).unwrap();
    }
    std::fs::copy(
        chat_model().join("tokenizer.json"),
        other.join("tokenizer.json"),
    )
    .unwrap();
    let o = bin()
        .args([
            "export",
            "gguf",
            "--model",
            other.to_str().unwrap(),
            "--adapter",
        ])
        .arg(&adapter)
        .arg("--out")
        .arg(&out2)
        .output()
        .unwrap();
    one_line_error(&o, "wrong base", &[]);
    assert!(!out2.exists());
    let left: Vec<_> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
