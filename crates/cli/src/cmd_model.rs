//! `anetrain eval` and `anetrain generate`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anetrain::data::records;
use anetrain::data::tokenizer::Tokenizer;
use anetrain::data::tokens::{self, TokenDtype};
use anetrain::device::backend::{Backend, OpenDevice};
use anetrain::device::KernelRunner;
use anetrain::engine::generate::{generate, generate_with_engine, GenerateOptions};
use anetrain::engine::Engine;
use anetrain::model::generation::{GenerationConfig, Sampling};
use anetrain::model::lora::Lora;
use anetrain::model::{Model, StoredDtype};
use anetrain::train::objective::Objective;
use anetrain::train::reference::Reference;
use anetrain::train::step::{eval_loss, Batch, Loss};
use anyhow::{bail, Context, Result};

use crate::fsutil::write_atomic;

/// Loads `dir`, with the adapter in `adapter` attached (or, with `merge`,
/// folded into the weights). Unless merged into, its matrices stay
/// memory-mapped in the file's dtype, as a LoRA run's base does.
fn load_model(dir: &Path, adapter: Option<&Path>, merge: bool) -> Result<Model> {
    let mut model = match merge {
        true => Model::load(dir)?,
        false => Model::load_frozen(dir)?,
    };
    if let Some(a) = adapter {
        let lora = Lora::load(&model.cfg, a)?;
        if merge {
            model.merge_lora(&lora);
        } else {
            model.lora = Some(lora);
        }
    }
    Ok(model)
}

pub struct MergeArgs {
    pub model: PathBuf,
    pub adapter: PathBuf,
    pub out: PathBuf,
    /// `f32`, `f16` or `bf16`; `None`: the base's.
    pub dtype: Option<String>,
    pub force: bool,
}

/// Refuses `--out` when it is a file, or a directory that holds files and
/// `force` is not given (`what`: the model written there).
fn writable_dir(out: &Path, force: bool, what: &str) -> Result<()> {
    if out.is_file() {
        bail!(
            "--out '{}' is a file; name a directory to write the {what} into",
            out.display()
        );
    }
    let occupied = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if occupied && !force {
        bail!(
            "'{}' already holds files; pass --force to write the {what} over them, or name a new directory",
            out.display()
        );
    }
    Ok(())
}

/// `--dtype f32|f16|bf16` (the parser admits no other).
fn dtype_flag(v: Option<&str>) -> Option<StoredDtype> {
    v.map(|d| match d {
        "f16" => StoredDtype::F16,
        "bf16" => StoredDtype::BF16,
        _ => StoredDtype::F32,
    })
}

/// `anetrain merge`: base + adapter → a plain model directory, its weights
/// in the base's dtype unless told otherwise (a quantized base's: its
/// scales' dtype).
pub fn merge(a: MergeArgs) -> Result<()> {
    let (model, adapter, out) = (&a.model, &a.adapter, &a.out);
    writable_dir(out, a.force, "merged model")?;
    let dtype = match dtype_flag(a.dtype.as_deref()) {
        Some(d) => d,
        None => anetrain::model::file_dtype(model)?,
    };
    let merged = load_model(model, Some(adapter), true)?;
    if let Some(q) = &merged.cfg.quantization {
        eprintln!(
            "note: the base is {}-bit quantized; the merged model is written dequantized ({}), and quantizing it again rounds the adapter's change with the base, which loses accuracy",
            q.default.bits,
            dtype.name()
        );
    }
    merged.save_as(out, dtype)?;
    let tok = model.join("tokenizer.json");
    if tok.is_file() {
        Tokenizer::load(&tok)?.save_to_dir(out, merged.cfg.max_position_embeddings)?;
    }
    anetrain::model::generation::copy_generation_config(model, out)?;
    eprintln!(
        "merged '{}' into '{}' -> {} ({})",
        adapter.display(),
        model.display(),
        out.display(),
        dtype.name()
    );
    Ok(())
}

pub struct QuantizeArgs {
    pub model: PathBuf,
    /// The model as the user named it (a Hub id, or a directory made
    /// absolute), recorded in the output's `quantized_from.json`.
    pub source: String,
    pub out: PathBuf,
    pub bits: u32,
    pub group_size: usize,
    pub dtype: Option<String>,
    pub force: bool,
}

