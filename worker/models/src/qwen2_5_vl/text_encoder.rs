//! Qwen-Image-Edit-Plus prompt encoding with the Qwen2.5-VL text encoder: condition images →
//! vision features (once per input set, [`QwenTextEncoder::encode_images`]), then per instruction the
//! chat template with one `Picture {i}: <|vision_start|><|image_pad|>…<|vision_end|>` per image, the
//! `<|image_pad|>` embeddings replaced by the vision features, the language model, and the template
//! prefix dropped ([`QwenTextEncoder::encode_prompt`]).
//!
//! Ported from diffusers 0.42.1 `pipelines/qwenimage/pipeline_qwenimage_edit_plus.py`
//! (`_get_qwen_prompt_embeds`, `encode_prompt`, `prompt_template_encode`,
//! `prompt_template_encode_start_idx`), transformers 5.24.0 `models/qwen2_vl/processing_qwen2_vl.py`
//! (`<|image_pad|>` expansion) and `models/qwen2_5_vl/modeling_qwen2_5_vl.py` (`Qwen2_5_VLModel.forward`:
//! embeddings, `masked_scatter` of the image features), Apache-2.0, Copyright The Qwen team, Alibaba
//! Group and the HuggingFace Inc. team.
//!
//! Checkpoints: a diffusers pipeline folder (`text_encoder/` config + shards, `tokenizer/`,
//! `processor/`), or a single file such as ComfyUI's `qwen_2.5_vl_7b_fp8_scaled.safetensors` (scaled
//! fp8, dequantised by the store / [`crate::nn::Linear`]). Both key layouts load: transformers ≥ 5
//! (`model.language_model.*`, `model.visual.*`) and older (`model.*`, `visual.*`); `lm_head` is
//! never read.
//!
//! Position ids: [`PositionMode::Mrope`] by default (the model as trained); diffusers 0.42.1 with
//! transformers ≥ 5.15 silently uses sequential positions instead ([`PositionMode::Sequential`],
//! diffusers issue #14194), available for parity with that reference.

use std::path::Path;
use std::sync::Arc;

use image::RgbImage;
use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError};
use crate::loading::diffusers::{component_store, open, read_config};
use crate::loading::weights::{Fp8Mode, WeightStore, Weights};
use crate::nn::AttentionImpl;
use crate::qwen2_5_vl::config::QwenVlConfig;
use crate::qwen2_5_vl::language_model::{LanguageModel, language_model_prefix};
use crate::qwen2_5_vl::processor::{ImageProcessorConfig, condition_resize, preprocess};
use crate::qwen2_5_vl::rope::{PositionMode, batch_position_ids};
use crate::qwen2_5_vl::tokenizer::QwenTokenizer;
use crate::qwen2_5_vl::vision::{VisionTransformer, vision_prefix};

/// The Edit-Plus chat template around the image placeholders and the instruction, and how many
/// leading tokens (the system prompt) are dropped from the embeddings.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PromptTemplate {
    /// The template, with `{}` where the image placeholders and the instruction go
    /// (`prompt_template_encode`).
    pub template: String,
    /// Per image (1-based `{}`): `Picture {}: <|vision_start|><|image_pad|><|vision_end|>`.
    pub image_template: String,
    /// Tokens dropped from the front of the hidden states (`prompt_template_encode_start_idx`).
    pub drop_idx: usize,
}

impl PromptTemplate {
    /// `QwenImageEditPlusPipeline`'s template (diffusers 0.42.1).
    pub fn edit_plus() -> Self {
        Self {
            template: "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), then explain how the user's text instruction should alter or modify the image. Generate a new image that meets the user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n".into(),
            image_template: "Picture {}: <|vision_start|><|image_pad|><|vision_end|>".into(),
            drop_idx: 64,
        }
    }

    /// The full text for `instruction` with `image_tokens[i]` `<|image_pad|>` tokens for image `i`
    /// (the processor's expansion done in place).
    pub fn render(&self, instruction: &str, image_tokens: &[i64]) -> String {
        let mut images = String::new();
        for (i, &n) in image_tokens.iter().enumerate() {
            let one = self.image_template.replacen("{}", &(i + 1).to_string(), 1);
            let pads = IMAGE_PAD.repeat(usize::try_from(n).unwrap_or(0));
            images.push_str(&one.replacen(IMAGE_PAD, &pads, 1));
        }
        self.template
            .replacen("{}", &format!("{images}{instruction}"), 1)
    }
}

