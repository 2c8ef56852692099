//! Writes a randomly initialised model of a preset as a Hugging Face
//! directory: `cargo run --example save_random -- PRESET OUT_DIR [SEED]`.
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        anyhow::bail!("usage: save_random PRESET OUT_DIR [SEED]");
    }
    let cfg = anetrain::model::config::ModelConfig::resolve(&args[1])?;
    let seed = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(0);
    let model = anetrain::model::Model::init(&cfg, seed)?;
    model.save(std::path::Path::new(&args[2]))?;
    println!("saved {} parameters to {}", model.num_params(), args[2]);
    Ok(())
}