/// `anetrain quantize`: the model in MLX's affine format.
pub fn quantize(a: QuantizeArgs) -> Result<()> {
    writable_dir(&a.out, a.force, "quantized model")?;
    let spec = anetrain::model::quant::QuantSpec::new(a.bits, a.group_size)?;
    let w = anetrain::tools::quantize::quantize_dir(
        &a.model,
        &a.out,
        spec,
        dtype_flag(a.dtype.as_deref()),
    )?;
    // What the adapters of the source may be applied to: its quantized copy.
    let source = serde_json::json!({ "source": a.source });
    write_atomic(
        &a.out.join(crate::base_check::QUANTIZED_FROM),
        format!("{source:#}\n").as_bytes(),
    )?;
    println!(
        "wrote {}: {} matrices in {}-bit groups of {} ({} scales), {} left as they were, {}; mlx-lm loads it (`mlx_lm.generate --model {}`), and anetrain trains LoRA on it",
        a.out.display(),
        w.quantized,
        a.bits,
        a.group_size,
        w.dtype.name(),
        w.kept,
        anetrain::plan::memory::size(w.bytes as u64),
        a.out.display()
    );
    Ok(())
}

/// `anetrain export gguf`: the model, its adapter merged in, as one GGUF
/// file with its tokenizer and chat template.
pub fn export_gguf(
    model: &Path,
    adapter: Option<&Path>,
    out: &Path,
    ty: anetrain::tools::gguf::ExportType,
    force: bool,
) -> Result<()> {
    if out.is_dir() {
        bail!(
            "--out '{}' is a directory; name the .gguf file to write",
            out.display()
        );
    }
    if out.exists() && !force {
        bail!(
            "'{}' already exists; pass --force to overwrite it",
            out.display()
        );
    }
    let tok_path = model.join("tokenizer.json");
    if !tok_path.is_file() {
        bail!(
            "'{}' has no tokenizer.json, and a GGUF file carries its tokenizer",
            model.display()
        );
    }
    let tok = Tokenizer::load(&tok_path)?;
    let merged = load_model(model, adapter, true)?;
    let gen = GenerationConfig::load(model)?;
    let name = adapter
        .unwrap_or(model)
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    eprintln!(
        "exporting {}{} as {:?} to {}",
        model.display(),
        adapter
            .map(|a| format!(" + {}", a.display()))
            .unwrap_or_default(),
        ty,
        out.display()
    );
    let w = anetrain::tools::gguf::export(&merged, &tok, gen.as_ref(), ty, &name, out)?;
    println!(
        "wrote {} ({} tensors, {} metadata keys, {:.1} MB); run it with `llama-cli -m {} -cnv`",
        out.display(),
        w.tensors,
        w.metadata,
        w.bytes as f64 / 1e6,
        out.display()
    );
    Ok(())
}

pub struct EvalArgs {
    pub adapter: Option<PathBuf>,
    pub backend: Backend,
    pub model: PathBuf,
    pub data: Option<PathBuf>,
    pub tokens: Option<PathBuf>,
    pub seq: Option<usize>,
    pub logits_out: Option<PathBuf>,
    pub token_dtype: TokenDtype,
    pub tokenizer: Option<PathBuf>,
    pub max_windows: Option<usize>,
    /// Records: which file of a data directory.
    pub split: Option<String>,
    pub mask_prompt: bool,
    pub keys: records::Keys,
    /// How preference pairs are scored (DPO unless `--objective` says).
    pub objective: Objective,
    /// `--objective` was given (it applies to pairs only).
    pub objective_given: bool,
}

/// The records file `eval --data PATH [--split S]` reads.
fn records_file(path: &Path, split: Option<&str>) -> Result<PathBuf> {
    let s = records::splits(path)?;
    if !path.is_dir() {
        if let Some(split) = split {
            bail!("--split {split} needs --data to be a directory holding {split}.jsonl");
        }
        return Ok(s.train);
    }
    let split = split.unwrap_or("test");
    let file = match split {
        "train" => Some(s.train),
        "valid" => s.valid,
        "test" => s.test,
        other => bail!("--split must be train, valid or test, not '{other}'"),
    };
    file.with_context(|| {
        format!(
            "'{}' has no {split}.jsonl; choose another --split",
            path.display()
        )
    })
}

