//! Text front ends: [`clip_tokenizer`] (CLIP BPE with the bundled vocabulary) and [`prompt`] (the
//! A1111 prompt syntax: weights and `BREAK`).

pub mod clip_tokenizer;
pub mod prompt;
