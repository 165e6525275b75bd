//! Configuration of the Qwen2.5-VL text encoder: the language model's [`TextConfig`]
//! (`Qwen2_5_VLTextConfig`), and the top-level [`QwenVlConfig`] (`Qwen2_5_VLConfig`: text and vision
//! configs plus the special token ids).
//!
//! Field meanings and defaults follow transformers 5.24.0
//! `models/qwen2_5_vl/configuration_qwen2_5_vl.py` (Apache-2.0, Copyright The Qwen team, Alibaba
//! Group and the HuggingFace Inc. team). `from_json` reads both the transformers ≥ 5 layout
//! (`text_config` object with `rope_parameters`) and the older one (text keys at the top level,
//! `rope_theta` and `rope_scaling.mrope_section`).

use crate::qwen2_5_vl::vision::VisionConfig;

/// `Qwen2_5_VLTextConfig` fields the language model needs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct TextConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Key/value heads (grouped-query attention): each serves `num_attention_heads / num_key_value_heads`
    /// query heads.
    pub num_key_value_heads: i64,
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding (`rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// M-RoPE: how many of the `head_dim / 2` rotary frequencies follow the temporal, height and
    /// width position ids (in that order, repeating); sums to `head_dim / 2`.
    pub mrope_section: Vec<i64>,
}

impl TextConfig {
    /// `text_config` of Qwen/Qwen2.5-VL-7B-Instruct `config.json` (the text encoder of
    /// Qwen/Qwen-Image-Edit-2509, `text_encoder/config.json`).
    pub fn qwen2_5_vl_7b() -> Self {
        Self {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            mrope_section: vec![16, 24, 24],
        }
    }

    /// The tiny test language model of `fixtures/qwen/common.py` (`TEXT_CONFIG`): 2 layers, hidden
    /// 16, 2 heads sharing 1 KV head, `mrope_section` [1, 1, 2]; `rms_norm_eps` is transformers'
    /// default 1e-5 (the fixture does not set it).
    pub fn tiny() -> Self {
        Self {
            vocab_size: 152064,
            hidden_size: 16,
            intermediate_size: 16,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            rms_norm_eps: 1e-5,
            rope_theta: 1_000_000.0,
            mrope_section: vec![1, 1, 2],
        }
    }

    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }

    /// Reads the `text_config` object of a transformers `config.json`, each key falling back to
    /// the top level (older configs keep the text keys there), then to transformers' defaults.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let root: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Self::from_value(&root)
    }

    /// [`TextConfig::from_json`] on a parsed config.
    pub fn from_value(root: &serde_json::Value) -> Result<Self, String> {
        if !root.is_object() {
            return Err("the config is not a JSON object".into());
        }
        let text = root.get("text_config").filter(|t| t.is_object());
        // A key of the text config: `text_config.key`, else the top-level `key`.
        let get = |key: &str| -> Option<&serde_json::Value> {
            text.and_then(|t| t.get(key))
                .filter(|v| !v.is_null())
                .or_else(|| root.get(key).filter(|v| !v.is_null()))
        };
        let int = |key: &str, default: Option<i64>| -> Result<i64, String> {
            match get(key) {
                None => default.ok_or_else(|| format!("`{key}` is missing")),
                Some(v) => v
                    .as_i64()
                    .ok_or_else(|| format!("`{key}` is not an integer")),
            }
        };
        if let Some(act) = get("hidden_act")
            && act.as_str() != Some("silu")
        {
            return Err(format!("unsupported text `hidden_act` {act}"));
        }
        if get("use_sliding_window").and_then(serde_json::Value::as_bool) == Some(true) {
            return Err("`use_sliding_window: true` is not supported".into());
        }
        // transformers ≥ 5: `rope_parameters {rope_theta, mrope_section}`; older: `rope_theta` and
        // `rope_scaling {mrope_section}`.
        let rope = get("rope_parameters").or_else(|| get("rope_scaling"));
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(serde_json::Value::as_str)
            && !matches!(kind, "default" | "mrope")
        {
            return Err(format!("unsupported text rope_type {kind:?}"));
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| get("rope_theta"))
            .map(|t| t.as_f64().ok_or("`rope_theta` is not a number"))
            .transpose()?
            .unwrap_or(1_000_000.0);
        let mrope_section = match rope.and_then(|r| r.get("mrope_section")) {
            None => vec![16, 24, 24],
            Some(a) => a
                .as_array()
                .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
                .ok_or("`mrope_section` is not a list of integers")?,
        };
        let num_attention_heads = int("num_attention_heads", Some(64))?;
        let config = Self {
            vocab_size: int("vocab_size", Some(152064))?,
            hidden_size: int("hidden_size", Some(8192))?,
            intermediate_size: int("intermediate_size", Some(29568))?,
            num_hidden_layers: int("num_hidden_layers", Some(80))?,
            num_attention_heads,
            num_key_value_heads: int("num_key_value_heads", Some(num_attention_heads))?,
            rms_norm_eps: get("rms_norm_eps")
                .map(|v| v.as_f64().ok_or("`rms_norm_eps` is not a number"))
                .transpose()?
                .unwrap_or(1e-5),
            rope_theta,
            mrope_section,
        };
        config.validate()?;
        Ok(config)
    }

    /// The structural constraints the language model relies on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ];
        if let Some((k, v)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("text `{k}` must be positive, is {v}"));
        }
        if self.hidden_size % self.num_attention_heads != 0 || self.head_dim() % 2 != 0 {
            return Err(format!(
                "text hidden_size {} / num_attention_heads {} must give an even head dim",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "text num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.mrope_section.iter().any(|&s| s < 0)
            || self.mrope_section.iter().sum::<i64>() != self.head_dim() / 2
        {
            return Err(format!(
                "text mrope_section {:?} must be non-negative and sum to head_dim / 2 = {}",
                self.mrope_section,
                self.head_dim() / 2
            ));
        }
        Ok(())
    }
}

/// `Qwen2_5_VLConfig`: the language model, the vision tower and the special token ids.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct QwenVlConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    /// `<|image_pad|>`: one per merged image patch, replaced by the vision features.
    pub image_token_id: i64,
    /// `<|video_pad|>` (never produced by the Edit pipelines; a prompt containing it is rejected).
    pub video_token_id: i64,
    /// `<|vision_start|>`.
    pub vision_start_token_id: i64,
    /// `<|vision_end|>`.
    pub vision_end_token_id: i64,
}

impl QwenVlConfig {
    /// Qwen/Qwen2.5-VL-7B-Instruct (Qwen-Image-Edit-2509's `text_encoder/config.json`).
    pub fn qwen2_5_vl_7b() -> Self {
        Self {
            text: TextConfig::qwen2_5_vl_7b(),
            vision: VisionConfig::qwen2_5_vl_7b(),
            ..Self::tiny()
        }
    }

    /// The tiny test text encoder of `fixtures/qwen/common.py` (`build_tiny()`).
    pub fn tiny() -> Self {
        Self {
            text: TextConfig::tiny(),
            vision: VisionConfig::tiny(),
            image_token_id: 151655,
            video_token_id: 151656,
            vision_start_token_id: 151652,
            vision_end_token_id: 151653,
        }
    }

    /// Reads a transformers `config.json` of `Qwen2_5_VLForConditionalGeneration`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let root: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::tiny();
        let id = |key: &str, default: i64| -> Result<i64, String> {
            match root.get(key).filter(|v| !v.is_null()) {
                None => Ok(default),
                Some(v) => v
                    .as_i64()
                    .ok_or_else(|| format!("`{key}` is not an integer")),
            }
        };
        let config = Self {
            text: TextConfig::from_value(&root)?,
            vision: VisionConfig::from_json(text)?,
            image_token_id: id("image_token_id", d.image_token_id)?,
            video_token_id: id("video_token_id", d.video_token_id)?,
            vision_start_token_id: id("vision_start_token_id", d.vision_start_token_id)?,
            vision_end_token_id: id("vision_end_token_id", d.vision_end_token_id)?,
        };
        if config.vision.out_hidden_size != config.text.hidden_size {
            return Err(format!(
                "vision out_hidden_size {} differs from the text hidden_size {}",
                config.vision.out_hidden_size, config.text.hidden_size
            ));
        }
        Ok(config)
    }
}