/// Mean loss over the records of `file` (prompt-masked on request).
fn eval_records(a: &EvalArgs, model: &mut Model, path: &Path) -> Result<()> {
    if a.logits_out.is_some() || a.max_windows.is_some() {
        bail!("--logits-out and --max-windows apply to token data, not to JSONL records");
    }
    let file = records_file(path, a.split.as_deref())?;
    let tok = Tokenizer::find(a.tokenizer.as_deref(), Some(&a.model))?;
    if records::holds_pairs(&file, &a.keys)? {
        return eval_pairs(a, model, &file, &tok);
    }
    if a.objective_given {
        bail!(
            "--objective scores preference pairs, and '{}' holds none",
            file.display()
        );
    }
    let rf = records::read_file(&file, &tok, &a.keys, a.mask_prompt)?;
    if let Some(w) = rf.unmasked_warning(a.mask_prompt) {
        eprintln!("warning: {w}");
    }
    for e in &rf.examples {
        tokens::check_ids(
            &e.tokens,
            model.cfg.vocab_size,
            &format!("'{}'", file.display()),
        )
        .context("the tokenizer does not match the model")?;
    }
    let seq = a.seq.unwrap_or(model.cfg.max_position_embeddings);
    if seq > model.cfg.max_position_embeddings {
        bail!(
            "--seq {seq} exceeds the model's max_position_embeddings ({})",
            model.cfg.max_position_embeddings
        );
    }
    let fitted = records::fit(rf.examples, seq);
    if let Some(w) = fitted.warning(&file, seq) {
        eprintln!("warning: {w}");
    }
    if fitted.examples.is_empty() {
        bail!(
            "'{}' has no record with a target token to evaluate",
            file.display()
        );
    }
    let records = fitted.examples.len();
    let batch = Batch::Examples(fitted.examples);
    let mut eng = Engine::on(model, a.backend.open()?);
    let loss = eval_loss(&mut eng, model, &mut Loss::sft(), &batch)?;
    let (loss, count) = (loss.loss, loss.targets);
    println!(
        "{}",
        serde_json::json!({"loss": loss, "tokens": count, "ppl": loss.exp(), "records": records})
    );
    Ok(())
}

/// The preference loss and TRL's metrics over the pairs of `file`: the
/// training step's own evaluation (`step::eval_loss`), DPO against the
/// base without the adapters.
fn eval_pairs(a: &EvalArgs, model: &mut Model, file: &Path, tok: &Tokenizer) -> Result<()> {
    use anetrain::data::preference::{self, Tokenization};
    if a.mask_prompt {
        bail!(
            "--mask-prompt applies to records; a preference loss counts the answers' tokens only"
        );
    }
    let how = match a.objective {
        Objective::Orpo { .. } => Tokenization::Orpo,
        _ => Tokenization::Dpo,
    };
    let pairs = preference::read_file(file, tok, how)?;
    for p in &pairs {
        for e in p.sequences() {
            tokens::check_ids(
                &e.tokens,
                model.cfg.vocab_size,
                &format!("'{}'", file.display()),
            )
            .context("the tokenizer does not match the model")?;
        }
    }
    let seq = a.seq.unwrap_or(model.cfg.max_position_embeddings);
    if seq > model.cfg.max_position_embeddings {
        bail!(
            "--seq {seq} exceeds the model's max_position_embeddings ({})",
            model.cfg.max_position_embeddings
        );
    }
    let fitted = preference::fit(pairs, seq);
    if let Some(w) = fitted.warning(file, seq) {
        eprintln!("warning: {w}");
    }
    if fitted.pairs.is_empty() {
        bail!(
            "'{}' has no pair with an answer token within --seq {seq}",
            file.display()
        );
    }
    let n = fitted.pairs.len();
    let reference = match a.objective {
        Objective::Dpo { .. } => Reference::base_of(model),
        _ => Reference::Unneeded,
    };
    let mut loss = Loss::new(a.objective, reference);
    let mut eng = Engine::on(model, a.backend.open()?);
    let r = eval_loss(&mut eng, model, &mut loss, &Batch::Pairs(fitted.pairs))?;
    let mut out = serde_json::Map::new();
    out.insert("objective".into(), a.objective.name().into());
    out.insert("loss".into(), serde_json::json!(r.loss));
    out.insert("pairs".into(), serde_json::json!(n));
    out.extend(r.preference.map(|m| m.json()).unwrap_or_default());
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}

