//! An engine's `settings` key in the worker's configuration: a preset's name
//! (`settings = "cuda"`) or a table of explicit choices whose unset keys are the portable preset's
//! (`[engine.sdxl.settings]`, `unet_memory_format = "channels_last"`).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use vnfarm_models::settings::{EsrganSettings, Preset, QwenSettings, SdxlSettings};

/// What the configuration says about one engine's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum SettingsChoice<T> {
    Preset(Preset),
    Explicit(T),
}

/// The settings types that have presets.
pub trait EngineSettings: Copy + Default + for<'de> Deserialize<'de> {
    fn preset(preset: Preset) -> Self;
}

impl EngineSettings for SdxlSettings {
    fn preset(preset: Preset) -> Self {
        SdxlSettings::preset(preset)
    }
}
impl EngineSettings for QwenSettings {
    fn preset(preset: Preset) -> Self {
        QwenSettings::preset(preset)
    }
}
impl EngineSettings for EsrganSettings {
    fn preset(preset: Preset) -> Self {
        EsrganSettings::preset(preset)
    }
}

impl<T: EngineSettings> SettingsChoice<T> {
    pub fn resolve(&self) -> T {
        match self {
            SettingsChoice::Preset(p) => T::preset(*p),
            SettingsChoice::Explicit(t) => *t,
        }
    }

    /// `portable`, `cuda`, or `explicit`, for the heartbeat.
    pub fn name(&self) -> &'static str {
        match self {
            SettingsChoice::Preset(p) => p.name(),
            SettingsChoice::Explicit(_) => "explicit",
        }
    }
}

// By hand rather than `#[serde(untagged)]`: an untagged enum reports only "data did not match any
// variant", while here a wrong key or value inside the table is named as the table's type names it.
impl<'de, T: EngineSettings> Deserialize<'de> for SettingsChoice<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ChoiceVisitor<T>(PhantomData<T>);
        impl<'de, T: EngineSettings> Visitor<'de> for ChoiceVisitor<T> {
            type Value = SettingsChoice<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a preset name (\"portable\" or \"cuda\") or a table of settings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Preset::deserialize(de::value::StrDeserializer::<E>::new(v))
                    .map(SettingsChoice::Preset)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(SettingsChoice::Explicit)
            }
        }
        deserializer.deserialize_any(ChoiceVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_models::nn::MemoryFormat;

    use super::*;

    #[derive(Deserialize)]
    struct Holder {
        settings: SettingsChoice<SdxlSettings>,
    }

    #[test]
    fn a_preset_name_or_a_table_chooses_the_settings() {
        let h: Holder = toml::from_str("settings = \"cuda\"").unwrap();
        assert_eq!(h.settings.resolve(), SdxlSettings::preset(Preset::Cuda));
        assert_eq!(h.settings.name(), "cuda");
        let h: Holder =
            toml::from_str("[settings]\nunet_memory_format = \"channels_last\"").unwrap();
        let s = h.settings.resolve();
        assert_eq!(s.unet_memory_format, MemoryFormat::ChannelsLast);
        assert!(!s.cuda_graphs, "unset keys are the portable preset's");
        assert_eq!(h.settings.name(), "explicit");
    }

    #[test]
    fn a_wrong_preset_or_key_is_named() {
        let e = toml::from_str::<Holder>("settings = \"fast\"")
            .err()
            .unwrap();
        assert!(e.to_string().contains("fast"), "{e}");
        let e = toml::from_str::<Holder>("[settings]\ncuda_graph = true")
            .err()
            .unwrap();
        assert!(e.to_string().contains("cuda_graph"), "{e}");
    }
}
