//! Getting weights from files to the device: [`safetensors`] (mmap, header parsing, bounds checks,
//! staged copies), [`weights`] (name tables and the cursor model code asks), [`diffusers`]
//! (component folders with shards and variants).

pub mod diffusers;
pub mod lora;
pub mod safetensors;
pub mod weights;