const IMAGE_PAD: &str = "<|image_pad|>";
const VIDEO_PAD: &str = "<|video_pad|>";

/// How the encoder is placed and computed.
#[derive(Debug, Clone, Copy)]
pub struct TextEncoderOptions {
    pub device: Device,
    /// The weights' and activations' dtype.
    pub kind: Kind,
    pub attention: AttentionImpl,
    pub fp8: Fp8Mode,
    pub positions: PositionMode,
}

impl Default for TextEncoderOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            kind: Kind::Float,
            attention: AttentionImpl::Sdpa,
            fp8: Fp8Mode::Upcast,
            positions: PositionMode::Mrope,
        }
    }
}

/// The vision features of one set of condition images: computed once, reused for every
/// instruction (positive and negative prompt).
#[derive(Debug)]
pub struct ImageFeatures {
    /// `(t, h, w)` patch grid per image.
    pub grid_thw: Vec<(i64, i64, i64)>,
    /// `[Σ tokens, hidden]` on the encoder's device, images in order.
    pub features: Tensor,
    /// `<|image_pad|>` tokens per image (`t · h · w / merge²`).
    pub tokens_per_image: Vec<i64>,
}

impl ImageFeatures {
    /// No condition images (the template without placeholders).
    pub fn none(hidden: i64, kind: Kind, device: Device) -> Self {
        Self {
            grid_thw: Vec::new(),
            features: Tensor::zeros([0, hidden], (kind, device)),
            tokens_per_image: Vec::new(),
        }
    }
}

/// The Qwen2.5-VL text encoder of Qwen-Image-Edit-Plus.
#[derive(Debug)]
pub struct QwenTextEncoder {
    pub config: QwenVlConfig,
    pub processor: ImageProcessorConfig,
    pub template: PromptTemplate,
    pub positions: PositionMode,
    tokenizer: QwenTokenizer,
    vision: VisionTransformer,
    language_model: LanguageModel,
}

impl QwenTextEncoder {
    /// A diffusers pipeline folder: `text_encoder/config.json` and its weights, `tokenizer/`
    /// (else the bundled tokenizer), `processor/preprocessor_config.json` (else the defaults).
    pub fn load_diffusers(root: &Path, opts: TextEncoderOptions) -> Result<Self, LoadError> {
        let dir = root.join("text_encoder");
        let config = read_config(&dir.join("config.json"), QwenVlConfig::from_json)?;
        let store = component_store(&dir, "model", |k| Some(k.to_string()))?;
        let tokenizer = QwenTokenizer::from_dir(&root.join("tokenizer"))?;
        let pre = root.join("processor").join("preprocessor_config.json");
        let processor = if pre.exists() {
            read_config(&pre, ImageProcessorConfig::from_json)?
        } else {
            ImageProcessorConfig::default()
        };
        Self::from_store(store, &dir, config, tokenizer, processor, opts)
    }

    /// A single safetensors file (e.g. ComfyUI's `qwen_2.5_vl_7b_fp8_scaled.safetensors`) with the
    /// given config, the bundled tokenizer and the default processor settings.
    pub fn load_single_file(
        path: &Path,
        config: QwenVlConfig,
        opts: TextEncoderOptions,
    ) -> Result<Self, LoadError> {
        let store = WeightStore::identity(open(path)?);
        Self::from_store(
            store,
            path,
            config,
            QwenTokenizer::bundled()?,
            ImageProcessorConfig::default(),
            opts,
        )
    }