pub fn eval(a: EvalArgs) -> Result<()> {
    let mut model = load_model(&a.model, a.adapter.as_deref(), false)?;
    if let (None, Some(d)) = (&a.tokens, &a.data) {
        if records::is_records(d) {
            return eval_records(&a, &mut model, d);
        }
    }
    if a.split.is_some() || a.mask_prompt {
        bail!("--split and --mask-prompt apply to JSONL records (--data DIR or FILE.jsonl)");
    }
    let vocab = model.cfg.vocab_size;
    let (rows, two_d) = match (&a.tokens, &a.data) {
        (Some(t), None) => {
            let rows = tokens::read_npy_rows(t, vocab)?;
            let two_d = npy::read(t)?.shape.len() == 2;
            (rows, two_d)
        }
        (None, Some(d)) => {
            let tok = if tokens::is_text(d) {
                Some(Tokenizer::find(a.tokenizer.as_deref(), Some(&a.model))?)
            } else {
                None
            };
            let ids = tokens::load_tokens(d, a.token_dtype, tok.as_ref(), vocab)?;
            let seq = a.seq.unwrap_or(model.cfg.max_position_embeddings.min(256));
            let mut w = tokens::windows(&ids, seq);
            if w.is_empty() {
                bail!(
                    "'{}' holds {} tokens, fewer than one window of --seq {seq} + 1",
                    d.display(),
                    ids.len()
                );
            }
            if let Some(n) = a.max_windows {
                w.truncate(n.max(1));
            }
            (w, true)
        }
        _ => bail!("give exactly one of --tokens FILE.npy or --data PATH"),
    };
    let max_len = rows.iter().map(|r| r.len() - 1).max().unwrap_or(0);
    if max_len > model.cfg.max_position_embeddings {
        bail!(
            "sequences of {max_len} tokens exceed the model's max_position_embeddings ({})",
            model.cfg.max_position_embeddings
        );
    }
    let mut eng = Engine::on(&model, a.backend.open()?);
    let batch = Batch::Examples(
        rows.iter()
            .map(|r| records::Example {
                tokens: r.clone(),
                offset: 0,
            })
            .collect(),
    );
    let loss = eval_loss(&mut eng, &mut model, &mut Loss::sft(), &batch)?;
    if let Some(out) = &a.logits_out {
        let all_logits = row_logits(eng, &model, &rows)?;
        let n = rows[0].len() - 1;
        let shape = if two_d {
            vec![rows.len(), n, vocab]
        } else {
            vec![n, vocab]
        };
        write_atomic(out, &npy::encode_f32(&shape, &all_logits))?;
    }
    let (loss, count) = (loss.loss, loss.targets);
    println!(
        "{}",
        serde_json::json!({"loss": loss, "tokens": count, "ppl": loss.exp()})
    );
    Ok(())
}

/// Every row's logits, `[rows, n, vocab]` in order (`--logits-out`).
fn row_logits<R: KernelRunner>(
    mut eng: Engine<R>,
    model: &Model,
    rows: &[Vec<u32>],
) -> Result<Vec<f32>> {
    let mut all = Vec::new();
    for row in rows {
        let fwd = eng.forward_only(model, &row[..row.len() - 1])?;
        all.extend_from_slice(&eng.logits(model, &fwd.xf)?);
    }
    Ok(all)
}

pub struct GenerateArgs {
    pub adapter: Option<PathBuf>,
    pub backend: Backend,
    pub model: PathBuf,
    pub prompt: String,
    pub max_tokens: usize,
    /// `None`: the model's generation_config.json, else the defaults.
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub seed: u64,
    pub tokenizer: Option<PathBuf>,
    /// Render the prompt as one user message with the chat template.
    pub chat: bool,
}

