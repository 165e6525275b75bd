//! Qwen2.5-VL, the text encoder of Qwen-Image(-Edit): [`vision`] (the vision tower that turns
//! condition images into embeddings for the `<|image_pad|>` tokens), [`language_model`] (the Qwen2
//! decoder whose last hidden state is the prompt embedding), [`rope`] (its M-RoPE position ids),
//! [`processor`] (condition images → patches), [`tokenizer`] (Qwen2 BPE), [`config`], and
//! [`text_encoder`] (the Edit-Plus prompt encoding that ties them together).

pub mod config;
pub mod language_model;
pub mod processor;
pub mod rope;
pub mod text_encoder;
pub mod tokenizer;
pub mod vision;