    /// Builds the encoder from any store holding one of the two key layouts; `origin` names the
    /// checkpoint in errors.
    pub fn from_store(
        store: WeightStore,
        origin: &Path,
        config: QwenVlConfig,
        tokenizer: QwenTokenizer,
        processor: ImageProcessorConfig,
        opts: TextEncoderOptions,
    ) -> Result<Self, LoadError> {
        let bad = |reason: String| LoadError::Config {
            path: origin.to_path_buf(),
            reason,
        };
        config.text.validate().map_err(bad)?;
        processor.validate().map_err(bad)?;
        if processor.patch_size != config.vision.patch_size
            || processor.merge_size != config.vision.spatial_merge_size
            || processor.temporal_patch_size != config.vision.temporal_patch_size
            || config.vision.in_channels != 3
        {
            return Err(bad(format!(
                "processor patch/merge/temporal sizes {}/{}/{} do not match the vision tower's {}/{}/{} (3 channels)",
                processor.patch_size,
                processor.merge_size,
                processor.temporal_patch_size,
                config.vision.patch_size,
                config.vision.spatial_merge_size,
                config.vision.temporal_patch_size
            )));
        }
        if config.vision.out_hidden_size != config.text.hidden_size {
            return Err(bad(format!(
                "vision out_hidden_size {} differs from the text hidden_size {}",
                config.vision.out_hidden_size, config.text.hidden_size
            )));
        }
        let lm_prefix = language_model_prefix(&store).ok_or_else(|| LoadError::Missing {
            path: origin.to_path_buf(),
            tensor: "model.language_model.embed_tokens.weight (or model.embed_tokens.weight)"
                .into(),
        })?;
        let vis_prefix = vision_prefix(&store).ok_or_else(|| LoadError::Missing {
            path: origin.to_path_buf(),
            tensor: "model.visual.patch_embed.proj.weight (or visual.patch_embed.proj.weight)"
                .into(),
        })?;
        let w = Weights::new(Arc::new(store.with_fp8(opts.fp8)), opts.device, opts.kind);
        let vision = VisionTransformer::new(&w.pp(vis_prefix), &config.vision, opts.attention)?;
        let language_model = LanguageModel::new(&w.pp(lm_prefix), &config.text, opts.attention)?;
        Ok(Self {
            config,
            processor,
            template: PromptTemplate::edit_plus(),
            positions: opts.positions,
            tokenizer,
            vision,
            language_model,
        })
    }

    pub fn tokenizer(&self) -> &QwenTokenizer {
        &self.tokenizer
    }

    pub fn language_model(&self) -> &LanguageModel {
        &self.language_model
    }

    pub fn vision(&self) -> &VisionTransformer {
        &self.vision
    }

    /// Input images as the pipeline receives them: each is first resized (LANCZOS) to the
    /// condition area ([`condition_resize`]), then processed and embedded
    /// ([`QwenTextEncoder::encode_condition_images`]).
    pub fn encode_images(&self, images: &[RgbImage]) -> Result<ImageFeatures, GenerateError> {
        let resized = images
            .iter()
            .map(|i| condition_resize(i, &self.processor))
            .collect::<Result<Vec<_>, _>>()?;
        self.encode_condition_images(&resized)
    }

    /// Already-resized condition images: the image processor, then the vision tower.
    pub fn encode_condition_images(
        &self,
        images: &[RgbImage],
    ) -> Result<ImageFeatures, GenerateError> {
        if images.is_empty() {
            return Ok(ImageFeatures::none(
                self.config.text.hidden_size,
                self.language_model.kind(),
                self.language_model.device(),
            ));
        }
        let processed = preprocess(images, &self.processor)?;
        self.encode_pixel_values(&processed.pixel_values, &processed.grid_thw)
    }

    /// The vision tower on the image processor's output (`pixel_values [N, 1176]`, one `(t, h, w)`
    /// grid per image).
    pub fn encode_pixel_values(
        &self,
        pixel_values: &Tensor,
        grid_thw: &[(i64, i64, i64)],
    ) -> Result<ImageFeatures, GenerateError> {
        let merge = self.config.vision.spatial_merge_size;
        let features = self
            .vision
            .forward(pixel_values, grid_thw)?
            .to_device(self.language_model.device())
            .to_kind(self.language_model.kind());
        Ok(ImageFeatures {
            tokens_per_image: grid_thw
                .iter()
                .map(|&(t, h, w)| t * h * w / (merge * merge))
                .collect(),
            grid_thw: grid_thw.to_vec(),
            features,
        })
    }

    /// The token ids of `instruction` in the template with `images`' placeholders expanded.
    /// An instruction holding `<|image_pad|>` or `<|video_pad|>` itself is rejected (it would
    /// claim image features that do not exist).
    pub fn prompt_ids(
        &self,
        instruction: &str,
        images: &ImageFeatures,
    ) -> Result<Vec<i64>, GenerateError> {
        if instruction.contains(IMAGE_PAD) || instruction.contains(VIDEO_PAD) {
            return Err(GenerateError::InvalidRequest(
                "the instruction must not contain <|image_pad|> or <|video_pad|>".into(),
            ));
        }
        let text = self.template.render(instruction, &images.tokens_per_image);
        let ids = self
            .tokenizer
            .encode(&text)
            .map_err(GenerateError::Tokenizer)?;
        let image_tokens = ids
            .iter()
            .filter(|&&t| t == self.config.image_token_id)
            .count() as i64;
        let expected: i64 = images.tokens_per_image.iter().sum();
        if image_tokens != expected || ids.contains(&self.config.video_token_id) {
            return Err(GenerateError::InvalidRequest(format!(
                "the prompt holds {image_tokens} image tokens for {expected} image features"
            )));
        }
        if ids.len() <= self.template.drop_idx {
            return Err(GenerateError::InvalidRequest(format!(
                "the prompt has {} tokens, not more than the {} template tokens dropped",
                ids.len(),
                self.template.drop_idx
            )));
        }
        Ok(ids)
    }

