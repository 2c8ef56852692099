//! `anetrain tokenizer train` (a BPE for your own text) and `anetrain
//! tokenize` (text into a token file for --data).

use std::path::{Path, PathBuf};

use anetrain::data::tokenizer::Tokenizer;
use anetrain::data::tokens::TokenDtype;

use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// UTF-8 text to tokenize.
    #[arg(long)]
    input: PathBuf,
    /// Output token file.
    #[arg(long)]
    output: PathBuf,
    /// Entry width (u16 holds ids below 65536).
    #[arg(long, value_parser = crate::choice::<TokenDtype>(), default_value = "u16")]
    token_dtype: TokenDtype,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let tok = Tokenizer::load(&hub::resolve_tokenizer(&a.tokenizer)?)?;
    let n = anetrain::data::tokens::tokenize_file(&tok, &a.input, &a.output, a.token_dtype)?;
    println!("wrote {n} tokens to {}", a.output.display());
    Ok(())
}

#[derive(clap::Args)]
pub struct TokenizerArgs {
    #[command(subcommand)]
    command: TokenizerCommand,
}

#[derive(clap::Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer (the kind the built-in corpus
    /// uses, with an <|endoftext|> token) on UTF-8 text files, one training
    /// sequence per line, and write it as a Hugging Face tokenizer.json.
    Train {
        /// Text files to learn from (repeatable).
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<PathBuf>,
        /// Entries in the vocabulary (at most; a small text may yield fewer).
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        /// Output tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run_tokenizer(a: TokenizerArgs) -> anyhow::Result<()> {
    let TokenizerCommand::Train {
        input,
        vocab_size,
        out,
    } = a.command;
    let files: Vec<&Path> = input.iter().map(PathBuf::as_path).collect();
    let tok = anetrain::data::corpus::train_tokenizer_on_files(&files, vocab_size)?;
    tok.save(&out)?;
    println!(
        "wrote a tokenizer of {} tokens to {}",
        tok.vocab_size(),
        out.display()
    );
    Ok(())
}