/// Tokens that end generation: the model's `generation_config.json`
/// `eos_token_id` (one or several, as transformers stops on any), the
/// tokenizer's `eos_token`, the token its chat template ends a turn with
/// (such as `<|im_end|>`) and the usual end-of-text tokens it knows.
fn stop_tokens(tok: &Tokenizer, gen: Option<&GenerationConfig>) -> Result<Vec<u32>> {
    let mut stops: Vec<u32> = tok.end_tokens().into_iter().map(|t| t.1).collect();
    stops.extend(tok.eos().map(|e| e.1));
    stops.extend(tok.end_of_turn()?.map(|e| e.1));
    stops.extend(gen.iter().flat_map(|g| g.eos_token_ids.iter().copied()));
    stops.sort_unstable();
    stops.dedup();
    Ok(stops)
}

pub fn run_generate(a: GenerateArgs) -> Result<()> {
    if a.temperature.is_some_and(|t| !(t >= 0.0 && t.is_finite())) {
        bail!("--temperature must be a finite number >= 0");
    }
    if a.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        bail!("--top-p must be in (0, 1]");
    }
    let gen = GenerationConfig::load(Path::new(&a.model))?;
    let device = a.backend.open()?;
    // The CPU decoder reads plain weights: fold the adapter in (f32); the
    // Neural Engine path keeps it as kernel regions.
    let model = load_model(&a.model, a.adapter.as_deref(), a.backend == Backend::Cpu)?;
    let tok = Tokenizer::find(a.tokenizer.as_deref(), Some(Path::new(&a.model)))?;
    let prompt = match a.chat {
        true => {
            let template = tok.chat.as_ref().with_context(|| {
                format!(
                    "--chat needs a chat template, and the tokenizer '{}' has none (no chat_template.jinja, no chat_template in tokenizer_config.json)",
                    tok.path.display()
                )
            })?;
            let messages = serde_json::json!([{"role": "user", "content": a.prompt}]);
            tok.encode(&template.render(&messages, None, true, &Default::default())?)?
        }
        false => tok.encode(&a.prompt)?,
    };
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    tokens::check_ids(&prompt, model.cfg.vocab_size, "the prompt")
        .context("the tokenizer does not match the model")?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if !a.chat {
        // A continuation follows its prompt; a chat reply stands alone.
        write!(out, "{}", a.prompt)?;
        out.flush()?;
    }
    let mut ids: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let sampling = GenerationConfig::sampling(
        gen.as_ref(),
        a.temperature,
        a.top_p,
        a.top_k,
        Sampling {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 0,
        },
    );
    if !(sampling.temperature >= 0.0 && sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
        bail!(
            "{}: temperature {} / top_p {} are not usable; give --temperature and --top-p",
            Path::new(&a.model).join("generation_config.json").display(),
            sampling.temperature,
            sampling.top_p
        );
    }
    let stops = stop_tokens(&tok, gen.as_ref())?;
    let emit = |t: u32| -> Result<()> {
        ids.push(t);
        let text = tok.decode(&ids)?;
        // Print whole characters only (a token may end mid-UTF-8 sequence).
        if !text.ends_with('\u{FFFD}') && text.len() > printed {
            write!(out, "{}", &text[printed..])?;
            out.flush()?;
            printed = text.len();
        }
        Ok(())
    };
    let options = GenerateOptions {
        max_new: a.max_tokens,
        sampling,
        seed: a.seed,
        stop: &stops,
    };
    // The compiled kernels cover the whole (prompt + new tokens) length.
    let total = (prompt.len() + a.max_tokens).min(model.cfg.max_position_embeddings);
    match device {
        // The CPU decodes with a KV cache.
        OpenDevice::Cpu => {
            generate(&model, &prompt, &options, emit)?;
        }
        device => {
            let mut eng = Engine::on(&model, device);
            eng.runner.set_fixed_seq(total);
            generate_with_engine(eng, &model, &prompt, &options, emit)?;
        }
    }
    writeln!(out)?;
    Ok(())
}
