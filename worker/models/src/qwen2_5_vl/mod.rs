//! Qwen2.5-VL, the text encoder of Qwen-Image(-Edit): [`vision`] (the vision tower that turns
//! condition images into embeddings for the `<|image_pad|>` tokens).

pub mod vision;