    /// The prompt embedding `[L, hidden]` of one instruction with the images' features (the
    /// template prefix dropped), as `QwenImageEditPlusPipeline.encode_prompt(...)[0][0]`.
    pub fn encode_prompt(
        &self,
        instruction: &str,
        images: &ImageFeatures,
    ) -> Result<Tensor, GenerateError> {
        let (embeds, _) = self.encode_prompts(&[instruction], images)?;
        Ok(embeds.select(0, 0))
    }

    /// Prompt embeddings of several instructions with the same images: `[B, L_max, hidden]`,
    /// each right-padded with zeros, and the mask `[B, L_max]` (int64, 1 = token), as the
    /// pipeline's `_get_qwen_prompt_embeds` (one batched forward, right padding). The mask is on
    /// the host, for the caller to move where it is needed: uploading it here would wait for the
    /// forward the embeddings are still being computed by.
    pub fn encode_prompts(
        &self,
        instructions: &[&str],
        images: &ImageFeatures,
    ) -> Result<(Tensor, Tensor), GenerateError> {
        if instructions.is_empty() {
            return Err(GenerateError::InvalidRequest("no instructions".into()));
        }
        let seqs = instructions
            .iter()
            .map(|i| self.prompt_ids(i, images))
            .collect::<Result<Vec<_>, _>>()?;
        let lm = &self.language_model;
        let device = lm.device();
        let b = seqs.len() as i64;
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = vec![self.tokenizer.pad; seqs.len() * len];
        let mut mask = vec![0i64; seqs.len() * len];
        for (bi, s) in seqs.iter().enumerate() {
            ids[bi * len..bi * len + s.len()].copy_from_slice(s);
            mask[bi * len..bi * len + s.len()].fill(1);
        }
        let ids_t = Tensor::from_slice(&ids).reshape([b, len as i64]);
        let mask_t = Tensor::from_slice(&mask).reshape([b, len as i64]);
        let hidden = self.config.text.hidden_size;

        // Embeddings with every sequence's `<|image_pad|>` rows replaced by the features.
        let embeds = lm.embed(&ids_t)?.reshape([b * len as i64, hidden]);
        let embeds = if images.features.size()[0] > 0 {
            let rows: Vec<i64> = ids
                .iter()
                .enumerate()
                .filter(|&(_, &t)| t == self.config.image_token_id)
                .map(|(i, _)| i as i64)
                .collect();
            let feats = images.features.to_device(device).to_kind(lm.kind());
            let all = feats.repeat([b, 1]);
            embeds.index_copy(0, &Tensor::from_slice(&rows).to_device(device), &all)
        } else {
            embeds
        };
        let embeds = embeds.reshape([b, len as i64, hidden]);

        let grids = vec![images.grid_thw.clone(); seqs.len()];
        let positions = batch_position_ids(
            &seqs,
            &grids,
            len,
            self.config.image_token_id,
            self.config.vision.spatial_merge_size,
            self.positions,
        )?;
        let mask_opt = (seqs.iter().any(|s| s.len() != len)).then(|| mask_t.to_device(device));
        let out = lm.forward(&embeds, &positions.to_device(device), mask_opt.as_ref())?;

        // Drop the template prefix, then right-pad with zeros to the longest.
        let drop = self.template.drop_idx;
        let keep = len - drop;
        let mut rows = Vec::with_capacity(seqs.len());
        let mut out_mask = vec![0i64; seqs.len() * keep];
        for (bi, s) in seqs.iter().enumerate() {
            let n = s.len() - drop;
            let valid = out.get(bi as i64).narrow(0, drop as i64, n as i64);
            let padded = if n < keep {
                Tensor::cat(
                    &[
                        valid,
                        Tensor::zeros([(keep - n) as i64, hidden], (lm.kind(), device)),
                    ],
                    0,
                )
            } else {
                valid
            };
            rows.push(padded);
            out_mask[bi * keep..bi * keep + n].fill(1);
        }
        Ok((
            Tensor::stack(&rows, 0),
            Tensor::from_slice(&out_mask).reshape([b, keep as i64]),
        ))
    }
}
