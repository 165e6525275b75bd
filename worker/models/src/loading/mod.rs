//! Getting weights from files to the device: [`safetensors`] (mmap, header parsing, bounds checks,
//! staged copies), [`pth`] (PyTorch zip checkpoints through a restricted [`pickle`] reader and a
//! stored-[`zip`] index), [`weights`] (name tables and the cursor model code asks), [`diffusers`]
//! (component folders with shards and variants), [`lora`] (LoRA fusion), [`stream`] (loads on a
//! side stream of their own).

pub mod diffusers;
pub mod lora;
pub mod pickle;
pub mod pth;
pub mod safetensors;
pub mod stream;
pub mod weights;
pub mod zip;
