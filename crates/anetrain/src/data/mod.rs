//! What a model is trained on: tokenizers and chat templates, the built-in
//! corpus, token files, and fine-tuning records. Nothing here knows a model.

pub mod chat;
pub mod corpus;
pub mod preference;
pub mod records;
pub mod tokenizer;
pub mod tokens;
